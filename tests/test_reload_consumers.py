"""SIGHUP changes consumers live: over real processes (a master + worker
pair on PostgreSQL), and the plan of which consumers stop and start, in
memory.

A removed consumer is stopped after it persisted what it had; a new one
starts from its own persisted position (facts it lacks are caught up from
the table, none twice); a changed one is restarted; the others go on,
without a duplicate, and the replication link stays up."""

import fcntl
import json
import os
import signal

from twisted.trial.unittest import SynchronousTestCase

from replicator.config import parse_instance
from replicator.daemon.reload import plan
from tests import test_reload
from tests.daemon import CACHES, Daemon, base_config, http, metric
from tests.servers import PostgresServer, free_port, wait_for


def _facts(path):
    """``(writer, token)`` of every fact line of a JSON-lines file, in order."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(e["writer"], e["token"]) for e in map(json.loads, f) if "rows" in e]


class ConsumerReloadTests(SynchronousTestCase):
    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()

    def test_consumers_removed_added_and_changed_by_sighup(self):
        rep_port = free_port()
        streams = [CACHES]
        master_cfg = base_config(
            "master", free_port(), streams, database={"postgres": self.dsn},
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        master_cfg["http"]["metrics_listen"] = f"127.0.0.1:{free_port()}"
        master = Daemon(self, master_cfg, "master")
        worker = Daemon(self, base_config(
            "worker1", free_port(), streams, database={"postgres": self.dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            consumers=[{"type": "jsonl", "path": "a.jsonl"},
                       {"type": "jsonl", "path": "c.jsonl"}]), "worker1")
        master.start()
        worker.start()
        path = lambda name: os.path.join(worker.dir, name)  # noqa: E731
        write = test_reload.ReloadClusterTests.write.__get__(self)
        metrics_url = f"http://{master.config['http']['metrics_listen']}/metrics"

        t1 = write(master, "caches", [["f1", None, 1]])
        t2 = write(master, "caches", [["f2", None, 2]])
        for name in ("a.jsonl", "c.jsonl"):
            wait_for(lambda: _facts(path(name)) == [("master", t1), ("master", t2)], 60,
                     f"{name} has both facts")
        disconnects = metric(http(metrics_url)[1].decode(), "replicator_disconnects_total")
        # b.jsonl, new to the worker, was left by an earlier run at t1.
        with open(path("a.jsonl")) as f:
            first = f.readline()
        with open(path("b.jsonl"), "w") as f:
            f.write(first)

        # a removed, c changed (its flush interval), b added after it.
        test_reload.ReloadClusterTests.rewrite(worker, consumers=[
            {"type": "jsonl", "path": "c.jsonl", "flush_interval": 0.01},
            {"type": "jsonl", "path": "b.jsonl"}])
        line, out = test_reload.ReloadClusterTests.hup_and_wait(worker, "reload: applied")
        self.assertIn("needs restart: nothing", line)
        self.assertIn("consumers[0] (jsonl) restarted", line)
        self.assertIn("consumers[1] (jsonl) started", line)
        self.assertIn("consumers[0] (jsonl) stopped", line)

        # a is closed (its lock released) and kept what it had.
        with open(path("a.jsonl"), "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a consumer holds it
        self.assertEqual(_facts(path("a.jsonl")), [("master", t1), ("master", t2)])

        t3 = write(master, "caches", [["f3", None, 3]])
        want = [("master", t1), ("master", t2), ("master", t3)]
        for name in ("b.jsonl", "c.jsonl"):
            try:
                wait_for(lambda: len(_facts(path(name))) >= 3, 60, f"{name} has f3")
            except AssertionError as e:
                raise AssertionError(f"{e}; worker: {worker.output()[-3000:]}") from None
        # b caught up from its own position (t2 from the table); none twice.
        self.assertEqual(_facts(path("b.jsonl")), want)
        self.assertEqual(_facts(path("c.jsonl")), want)
        self.assertEqual(_facts(path("a.jsonl")), [("master", t1), ("master", t2)])
        # No restart, no disconnect.
        self.assertIsNone(worker.proc.poll())
        self.assertEqual(metric(http(metrics_url)[1].decode(), "replicator_disconnects_total"),
                         disconnects)
        worker.kill(signal.SIGTERM)
        self.assertEqual(worker.proc.returncode, 0, worker.output()[-2000:])


def _config(consumers):
    return parse_instance({
        "server_name": "hs.test", "instance_name": "worker1",
        "database": {"postgres": "dbname=a"},
        "replication": {"upstream": "tcp:host=127.0.0.1:port=9092"},
        "streams": [dict(CACHES, writers=["master"])], "consumers": consumers})


class ConsumerPlanTests(SynchronousTestCase):
    A = {"type": "jsonl", "path": "a.jsonl"}
    B = {"type": "jsonl", "path": "b.jsonl"}
    LOG = {"type": "log"}

    def test_unchanged(self):
        p = plan(_config([self.A, self.LOG]), _config([self.A, self.LOG]))
        self.assertIsNone(p.consumers)
        self.assertEqual((p.applied, p.restart), ([], []))

    def test_kept_ones_are_matched_wherever_they_moved(self):
        p = plan(_config([self.A, self.LOG]), _config([self.B, self.LOG, self.A]))
        self.assertEqual(p.consumers.kept, {1: 1, 2: 0})
        self.assertEqual((p.consumers.stopped, p.consumers.started), ([], [0]))
        self.assertEqual(p.applied, ["consumers[0] (jsonl) started"])
        self.assertEqual(p.restart, [])

    def test_removed_changed_added(self):
        changed = dict(self.A, fsync=False)
        p = plan(_config([self.A, self.LOG]), _config([changed, self.B]))
        self.assertEqual(p.consumers.kept, {})
        self.assertEqual(p.consumers.stopped, [0, 1])
        self.assertEqual(p.consumers.started, [0, 1])
        self.assertEqual(p.consumers.restarted, {0: 0})
        self.assertEqual(p.applied, ["consumers[0] (jsonl) restarted",
                                     "consumers[1] (jsonl) started",
                                     "consumers[1] (log) stopped"])
        self.assertEqual(p.config.consumers, _config([changed, self.B]).consumers)


class RewireTests(SynchronousTestCase):
    """A reader held between two facts, handed to new consumers, rewound
    for the one that is behind (in memory: a Clock, a table as a dict)."""

    def make(self, consumers, table):
        from twisted.internet import defer
        from twisted.internet.task import Clock

        from replicator.replication.core.delivery import delivery_for
        from replicator.replication.core.reader import Reader
        from tests.support import updates_since

        deliver, many, reached = delivery_for("s", "w", consumers)
        return Reader("s", "w", 0, clock=Clock(), fetch_limit=2, deliver=deliver,
                      deliver_many=many, reached=reached,
                      source=lambda w, f, t, n: defer.succeed(updates_since(table, f, t, n)))

    def test_pause_waits_for_the_fact_in_hand_then_a_new_consumer_catches_up_alone(self):
        from twisted.internet import defer

        from replicator.consumers import MemoryConsumer
        from replicator.replication.core.delivery import rewire
        from tests.fakes import FakeConnection

        table = {t: [[f"r{t}"]] for t in range(1, 7)}
        kept = MemoryConsumer()
        slow = defer.Deferred()
        waits = [slow]

        class Slow(MemoryConsumer):
            def on_facts(self, stream, writer, token, rows):
                super().on_facts(stream, writer, token, rows)
                return waits.pop() if waits else None

        removed = Slow()
        reader = self.make([kept, removed], table)
        conn = FakeConnection("c")
        reader.position_line(conn, 0, 0)
        reader.rdata(conn, 1, ["r1"])  # in hand: removed has not finished it
        reader.rdata(conn, 2, ["r2"])
        paused = reader.pause()
        self.assertFalse(paused.called)
        slow.callback(None)
        self.assertTrue(paused.called)
        self.assertEqual(reader.position, 1)  # r2 waits in the queue
        reader.rdata(conn, 3, ["r3"])  # lines keep queueing while paused
        self.assertEqual(reader.position, 1)

        new = MemoryConsumer(positions={("s", "w"): 0})  # persisted: nothing yet
        live = MemoryConsumer()  # no position: live
        rewire(reader, [kept, new, live], [new, live])
        reader.resume()
        reader.position_line(conn, 3, 4)
        self.assertEqual([f[2] for f in kept.facts], [1, 2, 3])  # no duplicate
        self.assertEqual([f[2] for f in new.facts], [1, 2, 3])  # r1 caught up, for it alone
        self.assertEqual([f[2] for f in live.facts], [2, 3])
        self.assertEqual([f[2] for f in removed.facts], [1])
        self.assertEqual(reader.position, 4)
        self.assertEqual(new.positions(), {("s", "w"): 4})

    def test_a_new_consumer_starts_where_its_start_says_and_is_told_first(self):
        """``beginning``: after the trim boundary (facts below it are gone),
        every kept fact caught up for it alone; ``now``: at the reader's
        position.  Each is told its start (``on_position``) before a fact."""
        from replicator.consumers import MemoryConsumer
        from replicator.replication.core.delivery import rewire
        from tests.fakes import FakeConnection

        class Recording(MemoryConsumer):
            def __init__(self, start):
                super().__init__()
                self.start, self.calls = start, []

            def on_facts(self, stream, writer, token, rows):
                self.calls.append(("fact", token))
                super().on_facts(stream, writer, token, rows)

            def on_position(self, stream, writer, token):
                self.calls.append(("position", token))
                super().on_position(stream, writer, token)

        table = {t: [[f"r{t}"]] for t in range(3, 7)}  # 1 and 2 trimmed: boundary 2
        kept = MemoryConsumer()
        reader = self.make([kept], table)
        conn = FakeConnection("c")
        reader.position_line(conn, 0, 0)
        for t in (3, 4):
            reader.rdata(conn, t, [f"r{t}"])
        self.successResultOf(reader.pause())
        beginning, now = Recording("beginning"), Recording("now")
        rewire(reader, [kept, beginning, now], [beginning, now], beginning=2)
        reader.resume()
        reader.rdata(conn, 5, ["r5"])
        reader.position_line(conn, 5, 6)
        self.assertEqual(beginning.calls, [("position", 2), ("fact", 3), ("fact", 4),
                                           ("fact", 5), ("position", 6)])
        self.assertEqual(now.calls, [("position", 4), ("fact", 5), ("position", 6)])
        self.assertEqual([f[2] for f in kept.facts], [3, 4, 5])  # no duplicate

    def test_pause_during_an_outage_calls_the_retry_off_and_resume_tries_again(self):
        from twisted.internet import defer
        from twisted.internet.task import Clock

        from replicator.consumers import MemoryConsumer
        from replicator.replication.core.delivery import delivery_for, rewire
        from replicator.replication.core.reader import Reader
        from tests.fakes import FakeConnection
        from tests.support import updates_since

        table = {1: [["r1"]], 2: [["r2"]]}
        down = [True]

        def source(w, f, t, n):
            if down[0]:
                return defer.fail(OSError("database down"))
            return defer.succeed(updates_since(table, f, t, n))

        old = MemoryConsumer()
        clock = Clock()
        deliver, many, reached = delivery_for("s", "w", [old])
        reader = Reader("s", "w", 0, clock=clock, fetch_limit=10, deliver=deliver,
                        deliver_many=many, reached=reached, source=source)
        reader.position_line(FakeConnection("c"), 2, 2)  # catch-up fails: a retry waits
        self.assertEqual(len(clock.getDelayedCalls()), 1)
        paused = reader.pause()
        self.assertTrue(paused.called)
        self.assertEqual(clock.getDelayedCalls(), [])
        new = MemoryConsumer()
        rewire(reader, [new], [new])
        down[0] = False
        reader.resume()
        self.assertEqual([f[2] for f in new.facts], [1, 2])
        self.assertEqual(old.facts, [])
        self.assertEqual(reader.position, 2)
