"""The replication handler on StringTransport, with streams on a real PostgreSQL."""

import psycopg2
from twisted.internet import reactor, task
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import TestCase

from replicator.config import parse_database, parse_streams
from replicator.consumers import MemoryConsumer
from replicator.replication.handler import ReplicationHandler
from replicator.replication.protocol import (
    ClientReplicationProtocol, ServerReplicationProtocol,
)
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from tests.servers import PostgresServer
from tests.support import until

STREAMS = parse_streams([
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": ["master", "worker1"]},
    {"name": "events", "table": "event_stream",
     "columns": [{"event_id": "text"}], "writers": ["master"]},
])


def set_sequence(dsn, sequence, value):
    """What another writer sharing the database would have done: without it,
    a claimed token above the sequence is refused as impossible."""
    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True
        conn.cursor().execute("SELECT setval(%s, %s)", (sequence, value))
    finally:
        conn.close()


def lines(transport):
    return transport.value().decode().splitlines()


class HandlerTests(TestCase):
    timeout = 60

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()

    async def instance(self, name, consumers=()):
        db = Database(parse_database({"postgres": self.dsn, "pool_max": 3}))
        self.addCleanup(db.close)
        registry = StreamRegistry(db, name, STREAMS, reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        handler = ReplicationHandler(registry, name, "hs.test", consumers=consumers)
        handler.start()
        return registry, handler

    def server_conn(self, handler, name=None):
        proto = ServerReplicationProtocol(handler, "hs.test", clock=task.Clock())
        transport = StringTransport()
        proto.makeConnection(transport)
        if name:
            proto.dataReceived(f"NAME {name}\n".encode())
        self.addCleanup(lambda: proto.connectionLost(None))
        return proto, transport

    async def test_replicate_answers_every_stream_and_writer(self):
        registry, handler = await self.instance("master")
        await registry.get("caches").write_facts([[["f", None, 1]], []])
        await until(handler.idle)
        proto, tr = self.server_conn(handler)
        self.assertEqual(lines(tr)[0], "SERVER hs.test")
        tr.clear()
        proto.dataReceived(b"REPLICATE \r\n")
        self.assertEqual(lines(tr), [
            "POSITION caches master 2 2",
            "POSITION caches worker1 0 0",
            "POSITION events master 0 0",
        ])

    async def test_fanout_writes_the_same_bytes_to_every_connection(self):
        registry, handler = await self.instance("master")
        (p1, t1), (p2, t2) = self.server_conn(handler), self.server_conn(handler)
        idle, it = self.server_conn(handler)  # never sent REPLICATE
        for p, t in ((p1, t1), (p2, t2)):
            p.dataReceived(b"REPLICATE\n")
            t.clear()
        it.clear()
        caches = registry.get("caches")
        await caches.write_facts([
            [["a", ["@x:hs"], 1], ["b", None, 2], ["c", None, 3]],
            [],
        ])
        await caches.write_fact([["d", {"k": "v w"}, 4]])
        await until(lambda: handler.idle() and "caches master 3" in t1.value().decode())
        self.assertEqual(t1.value(), t2.value())
        # The empty fact 2 shows as a POSITION, alone or folded into the
        # advance that carries fact 3 (fan-out coalesces advances).
        self.assertIn(lines(t1), [[
            'RDATA caches master batch ["a",["@x:hs"],1]',
            'RDATA caches master batch ["b",null,2]',
            'RDATA caches master 1 ["c",null,3]',
            "POSITION caches master 1 2",
            'RDATA caches master 3 ["d",{"k":"v w"},4]',
        ], [
            'RDATA caches master batch ["a",["@x:hs"],1]',
            'RDATA caches master batch ["b",null,2]',
            'RDATA caches master 1 ["c",null,3]',
            'RDATA caches master 3 ["d",{"k":"v w"},4]',
        ]])
        self.assertEqual(it.value(), b"")
        # A rollback alone advances by POSITION.
        t1.clear()

        def boom(txn, stream_id):
            raise RuntimeError("no")

        with self.assertRaises(RuntimeError):
            async with registry.get("events").writer() as fact:
                fact.add_row(["$e"])
                fact.also(boom)
        await until(lambda: b"POSITION" in t1.value())
        self.assertEqual(lines(t1), ["POSITION events master 0 1"])

    async def test_writer_client_rows_are_consumed_and_relayed_whole(self):
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        registry, handler = await self.instance("master", [consumer])
        set_sequence(self.dsn, "cache_stream_seq", 4)  # worker1 wrote up to 4
        other, ot = self.server_conn(handler, "worker2")
        other.dataReceived(b"REPLICATE\n")
        ot.clear()
        worker, wt = self.server_conn(handler, "worker1")
        worker.dataReceived(
            b"POSITION caches worker1 0 0\n"
            b'RDATA caches worker1 batch ["a",null,1]\n'
            b'RDATA caches worker1 batch ["b",null,1]\n')
        self.assertEqual(ot.value().count(b"RDATA"), 0)  # half a fact: not yet
        worker.dataReceived(
            b'RDATA caches worker1 4 ["c",null,1]\n'
            b'RDATA caches worker1 4 ["dup",null,1]\n')
        await until(lambda: len(consumer.facts) == 1)
        self.assertEqual(consumer.facts, [
            ("caches", "worker1", 4, [["a", None, 1], ["b", None, 1], ["c", None, 1]])])
        # (The master, idle on caches, follows the linear token: its own
        # POSITION lines may interleave; only worker1's are checked.)
        self.assertEqual([l for l in lines(ot) if " worker1 " in l], [
            "POSITION caches worker1 0 0",
            'RDATA caches worker1 batch ["a",null,1]',
            'RDATA caches worker1 batch ["b",null,1]',
            'RDATA caches worker1 4 ["c",null,1]',
            'RDATA caches worker1 4 ["dup",null,1]',
        ])
        self.assertEqual(wt.value().count(b"RDATA"), 0)  # no echo
        self.assertEqual(handler.reader_positions()[("caches", "worker1")], 4)
        self.assertEqual(registry.get("caches").id_gen.get_current_token("worker1"), 4)
        # A client may not write a stream it is not a writer of.
        worker.dataReceived(b'RDATA events worker1 5 ["$e"]\n')
        self.assertTrue(lines(wt)[-1].startswith("ERROR invalid command: RDATA"))

    async def test_position_gap_is_fetched_from_the_table(self):
        consumer = MemoryConsumer(positions={("caches", "master"): 0})
        # The worker's registry writes nothing to caches before it is told.
        master_reg, master = await self.instance("master")
        await master_reg.get("caches").write_facts(
            [[["a", None, 1], ["b", None, 1]], [], [["c", None, 2]]])
        _, worker = await self.instance("worker1", [consumer])
        proto = ClientReplicationProtocol(worker, "worker1", "hs.test", clock=task.Clock())
        tr = StringTransport()
        proto.makeConnection(tr)
        self.assertEqual(lines(tr)[0], "NAME worker1")
        # A writer new to the stream starts at its smallest persisted
        # position (the master's 3), and announces it.
        self.assertEqual(lines(tr)[2:], ["REPLICATE ", "POSITION caches worker1 3 3"])
        proto.dataReceived(
            b"SERVER hs.test\n"
            b'RDATA caches master 2 ["early",null,0]\n'  # not connected yet: dropped
            b"POSITION caches master 3 3\n"
            b'RDATA caches master 3 ["c",null,2]\n')      # duplicate of the catch-up
        await until(lambda: worker.reader_positions()[("caches", "master")] == 3)
        await until(worker.idle)
        self.assertEqual(consumer.facts, [
            ("caches", "master", 1, [["a", None, 1], ["b", None, 1]]),
            ("caches", "master", 3, [["c", None, 2]]),
        ])
        proto.connectionLost(None)

    async def test_partial_batch_dies_with_its_connection(self):
        consumer = MemoryConsumer(positions={("caches", "master"): 0})
        await self.instance("master")  # creates the tables worker1 only reads
        _, worker = await self.instance("worker1", [consumer])
        set_sequence(self.dsn, "cache_stream_seq", 1)  # the master wrote fact 1
        proto = ClientReplicationProtocol(worker, "worker1", "hs.test", clock=task.Clock())
        proto.makeConnection(StringTransport())
        proto.dataReceived(b"SERVER hs.test\nPOSITION caches master 0 0\n"
                           b'RDATA caches master batch ["lost",null,0]\n')
        proto.connectionLost(None)
        proto2 = ClientReplicationProtocol(worker, "worker1", "hs.test", clock=task.Clock())
        proto2.makeConnection(StringTransport())
        proto2.dataReceived(b"SERVER hs.test\nPOSITION caches master 0 0\n"
                            b'RDATA caches master 1 ["whole",null,0]\n')
        await until(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "master", 1, [["whole", None, 0]])])
        proto2.connectionLost(None)

    async def test_user_sync_bookkeeping_and_relays(self):
        _, handler = await self.instance("master")
        a, at = self.server_conn(handler, "worker1")
        b, bt = self.server_conn(handler, "worker2")
        bt.clear()
        a.dataReceived(b"USER_SYNC worker1 @u:hs DEV start 1000\n"
                       b"USER_SYNC worker1 @v:hs None start 1001\n"
                       b"FEDERATION_ACK worker1 57\n"
                       b'LOCK_RELEASED ["worker1","lock","key"]\n'
                       b"REMOTE_SERVER_UP other.hs\n")
        self.assertEqual(handler.user_syncs,
                         {"worker1": {("@u:hs", "DEV"): 1000, ("@v:hs", None): 1001}})
        self.assertEqual(handler.federation_acks, {"worker1": 57})
        self.assertEqual(lines(bt), ['LOCK_RELEASED ["worker1","lock","key"]',
                                     "REMOTE_SERVER_UP other.hs"])
        a.dataReceived(b"USER_SYNC worker1 @u:hs DEV end 1002\n")
        self.assertEqual(handler.user_syncs, {"worker1": {("@v:hs", None): 1001}})
        a.connectionLost(None)  # expires with the connection
        self.assertEqual(handler.user_syncs, {})

    async def test_connection_metrics_are_labelled_by_name(self):
        from replicator import metrics

        def gauge(name):
            return metrics.CONNECTIONS.labels(name)._value.get()

        _, handler = await self.instance("master")
        unnamed, named, other = gauge("unnamed"), gauge("worker1"), gauge("other")
        proto, _ = self.server_conn(handler)
        self.assertEqual(gauge("unnamed"), unnamed + 1)
        proto.dataReceived(b"NAME worker1\nPING 1\n")
        self.assertEqual((gauge("unnamed"), gauge("worker1")), (unnamed, named + 1))
        self.assertEqual(
            metrics.COMMANDS_IN.labels("PING", "worker1")._value.get() >= 1, True)
        # A name the configuration does not know is "other".
        stranger, _ = self.server_conn(handler, "worker7")
        self.assertEqual(gauge("other"), other + 1)
        proto.connectionLost(None)
        stranger.connectionLost(None)
        self.assertEqual((gauge("unnamed"), gauge("worker1"), gauge("other")),
                         (unnamed, named, other))

    async def test_facts_written_behind_our_back_are_delivered_and_reported(self):
        """Rows inserted by SQL (IDs from the sequence) into a single-writer
        stream: the fan-out reads them from the table, sends them in order
        with ours, counts them and logs one line for the burst."""
        from twisted.logger import globalLogPublisher

        from replicator import metrics

        def foreign_count():
            return metrics.FOREIGN_FACTS.labels("events")._value.get()

        registry, handler = await self.instance("master")
        proto, tr = self.server_conn(handler)
        proto.dataReceived(b"REPLICATE\n")
        events = registry.get("events")
        await events.write_fact([["$ours1"]])
        await until(lambda: handler.idle() and b"$ours1" in tr.value())
        tr.clear()
        logged = []
        observer = logged.append
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        before = foreign_count()
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        cur = conn.cursor()
        cur.execute("INSERT INTO event_stream (stream_id, instance_name, event_id) "
                    "VALUES (nextval('event_stream_seq'), 'master', '$sql1')")
        cur.execute("INSERT INTO event_stream (stream_id, instance_name, event_id) "
                    "SELECT id, 'master', e FROM (SELECT nextval('event_stream_seq') AS id) s, "
                    "(VALUES ('$sql2a'), ('$sql2b')) AS r(e)")
        cur.execute("SELECT nextval('event_stream_seq')")  # taken, never used
        cur.execute("INSERT INTO event_stream (stream_id, instance_name, event_id) "
                    "VALUES (nextval('event_stream_seq'), 'master', '$sql3')")
        conn.close()
        await events.write_fact([["$ours2"]])
        await until(lambda: handler.idle() and b"$ours2" in tr.value())
        self.assertEqual(lines(tr), [
            'RDATA events master 2 ["$sql1"]',
            'RDATA events master batch ["$sql2a"]',
            'RDATA events master 3 ["$sql2b"]',
            'RDATA events master 5 ["$sql3"]',
            'RDATA events master 6 ["$ours2"]',
        ])
        self.assertEqual(foreign_count() - before, 3)
        reports = [e for e in logged if "written without" in str(e.get("log_format", ""))]
        self.assertEqual(len(reports), 1)
