"""The in-memory harness itself (:mod:`tests.harness`): what the suites on
it rely on holds — a pool that commits or rolls back each interaction as
adbapi does, a result only once it has fired, TCP that reaches listeners
or is refused, time that moves only when told."""

from twisted.internet import defer, endpoints, protocol
from twisted.internet.error import ConnectingCancelledError, ConnectionRefusedError
from twisted.trial.unittest import TestCase

from tests.harness import Harness, result_of


class Echo(protocol.Protocol):
    def dataReceived(self, data):
        self.transport.write(data)


class Recorder(protocol.Protocol):
    received = b""

    def dataReceived(self, data):
        self.received += data


class HarnessTests(TestCase):
    def setUp(self):
        self.h = Harness([], self.addCleanup)

    def test_each_interaction_commits_or_rolls_back_and_has_fired(self):
        pool = self.h.database().pool
        result_of(pool.runOperation("CREATE TABLE t (x INTEGER)"))

        def fails(txn):
            txn.execute("INSERT INTO t VALUES (1)")
            raise RuntimeError("rolled back")

        d = pool.runInteraction(fails)
        with self.assertRaises(RuntimeError):
            result_of(d)
        result_of(pool.runOperation("INSERT INTO t VALUES (?)", (2,)))
        # Another instance's handle sees what was committed, nothing else.
        other = self.h.database().pool
        self.assertEqual(result_of(other.runQuery("SELECT x FROM t")), [(2,)])

    def test_a_result_is_only_had_once_it_fired(self):
        with self.assertRaises(AssertionError):
            result_of(defer.Deferred())
        waiting = defer.Deferred()
        self.h.clock.callLater(5, waiting.callback, "late")
        self.assertEqual(self.h.run(waiting), "late")
        self.assertEqual(self.h.clock.seconds(), 5)

    def test_tcp_reaches_a_listener_or_is_refused(self):
        self.h.run(endpoints.serverFromString(self.h.clock, "tcp:9092").listen(
            protocol.Factory.forProtocol(Echo)))
        client = Recorder()
        endpoint = endpoints.TCP4ClientEndpoint(self.h.clock, "127.0.0.1", 9092)
        self.h.run(endpoints.connectProtocol(endpoint, client))
        client.transport.write(b"ping")
        self.h.flush()
        self.assertEqual(client.received, b"ping")
        nobody = endpoints.TCP4ClientEndpoint(self.h.clock, "127.0.0.1", 9093)
        with self.assertRaises(ConnectionRefusedError):
            self.h.run(endpoints.connectProtocol(nobody, Recorder()))
        # A connect cancelled before it is accepted never connects.
        attempt = endpoints.connectProtocol(endpoint, Recorder())
        attempt.cancel()
        self.h.flush()
        with self.assertRaises(ConnectingCancelledError):
            result_of(attempt)
        self.assertEqual(len(self.h.links), 1)

    def test_time_moves_only_when_told(self):
        calls = []
        self.h.clock.callLater(1, calls.append, 1)
        self.h.clock.callLater(3, calls.append, 3)
        self.h.flush()
        self.assertEqual(calls, [])
        self.h.advance(2)
        self.assertEqual((calls, self.h.clock.seconds()), ([1], 2))
        self.h.advance(1)
        self.assertEqual(calls, [1, 3])
