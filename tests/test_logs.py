"""Tests for replicator.logs: one line per event, control characters escaped."""

import io

from twisted.logger import LogLevel
from twisted.trial.unittest import SynchronousTestCase

from replicator.logformat import formatter
from replicator.logs import _observer, printable


class PrintableTests(SynchronousTestCase):
    def test_control_characters_are_escaped(self):
        self.assertEqual(printable("a\x00b\rc\nd\te\x1b[0m\x7f\x9b\u2028\u202e\u2066"),
                         "a\\x00b\\rc\\nd\\te\\x1b[0m\\x7f\\x9b\\u2028\\u202e\\u2066")

    def test_ordinary_text_is_kept(self):
        self.assertEqual(printable("worker-1 été €"), "worker-1 été €")

    def test_bytes_and_limits(self):
        self.assertEqual(printable(b"\xff\x1b"), "\ufffd\\x1b")
        self.assertEqual(printable("x" * 10, limit=4), "xxxx...")
        self.assertEqual(printable("x" * 300, limit=None), "x" * 300)
        # The cut comes before escaping: an escape is never split.
        self.assertEqual(printable("\x00" * 3, limit=2), "\\x00\\x00...")


class ObserverTests(SynchronousTestCase):
    def test_every_event_is_one_escaped_line(self):
        out = io.StringIO()
        observe = _observer(out, formatter("text", with_time=False))
        observe({"log_format": "peer said {text}", "text": "a\rb\x1b[2Jc\nd",
                 "log_level": LogLevel.warn, "log_namespace": "replicator.replication.x"})
        self.assertEqual(out.getvalue(), "WARN replication.x: peer said a\\rb\\x1b[2Jc d\n")
