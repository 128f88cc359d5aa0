"""``replicator verify`` beside a running daemon, and after the documented
repair (``replicator rewind --to``): a real master writing over TCP to a
worker whose ``jsonl`` consumer writes the file, on PostgreSQL, every
command the real one.

Verify beside the daemon must compare the file and the tables over the same
range: a fact committed and appended to the file while verify runs is not
"extra".  The race is made certain here rather than left to luck: verify is
held (a lock on the second stream's table, which it reads after the
first's) while a fact of the first stream is committed and written to the
file."""

import json
import os
import signal
import subprocess
import sys
import threading

import psycopg2
from twisted.trial.unittest import SynchronousTestCase

from tests.servers import PostgresServer, free_port, wait_for
from tests.test_cli import CACHES, SECRET, Daemon, base_config, http

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESENCE = {"name": "presence", "table": "presence_stream",
            "columns": [{"user_id": "text"}, {"state": "text"}], "writers": ["master"]}
TABLES = {"caches": CACHES["table"], "presence": PRESENCE["table"]}
#: Tells verify's connection apart in pg_stat_activity (libpq reads it).
APP = "verify-under-test"


class VerifyBesideTheDaemonTests(SynchronousTestCase):

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        rep_port = free_port()
        self.master = Daemon(self, base_config(
            "master", free_port(), [CACHES, PRESENCE], database={"postgres": self.dsn},
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"}), "master").start()
        self.worker = Daemon(self, base_config(
            "worker2", free_port(), [CACHES, PRESENCE], database={"postgres": self.dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            consumers=[{"type": "jsonl", "path": "facts.jsonl", "flush_interval": 0.01}]),
            "worker2").start()
        self.path = os.path.join(self.worker.dir, "facts.jsonl")
        self.written = {"caches": [], "presence": []}

    # ------------------------------------------------------------ helpers
    def write(self, stream, n=1):
        for _ in range(n):
            i = len(self.written[stream])
            row = ([f"f{i}", ["k", i], 1000 * (i + 1)] if stream == "caches"
                   else [f"@u{i}:hs", "online"])
            _, body = http(f"{self.master.http_base}/_replicator/v1/streams/{stream}/facts",
                           json.dumps({"rows": [row]}).encode(), SECRET)
            self.written[stream].append(json.loads(body)["stream_id"])

    def lines(self):
        with open(self.path, "rb") as f:
            return [json.loads(line) for line in f if line.endswith(b"\n")]

    def tokens(self, stream):
        return [line["token"] for line in self.lines()
                if line["stream"] == stream and "rows" in line]

    def caught_up(self):
        def done():
            if self.worker.proc.poll() is not None:
                raise AssertionError(self.worker.output()[-3000:])
            return all(set(tokens) <= set(self.tokens(stream))
                       for stream, tokens in self.written.items())
        wait_for(done, 60, "the worker's file has every fact")

    def verify_process(self):
        env = dict(os.environ, PYTHONPATH=ROOT, PGAPPNAME=APP)
        return subprocess.Popen([sys.executable, "-m", "replicator.cli", "verify", "-c",
                                 self.worker.path, "0"], cwd=self.worker.dir, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def verify(self):
        proc = self.verify_process()
        out, err = proc.communicate(timeout=120)
        return proc.returncode, out, err

    # ------------------------------------------------------------ tests
    def test_a_fact_written_while_verify_runs_is_not_extra(self):
        """Verify reads the first stream's table, then waits on the second's
        (locked); meanwhile a fact of the first stream is committed and the
        worker appends it to the file.  That fact is no difference: it is
        newer than what verify compares (the file as it was when the
        tables' snapshot was taken)."""
        self.write("caches")
        self.write("presence")
        self.caught_up()
        first = [line["stream"] for line in self.lines()]
        early, late = sorted(TABLES, key=first.index)  # whose lines come first
        lock = psycopg2.connect(self.dsn)
        self.addCleanup(lock.close)
        with lock.cursor() as cur:
            cur.execute(f"LOCK TABLE {TABLES[late]} IN ACCESS EXCLUSIVE MODE")
        proc = self.verify_process()
        self.addCleanup(lambda: proc.poll() is None and proc.kill())

        def waiting():
            if proc.poll() is not None:
                raise AssertionError(f"verify ended first: {proc.communicate()}")
            with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
                cur.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = "
                            "%s AND wait_event_type = 'Lock'", (APP,))
                return cur.fetchone()[0] == 1
        wait_for(waiting, 60, f"verify waiting on {TABLES[late]}")
        self.write(early)
        self.caught_up()  # committed, and in the file, while verify runs
        lock.rollback()
        out, err = proc.communicate(timeout=120)
        self.assertEqual((proc.returncode, err), (0, ""), out)
        self.assertNotIn("extra", out)
        self.assertIn("verify: EQUAL: 2 facts, each exactly once, in order, whole", out)
        self.assertIn(" bytes written after verify began (not compared)", out)
        # Run again, quiet: the fact is there, compared.
        code, out, err = self.verify()
        self.assertEqual((code, err), (0, ""), out)
        self.assertIn("verify: EQUAL: 3 facts", out)

    def test_verify_beside_continuous_writes_is_always_equal(self):
        """A master writing all the while (both streams) and verify run
        again and again: every run is EQUAL."""
        self.write("caches")
        self.write("presence")
        self.caught_up()
        stop = threading.Event()
        failures = []

        def writing():
            try:
                while not stop.is_set():
                    self.write("caches")
                    self.write("presence")
            except Exception as e:  # seen by the test below
                failures.append(e)
        writer = threading.Thread(target=writing)
        writer.start()
        try:
            results = []
            for _ in range(6):
                before = len(self.written["caches"])
                results.append(self.verify())
                wait_for(lambda: len(self.written["caches"]) > before + 2 or failures, 30,
                         "more writes between two runs")
        finally:
            stop.set()
            writer.join(30)
        self.assertEqual(failures, [])
        for code, out, err in results:
            self.assertEqual((code, err), (0, ""), out)
            self.assertIn("verify: EQUAL: ", out)
        self.caught_up()
        code, out, _ = self.verify()
        total = len(self.written["caches"]) + len(self.written["presence"])
        self.assertIn(f"verify: EQUAL: {total} facts", out)

    def test_after_a_rewind_the_facts_handed_on_again_are_judged(self):
        """A wrong copy of a fact, the documented repair (stop, ``rewind
        --to`` the fact, start), and the file then says: the wrong copy, the
        rewind line, the right copy.  Read as a reader applying the rewind
        would, that is equal; what the rewind superseded is counted."""
        self.write("caches", 10)
        self.caught_up()
        self.worker.kill(signal.SIGTERM)
        wrong = self.written["caches"][5]
        with open(self.path, "rb") as f:
            lines = f.readlines()
        for i, raw in enumerate(lines):
            line = json.loads(raw)
            if line.get("token") == wrong and line["stream"] == "caches":
                # The same length: the state file's offset stays where it was.
                lines[i] = raw.replace(b'"f5"', b'"g5"')
                self.assertNotEqual(lines[i], raw)
        with open(self.path, "wb") as f:
            f.writelines(lines)
        code, out, _ = self.verify()
        self.assertEqual(code, 1, out)
        self.assertIn(f"    different rows: {wrong} (1 rows in the file, 1 in the table)\n", out)

        env = dict(os.environ, PYTHONPATH=ROOT)
        rewind = subprocess.run([sys.executable, "-m", "replicator.cli", "rewind", "-c",
                                 self.worker.path, "0", "--stream", "caches", "--to",
                                 str(wrong)], cwd=self.worker.dir, env=env,
                                capture_output=True, text=True, timeout=120)
        self.assertEqual((rewind.returncode, rewind.stderr), (0, ""), rewind.stdout)
        self.worker.start()
        wait_for(lambda: self.tokens("caches").count(self.written["caches"][-1]) == 2, 60,
                 "the worker handed the facts on again")
        tokens = self.tokens("caches")
        self.assertEqual(tokens, self.written["caches"] + self.written["caches"][5:])
        self.assertIn({"stream": "caches", "writer": "master", "rewind": wrong - 1},
                      self.lines())
        code, out, err = self.verify()
        self.assertEqual((code, err), (0, ""), out)
        self.assertIn("  caches/master: 15 facts, checked from token 0 of writer master to "
                      f"{self.written['caches'][-1]}: 10 matched; no differences; 5 handed "
                      "on again after rewinds\n", out)
        self.assertIn("verify: EQUAL: 10 facts, each exactly once, in order, whole (5 facts "
                      "handed on again after rewinds)\n", out)
        # Another wrong copy after the rewind is a difference again.
        self.worker.kill(signal.SIGTERM)
        with open(self.path, "ab") as f:
            f.write(json.dumps({"stream": "caches", "writer": "master",
                                "token": self.written["caches"][-1], "rows": []},
                               separators=(",", ":")).encode() + b"\n")
        code, out, _ = self.verify()
        self.assertEqual(code, 1, out)
        self.assertIn(f"    duplicate: {self.written['caches'][-1]}\n", out)
