"""The status page's problem history outlives a restart
(:mod:`replicator.observe.problem_log`, :mod:`replicator.storage.problems`).

In memory: a recorder and its problem log on a SQLite database run inline
and a Clock, the database made to fail while problems start and end.  Over
real processes: a worker on PostgreSQL with problems, stopped and started
again; its page and ``/status.json`` still list them.
"""

import json
import signal
import sqlite3

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import DatabaseConfig, parse_streams
from replicator.observe import status, status_html
from replicator.observe.health import Finding
from replicator.observe.problem_log import ProblemLog
from replicator.storage.database import Database
from tests.cdp import chromium
from tests.daemon import CACHES, Daemon, base_config
from tests.fakes import FakeView
from tests.harness import SyncPool
from tests.servers import PostgresServer, free_port, wait_for
from tests.status_page import Cells, get, run_chromium
from tests.support import create_stream_tables


def link(text="replication not connected: upstream down"):
    return Finding("link", None, None, text, "")


def silent(writer="w1", for_=10):
    return Finding("never_announced", "caches", writer,
                   f"stream caches: writer {writer} never announced anything in {for_}s",
                   f"never announced anything in {for_}s")


class Node:
    """One run of an instance: its recorder and problem log on ``db``."""

    def __init__(self, test, db, clock, **log_options):
        self.found = []
        self.recorder = status.StatusRecorder(handler=FakeView(), clock=clock,
                                              findings=lambda: self.found, interval=5.0)
        self.log = ProblemLog(db, "worker1", clock, redact=lambda t: t.replace("hunter2", "***"),
                              **log_options)
        restored = defer.ensureDeferred(self.recorder.restore(self.log))
        test.assertIsNone(test.successResultOf(restored))
        self.recorder.startService()

    def stop(self, test):
        test.successResultOf(defer.maybeDeferred(self.recorder.stopService))

    def kill(self, test):
        """Gone without a word (SIGKILL): nothing written at the stop."""
        self.recorder.journal = None
        self.stop(test)

    def entries(self):
        return [(p.since, p.until, p.reason, p.before_restart, p.stopped_at, p.restarted_at)
                for p in self.recorder.problems]


class ProblemLogTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1000)
        self.connection = sqlite3.connect(":memory:")
        self.addCleanup(self.connection.close)
        self.pool = SyncPool(self.connection)
        self.db = Database(DatabaseConfig("sqlite", path=":memory:", pool_min=1, pool_max=1),
                           pool=self.pool)
        self.down = False
        self.tries = 0
        run = self.pool._run

        def maybe_down(work):
            self.tries += 1
            if self.down:
                return defer.fail(ConnectionError("the database is down"))
            return run(work)

        self.pool._run = maybe_down

    def wait(self, seconds):
        """Time passes, second by second (a retry due on the way runs then)."""
        for _ in range(seconds):
            self.clock.advance(1)

    def rows(self):
        return self.connection.execute(
            "SELECT kind, stream_name, writer, text, started_ms, ended_ms, stopped_ms, "
            "restarted_ms FROM replicator_problems ORDER BY started_ms, kind").fetchall()

    def test_writes_while_the_database_is_down_wait_and_are_written_when_it_is_back(self):
        node = Node(self, self.db, self.clock)
        self.assertEqual(self.tries, 1)  # the load: no table yet, nothing else
        node.found = [silent(for_=10)]
        self.clock.advance(5)  # 1005: it starts, one write
        self.assertEqual(self.rows(), [("never_announced", "caches", "w1",
                                        "stream caches: writer w1 never announced anything "
                                        "in 10s", 1005000, None, None, None)])
        tries = self.tries
        for i in range(10):  # going on: nothing written
            node.found = [silent(for_=15 + 5 * i)]
            self.clock.advance(5)
        self.assertEqual(self.tries, tries)
        # The database goes down, and that is a problem of its own (the
        # link, here, with a secret in its line); the first one ends.
        self.down = True
        node.found = [link("replication not connected: password hunter2")]
        self.clock.advance(5)  # 1060
        self.assertEqual(node.log.pending, 2)
        failed_at = self.tries
        self.assertEqual(failed_at, tries + 1)
        self.clock.advance(0.5)  # before the first retry (at least 0.75 s on)
        node.found = []
        node.recorder.note([])  # 1060.5: over in memory, the database still down
        self.assertEqual(node.log.pending, 2)  # the same two problems, not three
        self.assertEqual(self.tries, failed_at)  # waiting for the retry, not writing
        self.wait(60)  # retries with backoff, each failing
        self.assertGreater(self.tries, failed_at + 1)
        later = self.tries
        self.wait(60)
        self.assertLessEqual(self.tries - later, 3)  # by now ~30 s apart, not every second
        self.assertEqual(node.log.pending, 2)
        self.assertEqual(self.rows()[0][5], None)  # nothing written yet
        self.down = False
        self.wait(60)
        self.assertEqual(node.log.pending, 0)
        self.assertEqual(self.rows(), [
            ("never_announced", "caches", "w1",
             "stream caches: writer w1 never announced anything in 60s", 1005000, 1060000,
             None, None),
            ("link", "", "", "replication not connected: password ***", 1060000, 1060500,
             None, None)])
        done = self.tries
        self.wait(600)
        self.assertEqual(self.tries, done)  # nothing more to write: no retry left

        # A restart: both are there, before it.
        node.stop(self)
        again = Node(self, self.db, self.clock)
        self.assertEqual(again.entries(), [
            (1005.0, 1060.0, "stream caches: writer w1 never announced anything in 60s",
             True, None, None),
            (1060.0, 1060.5, "replication not connected: password ***", True, None, None)])

    def test_a_problem_ongoing_at_the_stop_is_shown_so_after_the_restart(self):
        node = Node(self, self.db, self.clock)
        node.found = [link()]
        self.clock.advance(5)  # 1005
        self.clock.advance(20)
        node.stop(self)  # 1025: an orderly stop records it
        again = Node(self, self.db, self.clock)
        self.assertEqual(again.entries(), [
            (1005.0, None, "replication not connected: upstream down", True, 1025.0, None)])
        # Still down in the new run: a new entry, its own.
        again.found = [link()]
        self.clock.advance(5)  # 1030
        self.assertEqual(len(again.entries()), 2)
        self.assertEqual(again.entries()[-1][:4],
                         (1030.0, None, "replication not connected: upstream down", False))
        # Killed (no stop recorded): the next start says it was ongoing
        # at a stop that came before it.
        self.clock.advance(30)  # 1060
        again.kill(self)
        third = Node(self, self.db, self.clock)
        self.assertEqual(third.entries(), [
            (1005.0, None, "replication not connected: upstream down", True, 1025.0, None),
            (1030.0, None, "replication not connected: upstream down", True, None, 1060.0)])
        snap = {"problems": [p.as_dict() for p in reversed(third.recorder.problems)],
                "started_at": third.recorder.restored_at}
        self.assertEqual([status_html.period(p) for p in snap["problems"]], [
            "1970-01-01 00:17:10 – ongoing at the stop (not recorded, before the restart "
            "at 00:17:40 UTC), end unknown",
            "1970-01-01 00:16:45 – ongoing at the stop (00:17:05 UTC), end unknown"])
        self.assertIn("ongoing at the stop", status_html.period(snap["problems"][0]))
        self.assertNotIn("– ongoing<", status_html._problem_rows(snap))
        self.assertTrue(status_html._problem_rows(snap).startswith(
            '<li class="restart">restart at 1970-01-01 00:17:40 UTC'))

    def test_the_pending_writes_and_the_table_are_bounded(self):
        node = Node(self, self.db, self.clock, max_pending=3, keep=4)
        self.down = True
        for i in range(5):  # five problems start and end while it is down
            node.found = [silent(f"w{i}")]
            self.clock.advance(5)
        node.found = []
        self.clock.advance(5)
        self.assertEqual(node.log.pending, 3)
        self.assertEqual(node.log.dropped, 2)
        self.down = False
        self.wait(120)
        self.assertEqual([r[2] for r in self.rows()], ["w2", "w3", "w4"])  # the last three
        for i in range(5, 8):
            node.found = [silent(f"w{i}")]
            self.clock.advance(5)
        node.found = []
        self.clock.advance(5)
        self.assertEqual([r[2] for r in self.rows()], ["w4", "w5", "w6", "w7"])  # keep=4

    def test_a_history_that_cannot_be_read_starts_the_page_without_it(self):
        self.down = True
        node = Node(self, self.db, self.clock)
        self.assertEqual(node.entries(), [])
        self.down = False
        node.found = [link()]
        self.clock.advance(5)
        self.assertEqual(len(self.rows()), 1)
        self.flushLoggedErrors()


class TableNameTests(SynchronousTestCase):
    def test_a_stream_cannot_use_the_history_table(self):
        from replicator.config import ConfigError

        with self.assertRaises(ConfigError) as caught:
            parse_streams([dict(CACHES, table="Replicator_Problems")])
        self.assertEqual(str(caught.exception), "config: streams[0].table: "
                         "'Replicator_Problems' is the replicator's own table")


class RestartTests(SynchronousTestCase):
    def test_the_page_still_lists_the_problems_after_a_restart(self):
        """A worker whose master is not up yet: its link is down and the
        master's writer is never heard past the grace; both end once the
        master runs.  Then the master stops (the link is down again) and
        the worker stops and starts again: its page and ``/status.json``
        list the three problems from before the restart, the open one as
        ongoing at the stop."""
        dsn = PostgresServer.shared().create_database()
        rep_port = free_port()
        streams = [dict(CACHES, writers=["master"])]
        master = base_config("master", free_port(), streams, database={"postgres": dsn},
                             replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        worker = base_config(
            "worker1", free_port(), streams, database={"postgres": dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}",
                         "reconnect_initial_delay": 0.1, "reconnect_max_delay": 0.3},
            health={"lag_grace": 1, "check_interval": 1})
        create_stream_tables(dsn, parse_streams(streams))
        worker_d = Daemon(self, worker, "worker1").start()
        base = worker_d.http_base

        def status_json():
            code, _, body = get(base + "/status.json")
            self.assertEqual(code, 200)
            return json.loads(body)

        def kinds(snap, ended):
            return sorted(p["reason"].split(":")[0] for p in snap["problems"]
                          if (p["until"] is not None) == ended)

        wait_for(lambda: kinds(status_json(), False) == ["replication not connected",
                                                         "stream caches"],
                 60, "the link down and the master's writer never heard")
        master_d = Daemon(self, master, "master").start()
        wait_for(lambda: status_json()["healthy"] and not kinds(status_json(), False), 60,
                 "both problems over")
        master_d.kill(signal.SIGTERM)
        wait_for(lambda: kinds(status_json(), False) == ["replication not connected"], 60,
                 "the link down again")
        before = status_json()["problems"]

        def ms(t):
            return None if t is None else round(t * 1000)

        worker_d.kill(signal.SIGTERM)
        self.assertEqual(worker_d.proc.returncode, 0, worker_d.output()[-2000:])

        worker_d.start()
        snap = status_json()
        # What ended before the restart is still listed after it.
        reasons = [p["reason"] for p in snap["problems"]]
        for p in before:
            if p["until"] is not None:
                self.assertIn(p["reason"], reasons)
        earlier = [p for p in snap["problems"] if p["before_restart"]]
        self.assertEqual([(ms(p["at"]), p["fails_health"]) for p in earlier],
                         [(ms(p["at"]), p["fails_health"]) for p in before])
        ended = [p for p in earlier if p["until"] is not None]
        self.assertEqual([(ms(p["at"]), ms(p["until"])) for p in ended],
                         [(ms(p["at"]), ms(p["until"])) for p in before
                          if p["until"] is not None])
        self.assertEqual(sorted(p["reason"].split(":")[0] for p in ended),
                         ["replication not connected", "stream caches"])
        [open_at_stop] = [p for p in earlier if p["until"] is None]
        self.assertRegex(open_at_stop["reason"], r"^replication not connected: upstream ")
        self.assertIsNotNone(open_at_stop["stopped_at"])
        self.assertGreaterEqual(open_at_stop["stopped_at"], open_at_stop["at"])
        self.assertLessEqual(open_at_stop["stopped_at"], snap["started_at"])
        for p in snap["problems"]:  # this run's: since its start
            if not p["before_restart"]:
                self.assertGreaterEqual(p["at"], snap["started_at"])
        # The page says the same: the restart, and the open one's stop.
        page = get(base + "/")[2].decode()
        self.assertIn("restart at ", page)
        self.assertIn(status_html.period(open_at_stop), page)
        self.assertIn("ongoing at the stop (", page)
        self.assertIn("stream caches: writer master never announced anything", page)
        # And so does the page once its script refreshed it.
        chromium()
        dumped = run_chromium("--virtual-time-budget=10000", "--dump-dom", base + "/")
        self.assertEqual(dumped.returncode, 0, dumped.stderr[-2000:])
        dom = Cells()
        dom.feed(dumped.stdout)
        self.assertIn("data-refreshed", dom.body, dumped.stdout[:3000])
        self.assertIn("restart at ", dom.texts["problems"])
        self.assertIn(status_html.period(open_at_stop), dom.texts["problems"])
