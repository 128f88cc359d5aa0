"""Tests for replicator.logs.output, .logformat and .twistedlog: one line per event in each
format, control characters escaped, no object reprs, Twisted's repeats dropped."""

import io
import json
import os
import tempfile
from urllib.parse import unquote

from twisted.internet import task
from twisted.internet.address import IPv4Address
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from replicator.http.redact import Redactor
from replicator.http.site import ERROR_TEXT_LIMIT, AccessLog
from replicator.logs.formats import clean, formatter
from replicator.logs.output import _observer, under_journald
from replicator.logs.printable import printable
from replicator.logs.twisted_lines import keep
from replicator.replication.transport.base_handler import BaseHandler
from replicator.replication.transport.protocol import ServerReplicationProtocol


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


class FormatTests(SynchronousTestCase):
    """The three line formats of :mod:`replicator.logs.formats`, in memory."""

    EVENT = {"log_format": "peer {conn} said {text}", "conn": "worker1 (127.0.0.1:5)",
             "text": 'a "b"\x1b', "n": 3, "ok": True, "none": None, "nan": float("nan"),
             "addr": IPv4Address("TCP", "127.0.0.1", 9092), "log_level": LogLevel.warn,
             "log_namespace": "replicator.replication.transport.protocol.ServerReplicationProtocol",
             "log_time": 1795639211.4523}

    def test_text_with_and_without_time(self):
        with_time = formatter("text", with_time=True)(self.EVENT)
        self.assertRegex(with_time, r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.452 WARN "
                                    r"replication\.protocol: peer worker1 \(127\.0\.0\.1:5\) "
                                    r'said a "b"\\x1b\n$')
        self.assertEqual(formatter("text", with_time=False)(self.EVENT),
                         'WARN replication.protocol: peer worker1 (127.0.0.1:5) said a "b"\\x1b\n')

    def test_logfmt(self):
        line = formatter("logfmt")(self.EVENT)
        self.assertTrue(line.endswith("\n") and "\n" not in line[:-1])
        self.assertRegex(line, r"^time=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.452[+-]\d\d:\d\d "
                               r"level=warn system=replication\.protocol ")
        self.assertIn(r' msg="peer worker1 (127.0.0.1:5) said a \"b\"\\x1b" ', line)
        self.assertIn(' conn="worker1 (127.0.0.1:5)" ', line)
        self.assertIn(" n=3 ok=true none= nan=nan addr=127.0.0.1:9092", line)

    def test_json(self):
        record = json.loads(formatter("json")(self.EVENT))
        self.assertEqual(record["level"], "warn")
        self.assertEqual(record["system"], "replication.protocol")
        self.assertEqual(record["message"], 'peer worker1 (127.0.0.1:5) said a "b"\\x1b')
        self.assertEqual((record["n"], record["ok"], record["none"], record["nan"],
                          record["addr"]), (3, True, None, "nan", "127.0.0.1:9092"))
        self.assertRegex(record["time"], r"T\d\d:\d\d:\d\d\.452[+-]\d\d:\d\d$")
        self.assertNotIn("log_namespace", record)

    def test_a_failure_stays_with_its_event(self):
        try:
            1 / 0
        except ZeroDivisionError:
            failure = Failure()
        event = {"log_format": "boom", "log_failure": failure, "log_level": LogLevel.critical,
                 "log_namespace": "replicator.x", "log_time": 0}
        text = formatter("text", with_time=False)(event)
        self.assertTrue(text.startswith("CRITICAL x: boom\n    Traceback"), text)
        self.assertTrue(all(line.startswith("    ") for line in text.splitlines()[1:]))
        self.assertIn("ZeroDivisionError", json.loads(formatter("json")(event))["traceback"])
        self.assertEqual(len(formatter("logfmt")(event).splitlines()), 1)

    def test_no_object_reprs(self):
        self.assertEqual(clean("to IPv6Address(type='TCP', host='::1', port=9092, flowInfo=0, "
                               "scopeID=0) via <twisted.internet.endpoints.TCP4ClientEndpoint "
                               "object at 0x7f54ff7ef050>"), "to [::1]:9092 via TCP4ClientEndpoint")
        server = ServerReplicationProtocol(BaseHandler(), "hs.test", clock=task.Clock())
        server.address = "127.0.0.1:56162"
        self.assertEqual(formatEvent({"log_format": "{conn}", "conn": server}),
                         "127.0.0.1:56162")
        server._peer_instance = "worker1"
        self.assertEqual(formatEvent({"log_format": "{conn}", "conn": server}),
                         "worker1 (127.0.0.1:56162)")


class TwistedLinesTests(SynchronousTestCase):
    def legacy(self, text, **extra):
        return {"log_namespace": "log_legacy", "log_format": "{log_text}", "log_text": text,
                "log_level": LogLevel.info, "system": "-", **extra}

    def test_twisteds_repeats_are_dropped(self):
        for text in ("ReplicationServerFactory starting on 9092", "Site starting on 9093",
                     "(TCP Port 9092 Closed)", "Starting factory <Factory object at 0x1>",
                     "Stopping factory <Factory object at 0x1>"):
            self.assertFalse(keep(self.legacy(text)), text)
        self.assertFalse(keep({"log_namespace": "twisted.internet.base",
                               "log_format": "Main loop terminated.",
                               "log_level": LogLevel.info}))
        self.assertFalse(keep({"log_namespace":
                               "replicator.replication.transport.tcp.UpstreamService",
                               "log_format": "Scheduling retry {attempt} to connect {endpoint} "
                                             "in {delay} seconds.",
                               "log_level": LogLevel.info}))

    def test_the_rest_is_kept(self):
        self.assertTrue(keep(self.legacy("Unhandled error in Deferred:", isError=1)))
        self.assertTrue(keep({"log_namespace": "twisted.web", "log_format": "oops",
                              "log_failure": Failure(ValueError("x"))}))
        self.assertTrue(keep({"log_namespace": "replicator.daemon.listening",
                              "log_format": "listening on {address}"}))
        self.assertEqual(formatter("text", False)(self.legacy("something new")),
                         "INFO twisted: something new\n")


class JournaldTests(SynchronousTestCase):
    def test_journal_stream_names_the_stream(self):
        with tempfile.TemporaryFile("w") as stream, tempfile.TemporaryFile("w") as other:
            st = os.fstat(stream.fileno())
            mine = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
            self.assertTrue(under_journald(stream, mine))
            self.assertFalse(under_journald(other, mine))  # inherited, redirected elsewhere
            self.assertFalse(under_journald(stream, {}))
            self.assertTrue(under_journald(io.StringIO(), mine))  # cannot check: trust it


class AccessLineTests(SynchronousTestCase):
    def test_an_error_answer_says_why(self):
        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        request = DummyRequest([b"x"])
        request.path, request.method, request.code = b"/x", b"POST", 400
        request.error_text = "invalid JSON: \x1b[2J" + "y" * 300
        AccessLog(Redactor([])).request(request)
        line = formatEvent(events[-1])
        self.assertIn(' 400 0 ', line)
        self.assertIn("(invalid JSON: \\x1b[2J" + "y" * (ERROR_TEXT_LIMIT - 18) + "...)", line)


class RedactorTests(SynchronousTestCase):
    def test_every_spelling_of_a_secret_is_hidden(self):
        redact = Redactor(["s3cret value"])
        cases = {
            "a s3cret value b": "a [redacted] b",
            "a %733cret%20value b": "a [redacted] b",
            "a %25733cret%2520value b": "a [redacted] b",  # encoded twice
            "100% s3cret%20value%": "100% [redacted]%",
            "a s3cret\nvalue b": "a [redacted] b",  # made one line first
            "nothing %zz here": "nothing %zz here",
        }
        for text, expected in cases.items():
            self.assertEqual(redact(text), expected, text)
        self.assertEqual(redact.lines("x\n%733cret value\ny"), "x\n[redacted]\ny")
        # In a path, a + may be a space, and a credential parameter's value
        # is hidden whoever's it is.
        self.assertEqual(redact.path(b"/a/s3cret+value"), "/a/[redacted]")
        self.assertEqual(redact.path(b"/a%3Fx=1&Access_Token=abc;p=2"),
                         "/a%3Fx=1&Access_Token=[redacted];p=2")
        self.assertEqual(redact.path(b"/a%3F%61ccess_token%3Dabc%3Flimit=1"),
                         "/a%3F%61ccess_token%3D[redacted]")

    def test_a_secret_cut_by_an_excerpt_is_hidden_too(self):
        """An error message quotes a client's value cut at 60 characters
        (``unknown stream 'aaa...<secret cut>'...``): no run of 8 of the
        secret's characters is shown, at either end of the cut."""
        from replicator.http.answers import excerpt

        secret = "4p2m_5bIcPqJXWrI4hTahRGdPgvvSNuQqGyZk1Lr0aQ"
        redact = Redactor([secret])
        for prefix in ("a" * 25, "caches?access_token=", "x" * 50):
            text = f"unknown stream {excerpt(prefix + secret)}"
            shown = redact(text)
            runs = [secret[i:i + 8] for i in range(len(secret) - 7)]
            self.assertEqual([r for r in runs if r in shown], [], shown)
            self.assertIn("[redacted]", shown)
        tail = redact("the end of it: " + secret[-20:])
        self.assertNotIn(secret[-20:-12], tail)
        # Short hidden strings (a Redis password) are hidden whole only.
        self.assertEqual(Redactor(["hunter2pw"])("a hunter2 b"), "a hunter2 b")

    def test_long_paths_are_cut_after_redaction(self):
        secret = "s3cret value"
        redact = Redactor([secret])
        thrice = "".join(f"%2525{b:02X}" for b in secret.encode())
        paths = [("x" * 195 + secret + "y" * 16000).encode(),
                 ("x" * 195 + thrice + "y" * 16000).encode(),
                 ("/" + thrice * 500).encode(),
                 ("/" + secret * 2000).encode(),
                 ("/a" * 90 + "%3Faccess_token=" + "z" * 16000).encode()]
        for raw in paths:
            shown = redact.path(raw)
            self.assertLessEqual(len(shown), 203)
            self.assertTrue(shown.endswith("..."), shown)
            forms = [shown]
            for _ in range(3):
                forms.append(unquote(forms[-1]))
            for form in forms:
                self.assertNotIn(secret, form)
                self.assertNotIn(secret[:6], form)  # not even a part at the cut
                self.assertNotIn("zzz", form)
        self.assertEqual(redact.path(paths[2]), "/[redacted]...")  # one run, then cut

    def test_a_traceback_spelling_a_secret_is_logged_redacted(self):
        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        try:
            raise ValueError("bad path /%733cret%20value")
        except ValueError:
            Redactor(["s3cret value"]).log_failure("Answering failed", Failure())
        text = formatEvent(events[-1])
        self.assertIn("ValueError: bad path /[redacted]", text)
        self.assertNotIn("%733cret", text)


class LogReadersTests(SynchronousTestCase):
    """The fault and adversarial suites read daemon logs: a text line's
    time (outside journald) must not hide a critical event from them."""

    LOG = ("2026-11-25 20:42:37.187 INFO replication: listening on 127.0.0.1:9092\n"
           "2026-11-25 20:42:38.001 CRITICAL replication.protocol: handler failed\n"
           "    Traceback (most recent call last):\n"
           "    ValueError: boom\n")

    def test_fuzz_and_chaos_see_through_the_time(self):
        from tests.chaos.run import logged_errors
        from tests.fuzz.daemon import log_problems

        self.assertEqual([kind for kind, _ in log_problems(self.LOG)], ["daemon_critical"])
        self.assertEqual(logged_errors(self.LOG),
                         ["CRITICAL replication.protocol: handler failed -> ValueError: boom"])
