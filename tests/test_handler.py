"""The replication handler in memory (:mod:`tests.harness`): streams on
SQLite run inline, connections on StringTransport, a clock the test moves.
What needs PostgreSQL itself (facts inserted by SQL behind the writer's
back, taking IDs from the shared sequence) runs there."""

import psycopg2
from twisted.internet import defer, reactor, task
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import TestCase

from replicator.config import parse_database, parse_streams
from replicator.consumers import MemoryConsumer
from replicator.export.source import linear_position
from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.transport.protocol import ServerReplicationProtocol
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from tests.harness import Harness, lines
from tests.servers import PostgresServer
from tests.stream_sets import HANDLER_STREAMS as STREAMS
from tests.support import until

#: ``caches`` written by three instances, as an operator adds a writer.
WRITERS3 = ["master", "worker1", "worker2"]
THREE_WRITERS = parse_streams([
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": WRITERS3},
])

class HandlerTests(TestCase):
    """Handler logic, in memory: every assertion follows ``settle()``."""

    def setUp(self):
        self.h = Harness(STREAMS, self.addCleanup)

    def test_replicate_answers_every_stream_and_writer(self):
        master = self.h.instance("master")
        self.h.run(master.stream("caches").write_facts([[["f", None, 1]], []]))
        proto, tr = self.h.serve(master, clear=False)
        self.assertEqual(lines(tr)[0], "SERVER hs.test")
        tr.clear()
        proto.dataReceived(b"REPLICATE \r\n")
        self.assertEqual(lines(tr), [
            "POSITION caches master 2 2",
            "POSITION caches worker1 0 0",
            "POSITION events master 0 0",
        ])

    def test_fanout_writes_the_same_bytes_to_every_connection(self):
        master = self.h.instance("master")
        (p1, t1) = self.h.serve(master, replicate=True)
        (p2, t2) = self.h.serve(master, replicate=True)
        idle, it = self.h.serve(master)  # never sent REPLICATE
        caches = master.stream("caches")
        self.h.run(caches.write_facts([
            [["a", ["@x:hs"], 1], ["b", None, 2], ["c", None, 3]],
            [],
        ]))
        self.h.run(caches.write_fact([["d", {"k": "v w"}, 4]]))
        self.assertEqual(t1.value(), t2.value())
        # The empty fact 2 shows as a POSITION (fan-out coalesces advances
        # that come within its interval; these came apart).
        self.assertEqual(lines(t1), [
            'RDATA caches master batch ["a",["@x:hs"],1]',
            'RDATA caches master batch ["b",null,2]',
            'RDATA caches master 1 ["c",null,3]',
            "POSITION caches master 1 2",
            'RDATA caches master 3 ["d",{"k":"v w"},4]',
        ])
        self.assertEqual(it.value(), b"")
        # A rollback alone advances by POSITION.
        t1.clear()

        def boom(txn, stream_id):
            raise RuntimeError("no")

        async def rolled_back():
            async with master.stream("events").writer() as fact:
                fact.add_row(["$e"])
                fact.also(boom)

        with self.assertRaises(RuntimeError):
            self.h.run(rolled_back())
        self.assertEqual(lines(t1), ["POSITION events master 0 1"])

    def test_a_line_admitted_after_a_reload_dropped_its_writer_is_dropped(self):
        """A claim waiting for the sequence's re-read (admission) when a
        reload removes its writer: dropped, not a CRITICAL ``KeyError``."""
        import dataclasses

        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        master = self.h.instance("master", [consumer])
        worker, _ = self.h.serve(master, "worker1")
        stream = master.stream("caches")
        read = defer.Deferred()
        stream.sequence_value = lambda: read  # the re-read of the sequence, held
        worker.dataReceived(b"POSITION caches worker1 0 0\n"
                            b'RDATA caches worker1 4 ["c",null,1]\n')
        old = stream.config.writers
        stream.config = dataclasses.replace(stream.config, writers=("master",))
        master.handler.writers_changed(stream, old)
        read.callback(4)  # the claim was true: admitted now, its writer gone
        self.h.settle()
        self.assertEqual(self.flushLoggedErrors(KeyError), [])
        self.assertEqual(consumer.facts, [])

    def test_writer_client_rows_are_consumed_and_relayed_whole(self):
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        master = self.h.instance("master", [consumer])
        self.h.sequence_taken("caches", 4)  # worker1 wrote up to 4
        other, ot = self.h.serve(master, "worker2", replicate=True)
        worker, wt = self.h.serve(master, "worker1")
        worker.dataReceived(
            b"POSITION caches worker1 0 0\n"
            b'RDATA caches worker1 batch ["a",null,1]\n'
            b'RDATA caches worker1 batch ["b",null,1]\n')
        self.h.settle()
        self.assertEqual(ot.value().count(b"RDATA"), 0)  # half a fact: not yet
        worker.dataReceived(
            b'RDATA caches worker1 4 ["c",null,1]\n'
            b'RDATA caches worker1 4 ["dup",null,1]\n')
        self.h.settle()
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
        self.assertEqual(master.handler.reader_positions()[("caches", "worker1")], 4)
        self.assertEqual(master.stream("caches").id_gen.get_current_token("worker1"), 4)
        # A client may not write a stream it is not a writer of.
        worker.dataReceived(b'RDATA events worker1 5 ["$e"]\n')
        self.assertEqual(lines(wt)[-1], "ERROR RDATA of events/worker1 refused: worker1 is not "
                                        "a writer of events here")

    def test_position_gap_is_fetched_from_the_table(self):
        consumer = MemoryConsumer(positions={("caches", "master"): 0})
        # The worker's registry writes nothing to caches before it is told.
        master = self.h.instance("master")
        self.h.run(master.stream("caches").write_facts(
            [[["a", None, 1], ["b", None, 1]], [], [["c", None, 2]]]))
        worker = self.h.instance("worker1", [consumer])
        proto, tr = self.h.client(worker, handshake=False, clear=False)
        self.assertEqual(lines(tr)[0], "NAME worker1")
        # A writer new to the stream starts at its smallest persisted
        # position (the master's 3), and announces it.
        self.assertEqual(lines(tr)[2:], ["REPLICATE ", "POSITION caches worker1 3 3"])
        proto.dataReceived(
            b"SERVER hs.test\n"
            b'RDATA caches master 2 ["early",null,0]\n'  # not connected yet: dropped
            b"POSITION caches master 3 3\n"
            b'RDATA caches master 3 ["c",null,2]\n')      # duplicate of the catch-up
        self.h.settle()
        self.assertEqual(worker.handler.reader_positions()[("caches", "master")], 3)
        self.assertEqual(consumer.facts, [
            ("caches", "master", 1, [["a", None, 1], ["b", None, 1]]),
            ("caches", "master", 3, [["c", None, 2]]),
        ])

    def test_partial_batch_dies_with_its_connection(self):
        consumer = MemoryConsumer(positions={("caches", "master"): 0})
        self.h.instance("master")  # creates the tables worker1 only reads
        worker = self.h.instance("worker1", [consumer])
        self.h.sequence_taken("caches", 1)  # the master wrote fact 1
        proto, _ = self.h.client(worker)
        proto.dataReceived(b"POSITION caches master 0 0\n"
                           b'RDATA caches master batch ["lost",null,0]\n')
        proto.connectionLost(None)
        proto2, _ = self.h.client(worker)
        proto2.dataReceived(b"POSITION caches master 0 0\n"
                            b'RDATA caches master 1 ["whole",null,0]\n')
        self.h.settle()
        self.assertEqual(consumer.facts, [("caches", "master", 1, [["whole", None, 0]])])

    def test_lines_of_a_writer_the_config_does_not_name_are_logged_once(self):
        """A worker whose config misspells a writer (``wroker1`` for
        ``worker1``) drops that writer's lines: one warning per (stream,
        writer) naming the config key, each line counted."""
        from twisted.logger import LogLevel, formatEvent, globalLogPublisher

        from replicator.observe import metrics

        typo = Harness(parse_streams([
            {"name": "caches", "table": "cache_stream",
             "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
             "writers": ["master", "wroker1"]},
        ]), self.addCleanup)
        typo.instance("master")  # creates the table the worker only reads
        worker = typo.instance("worker2", [MemoryConsumer()])
        logged = []
        globalLogPublisher.addObserver(logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, logged.append)

        def dropped(command):
            return metrics.COMMANDS_DROPPED.labels(command, "unknown_writer")._value.get()

        rdata, position = dropped("RDATA"), dropped("POSITION")
        proto, _ = typo.client(worker)
        proto.dataReceived(b"POSITION caches worker1 0 0\n"
                           b'RDATA caches worker1 1 ["a",null,0]\n'
                           b'RDATA caches worker1 2 ["b",null,0]\n'
                           b"POSITION caches worker1 2 2\n"
                           b"POSITION others worker1 0 0\n")
        typo.settle()
        warned = [e for e in logged if e.get("log_level") == LogLevel.warn
                  and "streams.caches.writers" in formatEvent(e)]
        self.assertEqual(len(warned), 1, warned)
        self.assertEqual((warned[0]["stream"], warned[0]["writer"]), ("caches", "worker1"))
        self.assertEqual((dropped("RDATA") - rdata, dropped("POSITION") - position), (2, 2))
        # A second connection saying the same: still counted, not logged again.
        proto2, _ = typo.client(worker)
        proto2.dataReceived(b'RDATA caches worker1 3 ["c",null,0]\n')
        typo.settle()
        self.assertEqual(len([e for e in logged if e.get("writer") == "worker1"
                              and e.get("log_level") == LogLevel.warn]), 1)
        self.assertEqual(dropped("RDATA") - rdata, 3)

    def test_user_sync_bookkeeping_and_relays(self):
        master = self.h.instance("master")
        handler = master.handler
        a, at = self.h.serve(master, "worker1")
        b, bt = self.h.serve(master, "worker2")
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

    def test_connection_metrics_are_labelled_by_name(self):
        from replicator.observe import metrics

        def gauge(name):
            return metrics.CONNECTIONS.labels(name)._value.get()

        master = self.h.instance("master")
        unnamed, named, other = gauge("unnamed"), gauge("worker1"), gauge("other")
        proto, _ = self.h.serve(master)
        self.assertEqual(gauge("unnamed"), unnamed + 1)
        proto.dataReceived(b"NAME worker1\nPING 1\n")
        self.assertEqual((gauge("unnamed"), gauge("worker1")), (unnamed, named + 1))
        self.assertEqual(
            metrics.COMMANDS_IN.labels("PING", "worker1")._value.get() >= 1, True)
        # A name the configuration does not know is "other".
        stranger, _ = self.h.serve(master, "worker7")
        self.assertEqual(gauge("other"), other + 1)
        proto.connectionLost(None)
        stranger.connectionLost(None)
        self.assertEqual((gauge("unnamed"), gauge("worker1"), gauge("other")),
                         (unnamed, named, other))

    def test_instances_joined_in_memory_replicate_both_ways(self):
        """A worker connected to the master through iosim transports: the
        master's facts reach the worker's consumer, the worker's reach the
        master's, each once, with no socket and no wait."""
        master_consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        worker_consumer = MemoryConsumer(positions={("caches", "master"): 0,
                                                    ("events", "master"): 0})
        master = self.h.instance("master", [master_consumer])
        worker = self.h.instance("worker1", [worker_consumer])
        link = self.h.connect(master, worker)
        self.assertTrue(link.client.established)
        self.h.run(master.stream("events").write_facts([[["$a"]], [["$b"]]]))
        self.h.run(master.stream("caches").write_fact([["m", None, 1]]))
        self.assertEqual([(s, t, rows) for s, _, t, rows in worker_consumer.facts],
                         [("events", 1, [["$a"]]), ("events", 2, [["$b"]]),
                          ("caches", 1, [["m", None, 1]])])
        # The worker's own writes (IDs from the stream's one sequence).
        self.h.run(worker.stream("caches").write_fact([["w", None, 2]]))
        self.assertEqual(master_consumer.facts, [("caches", "worker1", 2, [["w", None, 2]])])
        # A cut link: the worker's next fact comes after the reconnect.
        link.cut()
        self.h.settle()
        self.assertFalse(worker.handler.connections)
        self.h.run(master.stream("events").write_fact([["$c"]]))
        self.h.connect(master, worker)
        self.h.settle()
        self.assertEqual(worker_consumer.facts[-1], ("events", "master", 3, [["$c"]]))
        self.assertEqual(len(worker_consumer.facts), 4)


    def test_idle_writers_reach_the_busy_writers_last_fact(self):
        """Three writers of ``caches``, facts written on the master only:
        every instance's linear token and per-writer tokens (what
        ``replicator positions`` answers), every writer's row in
        ``stream_positions`` and so the export's bound reach the master's
        last fact without a write on either worker.  (Each idle worker used
        to follow the linear token, which the other idle worker held.)"""
        h = Harness(THREE_WRITERS, self.addCleanup)
        master = h.instance("master")
        workers = [h.instance(name) for name in ("worker1", "worker2")]
        for worker in workers:
            h.connect(master, worker)
        stream = master.stream("caches")
        for i in range(20):
            last = h.run(stream.write_fact([[f"func{i}", None, i]]))
        h.advance(1.0)  # positions are persisted a moment after they move
        for node in [master] + workers:
            gen = node.stream("caches").id_gen
            self.assertEqual(gen.get_linear_token(), last, node.name)
            self.assertEqual(gen.get_positions(), {w: last for w in WRITERS3}, node.name)
        persisted = dict(h.connection.execute(
            "SELECT instance_name, stream_id FROM stream_positions "
            "WHERE stream_name = 'caches'").fetchall())
        self.assertEqual(persisted, {w: last for w in WRITERS3})
        self.assertEqual(linear_position(persisted, WRITERS3), last)
        for worker in workers:
            self.assertEqual(worker.stream("caches").id_gen.in_flight(), 0)


class HandlerOnPostgresTests(TestCase):
    """What the handler does with PostgreSQL itself: a shared sequence that
    SQL outside the daemon takes IDs from."""

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

    async def test_facts_written_behind_our_back_are_delivered_and_reported(self):
        """Rows inserted by SQL (IDs from the sequence) into a single-writer
        stream: the fan-out reads them from the table, sends them in order
        with ours, counts them and logs one line for the burst."""
        from twisted.logger import globalLogPublisher

        from replicator.observe import metrics

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
