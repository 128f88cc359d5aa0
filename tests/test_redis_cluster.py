"""Sharded pub/sub on a real Redis 7 cluster (three masters on loopback,
``redis-cli --cluster create``) and a real PostgreSQL
(:mod:`replicator.replication.transport.redis_cluster`).

Facts of several streams flow from a writer to a reader through the
cluster, each stream on its own shard channel on the master serving its
slot; a slot migration moves one stream's channel to another master while
the writer writes, and the reader follows: every fact arrives exactly once
(the catch-up from the tables covers the gap).  In memory: the hash slot,
the config keys."""

import random

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase

from replicator.config import (
    ConfigError,
    RedisConfig,
    parse_database,
    parse_instance,
    parse_streams,
)
from replicator.consumers import MemoryConsumer
from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.transport.redis_cluster import RedisClusterBus, key_slot
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from tests.redis_cluster_servers import RedisCluster, command
from tests.servers import PostgresServer
from tests.support import Progress, as_sets, table_facts, until, until_handled, write_randomly

NAMES = ["s0", "s1", "s2"]
STREAMS = parse_streams([
    {"name": n, "table": f"cluster_{n}", "columns": [{"k": "text"}, {"n": "bigint"}],
     "writers": ["w"]} for n in NAMES])
TABLES = [(n, f"cluster_{n}", "k, n") for n in NAMES]


class SlotAndConfigTests(TestCase):
    def test_key_slot_is_redis_cluster_s(self):
        self.assertEqual(key_slot(b"foo"), 12182)  # CLUSTER KEYSLOT foo
        self.assertEqual(key_slot(b"{user1000}.following"), key_slot(b"user1000"))
        self.assertEqual(key_slot(b"a{}b"), key_slot(b"a{}b"))  # empty tag: whole key

    def test_the_bus_is_a_redis_bus(self):
        from twisted.internet import task
        from zope.interface.verify import verifyObject

        from replicator.replication.interfaces import IRedisBus
        from tests.handlers import CommandRecorder

        config = RedisConfig("tcp:host=127.0.0.1:port=1", channels="per_stream",
                             cluster=("tcp:host=127.0.0.1:port=1",))
        bus = RedisClusterBus(task.Clock(), config, CommandRecorder(["a"]), "hs", "w")
        self.assertTrue(verifyObject(IRedisBus, bus))
        self.assertEqual(bus.channel, "hs/replicator")

    def test_a_write_is_one_block_per_channel_on_its_master_and_moved_starts_over(self):
        from twisted.internet import task
        from twisted.internet.testing import StringTransport

        from replicator.replication.transport import redis_cluster as rc
        from tests.handlers import CommandRecorder

        config = RedisConfig("tcp:host=127.0.0.1:port=1", channels="per_stream",
                             cluster=("tcp:host=127.0.0.1:port=1",))
        handler = CommandRecorder(["a", "b"])
        handler.lost = []
        handler.lost_connection = lambda conn, reason: handler.lost.append(reason)
        bus = RedisClusterBus(task.Clock(), config, handler, "hs", "w")
        bus.running = True
        a, b = (bus.layout.stream_channel(n).encode() for n in "ab")
        split = (key_slot(a) + key_slot(b)) // 2
        bus.slots = [(0, split, "n1"), (split + 1, 16383, "n2")]
        transports = {}
        for node in ("n1", "n2"):
            factory = rc._Factory(rc._Publisher, config, bus, node, bus.generation)
            protocol = factory.buildProtocol(None)
            transports[node] = StringTransport()
            protocol.makeConnection(transports[node])
            bus.publishers[node] = protocol
        bus.conn = rc.RedisConnection(bus)
        bus.publish_lines([b"POSITION a w 1 1\n", b"POSITION b w 2 2\n",
                           b'RDATA a w 3 ["x"]\n'])
        node_of = {a: rc.owner(bus.slots, key_slot(a)), b: rc.owner(bus.slots, key_slot(b))}
        self.assertNotEqual(node_of[a], node_of[b])
        def spublish(channel, payload):
            return b"*3\r\n$8\r\nSPUBLISH\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
                len(channel), channel, len(payload), payload)

        self.assertEqual(transports[node_of[a]].value(),
                         b"*1\r\n$5\r\nMULTI\r\n" + spublish(a, b"POSITION a w 1 1")
                         + spublish(a, b'RDATA a w 3 ["x"]') + b"*1\r\n$4\r\nEXEC\r\n")
        self.assertEqual(transports[node_of[b]].value(), spublish(b, b"POSITION b w 2 2"))
        # The slot of b moved: MOVED ends the generation (a new one reads
        # the map again); the lines count as dropped.
        bus.publishers[node_of[b]].dataReceived(b"-MOVED 1234 127.0.0.1:7001\r\n")
        self.assertEqual(handler.lost, ["connection_lost"])
        self.assertIsNone(bus.conn)
        self.assertEqual(bus.publishers, {})

    def test_a_moved_slot_is_heard_even_while_a_ping_waits(self):
        """A ``sunsubscribe`` push that arrives while the subscriber's PING
        awaits its answer is the slot's move, not the PING's answer (it
        used to be handed to the PING, and the instance stayed deaf to
        the stream on its old master)."""
        from twisted.internet import task
        from twisted.internet.testing import StringTransport

        from replicator.replication.transport import redis_cluster as rc
        from tests.handlers import CommandRecorder

        config = RedisConfig("tcp:host=127.0.0.1:port=1", channels="per_stream",
                             cluster=("tcp:host=127.0.0.1:port=1",))
        bus = RedisClusterBus(task.Clock(), config, CommandRecorder(["a"]), "hs", "w")
        moved = []
        bus.moved = lambda protocol, channel: moved.append(channel)
        subscriber = rc._Factory(rc._ShardSubscriber, config, bus, "n1",
                                 bus.generation).buildProtocol(None)
        subscriber.makeConnection(StringTransport())
        pong = subscriber.ping()
        subscriber.dataReceived(b"*3\r\n$12\r\nsunsubscribe\r\n$4\r\nchan\r\n:0\r\n")
        self.assertEqual(moved, ["chan"])
        self.assertNoResult(pong)
        subscriber.dataReceived(b"*2\r\n$4\r\npong\r\n$0\r\n\r\n")
        self.assertEqual(self.successResultOf(pong), ["pong", ""])

    def test_config(self):
        def redis(section):
            return parse_instance({
                "server_name": "hs", "instance_name": "w", "database": {"sqlite": "x.db"},
                "streams": [{"name": "s", "table": "t", "columns": [{"a": "text"}],
                             "writers": ["w"]}],
                "replication": {"redis": section}}).replication.redis

        nodes = ["tcp:host=127.0.0.1:port=7000", "tcp:host=127.0.0.1:port=7001"]
        config = redis({"cluster": nodes})
        self.assertEqual((config.cluster, config.channels, config.endpoint),
                         (tuple(nodes), "per_stream", nodes[0]))
        for section, key in (({"cluster": nodes, "endpoint": nodes[0]}, "endpoint"),
                             ({"cluster": nodes, "channels": "single"}, "channels"),
                             ({"cluster": ["unix:/tmp/x"]}, "cluster[0]"),
                             ({"cluster": []}, "cluster")):
            with self.assertRaises(ConfigError) as e:
                redis(section)
            self.assertIn(f"replication.redis.{key}", str(e.exception))


class Node:
    def __init__(self, test, dsn, name, cluster, streams, consumer=None, keys=None):
        self.test, self.dsn, self.name, self.cluster = test, dsn, name, cluster
        self.streams, self.consumer, self.keys = streams, consumer, keys

    async def start(self):
        self.db = Database(parse_database({"postgres": self.dsn, "pool_max": 3}))
        self.registry = StreamRegistry(self.db, self.name, self.streams, reactor=reactor)
        await self.registry.start()
        consumers = [self.consumer] if self.consumer is not None else []
        self.handler = ReplicationHandler(self.registry, self.name, "hs.test", consumers)
        self.handler.start()
        config = RedisConfig(self.cluster.endpoints[0], channels="per_stream",
                             cluster=tuple(self.cluster.endpoints), keys=self.keys)
        self.link = RedisClusterBus(reactor, config, self.handler, "hs.test", self.name,
                                    ping_interval=0.5, ping_timeout=2, initial_delay=0.05,
                                    max_delay=0.3)
        self.link.startService()
        self.test.addCleanup(self.stop)
        return self

    async def stop(self):
        if getattr(self, "stopped", False):
            return
        self.stopped = True
        self.handler.stop()
        await self.link.stopService()
        await self.handler.drain()
        await self.registry.stop()
        self.db.close()


class ClusterTests(TestCase):
    timeout = 180

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        self.cluster = RedisCluster(3)
        self.addCleanup(self.cluster.stop)

    async def test_streams_flow_through_shards_and_follow_a_slot_move(self):
        rng = random.Random(7)
        keys = [(n, "w") for n in NAMES]
        writer = await Node(self, self.dsn, "w", self.cluster, STREAMS).start()
        consumer = MemoryConsumer(positions={k: 0 for k in keys})
        reader = await Node(self, self.dsn, "r", self.cluster, STREAMS, consumer).start()
        await until_handled([writer.handler, reader.handler],
                            lambda: writer.link.connected and reader.link.connected, timeout=30)
        channel = reader.link.layout.stream_channel("s0").encode()
        slot = key_slot(channel)
        self.assertEqual(int(command(self.cluster.ports[0], "CLUSTER", "KEYSLOT", channel)),
                         slot)
        # Each stream's channel is subscribed on the master serving its slot.
        for name in NAMES:
            stream_channel = reader.link.layout.stream_channel(name)
            node = f"127.0.0.1:{self.cluster.owner(key_slot(stream_channel.encode()))}"
            numsub = command(int(node.split(":")[1]), "PUBSUB", "SHARDNUMSUB", stream_channel)
            self.assertEqual(numsub.split(), [stream_channel, "2"], name)

        written = Progress(n=0)
        target = 1500

        async def writing(name):
            await write_randomly(writer.registry.get(name), rng, written, target,
                                 lambda n, j: [f"{name}-{n}", j], max_facts=10, pause=True)

        async def move():
            await written.until(lambda: written["n"] > 500, timeout=60)
            source = self.cluster.owner(slot)
            to = next(p for p in self.cluster.ports if p != source)
            ended = reader.link.generations_ended
            self.cluster.move_slot(slot, to)
            # The reader was told (sunsubscribe) and subscribes on the new master.
            await until(lambda: reader.link.generations_ended > ended and
                        reader.link.connected and
                        f"127.0.0.1:{to}" in reader.link.subscribers, timeout=30)

        await defer.gatherResults([defer.ensureDeferred(writing(n)) for n in NAMES]
                                  + [defer.ensureDeferred(move())])

        def caught_up():
            positions = reader.handler.reader_positions()
            return all(positions[k] == writer.registry.get(k[0]).id_gen.get_current_token("w")
                       for k in keys)

        await until_handled([reader.handler], caught_up, timeout=60)
        expected = table_facts(self.dsn, TABLES)
        got = {k: [] for k in keys}
        for stream, who, token, rows in consumer.facts:
            got[(stream, who)].append((token, rows))
        for key in keys:
            self.assertEqual(len(got[key]), len(expected[key]), key)  # none doubled
            self.assertEqual(as_sets({key: got[key]}), as_sets({key: expected[key]}), key)
        new_owner = self.cluster.owner(slot)
        self.assertEqual(
            command(new_owner, "PUBSUB", "SHARDNUMSUB", channel.decode()).split()[1], "2")


class SignedClusterTests(TestCase):
    """With ``replication.redis.keys`` on a cluster: the shard channels
    carry signed lines, the reader has every fact, and an unsigned
    POSITION SPUBLISHed on a stream's channel past the writer's facts is
    refused."""

    timeout = 180

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        self.cluster = RedisCluster(3)
        self.addCleanup(self.cluster.stop)

    async def test_signed_lines_flow_and_a_forgery_is_refused(self):
        import tempfile

        from tests.redis_signing_keys import keys_for, refused, write_keys

        paths = write_keys(tempfile.mkdtemp(), "w", "r")
        keys = [(n, "w") for n in NAMES]
        writer = await Node(self, self.dsn, "w", self.cluster, STREAMS,
                            keys=keys_for(paths, "w")).start()
        consumer = MemoryConsumer(positions={k: 0 for k in keys})
        reader = await Node(self, self.dsn, "r", self.cluster, STREAMS, consumer,
                            keys=keys_for(paths, "r")).start()
        await until_handled([writer.handler, reader.handler],
                            lambda: writer.link.connected and reader.link.connected, timeout=30)
        first = await writer.registry.get("s0").write_fact([["a", 1]])
        await until_handled([reader.handler],
                            lambda: reader.handler.reader_positions()[("s0", "w")] == first)
        channel = reader.link.layout.stream_channel("s0")
        refusals = refused("unsigned")
        command(self.cluster.owner(key_slot(channel.encode())), "SPUBLISH", channel,
                f"POSITION s0 w {first} {first + 50}")
        await until(lambda: refused("unsigned") > refusals)
        for n in NAMES:
            for i in range(20):
                await writer.registry.get(n).write_fact([[f"{n}-{i}", i]])

        def caught_up():
            positions = reader.handler.reader_positions()
            return all(positions[k] == writer.registry.get(k[0]).id_gen.get_current_token("w")
                       for k in keys)

        await until_handled([reader.handler], caught_up, timeout=60)
        expected = table_facts(self.dsn, TABLES)
        got = {k: [] for k in keys}
        for stream, who, token, rows in consumer.facts:
            got[(stream, who)].append((token, rows))
        for key in keys:
            self.assertEqual(got[key], expected[key], key)
