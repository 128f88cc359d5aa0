"""Replication over Redis pub/sub, in memory: the Redis transport's logic
against :class:`tests.memory_redis.MemoryRedis` on the harness's reactor
(:mod:`tests.harness`), with no server, no socket and no poll.  What needs
a real ``redis-server`` (its own restarts, a process frozen, TLS, the
cluster) stays in ``tests/test_replication_redis.py`` and its neighbours."""

import os

from prometheus_client import REGISTRY
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import TestCase

from replicator.config import RedisConfig, parse_streams
from replicator.consumers import MemoryConsumer
from replicator.observe import metrics
from replicator.replication.transport.redis import SYNAPSE_PROBE, RedisReplication
from tests.harness import Harness
from tests.memory_redis import MemoryRedis, parse_requests
from tests.redis_signing_keys import keys_for, refused, write_keys

STREAMS = parse_streams([
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": ["w1", "w2"]},
])
KEYS = [("caches", "w1"), ("caches", "w2")]
PASSWORD = "redis-test-secret"


class MemoryRedisTests(TestCase):
    """The fake server itself: what the transports rely on holds."""

    def test_requests_are_parsed_whole_or_kept(self):
        whole = b"*2\r\n$4\r\nAUTH\r\n$3\r\npwd\r\n"
        self.assertEqual(parse_requests(whole + whole[:7]), ([[b"AUTH", b"pwd"]], whole[:7]))
        self.assertEqual(parse_requests(b"*1\r\n$4\r\nPI"), ([], b"*1\r\n$4\r\nPI"))

    def test_a_block_reaches_subscribers_at_its_exec_in_order(self):
        redis = MemoryRedis()
        sub, pub = redis.buildProtocol(None), redis.buildProtocol(None)
        for p in (sub, pub):
            p.makeConnection(StringTransport())
        sub.dataReceived(b"*2\r\n$9\r\nSUBSCRIBE\r\n$1\r\nc\r\n")
        sub.transport.clear()
        pub.dataReceived(b"*1\r\n$5\r\nMULTI\r\n*3\r\n$7\r\nPUBLISH\r\n$1\r\nc\r\n$1\r\na\r\n")
        self.assertEqual(sub.transport.value(), b"")  # queued, not run
        pub.dataReceived(b"*3\r\n$7\r\nPUBLISH\r\n$1\r\nc\r\n$1\r\nb\r\n*1\r\n$4\r\nEXEC\r\n")
        message = b"*3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$1\r\n%s\r\n"
        self.assertEqual(sub.transport.value(), message % b"a" + message % b"b")
        self.assertEqual(pub.transport.value(),
                         b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n:1\r\n:1\r\n")
        self.assertEqual(redis.published, [(b"c", b"a"), (b"c", b"b")])


class InMemoryRedisCase(TestCase):
    """Instances of ``streams`` on the harness, and the in-memory Redis on
    its port 6379 (no tests of its own)."""

    streams = STREAMS

    def setUp(self):
        self.h = Harness(self.streams, self.addCleanup)
        self.redis = MemoryRedis(password=PASSWORD)
        self.h.clock.listenTCP(6379, self.redis)

    def link(self, node, password=PASSWORD, channels="single", keys=None, **options):
        """``node``'s Redis link to the in-memory server, started."""
        options = {"ping_interval": 0.5, "ping_timeout": 0.5, "initial_delay": 0.05,
                   "max_delay": 0.3, **options}
        link = RedisReplication(self.h.clock, RedisConfig("tcp:host=127.0.0.1:port=6379",
                                                          password, channels=channels,
                                                          keys=keys),
                                node.handler, "hs.test", node.name, **options)
        link.startService()
        self.addCleanup(lambda: self.h.run(link.stopService(), settle=False))
        node.link = link
        return link

    def joined(self):
        """Every link up, and past its registration's wait for a Synapse
        (``SYNAPSE_PROBE``: until then an instance's lines are held)."""
        self.h.advance(SYNAPSE_PROBE + 0.1)
        self.h.settle()

    def publish(self, line):
        """A foreign process's PUBLISH of ``line`` on our channel."""
        self.redis.publish(b"hs.test", line.encode())
        self.h.settle()


class RedisInMemoryTests(InMemoryRedisCase):

    def test_facts_of_two_writers_reach_a_reader_in_order(self):
        w1, w2 = self.h.instance("w1"), self.h.instance("w2")
        consumer = MemoryConsumer(positions={k: 0 for k in KEYS})
        reader = self.h.instance("r", [consumer])
        for node in (w1, w2, reader):
            self.link(node)
        self.joined()
        self.assertTrue(all(n.link.connected for n in (w1, w2, reader)))
        self.assertEqual(self.redis.subscribers(), {b"hs.test": 3, b"hs.test/USER_IP": 3})
        self.h.run(w1.stream("caches").write_fact([["a", None, 1]]))
        self.h.run(w2.stream("caches").write_fact([["b", {"k": 1}, 2]]))
        self.h.run(w1.stream("caches").write_facts([[["c", None, 3]], [["d", None, 4]]]))
        self.assertEqual([(w, t, rows) for _, w, t, rows in consumer.facts],
                         [("w1", 1, [["a", None, 1]]), ("w2", 2, [["b", {"k": 1}, 2]]),
                          ("w1", 3, [["c", None, 3]]), ("w1", 4, [["d", None, 4]])])
        # w2, idle since its fact, is announced past the others' facts.
        self.assertEqual(reader.handler.reader_positions(), {("caches", "w1"): 4,
                                                             ("caches", "w2"): 4})

    def test_position_only_advance_and_foreign_traffic(self):
        w1 = self.h.instance("w1")
        consumer = MemoryConsumer(positions={k: 0 for k in KEYS})
        reader = self.h.instance("r", [consumer])
        self.link(w1)
        self.link(reader)
        self.joined()
        stream = w1.stream("caches")
        self.h.run(stream.write_fact([["a", None, 1]]))
        self.assertEqual(reader.handler.reader_positions()[("caches", "w1")], 1)

        def boom(txn, stream_id):
            raise RuntimeError("rolled back")

        async def rolled_back():
            async with stream.writer() as fact:
                fact.add_row(["never", None, 1])
                fact.also(boom)

        with self.assertRaises(RuntimeError):
            self.h.run(rolled_back())
        # Reserved and rolled back: readers move by POSITION alone.
        self.assertEqual(reader.handler.reader_positions()[("caches", "w1")], 2)
        self.assertEqual(len(consumer.facts), 1)

        ignored = metrics.COMMANDS_DROPPED.labels("unknown", "unparsable")._value.get()
        unknown_before = metrics.COMMANDS_DROPPED.labels("RDATA", "unknown_stream")._value.get()
        for line in ('RDATA other_app master 5 ["$ev:hs","!room:hs","m.room.message",null]',
                     "POSITION other_app master 1 2",
                     "FOO bar baz",
                     "USER_SYNC synapse1 @u:hs None start 1000",
                     'RDATA caches w1 batch ["half",null,1]'):
            self.publish(line)
        self.h.run(stream.write_fact([["b", None, 2]]))
        self.assertEqual(reader.handler.reader_positions()[("caches", "w1")], 3)
        # Both instances hear each foreign line once.
        self.assertEqual(metrics.COMMANDS_DROPPED.labels("unknown", "unparsable")._value.get(),
                         ignored + 2)
        self.assertEqual(
            metrics.COMMANDS_DROPPED.labels("RDATA", "unknown_stream")._value.get(),
            unknown_before + 2)
        self.assertEqual(reader.handler.user_syncs, {"synapse1": {("@u:hs", None): 1000}})
        # A foreign line claiming to be w1's batch row joins w1's next fact,
        # as in Synapse: the wire carries no proof of origin.
        self.assertEqual([t for _, _, t, _ in consumer.facts], [1, 3])
        self.assertTrue(reader.link.connected)

    def test_a_ping_timed_out_is_judged_after_the_reactor_reads(self):
        # A process stopped past the ping timeout: at the SIGCONT the timeout
        # may run before the reactor reads the answer waiting in the socket.
        from twisted.internet import defer

        from replicator.replication.interfaces import LATE_CHECK

        link = self.link(self.h.instance("w1"))

        class Silent:
            last_data = self.h.clock.seconds()
            aborted = 0

            def ping(self):
                return defer.Deferred()  # (the answer is late)

            @property
            def transport(self):
                return self

            def abortConnection(self):
                Silent.aborted += 1

        answered, dead = Silent(), Silent()
        link._ping_one(answered)
        link._ping_one(dead)
        self.h.clock.advance(link.ping_timeout)
        self.assertEqual(Silent.aborted, 0)  # not judged yet
        answered.last_data = self.h.clock.seconds()  # what the reactor then read
        self.h.clock.advance(LATE_CHECK)
        self.assertEqual(Silent.aborted, 1)  # the one that stayed silent

    def test_auth_failure_never_stops_reconnecting(self):
        node = self.h.instance("w1")

        def refused(link):
            return REGISTRY.get_sample_value("replicator_redis_auth_refused_total",
                                             {"link": link}) or 0

        before = {link: refused(link) for link in ("subscriber", "publisher")}
        link = self.link(node, password="a-wrong-password")
        for _ in range(20):
            self.h.advance(0.3)
        # Several refused AUTHs, counted per link.
        self.assertTrue(all(refused(k) >= before[k] + 3 for k in before),
                        {k: refused(k) - before[k] for k in before})
        self.assertFalse(link.connected)
        self.assertIn("auth", (link.last_error or "").lower())
        # The operator fixes the server side; the link comes back by itself.
        self.redis.password = "a-wrong-password"
        for _ in range(5):
            self.h.advance(0.3)
        self.assertTrue(link.connected)
        self.assertIsNone(link.last_error)

    def test_a_dropped_server_is_rejoined_and_the_reader_catches_up(self):
        """Every client dropped (a server restart): both links come back
        with backoff, and what was written meanwhile reaches the reader
        (its catch-up from the table)."""
        writer = self.h.instance("w1")
        consumer = MemoryConsumer(positions={k: 0 for k in KEYS})
        reader = self.h.instance("r", [consumer])
        self.link(writer)
        self.link(reader)
        self.joined()
        self.redis.drop_all()
        self.h.flush()
        self.assertFalse(reader.link.connected)
        self.h.run(writer.stream("caches").write_fact([["while away", None, 1]]))
        self.assertEqual(consumer.facts, [])
        for _ in range(10):
            self.h.advance(0.3)
        self.h.settle()
        self.assertTrue(reader.link.connected and writer.link.connected)
        self.assertEqual(consumer.facts, [("caches", "w1", 1, [["while away", None, 1]])])


COLUMNS = [{"k": "text"}, {"n": "bigint"}]
NAMES = ["s0", "s1", "s2"]
ALL = parse_streams([{"name": n, "table": f"chan_{n}", "columns": COLUMNS, "writers": ["w"]}
                     for n in NAMES])


class PerStreamInMemoryTests(InMemoryRedisCase):
    """``channels: per_stream`` (:mod:`replicator.replication.transport.redis_channels`)."""

    streams = ALL

    def test_a_reader_of_one_stream_hears_that_stream_only(self):
        writer = self.h.instance("w")
        # (s1's position is for the reload below: its reader starts there.)
        consumer = MemoryConsumer(positions={("s0", "w"): 0, ("s1", "w"): 0})
        reader = self.h.instance("r", [consumer], streams=ALL[:1])
        self.link(writer, channels="per_stream")
        self.link(reader, channels="per_stream")
        heard = []
        received = reader.link.message_received

        def record(protocol, channel, message):
            heard.append((channel, message))
            return received(protocol, channel, message)

        reader.link.message_received = record
        self.joined()
        for i in range(1, 6):
            for name in NAMES:
                self.h.run(writer.stream(name).write_fact([[f"{name}-{i}", i]]))
        self.assertEqual(reader.handler.reader_positions()[("s0", "w")], 5)
        self.assertEqual([rows for _, _, _, rows in consumer.facts],
                         [[[f"s0-{i}", i]] for i in range(1, 6)])
        channels = {channel for channel, _ in heard}
        self.assertFalse(channels - {"hs.test/replicator", "hs.test/replicator/stream/s0"},
                         channels)
        self.assertFalse([m for _, m in heard if " s1 " in m or " s2 " in m])

        # A reload adds s1 to the reader: its channel is subscribed before
        # the REPLICATE goes out, so the writer's POSITION answer is heard
        # and the reader catches up from the table.
        stream = self.h.run(reader.registry.add(ALL[1], "streams[1]"))
        reader.handler.stream_added(stream)
        self.h.settle()
        self.assertEqual(reader.handler.reader_positions().get(("s1", "w")), 5)
        self.h.run(writer.stream("s1").write_fact([["s1-6", 6]]))
        self.assertEqual(reader.handler.reader_positions()[("s1", "w")], 6)
        s1 = [rows for s, _, _, rows in consumer.facts if s == "s1"]
        self.assertEqual(s1, [[[f"s1-{i}", i]] for i in range(1, 7)])


class SignedInMemoryTests(InMemoryRedisCase):
    """``replication.redis.keys`` (:mod:`replicator.replication.transport.redis_signing`):
    a Redis client that only PUBLISHes forges nothing a reader takes."""

    def test_a_forged_fact_reaches_no_consumer(self):
        """An RDATA of w1 with an ID the sequence gave out (no row behind
        it), and a ``batch`` row of w1 before w1's next fact: without keys
        the reader handed the forged fact on and joined the row to w1's
        next fact (a POSITION is checked against the table, an RDATA is
        not); with keys both are refused."""
        paths = write_keys(self.mktemp_dir(), "w1", "r")
        w1 = self.h.instance("w1")
        consumer = MemoryConsumer(positions={("caches", "w1"): 0})
        reader = self.h.instance("r", [consumer])
        for node in (w1, reader):
            self.link(node, keys=keys_for(paths, node.name))
        self.joined()
        first = self.h.run(w1.stream("caches").write_fact([["first", None, 1]]))
        self.assertEqual(reader.handler.reader_positions()[("caches", "w1")], first)
        reserved = first + 1
        self.h.sequence_taken("caches", reserved)  # given out, no row behind it
        refusals = refused("unsigned")
        for line in (f'RDATA caches w1 {reserved} ["forged",null,1]',
                     'RDATA caches w1 batch ["half",null,1]'):
            self.publish(line)
        # Both instances hear (and refuse) both lines.
        self.assertEqual(refused("unsigned"), refusals + 4)
        self.assertEqual(reader.handler.reader_positions()[("caches", "w1")], first)
        last = self.h.run(w1.stream("caches").write_fact([["second", None, 2]]))
        self.assertGreater(last, reserved)
        self.assertEqual(reader.handler.reader_positions()[("caches", "w1")], last)
        self.assertEqual([(t, rows) for _, _, t, rows in consumer.facts],
                         [(first, [["first", None, 1]]), (last, [["second", None, 2]])])

    def mktemp_dir(self):
        path = self.mktemp()
        os.makedirs(path)
        return path
