"""What /health says about replication: committed facts a reader has not
received, writers never heard of.

The monitor's verdicts are checked in memory (:mod:`tests.harness`: a real
handler and real tables, on SQLite run inline); then whole instances
(``service.Instance``) on a real PostgreSQL, over real TCP and a real
redis-server, with a proxy in the middle that stops relaying while the
sockets stay open (a link that is silently dead).
"""

import re
import uuid

import orjson
from prometheus_client import REGISTRY
from twisted.internet import endpoints, protocol, reactor, task
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool, readBody

from replicator.config import parse_instance, parse_streams
from replicator.consumers import MemoryConsumer
from replicator.daemon.service import Instance
from replicator.observe import metrics
from replicator.observe.health import HealthMonitor
from tests.harness import Harness
from tests.servers import PostgresServer, RedisServer
from tests.stream_sets import HEALTH_STREAM_DEFS as STREAM_DEFS
from tests.support import until, until_handled

SECRET = "health-test-secret-0123456789"
STREAMS = parse_streams(STREAM_DEFS)


def unreceived_metric(stream, writer):
    return REGISTRY.get_sample_value("replicator_unreceived_facts",
                                     {"stream": stream, "writer": writer})


class HealthMonitorTests(TestCase):
    """The verdicts, in memory (:mod:`tests.harness`): the instances on the
    harness's clock, the monitor on a Clock of its own; the grace counts, a
    fact that arrives in time is never a problem, recovery clears it."""

    def setUp(self):
        self.h = Harness(STREAMS, self.addCleanup)
        self.master = self.h.instance("master")
        self.consumer = MemoryConsumer()
        self.worker = self.h.instance("worker1", [self.consumer])
        self.clock = task.Clock()
        self.monitor = HealthMonitor(registry=self.worker.registry, handler=self.worker.handler,
                                     db=self.worker.db, clock=self.clock, lag_grace=10.0,
                                     expect_upstream=True)

    def upstream(self, node, lines: bytes):
        """A connection from upstream that has sent ``lines``, all handled."""
        proto, _ = self.h.client(node)
        proto.dataReceived(lines)
        self.h.settle()
        return proto

    def write(self, n, stream="caches"):
        s = self.master.stream(stream)
        row = (lambda i: [f"f{i}", i]) if stream == "caches" else (lambda i: [f"e{i}"])
        return [self.h.run(s.write_fact([row(i)])) for i in range(n)]

    def check(self, monitor=None):
        self.h.run((monitor or self.monitor).check_unreceived())

    def test_committed_facts_not_received_for_the_grace_are_a_problem(self):
        link = self.upstream(self.worker, b"POSITION caches master 0 0\n"
                                          b"POSITION events master 0 0\n"
                                          b"POSITION events worker2 0 0\n")
        self.check()
        self.assertIsNone(self.monitor.problem(True, "connected"))
        self.assertEqual(unreceived_metric("caches", "master"), 0)
        # The master commits 3 facts; this reader is told nothing.
        self.write(3)
        self.check()
        self.assertEqual(unreceived_metric("caches", "master"), 3)
        self.clock.advance(9)
        self.check()
        self.assertIsNone(self.monitor.problem(True, "connected"))
        self.clock.advance(1)
        self.assertEqual(self.monitor.problem(True, "connected"),
                         "stream caches: writer master has 3 committed facts not received "
                         "for 10s")
        # More facts meanwhile: the age is the oldest one's.
        self.write(2)
        self.clock.advance(5)
        self.check()
        self.assertEqual(self.monitor.problem(True, "connected"),
                         "stream caches: writer master has 5 committed facts not received "
                         "for 15s")
        self.assertEqual(REGISTRY.get_sample_value(
            "replicator_unreceived_age_seconds", {"stream": "caches", "writer": "master"}),
            15)
        # Told at last: the reader catches up from the table, healthy at once.
        link.dataReceived(b"POSITION caches master 5 5\n")
        self.h.settle()
        self.assertEqual([f[2] for f in self.consumer.facts], [1, 2, 3, 4, 5])
        self.assertIsNone(self.monitor.problem(True, "connected"))
        self.check()
        self.assertEqual(unreceived_metric("caches", "master"), 0)
        self.assertIsNone(self.monitor.problem(True, "connected"))
        # Its other streams' writers are checked the same way.
        self.write(1, "events")
        self.check()
        self.clock.advance(10)
        self.assertEqual(self.monitor.problem(True, "connected"),
                         "stream events: writer master has 1 committed fact not received "
                         "for 10s")

    def test_a_fact_deleted_from_the_table_is_no_longer_unreceived(self):
        # An operator deleted a committed row (facts are immutable, but it
        # happens): the finding went to "0 committed facts not received",
        # and its age ran on into the next, unrelated fact.
        self.upstream(self.worker, b"POSITION caches master 0 0\n"
                                   b"POSITION events master 0 0\n"
                                   b"POSITION events worker2 0 0\n")
        [token] = self.write(1)
        self.check()
        self.clock.advance(10)
        self.assertIn("1 committed fact not received", self.monitor.problem(True, "connected"))
        table = self.master.stream("caches").config.table
        self.h.run(self.master.db.runOperation(f"DELETE FROM {table} WHERE stream_id = {token}"))
        self.check()
        self.assertIsNone(self.monitor.problem(True, "connected"))
        self.write(1)
        self.check()
        self.clock.advance(10)
        self.assertEqual(self.monitor.problem(True, "connected"),
                         "stream caches: writer master has 1 committed fact not received "
                         "for 10s")

    def test_facts_received_within_the_grace_are_never_a_problem(self):
        link = self.upstream(self.worker, b"POSITION caches master 0 0\n"
                                          b"POSITION events master 0 0\n"
                                          b"POSITION events worker2 0 0\n")
        # Every check sees facts not yet received, each arriving within
        # the grace: steady load, never unhealthy.
        for round_ in range(6):
            tokens = self.write(2)
            self.check()
            self.clock.advance(6)
            self.assertIsNone(self.monitor.problem(True, "connected"), round_)
            link.dataReceived(b"POSITION caches master %d %d\n" % (tokens[-1], tokens[-1]))
            self.h.settle()
            self.clock.advance(6)
            self.assertIsNone(self.monitor.problem(True, "connected"), round_)
        self.assertEqual(len(self.consumer.facts), 12)

    def test_a_writer_never_heard_of_is_a_problem_after_the_grace(self):
        self.monitor.startService()
        self.addCleanup(self.monitor.stopService)
        link = self.upstream(self.worker, b"POSITION caches master 0 0\n"
                                          b"POSITION events master 0 0\n")
        self.clock.advance(9.5)
        self.assertIsNone(self.monitor.problem(True, "connected"))
        self.clock.advance(0.5)
        self.assertEqual(self.monitor.problem(True, "connected"),
                         "stream events: writer worker2 never announced anything in 10s")
        # A link that is down is named first.
        self.assertEqual(self.monitor.problem(False, "connecting"),
                         "replication not connected: connecting")
        link.dataReceived(b"POSITION events worker2 0 0\n")
        self.assertIsNone(self.monitor.problem(True, "connected"))

    def test_the_healthy_gauge_follows_the_verdict_at_scrape_time(self):
        """``replicator_healthy`` (what the alert on /health failing reads)
        is 1 while the replication verdict is OK, 0 as soon as it is not,
        and set at scrape time (collecting the registry runs its source)."""
        status = [(True, "connected")]
        source = self.monitor.healthy_source(lambda: status[0])
        metrics.add_source(source)
        self.addCleanup(metrics.remove_source, source)
        self.upstream(self.worker, b"POSITION caches master 0 0\n"
                                   b"POSITION events master 0 0\n"
                                   b"POSITION events worker2 0 0\n")
        self.assertEqual(REGISTRY.get_sample_value("replicator_healthy"), 1)
        status[0] = (False, "connecting")
        self.assertEqual(REGISTRY.get_sample_value("replicator_healthy"), 0)
        status[0] = (True, "connected")
        self.assertEqual(REGISTRY.get_sample_value("replicator_healthy"), 1)
        self.write(2)
        self.check()
        self.clock.advance(10)
        self.assertEqual(REGISTRY.get_sample_value("replicator_healthy"), 0)

    def test_a_master_reports_unreceived_facts_but_not_silent_workers(self):
        monitor = HealthMonitor(registry=self.master.registry, handler=self.master.handler,
                                db=self.master.db, clock=self.clock, lag_grace=10.0)
        self.clock.advance(60)
        self.check(monitor)
        self.assertIsNone(monitor.problem(False, "no worker connected"))
        # worker2 connected once, then its link went silent while it wrote.
        self.upstream(self.master, b"POSITION events worker2 0 0\n")
        worker2 = self.h.instance("worker2")
        self.h.run(worker2.stream("events").write_fact([["w2"]]))
        self.check(monitor)
        self.clock.advance(10)
        self.assertEqual(monitor.problem(False, "no worker connected"),
                         "stream events: writer worker2 has 1 committed fact not received "
                         "for 10s")


# ------------------------------------------------------------ whole instances
class _Side(protocol.Protocol):
    """One end of a proxied connection."""

    def __init__(self, proxy):
        self.proxy = proxy
        self.peer = None
        self.held = []

    def dataReceived(self, data):
        if self.proxy.paused or self.peer is None or self.peer.transport is None:
            self.held.append(data)
        else:
            self.peer.transport.write(data)

    def flush(self):
        if self.held and self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(b"".join(self.held))
            self.held = []

    def connectionLost(self, reason=None):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.loseConnection()


class Proxy(protocol.Factory):
    """A loopback TCP proxy that can stop relaying with every socket left
    open (what a silently dead link looks like) and start again."""

    def __init__(self, port: int):
        self.target = port
        self.paused = False
        self.sides = []

    def buildProtocol(self, addr):
        inbound = _Side(self)
        self.sides.append(inbound)

        def connected(outbound):
            inbound.peer, outbound.peer = outbound, inbound
            self.sides.append(outbound)
            if not self.paused:
                inbound.flush()
            return outbound

        def failed(f):
            if inbound.transport is not None:
                inbound.transport.loseConnection()

        endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.target), _Side(self)
        ).addCallbacks(connected, failed)
        return inbound

    async def listen(self, test) -> int:
        port = await endpoints.TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(self)
        test.addCleanup(port.stopListening)
        test.addCleanup(self.close)
        return port.getHost().port

    def pause(self):
        self.paused = True

    def resume(self):
        self.paused = False
        for side in list(self.sides):
            side.flush()

    def close(self):
        for side in self.sides:
            if side.transport is not None:
                side.transport.abortConnection()


class HealthEndToEndTests(TestCase):
    timeout = 180

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.agent = Agent(reactor, pool=pool)
        self.addCleanup(pool.closeCachedConnections)

    async def instance(self, name, replication, streams=STREAM_DEFS, http=False,
                       server_name="hs.test"):
        doc = {
            "server_name": server_name, "instance_name": name,
            "database": {"postgres": self.dsn, "pool_max": 3},
            "streams": streams, "replication": replication,
            "health": {"lag_grace": 1, "check_interval": 0.1},
        }
        if http:
            doc["http"] = {"listen": "tcp:0:interface=127.0.0.1", "secret": SECRET}
        instance = Instance(parse_instance(doc), reactor)
        self.addCleanup(instance.stop)
        await instance.start()
        return instance

    async def health(self, instance):
        url = f"http://127.0.0.1:{instance.port_of('HTTP')}/health".encode()
        response = await self.agent.request(b"GET", url)
        return response.code, orjson.loads(await readBody(response))

    async def until_health(self, instance, predicate, timeout=60.0):
        """Poll /health until ``predicate(code, answer)``; the last answer."""
        seen = []

        async def check():
            seen.append(await self.health(instance))
            return predicate(*seen[-1])

        waited = 0.0
        while not await check():
            if waited > timeout:
                raise AssertionError(f"/health never matched; last {seen[-1]}")
            await task.deferLater(reactor, 0.1, lambda: None)
            waited += 0.1
        return seen[-1]

    async def test_tcp_reader_with_a_silent_upstream_link(self):
        """The worker's link to the master stops carrying bytes, never
        closing (long ping timeout): the master's committed facts are named
        after the grace, and the worker is healthy again once they arrive."""
        master = await self.instance(
            "master", {"listen": "tcp:0:interface=127.0.0.1", "ping_timeout": 600},
            streams=[dict(d, writers=["master"]) for d in STREAM_DEFS])
        proxy = Proxy(master.port_of("replication"))
        proxy_port = await proxy.listen(self)
        worker = await self.instance(
            "worker1", {"upstream": f"tcp:host=127.0.0.1:port={proxy_port}",
                        "ping_interval": 1, "ping_timeout": 600},
            streams=[dict(d, writers=["master"]) for d in STREAM_DEFS], http=True)
        await self.until_health(worker, lambda code, _: code == 200)
        caches = master.registry.get("caches")
        for i in range(3):
            await caches.write_fact([[f"before{i}", i]])
        await until(lambda: worker.handler.reader_positions()[("caches", "master")] == 3)
        proxy.pause()
        for i in range(20):
            await caches.write_fact([[f"unseen{i}", i]])
        code, answer = await self.until_health(worker, lambda code, _: code == 503)
        self.assertEqual(answer["status"], "unhealthy")
        self.assertRegex(answer["reason"], r"^stream caches: writer master has 20 committed "
                                           r"facts not received for \d+s$")
        self.assertTrue(worker.redis is None and worker.replication_status()[0])
        self.assertEqual(worker.handler.reader_positions()[("caches", "master")], 3)
        proxy.resume()
        await self.until_health(worker, lambda code, _: code == 200)
        self.assertEqual(worker.handler.reader_positions()[("caches", "master")], 23)

    async def test_redis_writer_with_a_silent_link_and_a_writer_never_started(self):
        """On Redis the master's own link stops carrying bytes while it keeps
        writing: its reader names it; worker2 (configured, never started)
        is named once the master is fine again, and then not any more."""
        redis = RedisServer.shared()
        server_name = f"hs-{uuid.uuid4().hex[:8]}"
        proxy = Proxy(redis.port)
        proxy_port = await proxy.listen(self)
        master = await self.instance(
            "master", {"redis": {"endpoint": f"tcp:host=127.0.0.1:port={proxy_port}"}},
            server_name=server_name)
        worker = await self.instance(
            "worker1", {"redis": {"endpoint": redis.endpoint}}, http=True,
            server_name=server_name)
        await until_handled([master.redis.handler, worker.redis.handler],
                            lambda: master.redis.connected and worker.redis.connected,
                            timeout=30)
        events = master.registry.get("events")
        await events.write_fact([["seen"]])
        await until(lambda: worker.handler.reader_positions()[("events", "master")] == 1,
                    timeout=30)
        proxy.pause()
        for i in range(30):
            await events.write_fact([[f"unseen{i}"]])
        code, answer = await self.until_health(
            worker, lambda code, answer: "writer master" in answer.get("reason", ""))
        self.assertEqual(code, 503)
        self.assertRegex(answer["reason"], r"^stream events: writer master has 30 "
                                           r"committed facts not received for \d+s$")
        proxy.resume()
        code, answer = await self.until_health(
            worker, lambda code, answer: "writer master" not in answer.get("reason", ""))
        self.assertEqual(worker.handler.reader_positions()[("events", "master")], 31)
        self.assertEqual((code, answer), (503, {
            "status": "unhealthy", "reason": answer["reason"]}))
        self.assertTrue(re.fullmatch(r"stream events: writer worker2 never announced "
                                     r"anything in \d+s", answer["reason"]), answer)
        worker2 = await self.instance(
            "worker2", {"redis": {"endpoint": redis.endpoint}}, server_name=server_name)
        await self.until_health(worker, lambda code, _: code == 200)
        self.assertTrue(worker2.redis.connected)
