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

from tests.daemon import CACHES, SECRET, Daemon, base_config, http
from tests.servers import PostgresServer, free_port, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESENCE = {"name": "presence", "table": "presence_stream",
            "columns": [{"user_id": "text"}, {"state": "text"}], "writers": ["master"]}
TABLES = {"caches": CACHES["table"], "presence": PRESENCE["table"]}
#: Tells verify's connection apart in pg_stat_activity (libpq reads it).
APP = "verify-under-test"


def verify_process(config_path):
    """The real ``replicator verify`` of consumer 0, started."""
    env = dict(os.environ, PYTHONPATH=ROOT, PGAPPNAME=APP)
    return subprocess.Popen([sys.executable, "-m", "replicator.cli", "verify", "-c",
                             config_path, "0"], cwd=os.path.dirname(config_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def verify_held(test, dsn, table, config_path, meanwhile):
    """Run verify while ``table`` is locked; once verify waits on it (it
    holds the files and has read whatever comes before), ``meanwhile()``,
    then the lock goes.  ``(exit code, stdout, stderr)``."""
    lock = psycopg2.connect(dsn)
    test.addCleanup(lock.close)
    with lock.cursor() as cur:
        cur.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    proc = verify_process(config_path)
    test.addCleanup(lambda: proc.poll() is None and proc.kill())

    def waiting():
        if proc.poll() is not None:
            raise AssertionError(f"verify ended first: {proc.communicate()}")
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = "
                        "%s AND wait_event_type = 'Lock'", (APP,))
            return cur.fetchone()[0] == 1
    wait_for(waiting, 60, f"verify waiting on {table}")
    meanwhile()
    lock.rollback()
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


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

    def verify(self):
        proc = verify_process(self.worker.path)
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
        code, out, err = verify_held(self, self.dsn, TABLES[late], self.worker.path,
                                     lambda: (self.write(early), self.caught_up()))
        self.assertEqual((code, err), (0, ""), out)
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


class VerifyOnSqliteTests(SynchronousTestCase):
    """The same reading on SQLite (its snapshot is a read transaction): a
    wrong copy, a rewind line, the right copy."""

    def test_a_rewind_supersedes_on_sqlite(self):
        import sqlite3

        import yaml

        from replicator.config import parse_instance
        from replicator.storage.schema import table_ddl
        from tests.support import temp_dir

        directory = temp_dir(self)
        config = base_config("master", free_port(), [CACHES],
                             database={"sqlite": "db.sqlite"},
                             consumers=[{"type": "jsonl", "path": "facts.jsonl"}])
        with open(os.path.join(directory, "worker1.yaml"), "w") as f:
            yaml.safe_dump(config, f)
        stream = parse_instance(config).streams[0]
        rows = {t: [[f"f{t}", ["k"], t]] for t in range(1, 6)}
        with sqlite3.connect(os.path.join(directory, "db.sqlite")) as conn:
            for statement in table_ddl(stream, False):
                conn.execute(statement)
            for t, [row] in rows.items():
                conn.execute("INSERT INTO cache_invalidation_stream VALUES (?, ?, ?, ?, ?, 0)",
                             (t, "master", row[0], json.dumps(row[1]), row[2]))

        def line(**fields):
            return json.dumps({"stream": "caches", "writer": "master", **fields},
                              separators=(",", ":")) + "\n"
        with open(os.path.join(directory, "facts.jsonl"), "w") as f:
            f.write(line(position=0))
            f.writelines(line(token=t, rows=rows[t] if t != 4 else [["wrong", None, 0]])
                         for t in range(1, 6))
            f.write(line(rewind=3))
            f.writelines(line(token=t, rows=rows[t]) for t in (4, 5))
        env = dict(os.environ, PYTHONPATH=ROOT)
        done = subprocess.run([sys.executable, "-m", "replicator.cli", "verify", "-c",
                               "worker1.yaml", "0"], cwd=directory, env=env,
                              capture_output=True, text=True, timeout=120)
        self.assertEqual((done.returncode, done.stderr), (0, ""), done.stdout)
        self.assertIn("  caches/master: 7 facts, checked from token 0 of writer master to 5: "
                      "5 matched; no differences; 2 handed on again after rewinds\n",
                      done.stdout)
        self.assertIn("verify: EQUAL: 5 facts, each exactly once, in order, whole (2 facts "
                      "handed on again after rewinds)\n", done.stdout)


class BatchBeingWrittenTests(SynchronousTestCase):
    """A last line cut short because the daemon is writing it as verify
    takes the file's size is the batch in flight, not a problem."""

    def test_a_line_completed_while_verify_runs_is_not_a_problem(self):
        import yaml

        from replicator.config import parse_instance
        from replicator.storage.schema import table_ddl
        from tests.support import temp_dir

        dsn = PostgresServer.shared().create_database()
        directory = temp_dir(self)
        config = base_config("worker1", free_port(), [CACHES], database={"postgres": dsn},
                             consumers=[{"type": "jsonl", "path": "facts.jsonl"}])
        config_path = os.path.join(directory, "worker1.yaml")
        with open(config_path, "w") as f:
            yaml.safe_dump(config, f)
        rows = {t: [[f"f{t}", ["k"], t]] for t in range(1, 4)}
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            for statement in table_ddl(parse_instance(config).streams[0], True):
                cur.execute(statement)
            for t, [row] in rows.items():
                cur.execute("INSERT INTO cache_invalidation_stream VALUES (%s, %s, %s, %s, %s)",
                            (t, "master", row[0], json.dumps(row[1]), row[2]))
        text = "".join(json.dumps({"stream": "caches", "writer": "master", **fields},
                                  separators=(",", ":")) + "\n"
                       for fields in [{"position": 0}] + [{"token": t, "rows": rows[t]}
                                                          for t in rows]).encode()
        path = os.path.join(directory, "facts.jsonl")
        cut = len(text) - 20
        with open(path, "wb") as f:
            f.write(text[:cut])

        def rest():
            with open(path, "ab") as f:
                f.write(text[cut:])
        code, out, err = verify_held(self, dsn, CACHES["table"], config_path, rest)
        self.assertEqual((code, err), (0, ""), out)
        self.assertNotIn("truncated", out)
        self.assertIn(f"  {path}: {len(text) - text.rindex(b'{')} bytes written after verify "
                      f"began (not compared)\n", out)
        self.assertIn("verify: EQUAL: 2 facts, each exactly once, in order, whole\n", out)
