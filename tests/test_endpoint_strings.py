"""Endpoint strings as the daemon reads them: the loopback warning at startup
and the URL the CLI's HTTP commands target, for the escaped-colon and
keyword forms Twisted accepts."""

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from replicator import cli
from replicator.daemon.service import Instance
from replicator.net import endpoint_strings


def base_for(endpoint: str) -> str:
    return cli._http_base(SimpleNamespace(http=SimpleNamespace(listen=endpoint)))


class HttpBaseTests(SynchronousTestCase):
    def test_positional_port(self):
        self.assertEqual(base_for("tcp:9093:interface=127.0.0.1"), "http://127.0.0.1:9093")

    def test_keyword_port(self):
        self.assertEqual(base_for("tcp:port=9093:interface=127.0.0.1"),
                         "http://127.0.0.1:9093")

    def test_escaped_ipv6_interface(self):
        self.assertEqual(base_for(r"tcp6:9092:interface=\:\:1"), "http://[::1]:9092")

    def test_wildcard_interfaces_target_loopback(self):
        self.assertEqual(base_for("tcp:9093"), "http://127.0.0.1:9093")
        self.assertEqual(base_for("tcp:9093:interface=0.0.0.0"), "http://127.0.0.1:9093")
        self.assertEqual(base_for(r"tcp6:9093:interface=\:\:"), "http://127.0.0.1:9093")

    def test_not_tcp_is_one_line_and_exit_2(self):
        for endpoint in ("unix:/tmp/sock", "tcp", "tcp:interface=127.0.0.1"):
            with self.assertRaises(SystemExit) as raised:
                base_for(endpoint)
            self.assertEqual(raised.exception.code, 2, endpoint)


class LoopbackWarningTests(SynchronousTestCase):
    def warnings_for(self, endpoint: str) -> list:
        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        Instance._warn_exposed(endpoint, "replication")
        return [e for e in events if "plaintext" in formatEvent(e)]

    def test_loopback_listeners_are_quiet(self):
        for endpoint in ("tcp:9092:interface=127.0.0.1", r"tcp6:9092:interface=\:\:1",
                         "tcp:port=9092:interface=127.0.0.2", "unix:/tmp/sock"):
            self.assertEqual(self.warnings_for(endpoint), [], endpoint)

    def test_exposed_listeners_warn_once(self):
        for endpoint in ("tcp:9092", "tcp:9092:interface=0.0.0.0", r"tcp6:9092:interface=\:\:",
                         "tcp:9092:interface=192.0.2.1"):
            self.assertEqual(len(self.warnings_for(endpoint)), 1, endpoint)


class ParseAgreesWithTwistedTests(SynchronousTestCase):
    """``parse`` splits a string exactly as Twisted's own parser does, so the
    address checked at startup is the one Twisted binds."""

    @settings(max_examples=500, deadline=None)
    @given(st.text(alphabet="tcp6:=\\ab1.", min_size=1, max_size=30))
    def test_same_fields_as_twisted(self, text):
        from twisted.internet.endpoints import _parse

        try:
            args, kwargs = _parse(text)
        except RuntimeError:  # a trailing lone backslash
            self.assertRaises(ValueError, endpoint_strings.parse, text)
            return
        parsed = endpoint_strings.parse(text)
        self.assertEqual(parsed, (args[0] if args else "", args[1:], kwargs))

    def test_escaped_equals_and_backslash(self):
        self.assertEqual(endpoint_strings.parse(r"unix:/run/a\=b\\c:mode=660"),
                         ("unix", ["/run/a=b\\c"], {"mode": "660"}))
