"""Replication over a real redis-server and a real PostgreSQL: two writers of
one multi-writer stream and a reader, through a Redis crash and a reader
restart; a replaced link's late bytes; a frozen server.  The link's logic
(foreign traffic, position-only advances, refused AUTH) is tested in memory:
``tests/test_redis_memory.py``."""

import asyncio
import random
import socket
import threading
import types

from twisted.internet import defer, reactor, threads
from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from replicator.config import RedisConfig
from replicator.consumers import MemoryConsumer
from replicator.observe import metrics
from replicator.replication.transport.redis import RedisReplication
from tests.handlers import CommandRecorder
from tests.redis_nodes import KEYS, TABLES, Node
from tests.servers import PostgresServer, RedisServer
from tests.support import (
    Progress,
    WatchedConsumer,
    as_sets,
    sleep,
    table_facts,
    until,
    until_handled,
    write_randomly,
)


class RedisReplicationTests(TestCase):
    timeout = 300

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        self.redis = RedisServer(password="redis-test-secret")
        self.addCleanup(self.redis.stop)

    async def test_multi_writer_through_crash_and_restart(self):
        rng = random.Random(99)
        w1 = await Node(self, self.dsn, "w1", self.redis).start()
        w2 = await Node(self, self.dsn, "w2", self.redis).start()
        log = []
        consumer = MemoryConsumer(positions={k: 0 for k in KEYS})
        reader = await Node(self, self.dsn, "r", self.redis, consumer).start()
        await until_handled([n.handler for n in (w1, w2, reader)],
                            lambda: all(n.link.connected for n in (w1, w2, reader)))

        target = 10_000
        written = Progress(n=0)

        async def writer_loop(node):
            await write_randomly(
                node.registry.get("caches"), rng, written, target,
                lambda n, j: [f"f{n}", rng.choice([None, ["@k:hs"]]), j],
                max_facts=25, pause=True)

        async def chaos():
            nonlocal reader, consumer
            await written.until(lambda: written["n"] > 2500)
            self.redis.kill()
            await until_handled([reader.handler], lambda: not reader.link.connected, timeout=10)
            await sleep(0.3)  # writes go on without Redis
            self.redis.start()
            await written.until(lambda: written["n"] > 6000)
            # Restart the reader: its consumer resumes from what it handled.
            await reader.stop()
            log.extend(consumer.facts)
            consumer = MemoryConsumer(positions=consumer.positions())
            reader = await Node(self, self.dsn, "r", self.redis, consumer).start()

        await defer.gatherResults([
            defer.ensureDeferred(writer_loop(w1)),
            defer.ensureDeferred(writer_loop(w2)),
            defer.ensureDeferred(chaos()),
        ])

        def caught_up():
            positions = reader.handler.reader_positions()
            return all(positions[("caches", w.name)] is not None and
                       positions[("caches", w.name)] >=
                       w.registry.get("caches").id_gen.get_current_token(w.name)
                       for w in (w1, w2))

        await until_handled([reader.handler], caught_up, timeout=120)
        log.extend(consumer.facts)
        expected = {k: [] for k in KEYS}
        expected.update(table_facts(self.dsn, TABLES))
        got = {k: [] for k in KEYS}
        for stream, writer, token, rows in log:
            got[(stream, writer)].append((token, rows))
        for key in KEYS:
            self.assertEqual(len(got[key]), len(expected[key]), key)
            self.assertEqual(as_sets({key: got[key]}), as_sets({key: expected[key]}), key)
        # Both writers know each other and agree on the linear position.
        for w in (w1, w2):
            await until(lambda: w1.registry.get("caches").id_gen.get_linear_token() ==
                        w2.registry.get("caches").id_gen.get_linear_token())
        linear = reader.registry.get("caches").id_gen.get_linear_token()
        self.assertEqual(linear, min(reader.handler.reader_positions().values()))


def redis_clients(port, password):
    """How many clients ``redis-server`` has, this one included."""
    def bulk(s):
        b = s.encode()
        return b"$%d\r\n%s\r\n" % (len(b), b)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"*2\r\n" + bulk("AUTH") + bulk(password) + b"*2\r\n" + bulk("INFO")
                  + bulk("clients"))
        data = b""
        while b"connected_clients:" not in data or not data.endswith(b"\r\n\r\n"):
            data += s.recv(65536)
    return int(data.split(b"connected_clients:")[1].split(b"\r\n")[0])


class LoopProxy:
    """The chaos suite's proxy (:class:`tests.chaos.proxy.Proxy`), run on an
    asyncio loop in a thread of its own and driven from the reactor."""

    def __init__(self, target_port):
        from tests.chaos.proxy import Proxy

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = Proxy("writer", target_port)

    def call(self, fn):
        """``fn()`` (a coroutine function or a plain one) on the proxy's
        loop; a Deferred of its result."""
        async def go():
            result = fn()
            return await result if asyncio.iscoroutine(result) else result
        future = asyncio.run_coroutine_threadsafe(go(), self.loop)
        return threads.deferToThread(future.result, 30)

    async def stop(self):
        await self.call(self.proxy.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        await threads.deferToThread(self.thread.join, 10)
        self.loop.close()


class LateBytesTests(TestCase):
    """A writer's Redis link stalls with part of a fact on it, is replaced
    after its ping timeout, and the stalled bytes reach Redis late: they must
    never join the writer's next fact at the readers."""

    timeout = 120

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        self.redis = RedisServer(password="redis-test-secret")
        self.addCleanup(self.redis.stop)

    async def test_a_replaced_links_late_bytes_never_join_the_next_fact(self):
        link = LoopProxy(self.redis.port)
        self.addCleanup(link.stop)
        await link.call(link.proxy.start)
        writer = await Node(self, self.dsn, "w1", self.redis,
                            endpoint=f"tcp:host=127.0.0.1:port={link.proxy.port}").start()
        consumer = MemoryConsumer(positions={k: 0 for k in KEYS})
        reader = await Node(self, self.dsn, "r", self.redis, consumer).start()
        # The writer has announced POSITION caches w1 0 0.
        await until_handled([writer.handler, reader.handler],
                            lambda: writer.link.connected and reader.link.connected)
        # Past the registration's probe for a Synapse (which keeps our lines
        # in memory for synapse_probe): fact 1 goes out on the wire.
        await until(lambda: not writer.link.holding)
        old_publisher = writer.link.publisher

        # Fact 1 = {A, B} goes out on links that hold every byte.
        self.assertEqual(await link.call(link.proxy.hold), 2)
        caches = writer.registry.get("caches")
        await caches.write_fact([["A", None, 1], ["B", None, 1]])

        def held():
            return b"".join(bytes(x.held) for x in link.proxy.links if x.held is not None)

        async def holding(needle):
            while needle not in await link.call(held):
                await sleep(0.01)
        await holding(b"RDATA caches w1 batch")

        # No PING answered: the links are replaced, the new ones pass, and the
        # writer re-announces POSITION caches w1 1 1: the reader reads fact 1
        # from the table.
        await until_handled([writer.handler],
                            lambda: writer.link.connected and writer.link.publisher is not None
                            and writer.link.publisher is not old_publisher, timeout=30)
        await until_handled([reader.handler],
                            lambda: reader.handler.reader_positions()[("caches", "w1")] == 1,
                            timeout=30)

        # Then the old link's first line reaches Redis, and the old link
        # closes: the prefix up to the end of the first PUBLISH of a batch line.
        def through_first_batch_line(data):
            at = data.find(b"RDATA caches w1 batch")
            return 0 if at < 0 else data.index(b"\r\n", at) + 2

        clients = await threads.deferToThread(redis_clients, self.redis.port,
                                              self.redis.password)
        await link.call(lambda: link.proxy.release(through_first_batch_line))
        # Redis has run what it got once it has dropped both old links.
        while await threads.deferToThread(redis_clients, self.redis.port,
                                          self.redis.password) > clients - 2:
            await sleep(0.01)

        # Fact 2 = {C}.
        await caches.write_fact([["C", None, 2]])
        await until_handled([reader.handler],
                            lambda: reader.handler.reader_positions()[("caches", "w1")] == 2,
                            timeout=30)
        self.assertEqual(consumer.facts, [
            ("caches", "w1", 1, [["A", None, 1], ["B", None, 1]]),
            ("caches", "w1", 2, [["C", None, 2]]),
        ])


class RedisFailureModeTests(TestCase):
    """The ways Synapse's users lose Redis replication, each made impossible."""

    timeout = 120

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        self.redis = RedisServer(password="the-right-password")
        self.addCleanup(self.redis.stop)

    async def test_dead_socket_is_noticed_by_ping_and_replaced(self):
        import os
        import signal as sig

        consumer = WatchedConsumer(positions={k: 0 for k in KEYS})
        writer = await Node(self, self.dsn, "w1", self.redis).start()
        reader = await Node(self, self.dsn, "r", self.redis, consumer).start()
        await until_handled([writer.handler, reader.handler],
                            lambda: writer.link.connected and reader.link.connected)
        os.kill(self.redis.proc.pid, sig.SIGSTOP)  # alive but silent
        try:
            # ping every 0.5 s, 0.5 s to answer: noticed within seconds.
            await until_handled([reader.handler], lambda: not reader.link.connected, timeout=10)
            await writer.registry.get("caches").write_fact([["while frozen", None, 1]])
        finally:
            os.kill(self.redis.proc.pid, sig.SIGCONT)
        await until_handled([reader.handler], lambda: reader.link.connected, timeout=20)
        await consumer.until(lambda: consumer.facts, timeout=20)
        self.assertEqual(consumer.facts, [("caches", "w1", 1, [["while frozen", None, 1]])])


class EchoFilterTests(TestCase):
    """Redis pub/sub delivers our own publications back to us: what names
    this instance (its RDATA, POSITION, USER_SYNC, CLEAR_USER_SYNC,
    FEDERATION_ACK) is dropped, anything else of the same kinds is handed to
    the handler, in order."""

    def test_our_own_lines_are_not_delivered_back(self):
        from twisted.internet import task

        handler = CommandRecorder(["caches", "events"])
        link = RedisReplication(task.Clock(), RedisConfig("tcp:host=127.0.0.1:port=1"),
                                handler, "hs.test", "worker1")
        link.conn, link.subscriber = types.SimpleNamespace(current_line=None), object()
        own = [
            'RDATA caches worker1 5 ["a",null,1]',
            "POSITION events worker1 4 7",
            "USER_SYNC worker1 @u:hs.test DEV start 1000",
            "CLEAR_USER_SYNC worker1",
            "FEDERATION_ACK worker1 9",
            # A stream we do not know, naming us: no prefix of ours, still ours.
            "POSITION other worker1 1 2",
        ]
        others = [
            'RDATA caches worker2 5 ["a",null,1]',
            "POSITION events master 4 7",
            "USER_SYNC worker2 @u:hs.test DEV start 1000",
            "CLEAR_USER_SYNC worker11",
            "FEDERATION_ACK master 9",
        ]
        for line in own + others:
            link.message_received(link.subscriber, b"hs.test", (line + "\n").encode())
        self.assertEqual(handler.received, [
            'RDATA caches worker2 5 ["a",null,1]',
            "POSITION events master 4 7",
            "USER_SYNC worker2 @u:hs.test DEV start 1000",
            "CLEAR_USER_SYNC worker11",
            "FEDERATION_ACK master 9",
        ])
        # A subscriber that is not the current one delivers nothing.
        link.message_received(object(), b"hs.test", b"POSITION events master 7 8\n")
        self.assertEqual(len(handler.received), 5)


class ConfiguredKeepaliveTests(TestCase):
    """``replication.ping_interval`` and ``ping_timeout`` govern the Redis
    links too, not only TCP's (the instance used to build its Redis links
    with the class defaults, 10 s and 5 s, whatever the config said)."""

    async def test_the_instance_builds_its_redis_links_with_the_configured_keepalive(self):
        from replicator.config import parse_instance
        from replicator.daemon.service import Instance
        from tests.servers import free_port

        doc = {"server_name": "hs.test", "instance_name": "w1",
               "database": {"sqlite": self.mktemp() + ".db"},
               "streams": [{"name": "caches", "table": "cache_stream",
                            "columns": [{"cache_func": "text"}], "writers": ["w1"]}],
               # Nothing listens there: the links keep trying, which is all
               # this test needs.
               "replication": {"redis": {"endpoint": f"tcp:host=127.0.0.1:port={free_port()}"},
                               "ping_interval": 2, "ping_timeout": 7}}
        instance = Instance(parse_instance(doc), reactor)
        self.addCleanup(instance.stop)
        await instance.start()
        link = instance.redis
        self.assertEqual((link.ping_interval, link.ping_timeout), (2, 7))
        # The keepalive timer runs at that interval.
        self.assertEqual(link._pinger.interval, 2)


class PublishBlockTests(TestCase):
    """The lines of one write reach the channel all or nothing: several are
    PUBLISHed inside MULTI ... EXEC, and the replies stay matched to their
    commands (MULTI's +OK, a +QUEUED per PUBLISH, EXEC's list), whatever
    EXEC answers or if the link goes."""

    def setUp(self):
        from twisted.internet import task
        from twisted.internet.testing import StringTransport

        from replicator.replication.transport.redis import _Publisher, _RedisFactory

        self.link = RedisReplication(task.Clock(), RedisConfig("tcp:host=127.0.0.1:port=1"),
                                     CommandRecorder(["caches"]), "hs.test", "w1")
        config = RedisConfig("tcp:host=127.0.0.1:port=1")
        self.publisher = _RedisFactory(_Publisher, config, self.link,
                                       "publisher").buildProtocol(None)
        self.transport = StringTransport()
        self.publisher.makeConnection(self.transport)
        self.assertIs(self.link.publisher, self.publisher)  # ready: no AUTH, no SELECT

    def dropped(self):
        return metrics.COMMANDS_DROPPED.labels("PUBLISH", "failed")._value.get()

    def publish(self, *lines):
        self.transport.clear()
        self.link.publish_lines([line.encode() + b"\n" for line in lines])
        return self.transport.value()

    def test_several_lines_go_in_one_block_and_its_replies_are_accounted_for(self):
        def publish_command(payload):
            return b"*3\r\n$7\r\nPUBLISH\r\n$7\r\nhs.test\r\n$%d\r\n%s\r\n" % (
                len(payload), payload)
        batch = b'RDATA caches w1 batch ["A",null,1]'
        last = b'RDATA caches w1 1 ["B",null,1]'
        self.assertEqual(self.publish(batch.decode(), last.decode()),
                         b"*1\r\n$5\r\nMULTI\r\n" + publish_command(batch)
                         + publish_command(last) + b"*1\r\n$4\r\nEXEC\r\n")
        before = self.dropped()
        self.publisher.dataReceived(b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n:1\r\n:1\r\n")
        self.assertEqual(self.dropped(), before)
        self.assertEqual(self.publisher.replyQueue.waiting, [])
        # The next reply is the next command's: a PING's.
        pong = self.publisher.ping()
        self.publisher.dataReceived(b"+PONG\r\n")
        self.assertEqual(self.successResultOf(pong), "PONG")
        # One line is one PUBLISH, atomic by itself.
        self.assertEqual(self.publish("POSITION caches w1 1 1"),
                         publish_command(b"POSITION caches w1 1 1"))
        self.publisher.dataReceived(b":1\r\n")
        self.assertEqual((self.dropped(), self.publisher.replyQueue.waiting), (before, []))

    def test_a_block_that_did_not_run_counts_its_lines_as_dropped(self):
        before = self.dropped()
        self.publish("RDATA caches w1 batch x", "RDATA caches w1 1 y")
        self.publisher.dataReceived(
            b"+OK\r\n-ERR refused\r\n+QUEUED\r\n"
            b"-EXECABORT Transaction discarded because of previous errors.\r\n")
        self.assertEqual(self.dropped(), before + 2)
        self.assertEqual(self.publisher.replyQueue.waiting, [])
        # A block whose link goes before EXEC answers: Redis ran it or not,
        # we cannot know; the reconnect's POSITIONs cover it either way.
        self.publish("RDATA caches w1 batch x", "RDATA caches w1 batch y", "RDATA caches w1 2 z")
        self.publisher.dataReceived(b"+OK\r\n+QUEUED\r\n")
        self.publisher.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.dropped(), before + 5)
        self.assertIsNone(self.link.publisher)


class SubscriberInputTests(TestCase):
    """What the subscriber reads off the channel is a line of text, whatever
    it looks like: a payload that reads as a number (anyone may PUBLISH
    ``123`` on the channel) is an unparsable line like any other, not a
    crash of the subscriber's ``dataReceived`` (which would drop the link)."""

    def test_a_number_on_the_channel_is_an_unparsable_line(self):
        from twisted.internet import task
        from twisted.internet.testing import StringTransport

        from replicator.replication.transport.redis import _RedisFactory, _Subscriber

        handler = CommandRecorder(["caches"])
        link = RedisReplication(task.Clock(), RedisConfig("tcp:host=127.0.0.1:port=1"),
                                handler, "hs.test", "w2")
        subscriber = _RedisFactory(_Subscriber, link.config, link,
                                   "subscriber").buildProtocol(None)
        subscriber.makeConnection(StringTransport())
        link.conn, link.subscriber = types.SimpleNamespace(current_line=None), subscriber
        unparsable = metrics.COMMANDS_DROPPED.labels("unknown", "unparsable")._value.get()

        def message(payload):
            return b"*3\r\n$7\r\nmessage\r\n$7\r\nhs.test\r\n$%d\r\n%s\r\n" % (
                len(payload), payload)
        subscriber.dataReceived(message(b"123") + message(b"-1.5")
                                + message(b"POSITION caches w1 1 2\n"))
        self.assertEqual(handler.received, ["POSITION caches w1 1 2"])
        self.assertEqual(metrics.COMMANDS_DROPPED.labels("unknown", "unparsable")._value.get(),
                         unparsable + 2)


class LinkSocketTests(TestCase):
    """Both Redis links send without delay (``TCP_NODELAY``), as the TCP
    replication connections do: a fact's block is written the moment the
    fan-out hands it over, never held back by Nagle's algorithm waiting for
    the acknowledgement of the block before it."""

    timeout = 60

    async def test_both_links_set_tcp_nodelay(self):
        redis = RedisServer()
        self.addCleanup(redis.stop)
        link = RedisReplication(reactor, RedisConfig(redis.endpoint),
                                CommandRecorder(["caches"]), "hs.test", "w1",
                                initial_delay=0.05, max_delay=0.3)
        link.handler.new_connection = lambda conn: None
        link.handler.lost_connection = lambda conn, reason: None
        link.startService()
        self.addCleanup(link.stopService)
        await until_handled([link.handler], lambda: link.connected)
        for protocol in (link.publisher, link.subscriber):
            sock = protocol.transport.getHandle()
            self.assertTrue(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
                            protocol.role)
