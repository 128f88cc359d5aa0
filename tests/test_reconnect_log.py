"""The retry line of an outgoing link, in memory (task.Clock): the reason in
our words, a counter that counts the retries of this outage, the delay
rounded, no Twisted object repr, and Twisted's own retry line silenced."""

from twisted.internet import defer, error, task
from twisted.internet.testing import StringTransport
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator.config import parse_replication
from replicator.config.model import ReplicationConfig
from replicator.net.backoff import RECONNECT_INITIAL_DELAY, RECONNECT_MAX_DELAY, Backoff
from replicator.net.reconnect import LOUD_RETRIES, QUIET_INTERVAL, failure_reason
from replicator.replication.transport.base_handler import BaseHandler
from replicator.replication.transport.tcp import upstream_service


class Endpoint:
    """A client endpoint whose attempts fail with ``failures`` (in turn,
    the last one repeated) or, with None, connect on a StringTransport."""

    def __init__(self, *failures):
        self.failures = list(failures)
        self.protocols = []

    def connect(self, factory):
        failure = self.failures.pop(0) if len(self.failures) > 1 else self.failures[0]
        if failure is not None:
            return defer.fail(failure)
        protocol = factory.buildProtocol(None)
        protocol.makeConnection(StringTransport())
        self.protocols.append(protocol)
        return defer.succeed(protocol)


class RetryLineTests(SynchronousTestCase):
    def setUp(self):
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)
        self.clock = task.Clock()

    def lines(self):
        return [formatEvent(e) for e in self.events
                if "retry" in (e.get("log_format") or "").lower()]

    def service(self, endpoint, jitter=0.0):
        service = upstream_service(self.clock, "tcp:host=127.0.0.1:port=9092", BaseHandler(),
                                   "worker1", "hs.test", clock=self.clock,
                                   wrap_endpoint=lambda _: endpoint)
        service.backoff.jitter = jitter
        service.startService()
        self.addCleanup(service.stopService)
        return service

    def test_refused_retries_count_and_stay_under_the_cap(self):
        self.service(Endpoint(Failure(error.ConnectionRefusedError("111: Connection refused"))))
        for _ in range(4):
            self.clock.advance(RECONNECT_MAX_DELAY)
        self.assertEqual(self.lines()[:5], [
            "upstream 127.0.0.1:9092: connection refused; retry 1 in 0.5 s",
            "upstream 127.0.0.1:9092: connection refused; retry 2 in 1.0 s",
            "upstream 127.0.0.1:9092: connection refused; retry 3 in 2.0 s",
            "upstream 127.0.0.1:9092: connection refused; retry 4 in 2.0 s",
            "upstream 127.0.0.1:9092: connection refused; retry 5 in 2.0 s",
        ])

    def test_delays_are_rounded_and_jittered_under_the_cap(self):
        service = self.service(Endpoint(Failure(error.TimeoutError())), jitter=0.25)
        for _ in range(8):
            self.clock.advance(RECONNECT_MAX_DELAY)
        delays = [float(line.rsplit(" in ", 1)[1].split(" ")[0]) for line in self.lines()]
        self.assertTrue(all(d <= RECONNECT_MAX_DELAY for d in delays), delays)
        self.assertTrue(all(len(str(d)) <= 3 for d in delays), delays)  # one decimal
        self.assertIn("upstream 127.0.0.1:9092: timed out; retry 1 in ", self.lines()[0])
        self.assertEqual(service.backoff.failures, len(delays))

    def test_short_delays_keep_two_decimals(self):
        service = upstream_service(self.clock, "tcp:host=127.0.0.1:port=9092", BaseHandler(),
                                   "worker1", "hs.test", initial_delay=0.05, max_delay=0.05,
                                   clock=self.clock, wrap_endpoint=lambda _: Endpoint(
                                       Failure(error.ConnectionRefusedError())))
        service.backoff.jitter = 0.0
        service.startService()
        self.addCleanup(service.stopService)
        self.assertEqual(self.lines(),
                         ["upstream 127.0.0.1:9092: connection refused; retry 1 in 0.05 s"])

    def test_twisteds_own_retry_line_is_silenced(self):
        self.service(Endpoint(Failure(error.ConnectionRefusedError())))
        self.clock.advance(1)
        texts = [formatEvent(e) for e in self.events]
        self.assertFalse([t for t in texts if "Scheduling retry" in t], texts)
        self.assertFalse([t for t in texts if "<" in t or "object at 0x" in t], texts)

    def test_closed_by_peer_names_its_error(self):
        endpoint = Endpoint(None)
        self.service(endpoint)
        proxy = endpoint.protocols[0]
        proxy.dataReceived(b"ERROR NAME worker1 does not match the client certificate\n")
        proxy.connectionLost(Failure(error.ConnectionDone()))
        self.assertEqual(self.lines(), [
            "upstream 127.0.0.1:9092: closed by peer: ERROR NAME worker1 does not match the "
            "client certificate; retry 1 in 0.5 s"])

    def test_closed_by_peer_without_a_word(self):
        endpoint = Endpoint(None, Failure(error.ConnectionRefusedError()))
        self.service(endpoint)
        endpoint.protocols[0].connectionLost(Failure(error.ConnectionDone()))
        self.clock.advance(RECONNECT_INITIAL_DELAY)
        self.assertEqual(self.lines(), [
            "upstream 127.0.0.1:9092: closed by peer; retry 1 in 0.5 s",
            "upstream 127.0.0.1:9092: connection refused; retry 2 in 1.0 s"])

    def test_a_long_outage_is_logged_now_and_then_and_a_new_one_counts_from_1(self):
        endpoint = Endpoint(Failure(error.ConnectionRefusedError()))
        service = self.service(endpoint)
        for _ in range(LOUD_RETRIES + 40):
            self.clock.advance(RECONNECT_MAX_DELAY)
        lines = self.lines()
        self.assertEqual(len(lines), LOUD_RETRIES + 1, lines)
        self.assertIn("further retries logged once a minute", lines[LOUD_RETRIES - 1])
        later = self.events[-1]
        self.assertGreater(later["retry"], LOUD_RETRIES + QUIET_INTERVAL / RECONNECT_MAX_DELAY - 2)
        # The link proves healthy: the next outage counts from 1 again.
        service.backoff.reset()
        self.clock.advance(RECONNECT_MAX_DELAY)
        self.assertIn("retry 1 in 0.5 s", self.lines()[-1])


class ReasonTests(SynchronousTestCase):
    def test_tls_handshake_errors(self):
        from OpenSSL import SSL

        failure = Failure(SSL.Error([("SSL routines", "", "certificate verify failed")]))
        self.assertEqual(failure_reason(failure), "TLS: certificate verify failed")

    def test_tls_hostname_mismatch(self):
        from service_identity import VerificationError
        from service_identity.exceptions import DNSMismatch
        from service_identity.hazmat import DNS_ID

        failure = Failure(VerificationError(errors=[DNSMismatch(DNS_ID("master"))]))
        self.assertEqual(failure_reason(failure), "TLS: the certificate is not for master")

    def test_others(self):
        self.assertEqual(failure_reason(Failure(error.ConnectionRefusedError())),
                         "connection refused")
        self.assertEqual(failure_reason(Failure(error.TimeoutError())), "timed out")
        self.assertEqual(failure_reason(Failure(error.ConnectionLost())), "connection lost")
        self.assertEqual(failure_reason(Failure(error.DNSLookupError("master"))),
                         "DNS lookup failed: master")
        self.assertEqual(failure_reason(Failure(ValueError("bad\x1b[2J\nthing"))),
                         "bad\\x1b[2J")


class DefaultsTests(SynchronousTestCase):
    def test_one_default_cap_everywhere(self):
        self.assertEqual(RECONNECT_MAX_DELAY, 2.0)
        self.assertEqual(ReplicationConfig().reconnect_max_delay, RECONNECT_MAX_DELAY)
        self.assertEqual(parse_replication({}).reconnect_max_delay, RECONNECT_MAX_DELAY)
        self.assertEqual(parse_replication({}).reconnect_initial_delay, RECONNECT_INITIAL_DELAY)
        self.assertEqual(Backoff().maximum, RECONNECT_MAX_DELAY)


class RedisRetryLineTests(TestCase):
    """Both Redis links say why they retry: a refused AUTH, then a Redis
    server that is gone."""

    timeout = 120

    async def test_auth_refusal_and_a_dead_server(self):
        from tests.redis_nodes import Node
        from tests.servers import PostgresServer, RedisServer
        from tests.support import LogWatch

        log = LogWatch(self)
        events = log.events
        redis = RedisServer(password="the-right-password")
        self.addCleanup(redis.stop)
        node = Node(self, PostgresServer.shared().create_database(), "w1", redis)
        node.redis = type("WrongPassword", (), {"endpoint": redis.endpoint,
                                                "password": "a-wrong-password"})()
        await node.start()

        def retries(what):
            return [formatEvent(e) for e in events
                    if "retry" in e and e.get("what") == f"redis {what}"]

        await log.until(lambda: len(retries("subscriber")) >= 2
                        and len(retries("publisher")) >= 2)
        where = f"127.0.0.1:{redis.port}"
        for what in ("subscriber", "publisher"):
            for line in retries(what)[:2]:
                self.assertRegex(line, rf"^redis {what} {where}: \S.*; retry \d+ in \d+\.\d+ s$")
            self.assertIn("password", retries(what)[0].lower())  # the server's refusal
        redis.kill()
        await log.until(lambda: any("connection refused" in line
                                    for line in retries("subscriber")))
        await node.stop()
