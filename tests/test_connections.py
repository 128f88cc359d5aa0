"""Outgoing and incoming links under hostile or broken peers: a silent
upstream, a listener flooded with idle sockets, an upstream (TCP or Redis)
that accepts and closes at once, a Redis that drops a connection before it
is ready.

The listener's caps, the TCP upstream's timeout and backoff and the Redis
links' backoff run in memory (:mod:`tests.harness`: scripted peers joined
by iosim transports); whole instances and a real redis-server over real
loopback sockets.  Reconnect delays run on a Clock handed to the
services: the tests read the delays the services chose instead of timing
anything.
"""

import tempfile

from twisted.internet import endpoints, reactor
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from replicator.config import RedisConfig, parse_instance
from replicator.observe import metrics
from replicator.replication.transport.base_handler import BaseHandler
from replicator.replication.transport.redis import RedisReplication
from replicator.replication.transport.tcp import (
    ConnectionSettings,
    ReplicationServerFactory,
    upstream_service,
)
from tests.harness import Harness
from tests.support import until, until_handled


class PeerProtocol(Protocol):
    """One accepted or made connection of a scripted peer."""

    def connectionMade(self):
        self.data = b""
        self.lost = False
        self.factory.protocols.append(self)
        if self.factory.mode == "close":
            self.transport.loseConnection()
        elif self.factory.mode == "talk":
            self.transport.write(b"SERVER hs.test\nPING 1\n")

    def dataReceived(self, data):
        self.data += data
        if self.factory.mode == "close-on-data":
            self.transport.loseConnection()

    def connectionLost(self, reason):
        self.lost = True


class Peer(Factory):
    """A scripted peer: ``mode`` is ``silent`` (accept, never write),
    ``close`` (accept and close at once), ``talk`` (SERVER and PING, then
    silence) or ``close-on-data`` (close at the first bytes received)."""

    protocol = PeerProtocol

    def __init__(self, mode):
        self.mode = mode
        self.protocols = []


async def listen(test, factory):
    port = await endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(factory)
    test.addCleanup(port.stopListening)
    return port.getHost().port


async def connect(port, mode="silent"):
    factory = Peer(mode)
    proto = await endpoints.connectProtocol(
        endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port), factory.buildProtocol(None))
    return proto


def only_call(clock):
    calls = clock.getDelayedCalls()
    return calls[0] if len(calls) == 1 else None


class SilentUpstreamTests(TestCase):
    timeout = 60

    def test_silent_upstream_is_not_connected_and_is_dropped(self):
        """In memory (:mod:`tests.harness`): the upstream accepts and never
        writes."""
        h = Harness([], self.addCleanup)
        peer = Peer("silent")
        h.clock.listenTCP(9092, peer)
        settings = ConnectionSettings(ping_interval=0.2, ping_timeout=1.0)
        service = upstream_service(h.clock, "tcp:host=127.0.0.1:port=9092", BaseHandler(),
                                   "worker1", "hs.test", settings, initial_delay=30,
                                   max_delay=30)
        service.startService()
        self.addCleanup(lambda: h.run(service.stopService(), settle=False))
        h.flush()
        self.assertTrue(peer.protocols and service.replication_factory.current)
        self.assertFalse(service.connected)
        # The client times the silent server out and says why.
        h.advance(0.9)
        self.assertFalse(peer.protocols[0].lost)
        h.advance(0.2)
        self.assertTrue(peer.protocols[0].lost)
        self.assertTrue(peer.protocols[0].data.startswith(b"NAME worker1\nPING "))
        self.assertTrue(peer.protocols[0].data.endswith(b"ERROR ping timeout\n"))
        self.assertEqual(service.replication_factory.current.close_reason, "ping_timeout")
        self.assertFalse(service.connected)

    async def test_health_of_a_worker_whose_upstream_is_silent(self):
        """What /health reads: not connected while the upstream has not
        answered the handshake, though the socket is up."""
        from replicator.daemon.service import Instance

        peer = Peer("silent")
        port = await listen(self, peer)
        tmp = tempfile.mkdtemp()
        config = parse_instance({
            "server_name": "hs.test", "instance_name": "worker1",
            "database": {"sqlite": f"{tmp}/worker1.sqlite"},
            "replication": {"upstream": f"tcp:host=127.0.0.1:port={port}"},
        })
        instance = Instance(config, reactor)
        await instance.start()
        self.addCleanup(instance.stop)
        await until(lambda: peer.protocols and instance.handler.connections)
        connected, detail = instance.replication_status()
        self.assertFalse(connected)
        self.assertIn("has not answered since the start at", detail)


class StartupGarbageTests(TestCase):
    async def test_startup_objects_are_out_of_the_collectors_reach(self):
        """A full garbage collection walks every tracked object while the
        reactor waits: what startup made (and keeps for the process's life)
        is frozen once started, so a long catch-up's collections stay short."""
        import gc

        from replicator.daemon.service import Instance

        gc.unfreeze()
        self.addCleanup(gc.unfreeze)
        tmp = tempfile.mkdtemp()
        config = parse_instance({
            "server_name": "hs.test", "instance_name": "master",
            "database": {"sqlite": f"{tmp}/master.sqlite"},
            "streams": [{"name": "s", "table": "s_stream", "writers": ["master"],
                         "columns": [{"v": "text"}]}],
        })
        instance = Instance(config, reactor)
        await instance.start()
        self.addCleanup(instance.stop)
        self.assertGreater(gc.get_freeze_count(), 0)


class ListenerCapTests(TestCase):
    """The listener's caps, in memory (:mod:`tests.harness`: the factory's
    protocols joined to scripted peers)."""

    def test_readers_over_the_cap_get_an_error_and_are_closed(self):
        h = Harness([], self.addCleanup)
        factory = ReplicationServerFactory(BaseHandler("master"), "hs.test", clock=h.clock,
                                           max_connections=2)

        def connect():
            return h.accept(factory, Peer("silent").buildProtocol(None)).client

        refused = metrics.CONNECTIONS_REFUSED.labels("max_connections")
        before = refused._value.get()
        first, second, third = connect(), connect(), connect()
        for n, p in enumerate((first, second, third)):
            p.transport.write(b"NAME reader%d\nREPLICATE\n" % n)
            h.flush()
            self.assertEqual(factory.crowd.identified, min(n + 1, 2))
            self.assertTrue(p.data)
        self.assertTrue(third.lost)
        self.assertTrue(third.data.endswith(b"ERROR too many connections\n"), third.data)
        self.assertTrue(first.data.startswith(b"SERVER hs.test\nPING "))
        self.assertFalse(first.lost or second.lost)
        self.assertEqual(len(factory.live), 2)
        self.assertEqual(refused._value.get() - before, 1)
        # A slot freed is a slot to take again.
        first.transport.loseConnection()
        h.flush()
        self.assertEqual(len(factory.live), 1)
        fourth = connect()
        fourth.transport.write(b"NAME reader4\nREPLICATE\n")
        h.flush()
        self.assertTrue(fourth.data.startswith(b"SERVER hs.test\n"))
        self.assertFalse(fourth.lost)
        for p in (second, fourth):
            p.transport.loseConnection()
        h.flush()
        self.assertFalse(factory.live)


class FdBudgetTests(TestCase):
    def config(self, **replication):
        return parse_instance({
            "server_name": "hs.test", "instance_name": "master",
            "database": {"sqlite": "unused.sqlite"},
            "replication": dict({"listen": "tcp:0:interface=127.0.0.1"}, **replication),
            "http": {"listen": "tcp:0:interface=127.0.0.1", "secret": "s" * 16},
        })

    def test_caps_within_the_limit(self):
        from replicator.daemon.startup import fd_budget_problem

        self.assertIsNone(fd_budget_problem(self.config(), 1024))
        self.assertIsNone(fd_budget_problem(self.config(max_connections=5000), -1))

    def test_caps_over_the_limit_name_the_keys(self):
        from replicator.daemon.startup import fd_budget_problem

        # The default caps (256 + 64 + 256 + 4 + 16) and the rest (64 + 1) under a
        # 128-fd limit.
        problem = fd_budget_problem(self.config(), 128)
        self.assertEqual(problem, "replication.max_connections + replication.max_unidentified + "
                                  "http.max_connections + http.reserved_for_health + "
                                  "http.reserved_for_writers and 65 "
                                  "descriptors for the rest need 661 file descriptors, over the "
                                  "process limit of 128 (ulimit -n, LimitNOFILE=): lower the "
                                  "caps or raise the limit")
        self.assertIsNone(fd_budget_problem(self.config(max_connections=32), 1024))


class TcpBackoffTests(TestCase):
    """The upstream's reconnect delays, in memory: each connect reaches a
    scripted peer through the harness; the service's own Clock is read."""

    def start(self, peer, **kwargs):
        h = self.h = Harness([], self.addCleanup)
        clock = Clock()
        h.clock.listenTCP(9092, peer)
        service = upstream_service(h.clock, "tcp:host=127.0.0.1:port=9092", BaseHandler(),
                                   "worker1", "hs.test", clock=clock, **kwargs)
        service.startService()
        self.addCleanup(lambda: h.run(service.stopService(), settle=False))
        return service, clock

    def next_delay(self, service, clock, failures):
        """Once the connection ended and the retry is scheduled: its delay,
        and the retry run."""
        self.h.flush()
        self.assertEqual(service.backoff.failures, failures)
        call = only_call(clock)
        self.assertIsNotNone(call, clock.getDelayedCalls())
        delay = call.getTime() - clock.seconds()
        clock.advance(delay)
        return delay

    def test_upstream_that_accepts_and_closes_sees_growing_delays(self):
        peer = Peer("close")
        service, clock = self.start(peer, initial_delay=0.5, max_delay=30)
        delays = []
        for n in range(1, 8):
            delays.append(self.next_delay(service, clock, n))
        self.assertEqual(len(peer.protocols), 7)
        self.assertEqual(delays, sorted(set(delays)), delays)  # strictly growing
        self.assertGreaterEqual(delays[0], 0.375)
        self.assertGreaterEqual(delays[5], 0.5 * 2**5 * 0.75)
        self.assertLessEqual(max(delays), 30)

    def test_backoff_resets_only_after_a_healthy_connection(self):
        peer = Peer("close")
        settings = ConnectionSettings(ping_interval=5.0, ping_timeout=15.0)
        service, clock = self.start(peer, settings=settings, initial_delay=0.5, max_delay=30)
        for n in range(1, 4):
            self.next_delay(service, clock, n)
        # Now the server answers the handshake, but closes before a
        # ping interval has passed: not healthy yet.
        peer.mode = "talk"
        self.h.flush()
        self.assertEqual(len(peer.protocols), 4)
        self.assertTrue(service.connected)
        clock.advance(4.9)
        peer.protocols[-1].transport.loseConnection()
        delay = self.next_delay(service, clock, 4)
        self.assertGreaterEqual(delay, 0.5 * 2**3 * 0.75)
        # This time it stays for a ping interval: the backoff starts over.
        self.h.flush()
        self.assertEqual(len(peer.protocols), 5)
        self.assertTrue(service.connected)
        clock.advance(5.0)
        self.assertEqual(service.backoff.failures, 0)
        peer.protocols[-1].transport.loseConnection()
        delay = self.next_delay(service, clock, 1)
        self.assertLessEqual(delay, 0.5)


class RedisLinkTests(TestCase):
    """The Redis links, in memory against a scripted Redis: the same
    backoff, and no ClientService state error when a connection dies
    before it is ready."""

    def start(self, peer, password=None):
        h = self.h = Harness([], self.addCleanup)
        h.clock.listenTCP(6379, peer)
        clock = Clock()

        link = RedisReplication(h.clock, RedisConfig("tcp:host=127.0.0.1:port=6379", password),
                                BaseHandler(), "hs.test", "w1", ping_interval=1.0, ping_timeout=0.5,
                                initial_delay=0.5, max_delay=30, clock=clock)
        link.startService()
        self.addCleanup(lambda: h.run(link.stopService(), settle=False))
        return link, clock

    def test_redis_that_accepts_and_closes_sees_growing_delays(self):
        peer = Peer("close")
        link, clock = self.start(peer)
        delays = {"subscriber": [], "publisher": []}
        backoffs = {"subscriber": link.sub_backoff, "publisher": link.pub_backoff}
        for n in range(1, 8):
            self.h.flush()
            self.assertEqual([b.failures for b in backoffs.values()], [n, n])
            self.assertTrue(all(p.lost for p in peer.protocols))
            for role, backoff in backoffs.items():
                delays[role].append(backoff.last_delay)
            clock.advance(max(b.last_delay for b in backoffs.values()))
        self.assertEqual(len(peer.protocols), 14)
        for role, chosen in delays.items():
            self.assertEqual(chosen, sorted(set(chosen)), role)  # strictly growing
            self.assertGreaterEqual(chosen[5], 0.5 * 2**5 * 0.75)
        # Jitter: the two links do not come back in lockstep.
        self.assertNotEqual(delays["subscriber"], delays["publisher"])
        self.assertFalse(link.connected)

    def test_connection_lost_before_ready_is_retried_without_a_state_error(self):
        """AUTH is answered by a closed connection: the link is retried
        with backoff, and ClientService never sees an event it has no
        transition for (automat NoTransition logged as Unhandled Error)."""
        peer = Peer("close-on-data")
        link, clock = self.start(peer, password="secret-password")
        for n in range(1, 4):
            self.h.flush()
            self.assertGreaterEqual(link.sub_backoff.failures, n)
            self.assertGreaterEqual(link.pub_backoff.failures, n)
            self.assertTrue(all(p.lost for p in peer.protocols))
            clock.advance(60)
        self.assertTrue(all(p.data.startswith(b"*2\r\n$4\r\nAUTH\r\n") for p in peer.protocols))
        self.assertGreaterEqual(len(peer.protocols), 6)
        self.assertFalse(link.connected)

    def test_stop_while_a_connection_is_getting_ready(self):
        """Stopped while AUTH is unanswered: the connection is closed by the
        stop, and its end is no error."""
        peer = Peer("silent")
        link, clock = self.start(peer, password="secret-password")
        self.h.flush()
        self.assertEqual(len(peer.protocols), 2)
        self.assertTrue(all(p.data for p in peer.protocols))
        self.h.run(link.stopService(), settle=False)
        self.assertTrue(all(p.lost for p in peer.protocols))
        self.assertFalse(link.connected)


class RedisHealthyResetTests(TestCase):
    """On a real redis-server: failures while it is down make the delays
    grow; coming back resets nothing until the links were ready and up for
    ping_interval."""

    timeout = 120

    async def test_backoff_resets_only_after_ready_and_a_ping_interval(self):
        from tests.servers import RedisServer

        redis = RedisServer()
        self.addCleanup(redis.stop)
        clock = Clock()

        class Handler(BaseHandler):
            def on_REPLICATE(self, conn, cmd):
                pass

        link = RedisReplication(reactor, RedisConfig(redis.endpoint), Handler(), "hs.test",
                                "w1", ping_interval=1.0, ping_timeout=0.5,
                                initial_delay=0.5, max_delay=30, clock=clock)
        link.startService()
        self.addCleanup(link.stopService)
        backoffs = (link.sub_backoff, link.pub_backoff)
        await until_handled([link.handler], lambda: link.connected, timeout=30)
        redis.kill()
        for n in range(1, 5):
            await until(lambda: all(b.failures == n for b in backoffs), timeout=30)
            if n < 4:
                clock.advance(max(b.last_delay for b in backoffs))
        self.assertFalse(link.connected)
        redis.start()
        clock.advance(max(b.last_delay for b in backoffs))
        await until_handled([link.handler], lambda: link.connected, timeout=30)
        # Connected and subscribed, but not yet proven: no reset.
        self.assertEqual([b.failures for b in backoffs], [4, 4])
        clock.advance(1.0)
        self.assertEqual([b.failures for b in backoffs], [0, 0])
