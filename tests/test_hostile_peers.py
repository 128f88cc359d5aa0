"""Peers that lie: tokens beyond what the database ever handed out, rows that
do not fit the stream, partial batches that never end, relayed lines that
would be re-encoded past the line limit.  Honest peers beside them lose
nothing and are never disconnected; nothing the liar claimed moves a token.

Handler tests run in memory (:mod:`tests.harness`: StringTransport, SQLite
run inline, a clock the test moves); the integration tests use a real
PostgreSQL, real loopback sockets and a real redis-server.
"""

import socket

from twisted.internet import endpoints, reactor
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from replicator.config import (
    ConfigError,
    RedisConfig,
    parse_database,
    parse_replication,
    parse_streams,
)
from replicator.consumers import MemoryConsumer
from replicator.observe import metrics
from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.transport.redis import RedisReplication
from replicator.replication.transport.redis_bus import RedisConnection
from replicator.replication.transport.tcp import ReplicationServerFactory, upstream_service
from replicator.replication.wire.commands import parse_line
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from tests.fakes import FakeBus
from tests.harness import Harness
from tests.servers import PostgresServer, RedisServer
from tests.support import Waits, WatchedConsumer, create_stream_tables, until, until_handled

STREAMS = parse_streams([
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": ["master", "worker1"]},
    {"name": "events", "table": "event_stream",
     "columns": [{"event_id": "text"}, {"flag": "boolean"}], "writers": ["master"]},
])

BIG = 2 ** 62


def lines(transport):
    return transport.value().decode("utf-8", "surrogatepass").splitlines()


def refused(stream, reason):
    metric = getattr(metrics, "INBOUND_REFUSED", None)
    return 0 if metric is None else metric.labels(stream, reason)._value.get()


class _Base(TestCase):
    timeout = 60

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        # What the writers create (an instance that only reads creates nothing).
        create_stream_tables(self.dsn, STREAMS)

    async def instance(self, name, consumers=(), **kwargs):
        db = Database(parse_database({"postgres": self.dsn, "pool_max": 3}))
        self.addCleanup(db.close)
        registry = StreamRegistry(db, name, STREAMS, reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        handler = ReplicationHandler(registry, name, "hs.test", consumers=consumers, **kwargs)
        handler.start()
        return registry, handler


class _InMemory(TestCase):
    """Handler tests in memory: each ``settled`` runs the instances until
    they are idle, then checks."""

    def setUp(self):
        self.h = Harness(STREAMS, self.addCleanup)
        self.h.create_tables()  # what the writers create

    def instance(self, name, consumers=(), **kwargs):
        node = self.h.instance(name, consumers, **kwargs)
        return node.registry, node.handler

    def server_conn(self, handler, name=None, replicate=False):
        return self.h.serve(self._node(handler), name, replicate=replicate)

    def client_conn(self, handler, name):
        return self.h.client(self._node(handler))

    def _node(self, handler):
        return next(n for n in self.h.nodes if n.handler is handler)

    def settled(self, predicate):
        """Everything run; then ``predicate()`` holds."""
        self.h.settle()
        self.assertTrue(predicate())

    def positions_table(self):
        rows = self.h.connection.execute(
            "SELECT stream_name, instance_name, stream_id FROM stream_positions").fetchall()
        return {(s, w): p for s, w, p in rows}


class PositionPoisoningTests(_InMemory):
    """Item 1: a claim beyond the stream's sequence is refused and moves nothing."""

    def test_writer_client_cannot_push_the_masters_token(self):
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        registry, handler = self.instance("master", [consumer])
        caches = registry.get("caches")
        self.h.run(caches.write_fact([["before", None, 1]]))
        self.settled(handler.idle)
        honest, ht = self.server_conn(handler, "worker2", replicate=True)
        before = refused("caches", "beyond_sequence")
        liar, lt = self.server_conn(handler, "worker1")
        liar.dataReceived(b"POSITION caches worker1 777 %d\n" % BIG)
        self.h.settle()
        self.assertEqual(liar.close_reason, "invalid_command")
        self.assertTrue(lines(lt)[-1].startswith("ERROR "), lines(lt))
        self.assertIn("beyond", lines(lt)[-1])
        self.assertEqual(refused("caches", "beyond_sequence"), before + 1)
        gen = caches.id_gen
        self.assertEqual(gen.get_positions(), {"master": 1, "worker1": 0})
        self.assertEqual(handler.reader_positions()[("caches", "worker1")], 0)
        self.assertEqual([l for l in lines(ht) if "worker1" in l], [])  # never relayed
        # The master's next fact reaches the honest reader, and what is
        # persisted is what is true.
        ht.clear()
        self.h.run(caches.write_fact([["after", None, 2]]))
        self.settled(lambda: b"RDATA caches master 2 " in ht.value())
        self.assertEqual(lines(ht), ['RDATA caches master 2 ["after",null,2]'])
        self.h.run(caches.flush_positions())
        table = self.positions_table()
        self.assertEqual(table[("caches", "master")], 2)
        self.assertLess(max(table.values()), 100)
        # A REPLICATE never answers with the claim either.
        ht.clear()
        honest.dataReceived(b"REPLICATE\n")
        self.assertIn("POSITION caches worker1 0 0", lines(ht))

    def test_rdata_token_beyond_the_sequence_is_refused(self):
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        registry, handler = self.instance("master", [consumer])
        honest, ht = self.server_conn(handler, "worker2", replicate=True)
        liar, lt = self.server_conn(handler, "worker1")
        liar.dataReceived(b"POSITION caches worker1 0 0\n"
                          b'RDATA caches worker1 batch ["a",null,1]\n'
                          b'RDATA caches worker1 %d ["b",null,1]\n'
                          b'RDATA caches worker1 1 ["c",null,1]\n' % BIG)
        self.h.settle()
        self.assertTrue(lines(lt)[-1].startswith("ERROR "), lines(lt))
        self.settled(handler.idle)
        self.assertEqual(consumer.facts, [])
        self.assertEqual(registry.get("caches").id_gen.get_positions(),
                         {"master": 0, "worker1": 0})
        # Only the POSITION that was true before the lie went on.
        self.assertEqual([l for l in lines(ht) if "worker1" in l],
                         ["POSITION caches worker1 0 0"])

    def test_honest_claims_above_what_was_seen_are_checked_in_order(self):
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        registry, handler = self.instance("master", [consumer])
        w_registry, _ = self.instance("worker1")
        # worker1 really writes: the shared sequence moves.
        wc = w_registry.get("caches")
        t1 = self.h.run(wc.write_fact([["a", None, 1], ["b", None, 1]]))
        t2 = self.h.run(wc.write_fact([]))
        t3 = self.h.run(wc.write_fact([["c", None, 3]]))
        honest, ht = self.server_conn(handler, "worker2", replicate=True)
        worker, wt = self.server_conn(handler, "worker1")
        sent = (b"POSITION caches worker1 0 0\n"
                b'RDATA caches worker1 batch ["a",null,1]\n'
                b'RDATA caches worker1 %d ["b",null,1]\n'
                b"POSITION caches worker1 %d %d\n"
                b'RDATA caches worker1 %d ["c",null,3]\n' % (t1, t1, t2, t3))
        worker.dataReceived(sent)
        self.settled(lambda: len(consumer.facts) == 2)
        self.assertIsNone(worker.close_reason)
        self.assertEqual(consumer.facts, [
            ("caches", "worker1", t1, [["a", None, 1], ["b", None, 1]]),
            ("caches", "worker1", t3, [["c", None, 3]]),
        ])
        self.assertEqual([l for l in lines(ht) if "worker1" in l],
                         sent.decode().splitlines())
        self.assertEqual(registry.get("caches").id_gen.get_current_token("worker1"), t3)

    def test_upstream_cannot_push_a_workers_token(self):
        consumer = MemoryConsumer(positions={("events", "master"): 0})
        m_registry, _ = self.instance("master")
        registry, worker = self.instance("worker1", [consumer])
        before = refused("events", "beyond_sequence")
        for claim in (b"%d" % BIG, b"%d" % 2 ** 70):
            proto, tr = self.client_conn(worker, "worker1")
            proto.dataReceived(b"POSITION events master 0 " + claim + b"\n")
            self.h.settle()
            self.assertIsNotNone(proto.close_reason)
            self.assertTrue(lines(tr)[-1].startswith("ERROR "), lines(tr))
            proto.connectionLost(None)
        self.assertGreaterEqual(refused("events", "beyond_sequence"), before + 1)
        self.assertEqual(registry.get("events").id_gen.get_current_token("master"), 0)
        self.assertEqual(worker.reader_positions()[("events", "master")], 0)
        # The master's real fact 1 still reaches the worker's consumer.
        token = self.h.run(m_registry.get("events").write_fact([["$e1", True]]))
        proto, tr = self.client_conn(worker, "worker1")
        proto.dataReceived(b"POSITION events master 0 0\n"
                           b'RDATA events master %d ["$e1",true]\n' % token)
        self.settled(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("events", "master", token, [["$e1", True]])])
        self.assertIsNone(proto.close_reason)


class RelayTests(_InMemory):
    """Item 4: relayed lines are the bytes received, never a re-encoding."""

    def test_lock_released_with_a_lone_surrogate_is_relayed_as_received(self):
        _, handler = self.instance("master")
        honest, ht = self.server_conn(handler, "worker2", replicate=True)
        other, ot = self.server_conn(handler, "worker3")  # not replicating
        sender, st = self.server_conn(handler, "worker1")
        key = "\u20ac" * 4000 + "\\ud800"
        line = (f'LOCK_RELEASED ["worker1","lock","{key}"]').encode()
        self.assertLess(len(line), 16384)
        sender.dataReceived(line + b"\r\n"
                            + b"REMOTE_SERVER_UP  other.hs\n"
                            + b"NEW_ACTIVE_TASK t1\n")
        for t in (ht, ot):
            self.assertEqual(t.value(), line + b"\nREMOTE_SERVER_UP  other.hs\n"
                             b"NEW_ACTIVE_TASK t1\n")
        for p in (honest, other, sender):
            self.assertIsNone(p.close_reason)

    def test_position_and_rdata_are_relayed_as_received(self):
        registry, handler = self.instance("master")
        self.h.sequence_taken("caches", 10)
        honest, ht = self.server_conn(handler, "worker2", replicate=True)
        sender, _ = self.server_conn(handler, "worker1")
        sent = (b'POSITION caches worker1 00 0\n'
                b'RDATA caches worker1 3 ["\\u20ac \\ud800", {"z": 1, "a": [1.50]}, 7]\n')
        sender.dataReceived(sent)
        self.settled(lambda: b"RDATA" in ht.value())
        self.assertEqual(b"".join(l + b"\n" for l in ht.value().splitlines()
                                  if b"worker1" in l), sent)


    def test_rdata_before_the_writers_position_is_not_relayed(self):
        """A fact the master itself does not take (RDATA on a connection
        that has not announced the writer's position yet: the reader waits
        for the POSITION and reads the table) is not passed on either:
        found by a red team, a forged fact reached one worker's consumer and
        not the master's."""
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        _, handler = self.instance("master", consumers=[consumer])
        self.h.sequence_taken("caches", 10)
        honest, ht = self.server_conn(handler, "worker2", replicate=True)
        forger, ft = self.server_conn(handler, "worker1")
        forger.dataReceived(b'RDATA caches worker1 batch ["FORGED", null, 1]\n'
                            b'RDATA caches worker1 3 ["FORGED2", null, 2]\n'
                            b'POSITION caches worker1 3 3\n')
        self.settled(lambda: b"POSITION caches worker1 3 3" in ht.value())
        self.settled(lambda: handler.reader_positions()[("caches", "worker1")] == 3)
        self.assertNotIn(b"FORGED", ht.value())
        self.assertEqual(consumer.facts, [])


class RowCheckTests(_InMemory):
    """Item 12: rows that do not fit the stream are never delivered."""

    def test_writer_client_rows_are_checked(self):
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        _, handler = self.instance("master", [consumer])
        self.h.sequence_taken("caches", 10)
        honest, ht = self.server_conn(handler, "worker2", replicate=True)
        for bad in (b'["a",null]', b'["a",null,"12"]', b'["a",null,1,2]', b'[null,null,1]',
                    b'["a",null,9223372036854775808]', b'["a\\u0000",null,1]'):
            before = refused("caches", "bad_row")
            events = []
            globalLogPublisher.addObserver(events.append)
            try:
                p, t = self.server_conn(handler, "worker1")
                p.dataReceived(b"POSITION caches worker1 0 0\n"
                               b"RDATA caches worker1 batch " + bad + b"\n"
                               b"RDATA caches worker1 batch " + bad + b"\n"
                               b"RDATA caches worker1 2 " + bad + b"\n")
            finally:
                globalLogPublisher.removeObserver(events)
            self.assertEqual(p.close_reason, "invalid_command", bad)
            self.assertTrue(lines(t)[-1].startswith("ERROR "), lines(t))
            self.assertEqual(refused("caches", "bad_row"), before + 1, bad)
            self.assertEqual(
                len([e for e in events if "does not fit" in formatEvent(e)]), 1, bad)
            p.connectionLost(None)
        self.settled(handler.idle)
        self.assertEqual(consumer.facts, [])
        self.assertEqual([l for l in lines(ht) if l.startswith("RDATA")], [])
        # A good row after all that is delivered.
        p, t = self.server_conn(handler, "worker1")
        p.dataReceived(b'POSITION caches worker1 0 0\nRDATA caches worker1 2 ["a",{"x":[1]},-5]\n')
        self.settled(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "worker1", 2, [["a", {"x": [1]}, -5]])])

    def test_upstream_rows_are_checked(self):
        consumer = MemoryConsumer(positions={("events", "master"): 0})
        _, worker = self.instance("worker1", [consumer])
        self.h.sequence_taken("events", 10)
        proto, tr = self.client_conn(worker, "worker1")
        proto.dataReceived(b"POSITION events master 0 0\n"
                           b'RDATA events master 1 [5, true]\n'
                           b'RDATA events master 2 ["$ok", true]\n')
        self.assertEqual(proto.close_reason, "invalid_command")
        self.assertTrue(lines(tr)[-1].startswith("ERROR "), lines(tr))
        self.settled(worker.idle)
        self.assertEqual(consumer.facts, [])
        proto, tr = self.client_conn(worker, "worker1")
        proto.dataReceived(b"POSITION events master 0 0\n"
                           b'RDATA events master 1 ["$a", 1]\n'
                           b'RDATA events master 2 ["$b", false]\n')
        self.settled(lambda: len(consumer.facts) == 2)
        self.assertIsNone(proto.close_reason)
        self.assertEqual(consumer.facts, [("events", "master", 1, [["$a", 1]]),
                                          ("events", "master", 2, [["$b", False]])])


class PartialBatchTests(_InMemory):
    """Item 5 (part): a partial batch is bounded in rows and bytes."""

    def test_batch_over_the_row_bound_closes(self):
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        _, handler = self.instance("master", [consumer], max_batch_rows=100,
                                         max_batch_bytes=1 << 20)
        self.h.sequence_taken("caches", 10)
        honest, ht = self.server_conn(handler, "worker2", replicate=True)
        p, t = self.server_conn(handler, "worker1")
        row = b'RDATA caches worker1 batch ["r",null,1]\n'
        # A whole fact of exactly the bound is fine.
        p.dataReceived(b"POSITION caches worker1 0 0\n" + row * 99
                       + b'RDATA caches worker1 1 ["r",null,1]\n')
        self.settled(lambda: consumer.facts)
        self.assertEqual(len(consumer.facts[0][3]), 100)
        # A partial batch may hold at most 99 rows: its closing line
        # makes the fact's 100th.
        before = refused("caches", "batch_too_large")
        p.dataReceived(row * 99)
        self.assertIsNone(p.close_reason)
        p.dataReceived(row)
        self.assertEqual(p.close_reason, "invalid_command")
        self.assertTrue(lines(t)[-1].startswith("ERROR "), lines(t))
        self.assertEqual(refused("caches", "batch_too_large"), before + 1)
        p.connectionLost(None)
        self.assertNotIn(p, handler.connections)
        self.assertEqual(len(consumer.facts), 1)
        self.assertEqual(ht.value().count(b"RDATA"), 100)  # the whole fact only

    def test_batch_over_the_byte_bound_closes(self):
        _, handler = self.instance("master", max_batch_bytes=100_000)
        self.h.sequence_taken("caches", 10)
        p, t = self.server_conn(handler, "worker1")
        row = b'RDATA caches worker1 batch ["' + b"x" * 1000 + b'",null,1]\n'
        p.dataReceived(b"POSITION caches worker1 0 0\n" + row * 90)
        self.assertIsNone(p.close_reason)
        p.dataReceived(row * 10)
        self.assertEqual(p.close_reason, "invalid_command")
        self.assertTrue(lines(t)[-1].startswith("ERROR "), lines(t))

    def test_bounds_are_configured_with_ranges(self):
        config = parse_replication({})
        self.assertEqual((config.max_batch_rows, config.max_batch_bytes), (10_000, 16 << 20))
        config = parse_replication({"max_batch_rows": 5, "max_batch_bytes": 65536})
        self.assertEqual((config.max_batch_rows, config.max_batch_bytes), (5, 65536))
        for bad in ({"max_batch_rows": 0}, {"max_batch_rows": 10 ** 7},
                    {"max_batch_bytes": 1000}, {"max_batch_bytes": 1 << 31},
                    {"max_batch_rows": "x"}):
            with self.assertRaises(ConfigError) as e:
                parse_replication(bad)
            self.assertIn(next(iter(bad)), str(e.exception))


def bus_conn(handler, kind=RedisConnection):
    """The one connection a Redis subscription is to the handler."""
    conn = kind(FakeBus())
    handler.new_connection(conn)
    return conn


def hear(handler, conn, text):
    """One message from the channel, as :class:`RedisReplication` dispatches it."""
    cmd = parse_line(text)
    conn.current_line = text.encode("utf-8")
    try:
        getattr(handler, "on_" + cmd.NAME)(conn, cmd)
    finally:
        conn.current_line = None


#: A row cheap on the wire and dear once parsed: 530 empty lists in its
#: ``json`` column (about 1.6 KB of line, about 40 KB of Python objects).
AMPLIFIED_ROW = b'["amp",[' + b",".join([b"[]"] * 530) + b'],1]'


class BatchMemoryTests(_InMemory):
    """Issue 20 item 4: what a peer can make us hold for a partial batch is
    bounded by what it costs in memory, per writer across connections."""

    def test_partial_batch_is_held_at_about_its_wire_size(self):
        import gc
        import tracemalloc

        _, handler = self.instance("master")
        self.h.sequence_taken("caches", 10)
        honest, ht = self.server_conn(handler, "worker2", replicate=True)
        p, t = self.server_conn(handler, "worker1")
        p.dataReceived(b"POSITION caches worker1 0 0\n")
        data = b"RDATA caches worker1 batch " + AMPLIFIED_ROW + b"\n"
        gc.collect()
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(400):
            p.dataReceived(data)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        wire = 400 * len(data)
        self.assertIsNone(p.close_reason)
        self.assertLessEqual(held, 3 * wire, f"{held} bytes held for {wire} bytes of lines")
        # The batch still completes into the whole fact, relayed as received.
        p.dataReceived(b'RDATA caches worker1 1 ["end",null,1]\n')
        self.settled(lambda: ht.value().count(data) == 400)

    def test_completed_batch_parses_within_a_bound(self):
        """A batch whose rows would take, once parsed, far more than
        ``max_batch_bytes`` is refused before it completes, though its
        lines are well under the bound."""
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        _, handler = self.instance("master", [consumer], max_batch_bytes=1 << 20)
        self.h.sequence_taken("caches", 10)
        p, t = self.server_conn(handler, "worker1")
        data = b"RDATA caches worker1 batch " + AMPLIFIED_ROW + b"\n"
        before = refused("caches", "batch_too_large")
        # 300 lines: 0.5 MB of lines (under the bound), ~12 MB once parsed.
        p.dataReceived(b"POSITION caches worker1 0 0\n" + data * 300
                       + b'RDATA caches worker1 1 ["end",null,1]\n')
        self.assertEqual(p.close_reason, "invalid_command")
        self.assertIn("too large", lines(t)[-1])
        self.assertEqual(refused("caches", "batch_too_large"), before + 1)
        self.h.settle()
        self.assertEqual(consumer.facts, [])

    def test_batch_bounds_hold_per_writer_across_connections(self):
        """Two connections of one writer (an old one not yet timed out and
        its replacement, or a Redis subscription and a TCP link) share the
        writer's bound: a fact has at most ``max_batch_rows`` rows wherever
        its lines come from."""
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        _, handler = self.instance("master", [consumer], max_batch_rows=100)
        self.h.sequence_taken("caches", 10)
        one, two = bus_conn(handler), bus_conn(handler)
        self.addCleanup(handler.lost_connection, one, "test")
        self.addCleanup(handler.lost_connection, two, "test")
        row = 'RDATA caches worker1 batch ["r",null,1]'
        for conn in (one, two):
            hear(handler, conn, "POSITION caches worker1 0 0")
        for _ in range(60):
            hear(handler, one, row)
        before = refused("caches", "batch_too_large")
        for _ in range(39):
            hear(handler, two, row)
        self.assertEqual(refused("caches", "batch_too_large"), before)
        hear(handler, two, row)  # the writer's 100th partial row
        self.assertEqual(refused("caches", "batch_too_large"), before + 1)
        # What one held still completes; two's rows are gone with the refusal.
        hear(handler, one, 'RDATA caches worker1 1 ["end",null,1]')
        hear(handler, two, 'RDATA caches worker1 2 ["end",null,1]')
        self.settled(lambda: len(consumer.facts) == 2)
        self.assertEqual([len(fact[3]) for fact in consumer.facts], [61, 1])


class StaleBatchTests(_InMemory):
    """Issue 20 item 1, the reader's half: on Redis every writer's lines
    reach a reader on its one subscription; a batch left open by late bytes
    of a replaced publisher link must not join the writer's next fact.  A
    batch is legitimate only while its writer has sent nothing but batch
    lines of that stream since it opened (a writer sends a fact's lines in
    one go: ours in one MULTI/EXEC, Synapse in one loop)."""

    def reader_on_bus(self):
        consumer = MemoryConsumer(positions={("caches", "master"): 0,
                                             ("events", "master"): 0})
        _, handler = self.instance("worker2", [consumer])
        self.h.sequence_taken("caches", 10)
        self.h.sequence_taken("events", 10)
        conn = bus_conn(handler)
        self.addCleanup(handler.lost_connection, conn, "test")
        return consumer, handler, conn

    def test_position_of_the_writer_ends_its_stale_batch(self):
        """The sequence of the issue."""
        consumer, handler, conn = self.reader_on_bus()
        hear(handler, conn, "POSITION caches master 0 0")
        hear(handler, conn, 'RDATA caches master batch ["A",null,1]')
        hear(handler, conn, "POSITION caches master 1 1")  # re-announced from a new link
        hear(handler, conn, 'RDATA caches master 2 ["C",null,2]')
        self.settled(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "master", 2, [["C", None, 2]])])

    def test_any_other_line_of_the_writer_ends_its_stale_batch(self):
        consumer, handler, conn = self.reader_on_bus()
        for stream in ("caches", "events"):
            hear(handler, conn, f"POSITION {stream} master 0 0")
        for between in ('RDATA events master 1 ["$e1",null]',
                        'RDATA events master batch ["$e2",null]',
                        "POSITION events master 2 2"):
            consumer.facts.clear()
            hear(handler, conn, 'RDATA caches master batch ["A",null,1]')  # a late half
            hear(handler, conn, between)
            if "batch" in between:
                hear(handler, conn, 'RDATA events master 2 ["$e2b",null]')
            token = handler.reader_positions()[("caches", "master")] + 1
            hear(handler, conn, f'RDATA caches master {token} ["C",null,2]')
            self.settled(lambda: handler.idle() and any(
                f[0] == "caches" for f in consumer.facts))
            self.assertEqual([f for f in consumer.facts if f[0] == "caches"],
                             [("caches", "master", token, [["C", None, 2]])], between)

    def test_batch_lines_of_other_writers_leave_it_open(self):
        """Other writers' lines interleave on the channel (Synapse's
        processes publish independently): the batch stays whole."""
        consumer, handler, conn = self.reader_on_bus()
        hear(handler, conn, "POSITION caches master 0 0")
        hear(handler, conn, "POSITION caches worker1 0 0")
        hear(handler, conn, 'RDATA caches master batch ["A",null,1]')
        hear(handler, conn, 'RDATA caches worker1 batch ["x",null,1]')
        hear(handler, conn, "POSITION events synapse1 0 3")
        hear(handler, conn, 'RDATA caches master batch ["B",null,1]')
        hear(handler, conn, 'RDATA caches worker1 2 ["y",null,1]')
        hear(handler, conn, 'RDATA caches master 1 ["C",null,1]')
        self.settled(lambda: len(consumer.facts) == 2)
        self.assertEqual(sorted(consumer.facts), [
            ("caches", "master", 1, [["A", None, 1], ["B", None, 1], ["C", None, 1]]),
            ("caches", "worker1", 2, [["x", None, 1], ["y", None, 1]])])


class BusRefusalTests(_InMemory):
    """Issue 24 item 1: what a refusal does depends on what a connection
    declares (one peer: ERROR and close), not on the methods it has."""

    def test_a_bus_with_a_close_method_is_still_not_closed(self):
        closed = []

        class ClosableBus(RedisConnection):
            def close(self, *args, **kwargs):
                closed.append(args)

        consumer = MemoryConsumer(positions={("caches", "master"): 0})
        _, handler = self.instance("worker2", [consumer])
        self.h.sequence_taken("caches", 10)
        conn = bus_conn(handler, ClosableBus)
        self.addCleanup(handler.lost_connection, conn, "test")
        before = refused("caches", "beyond_sequence")
        hear(handler, conn, "POSITION caches master 0 0")
        hear(handler, conn, f"POSITION caches master 777 {BIG}")
        self.settled(lambda: refused("caches", "beyond_sequence") == before + 1)
        self.assertEqual(closed, [])
        # The bus goes on: the next honest fact arrives.
        hear(handler, conn, 'RDATA caches master 1 ["real",null,1]')
        self.settled(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "master", 1, [["real", None, 1]])])


class TcpIntegrationTests(_Base):
    """The same attacks over real loopback sockets: the honest worker beside
    the liar loses nothing and stays connected."""

    timeout = 120

    async def listen(self, handler):
        factory = ReplicationServerFactory(handler, "hs.test", clock=reactor)
        port = await endpoints.serverFromString(
            reactor, "tcp:0:interface=127.0.0.1").listen(factory)
        self.addCleanup(port.stopListening)
        return port.getHost().port

    def connect(self, handler, name, port):
        service = upstream_service(reactor, f"tcp:host=127.0.0.1:port={port}", handler,
                                   name, "hs.test", initial_delay=0.02, max_delay=0.2)
        service.startService()

        def stop():
            handler.stop()
            return service.stopService()
        self.addCleanup(stop)
        return service

    def raw_peer(self, port, name):
        sock = socket.create_connection(("127.0.0.1", port))
        self.addCleanup(sock.close)
        sock.sendall(b"NAME %s\n" % name.encode())
        return sock

    async def test_poisoning_and_an_oversized_relay_harm_no_honest_worker(self):
        registry, master = await self.instance("master")
        port = await self.listen(master)
        consumer = WatchedConsumer(positions={("caches", "master"): 0,
                                              ("caches", "worker1"): 0})
        locks = []
        released = Waits()

        class Locks:
            def on_LOCK_RELEASED(self, conn, cmd):
                locks.append(cmd)
                released.check()

        _, worker2 = await self.instance("worker2", [consumer])
        worker2.listeners.append(Locks())
        self.connect(worker2, "worker2", port)
        await until_handled([master, worker2],
                            lambda: len(master.connections) == 1 and worker2.connections)
        honest_conn = next(iter(worker2.connections))

        liar = self.raw_peer(port, "worker1")
        liar.sendall(b"POSITION caches worker1 777 %d\n" % BIG)
        key = "\u20ac" * 4000 + "\\ud800"
        liar2 = self.raw_peer(port, "worker3")
        liar2.sendall((f'LOCK_RELEASED ["w","lock","{key}"]\n').encode())
        await released.wait(lambda: locks)
        self.assertEqual(len(locks), 1)
        self.assertEqual(locks[0].lock_key, "\u20ac" * 4000 + "\ud800")

        liar.setblocking(False)
        got = []

        def liar_told():
            try:
                got.append(liar.recv(65536))
            except BlockingIOError:
                pass
            return b"ERROR " in b"".join(got)

        await until(liar_told, timeout=10)
        self.assertIn(b"ERROR ", b"".join(got))

        token = await registry.get("caches").write_fact([["real", None, 1]])
        await consumer.until(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "master", token, [["real", None, 1]])])
        self.assertEqual(registry.get("caches").id_gen.get_current_token("master"), token)
        self.assertIs(next(iter(worker2.connections)), honest_conn)
        self.assertIsNone(honest_conn.close_reason)


class RedisPoisoningTests(_Base):
    """On Redis there is no one connection to blame: a refused claim is
    dropped and counted, and the bus goes on."""

    timeout = 120

    def setUp(self):
        super().setUp()
        self.redis = RedisServer()
        self.addCleanup(self.redis.stop)

    async def node(self, name, consumers=()):
        registry, handler = await self.instance(name, consumers)
        link = RedisReplication(reactor, RedisConfig(self.redis.endpoint), handler, "hs.test",
                                name, ping_interval=0.5, ping_timeout=0.5,
                                initial_delay=0.05, max_delay=0.3)
        link.startService()

        async def stop():
            handler.stop()
            await link.stopService()
            await handler.drain()
        self.addCleanup(stop)
        return registry, handler, link

    def publish(self, message):
        from tests.redis_nodes import publish_raw
        publish_raw(self.redis.port, "hs.test", message)

    async def test_forged_claims_are_dropped_and_counted(self):
        m_registry, master, m_link = await self.node("master")
        consumer = WatchedConsumer(positions={("caches", "master"): 0,
                                              ("caches", "worker1"): 0})
        _, reader, r_link = await self.node("worker2", [consumer])
        await until_handled([master, reader], lambda: m_link.connected and r_link.connected)
        before = refused("caches", "beyond_sequence")
        bad_before = refused("caches", "bad_row")
        self.publish(f"POSITION caches worker1 777 {BIG}")
        self.publish(f'RDATA caches worker1 {BIG} ["x",null,1]')
        self.publish('RDATA caches worker1 1 ["x",null,"not a number"]')
        # Both instances hear both lies.
        await until(lambda: refused("caches", "beyond_sequence") == before + 4)
        await until(lambda: refused("caches", "bad_row") == bad_before + 2)
        self.assertEqual(m_registry.get("caches").id_gen.get_positions(),
                         {"master": 0, "worker1": 0})
        token = await m_registry.get("caches").write_fact([["real", None, 1]])
        await consumer.until(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "master", token, [["real", None, 1]])])
        self.assertEqual(reader.reader_positions()[("caches", "worker1")], 0)
        self.assertTrue(m_link.connected and r_link.connected)


class OwnFanoutTests(_InMemory):
    """What we send is never a line or batch the receiver must reject: a fact
    too big for a peer's bounds goes out as ``POSITION t t`` and readers read
    it from the table, whole."""

    def test_a_fact_beyond_the_bounds_is_announced_by_position(self):
        registry, master = self.instance("master", max_batch_rows=3,
                                         max_line_length=1024)
        honest, ht = self.server_conn(master, "worker2", replicate=True)
        consumer = MemoryConsumer(positions={("caches", "master"): 0})
        _, worker = self.instance("worker2", [consumer], max_batch_rows=3,
                                  max_line_length=1024)
        proto, _ = self.client_conn(worker, "worker2")
        proto.dataReceived(b"POSITION caches master 0 0\n")
        caches = registry.get("caches")
        small = self.h.run(caches.write_fact([["a", None, 1], ["b", None, 1], ["c", None, 1]]))
        big = self.h.run(caches.write_fact([[f"r{i}", None, i] for i in range(4)]))
        long = self.h.run(caches.write_fact([["x" * 2000, None, 1]]))
        after = self.h.run(caches.write_fact([["d", None, 1]]))
        self.settled(lambda: master.idle() and b"RDATA caches master %d " % after
                     in ht.value())
        self.assertEqual(lines(ht), [
            'RDATA caches master batch ["a",null,1]',
            'RDATA caches master batch ["b",null,1]',
            f'RDATA caches master {small} ["c",null,1]',
            f"POSITION caches master {big} {big}",
            f"POSITION caches master {long} {long}",
            f'RDATA caches master {after} ["d",null,1]',
        ])
        # A reader fed those lines gets every fact whole, the big ones
        # from the table.
        proto.dataReceived(ht.value())
        self.settled(lambda: len(consumer.facts) == 4)
        self.assertEqual([(t, len(rows)) for _, _, t, rows in consumer.facts],
                         [(small, 3), (big, 4), (long, 1), (after, 1)])
        self.assertEqual(consumer.facts[2][3], [["x" * 2000, None, 1]])
        self.assertIsNone(proto.close_reason)

    def test_a_fact_dear_once_decoded_is_announced_by_position(self):
        """Under ``max_batch_bytes`` on the wire, over what a reader accepts
        once decoded (issue 20 item 4): the writer does not send it either."""
        registry, master = self.instance("master", max_batch_bytes=1 << 20)
        honest, ht = self.server_conn(master, "worker2", replicate=True)
        keys = [[]] * 530
        caches = registry.get("caches")
        dear = self.h.run(caches.write_fact([[f"r{i}", keys, i] for i in range(300)]))
        cheap = self.h.run(caches.write_fact([[f"r{i}", keys, i] for i in range(3)]))
        self.settled(lambda: master.idle() and b"RDATA caches master %d " % cheap
                     in ht.value())
        self.assertEqual(lines(ht)[0], f"POSITION caches master {dear} {dear}")
        self.assertEqual(len(lines(ht)), 4)
