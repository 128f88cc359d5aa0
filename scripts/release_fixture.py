#!/usr/bin/env python3
"""Make the databases of the last release, for the migration tests.

The release is exported from its tag (``git archive``), its own daemon
(``python -m replicator.cli run``) is started on a fresh SQLite file and on
a fresh PostgreSQL database, a few facts are written through its HTTP API,
and it is stopped cleanly (its positions persisted).  Saved in
``tests/fixtures/release-<version>/``:

* ``sqlite.db``: the SQLite file (its write-ahead log checkpointed in);
* ``postgres.sql``: a plain-SQL ``pg_dump`` of the PostgreSQL database;
* ``fingerprint.json``: what both hold (tables, columns, indexes, sequence,
  rows), so that a clone without the tag can still tell the fixtures are
  what the release made.

The tests compare these fixtures with a fresh run of the release when the
tag is present, and with ``fingerprint.json`` always.  Run from the
repository root: ``python scripts/release_fixture.py`` (needs the tag and
PostgreSQL's server binaries, as the tests do).
"""

import io
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.servers import PostgresServer, free_port, wait_for  # noqa: E402

RELEASE = "v0.2.0"
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "release-0.2.0")
SECRET = "release-fixture-secret-0123456789"

#: The one stream the fixture databases hold (as the README's example).
STREAM = {
    "name": "caches", "table": "cache_invalidation_stream",
    "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}],
    "writers": ["master"],
}

#: The facts written, in order: stream IDs 1 to 4 (a two-row fact, and a
#: fact with no rows, which takes an ID but leaves no row).
FACTS: list[list[list]] = [
    [["get_user", ["@alice:hs.test"], 1000]],
    [["get_user", ["@bob:hs.test"], 1001], ["get_rooms", None, 1001]],
    [],
    [["get_room", ["!room:hs.test"], 1003]],
]


def export_release(tag: str, dest: str) -> None:
    """The tree of ``tag`` in ``dest`` (``git archive``)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", tag],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest)


def run_release(source: str, database: dict[str, str], workdir: str) -> None:
    """Start the release in ``source`` on ``database``, write :data:`FACTS`,
    stop it with SIGTERM; raises if any of it fails."""
    import yaml

    port = free_port()
    config = {"server_name": "hs.test", "instance_name": "master", "log_level": "info",
              "database": database, "streams": [STREAM],
              "http": {"listen": f"tcp:{port}:interface=127.0.0.1", "secret": SECRET}}
    path = os.path.join(workdir, "master.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    env = dict(os.environ, PYTHONPATH=source)
    log_path = os.path.join(workdir, "out.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "replicator.cli", "run", "-c", path],
                                cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/_replicator/v1"

    def output() -> str:
        with open(log_path, "rb") as f:
            return f.read().decode(errors="replace")[-2000:]

    def request(url: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
        req.add_header("Authorization", f"Bearer {SECRET}")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=10) as response:
            return json.loads(response.read() or b"{}")

    def answering() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the release daemon exited: {output()}")
        request(base + "/positions")
        return True

    try:
        wait_for(answering, timeout=90.0, what="the release daemon answering")
        for i, rows in enumerate(FACTS, 1):
            answer = request(f"{base}/streams/{STREAM['name']}/facts", {"rows": rows})
            if answer.get("stream_id") != i:
                raise AssertionError(f"fact {i} got stream ID {answer}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    if code != 0:
        raise AssertionError(f"the release daemon exited with {code}: {output()}")


# ------------------------------------------------------------ fingerprints
def _rows(rows) -> list[list]:
    return sorted(([v for v in row] for row in rows), key=json.dumps)


def sqlite_fingerprint(path: str) -> dict[str, Any]:
    """Tables (columns), indexes and rows of the SQLite file at ``path``."""
    # immutable: read as it is, without the -wal and -shm files a
    # read-only open of a WAL database leaves beside it.
    conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    try:
        objects = conn.execute("SELECT type, name, tbl_name FROM sqlite_master "
                               "WHERE name NOT LIKE 'sqlite_%' ORDER BY name").fetchall()
        tables, indexes, rows = {}, {}, {}
        for kind, name, table in objects:
            if kind == "table":
                tables[name] = [[c[1], c[2], c[3], c[5]] for c in
                                conn.execute(f"PRAGMA table_info({name})")]
                rows[name] = _rows(conn.execute(f"SELECT * FROM {name}"))
            elif kind == "index":
                indexes[name] = [table] + [c[2] for c in
                                           conn.execute(f"PRAGMA index_info({name})")]
        return {"tables": tables, "indexes": indexes, "rows": rows}
    finally:
        conn.close()


def postgres_fingerprint(dsn: str) -> dict[str, Any]:
    """Tables (columns), indexes, sequences and rows of the database."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    try:
        cur = conn.cursor()
        cur.execute("SELECT table_name, column_name, data_type, is_nullable "
                    "FROM information_schema.columns WHERE table_schema = 'public' "
                    "ORDER BY table_name, ordinal_position")
        tables: dict[str, list] = {}
        for table, column, kind, nullable in cur.fetchall():
            tables.setdefault(table, []).append([column, kind, nullable])
        cur.execute("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' "
                    "ORDER BY indexname")
        indexes = dict(cur.fetchall())
        cur.execute("SELECT sequencename, last_value FROM pg_sequences "
                    "WHERE schemaname = 'public' ORDER BY sequencename")
        sequences = dict(cur.fetchall())
        rows = {}
        for table in tables:
            cur.execute(f"SELECT * FROM {table}")
            rows[table] = _rows(cur.fetchall())
        return {"tables": tables, "indexes": indexes, "sequences": sequences, "rows": rows}
    finally:
        conn.close()


# ------------------------------------------------------------------ make
def restore_postgres(server: PostgresServer, dump: str) -> str:
    """A fresh database on ``server`` holding the plain-SQL ``dump``; its DSN."""
    dsn = server.create_database("release")
    subprocess.run([os.path.join(server.bindir, "psql"), "-q", "-X", "-v", "ON_ERROR_STOP=1",
                    "-d", dsn, "-f", dump], check=True, capture_output=True)
    return dsn


def make(out: str, server: PostgresServer, tag: str = RELEASE) -> dict[str, Any]:
    """The release's databases in ``out`` (see the module docstring); returns
    the fingerprint also written to ``out/fingerprint.json``."""
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="replicator-release-")
    try:
        source = os.path.join(work, "source")
        export_release(tag, source)
        # SQLite: the file, its write-ahead log checkpointed in.
        sqlite_dir = os.path.join(work, "sqlite")
        os.makedirs(sqlite_dir)
        run_release(source, {"sqlite": "state.db"}, sqlite_dir)
        db_path = os.path.join(sqlite_dir, "state.db")
        conn = sqlite3.connect(db_path)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        shutil.copyfile(db_path, os.path.join(out, "sqlite.db"))
        # PostgreSQL: a plain-SQL dump.
        pg_dir = os.path.join(work, "postgres")
        os.makedirs(pg_dir)
        dsn = server.create_database("release")
        run_release(source, {"postgres": dsn}, pg_dir)
        dump = subprocess.run([os.path.join(server.bindir, "pg_dump"), "--no-owner",
                               "--no-privileges", "-d", dsn],
                              check=True, capture_output=True, text=True).stdout
        # pg_dump's \restrict guard (PostgreSQL 13.22/14.19/15.14/16.10/17.6
        # and later) is unknown to older psql; this dump is our own.
        dump = "".join(line for line in dump.splitlines(keepends=True)
                       if not line.startswith(("\\restrict", "\\unrestrict")))
        with open(os.path.join(out, "postgres.sql"), "w") as f:
            f.write(dump)
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", f"{tag}^{{commit}}"],
                                check=True, capture_output=True, text=True).stdout.strip()
        fingerprint = {"release": tag, "commit": commit,
                       "sqlite": sqlite_fingerprint(os.path.join(out, "sqlite.db")),
                       "postgres": postgres_fingerprint(dsn)}
        with open(os.path.join(out, "fingerprint.json"), "w") as f:
            json.dump(fingerprint, f, indent=1, sort_keys=True)
            f.write("\n")
        return fingerprint
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    started = time.monotonic()
    server = PostgresServer()
    try:
        make(FIXTURES, server)
    finally:
        server.stop()
    print(f"release fixtures of {RELEASE} in {os.path.relpath(FIXTURES, ROOT)} "
          f"({time.monotonic() - started:.1f}s)")


if __name__ == "__main__":
    main()
