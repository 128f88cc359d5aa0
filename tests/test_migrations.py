"""Schema versions and migrations (:mod:`replicator.storage.migrations`).

Over real processes, on the databases release 0.2.0 made (the committed
fixtures of ``scripts/release_fixture.py``): a start migrates, one line per
step, facts and positions kept, writes continuing from the right ID;
``replicator migrate`` (and ``--dry-run``); a schema newer than this
replicator, or an older one with ``auto_migrate: false``, is one line and
exit 2 from ``run``, ``check`` and ``migrate``; two ``migrate`` at once on
PostgreSQL migrate once.  In process: a failing step rolls back whole, the
steps before it stay.
"""

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import tempfile

import psycopg2
import yaml
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator import __version__
from replicator.config import ConfigError, parse_database
from replicator.config.streams import parse_stream
from replicator.storage import migrations
from replicator.storage.database import Database
from tests.daemon import CACHES, PY, Daemon, base_config, cli
from tests.release_020 import FIXTURES, RELEASE_FACTS, postgres_copy, release
from tests.servers import PostgresServer, free_port, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


STEP_2_LINE = "schema: migrating 1 -> 2: record the schema version in replicator_schema"
#: What migrating a 0.2.0 database logs: one line per step.
STEP_LINES = [STEP_2_LINE, "schema: migrating 2 -> 3: create stream_retention "
                           "(the trim boundaries of retention)",
              "schema: migrating 3 -> 4: create stream_idempotency "
              "(the Idempotency-Keys of writes)"]
STEP_LINE = "\n".join(STEP_LINES)


def fingerprint():
    with open(os.path.join(FIXTURES, "fingerprint.json")) as f:
        return json.load(f)


def sqlite_copy() -> str:
    """A directory holding a copy of the release's SQLite file as state.db."""
    directory = tempfile.mkdtemp(prefix="replicator-migrate-")
    shutil.copyfile(os.path.join(FIXTURES, "sqlite.db"), os.path.join(directory, "state.db"))
    return directory


def write_config(directory: str, config: dict) -> str:
    path = os.path.join(directory, "c.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def sqlite_config(**extra) -> dict:
    return base_config("master", free_port(), [CACHES], database={"sqlite": "state.db"}, **extra)


def schema_row_sqlite(path: str):
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT version, replicator_version, instance_name "
                            "FROM replicator_schema").fetchall()
    finally:
        conn.close()


def sqlite_facts(path: str):
    conn = sqlite3.connect(path)
    try:
        facts = []
        for stream_id, *row in conn.execute(
                "SELECT stream_id, cache_func, keys, invalidation_ts "
                "FROM cache_invalidation_stream ORDER BY stream_id, rowid"):
            row[1] = json.loads(row[1]) if row[1] is not None else None
            if facts and facts[-1][0] == stream_id:
                facts[-1][1].append(row)
            else:
                facts.append((stream_id, [row]))
        positions = conn.execute("SELECT * FROM stream_positions").fetchall()
        return facts, positions
    finally:
        conn.close()


class ReleaseFixtureTests(SynchronousTestCase):
    """The fixtures are what release 0.2.0 makes: compared with a fresh run
    of the release when its tag is here, with the recorded fingerprint
    always (a clone without tags still checks that)."""

    def test_fixtures_match_their_fingerprint_and_the_release(self):
        recorded = fingerprint()
        self.assertEqual(recorded["release"], "v0.2.0")
        self.assertEqual(release.sqlite_fingerprint(os.path.join(FIXTURES, "sqlite.db")),
                         recorded["sqlite"])
        self.assertEqual(release.postgres_fingerprint(postgres_copy()), recorded["postgres"])
        # Neither has a version table: that is how version 1 is recognised.
        for engine in ("sqlite", "postgres"):
            self.assertEqual(sorted(recorded[engine]["tables"]),
                             ["cache_invalidation_stream", "stream_positions"])
        try:
            tag = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", "-q",
                                  "v0.2.0^{commit}"], capture_output=True, text=True)
        except FileNotFoundError:  # no git at all
            return
        if tag.returncode != 0:
            return  # a clone without tags, or no clone: the fingerprint above is the check
        self.assertEqual(tag.stdout.strip(), recorded["commit"])
        out = tempfile.mkdtemp(prefix="replicator-release-")
        self.addCleanup(shutil.rmtree, out, True)
        made = release.make(out, PostgresServer.shared())
        self.assertEqual(made, recorded)
        self.assertEqual(release.sqlite_fingerprint(os.path.join(out, "sqlite.db")),
                         recorded["sqlite"])


class UpgradeTests(SynchronousTestCase):
    """The current daemon started on the release's databases."""

    def tail(self, port: int) -> subprocess.Popen:
        tail = subprocess.Popen(
            [PY, "-m", "replicator.cli", "tail", f"tcp:host=127.0.0.1:port={port}",
             "--name", "tailer"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.addCleanup(lambda: tail.poll() is None and tail.kill())
        return tail

    @staticmethod
    def next_command(tail) -> str:
        line = tail.stdout.readline().strip()
        while line.startswith(("PING ", "SERVER ")):
            line = tail.stdout.readline().strip()
        return line

    def schema_lines(self, daemon) -> list:
        return [line.split(": ", 1)[1] for line in daemon.output().splitlines()
                if " schema: " in line]

    def test_sqlite(self):
        rep_port = free_port()
        config = sqlite_config(replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        daemon = Daemon(self, config, "sqlite")
        shutil.copyfile(os.path.join(FIXTURES, "sqlite.db"), os.path.join(daemon.dir, "state.db"))
        daemon.start()
        self.assertEqual(self.schema_lines(daemon), STEP_LINES)
        # Positions kept: the writer is where the release left it.
        tail = self.tail(rep_port)
        self.assertEqual(self.next_command(tail), "POSITION caches master 4 4")
        # Writes continue from the next ID.
        written = cli("write", "-c", daemon.path, "caches", '["get_user", null, 1005]',
                      cwd=daemon.dir)
        self.assertEqual((written.returncode, written.stdout), (0, "5\n"), written.stderr)
        self.assertEqual(self.next_command(tail), 'RDATA caches master 5 ["get_user",null,1005]')
        daemon.proc.send_signal(signal.SIGTERM)
        self.assertEqual(daemon.proc.wait(30), 0, daemon.output()[-2000:])
        # Started again: nothing to migrate.
        daemon.start()
        self.assertEqual(self.schema_lines(daemon), STEP_LINES)
        daemon.proc.send_signal(signal.SIGTERM)
        self.assertEqual(daemon.proc.wait(30), 0)
        path = os.path.join(daemon.dir, "state.db")
        facts, positions = sqlite_facts(path)
        self.assertEqual(facts, RELEASE_FACTS + [(5, [["get_user", None, 1005]])])
        self.assertEqual(positions, [("caches", "master", 5)])
        self.assertEqual(schema_row_sqlite(path), [(4, __version__, "master")])

    def test_postgres(self):
        dsn = postgres_copy()
        rep_port = free_port()
        caches = dict(CACHES)
        master = base_config("master", free_port(), [caches], database={"postgres": dsn},
                             replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        worker = base_config("worker1", free_port(), [caches], database={"postgres": dsn},
                             replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
                             consumers=[{"type": "jsonl", "path": "facts.jsonl"}])
        master = Daemon(self, master, "master").start()
        self.assertEqual(self.schema_lines(master), STEP_LINES)
        # A reader whose file says it has nothing of the master's yet reads
        # the release's facts back from the migrated table.
        worker = Daemon(self, worker, "worker1")
        with open(os.path.join(worker.dir, "facts.jsonl"), "w") as f:
            f.write('{"stream":"caches","writer":"master","position":0}\n')
        worker.start()
        self.assertEqual(self.schema_lines(worker), [])  # it writes nothing: migrates nothing
        written = cli("write", "-c", master.path, "caches", '["get_user", null, 1005]',
                      cwd=master.dir)
        self.assertEqual((written.returncode, written.stdout), (0, "5\n"), written.stderr)
        jsonl = os.path.join(worker.dir, "facts.jsonl")

        def facts():
            with open(jsonl) as f:
                entries = [json.loads(line) for line in f]
            return [(e["token"], e["rows"]) for e in entries if e.get("rows")]

        expected = RELEASE_FACTS + [(5, [["get_user", None, 1005]])]
        try:
            wait_for(lambda: facts() == expected, timeout=60, what="the worker's facts")
        except AssertionError:
            self.fail(f"{facts()} != {expected}; worker: {worker.output()[-1500:]}")
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT version, replicator_version, instance_name "
                        "FROM replicator_schema")
            self.assertEqual(cur.fetchall(), [(4, __version__, "master")])
        conn.close()


class MigrateCommandTests(SynchronousTestCase):
    def migrate(self, path, *extra):
        return cli("migrate", "-c", path, *extra, cwd=os.path.dirname(path))

    def test_sqlite_dry_run_then_migrate(self):
        directory = sqlite_copy()
        path = write_config(directory, sqlite_config())
        db = os.path.join(directory, "state.db")
        before = release.sqlite_fingerprint(db)
        dry = self.migrate(path, "--dry-run")
        self.assertEqual((dry.returncode, dry.stderr), (0, ""))
        self.assertEqual(dry.stdout,
                         STEP_LINE.replace("migrating", "would migrate") + "\n")
        self.assertEqual(release.sqlite_fingerprint(db), before)
        checked = cli("check", "-c", path, cwd=directory)
        self.assertEqual(checked.returncode, 0, checked.stderr)
        self.assertTrue(checked.stdout.rstrip().endswith(
            "; schema version 1, start migrates it to 4"), checked.stdout)
        done = self.migrate(path)
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        self.assertEqual(done.stdout, f"{STEP_LINE}\nschema: at version 4\n")
        again = self.migrate(path)
        self.assertEqual((again.returncode, again.stdout), (0, "schema: already at version 4\n"))
        checked = cli("check", "-c", path, cwd=directory)
        self.assertTrue(checked.stdout.rstrip().endswith("; schema version 4 (current)"),
                        checked.stdout)
        self.assertEqual(sqlite_facts(db), (RELEASE_FACTS, [("caches", "master", 4)]))
        conn = sqlite3.connect(db)
        try:  # step 4's table, with its primary key and index
            self.assertEqual([r[1] for r in conn.execute(
                "PRAGMA table_info(stream_idempotency)")],
                ["table_name", "idem_key", "fingerprint", "stream_id", "created_ms"])
            self.assertEqual(sorted(r[1] for r in conn.execute(
                "PRAGMA index_list(stream_idempotency)")),
                ["sqlite_autoindex_stream_idempotency_1", "stream_idempotency_created"])
        finally:
            conn.close()

    def test_new_database(self):
        directory = tempfile.mkdtemp(prefix="replicator-migrate-")
        path = write_config(directory, sqlite_config())
        dry = self.migrate(path, "--dry-run")
        self.assertEqual(dry.stdout, "schema: would create version 4 (new database)\n")
        self.assertFalse(os.path.exists(os.path.join(directory, "state.db")))
        done = self.migrate(path)
        self.assertEqual((done.returncode, done.stdout),
                         (0, "schema: creating version 4 (new database)\nschema: at version 4\n"),
                         done.stderr)
        self.assertEqual(schema_row_sqlite(os.path.join(directory, "state.db")),
                         [(4, __version__, "master")])

    def test_postgres_two_at_once_migrate_once(self):
        dsn = postgres_copy()
        directory = tempfile.mkdtemp(prefix="replicator-migrate-")
        path = write_config(directory, base_config("master", free_port(), [CACHES],
                                                   database={"postgres": dsn}))
        # Hold the migration lock so that both wait for it, then let go.
        holder = psycopg2.connect(dsn)
        self.addCleanup(holder.close)
        holder.autocommit = True
        holder.cursor().execute("SELECT pg_advisory_lock(%s)", (migrations.LOCK_KEY,))
        procs = [subprocess.Popen([PY, "-m", "replicator.cli", "migrate", "-c", path],
                                  cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        for proc in procs:
            self.addCleanup(lambda p=proc: p.poll() is None and p.kill())

        def both_waiting():
            cur = holder.cursor()
            cur.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                        "AND NOT granted")
            for proc in procs:
                if proc.poll() is not None:
                    raise AssertionError(f"migrate exited early: {proc.communicate()}")
            return cur.fetchone()[0] == 2

        wait_for(both_waiting, timeout=60, what="both migrate processes waiting for the lock")
        holder.cursor().execute("SELECT pg_advisory_unlock(%s)", (migrations.LOCK_KEY,))
        outputs = [proc.communicate(timeout=60) for proc in procs]
        self.assertEqual([proc.returncode for proc in procs], [0, 0], outputs)
        # Each step ran once, in one process or the other (each step takes
        # the lock on its own), and both end at the current version.
        said = [out.splitlines() for out, _ in outputs]
        self.assertEqual(sorted(line for lines in said for line in lines[:-1]),
                         sorted(STEP_LINES), outputs)
        self.assertEqual(sorted(lines[-1] for lines in said),
                         ["schema: at version 4", "schema: at version 4"]
                         if all(len(lines) > 1 for lines in said) else
                         ["schema: at version 4", "schema: at version 4 (migrated meanwhile "
                          "by another process)"], outputs)


class RefusalTests(SynchronousTestCase):
    """What a start refuses is one line and exit 2, from run, check and
    migrate alike, the database unchanged."""

    def assert_one_line(self, result, line: str):
        self.assertEqual(result.returncode, 2, result.stdout + result.stderr)
        self.assertEqual(result.stdout + result.stderr, line + "\n")

    def test_newer_schema(self):
        directory = sqlite_copy()
        db = os.path.join(directory, "state.db")
        conn = sqlite3.connect(db)
        conn.execute(migrations.SCHEMA_DDL)
        conn.execute("INSERT INTO replicator_schema (version, migrated_at, replicator_version, "
                     "instance_name) VALUES (99, '2030-01-01T00:00:00+00:00', '9.0', 'master')")
        conn.commit()
        conn.close()
        path = write_config(directory, sqlite_config())
        line = (f"replicator: database.sqlite: database schema version 99 is newer than this "
                f"replicator ({__version__}) supports ({migrations.CURRENT_VERSION}); "
                "upgrade replicator")
        for command in ("run", "check", "migrate"):
            self.assert_one_line(cli(command, "-c", path, cwd=directory), line)
        self.assertEqual(sqlite_facts(db), (RELEASE_FACTS, [("caches", "master", 4)]))

    def test_older_schema_without_auto_migrate(self):
        directory = sqlite_copy()
        config = sqlite_config()
        config["database"]["auto_migrate"] = False
        path = write_config(directory, config)
        db = os.path.join(directory, "state.db")
        before = release.sqlite_fingerprint(db)
        line = ("replicator: database.sqlite: database schema version 1 is older than this "
                f"replicator's ({migrations.CURRENT_VERSION}) and auto_migrate is false: back the "
                "database up and run "
                "'replicator migrate -c' with this file")
        for command in ("run", "check"):
            self.assert_one_line(cli(command, "-c", path, cwd=directory), line)
        self.assertEqual(release.sqlite_fingerprint(db), before)
        done = cli("migrate", "-c", path, cwd=directory)
        self.assertEqual(done.returncode, 0, done.stderr)

    def test_stream_table_named_like_the_schema_table(self):
        with self.assertRaises(ConfigError) as caught:
            parse_stream(dict(CACHES, table="replicator_schema"), "streams[0]")
        self.assertEqual(str(caught.exception),
                         "config: streams[0].table: 'replicator_schema' is the replicator's "
                         "own table")


class Clock:
    def seconds(self) -> float:
        return 1.7e9


def _fail(txn, postgres: bool) -> None:
    txn.execute("CREATE TABLE half_done (x INTEGER)")
    txn.execute("INSERT INTO half_done VALUES (1)")
    raise RuntimeError("boom after half the work")


class RollbackTests(TestCase):
    """A failing step leaves the database exactly as before it; the steps
    before it stay done (each is its own transaction)."""

    STEPS = migrations.STEPS[:2] + (migrations.Step(3, "half, then fail", _fail),)

    def tables(self, db: Database):
        if db.is_postgres:
            text = ("SELECT table_name FROM information_schema.tables "
                    "WHERE table_schema = current_schema() ORDER BY 1")
        else:
            text = "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY 1"
        return db.runQuery(text).addCallback(lambda rows: [r[0] for r in rows])

    async def check_rollback(self, db: Database) -> None:
        self.addCleanup(db.close)
        await db.runOperation("CREATE TABLE stream_positions (stream_name TEXT NOT NULL, "
                              "instance_name TEXT NOT NULL, stream_id BIGINT NOT NULL, "
                              "PRIMARY KEY (stream_name, instance_name))")
        await db.runOperation("INSERT INTO stream_positions VALUES ('caches', 'master', 7)")
        lines = []
        with self.assertRaises(migrations.StepFailed) as caught:
            await migrations.migrate(db, lines.append, Clock(), "master", self.STEPS)
        self.assertEqual(str(caught.exception), "schema: migrating 2 -> 3 failed and was "
                         "rolled back: boom after half the work")
        self.assertEqual(lines, [STEP_2_LINE, "schema: migrating 2 -> 3: half, then fail"])
        self.assertEqual(await self.tables(db), ["replicator_schema", "stream_positions"])
        self.assertEqual(await migrations.current_version(db), 2)
        self.assertEqual(await db.runQuery("SELECT * FROM stream_positions"),
                         [("caches", "master", 7)])
        # Again: the same step fails the same way, and nothing of it stays.
        lines.clear()
        with self.assertRaises(migrations.StepFailed):
            await migrations.migrate(db, lines.append, Clock(), "master", self.STEPS)
        self.assertEqual(await migrations.current_version(db), 2)
        self.assertEqual(await self.tables(db), ["replicator_schema", "stream_positions"])

    async def test_sqlite(self):
        path = os.path.join(tempfile.mkdtemp(prefix="replicator-rollback-"), "state.db")
        await self.check_rollback(Database(parse_database({"sqlite": path})))

    async def test_postgres(self):
        dsn = PostgresServer.shared().create_database("rollback")
        await self.check_rollback(Database(parse_database({"postgres": dsn, "pool_max": 2})))
