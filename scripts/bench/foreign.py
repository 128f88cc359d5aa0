#!/usr/bin/env python3
"""Plain-SQL writers behind the fence (``foreign_writers: true``): what the
fence costs them, and how soon their facts reach a worker.

``foreign.insert_txn_per_s`` (baseline: the same inserts without the fence)
    ``WRITERS`` threads, each its own connection, commit one-row
    transactions (``INSERT ... VALUES (...)``, ID and writer from the
    defaults) for ``SECONDS`` s, alternating between the stream's table
    with the fence (its default and its check trigger, as the start makes
    them) and the same table with a plain ``nextval`` default and no
    trigger, ``ROUNDS`` rounds each; the sums per
    side.  PostgreSQL (fsync on) alone: no daemon runs, so nothing is
    delivered (an unfenced round beside a running reader is exactly what
    the fence is for: the reader skips rows, its audit stops the stream).
    The target: a ratio of at least 0.9.
``foreign.insert_rows_per_s`` (baseline: the same without the fence)
    The same with ``BATCH`` rows per transaction (the fence is taken once
    per transaction; each later row costs the default's check of its
    transaction-local setting).
``foreign.delivery.p99_ms`` (no baseline)
    Then two ``replicator run`` processes: a master that writes the stream
    (so it polls the fence every 50 ms) and a worker over TCP with a
    ``jsonl`` consumer.  The same writers commit fenced one-row
    transactions for ``SECONDS`` s, ``ROUNDS`` times; of each, from the
    return of its ``COMMIT`` to its line in the worker's file (a thread
    tails the file every 2 ms).  Also printed: p50, max, and the writers'
    rate meanwhile (the fence polled, the facts replicated).

Run alone: ``python scripts/bench/foreign.py`` (its own PostgreSQL) or
``make bench BENCH="--only foreign"``.
"""

import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

from bigfact import _Cleanups  # noqa: E402
from common import percentile, record  # noqa: E402

WRITERS = int(os.environ.get("FOREIGN_WRITERS", "4"))
SECONDS = float(os.environ.get("FOREIGN_SECONDS", "3"))
ROUNDS = int(os.environ.get("FOREIGN_ROUNDS", "3"))
BATCH = 100
STREAM = {"name": "orders", "table": "orders_stream", "columns": [{"item": "text"}],
          "writers": ["master"], "foreign_writers": True}



def _default(dsn, fenced):
    """The table as the start makes it (the fence's default and its check
    trigger), or a plain ``nextval`` default and no trigger."""
    import psycopg2

    from replicator.config.streams import parse_stream
    from replicator.streams.fence import check_name, default_expression

    config = parse_stream(STREAM, "streams[0]")
    default = default_expression(config) if fenced else f"nextval('{config.sequence}')"
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    conn.cursor().execute(f"ALTER TABLE {config.table} ALTER COLUMN {config.id_column} "
                          f"SET DEFAULT {default}")
    conn.cursor().execute(f"ALTER TABLE {config.table} "
                          f"{'ENABLE' if fenced else 'DISABLE'} TRIGGER {check_name(config)}")
    conn.close()


def _writers(dsn, table, rows, seconds, stamps):
    """``WRITERS`` threads committing ``rows``-row transactions into
    ``table`` for ``seconds``; transactions committed.  ``stamps``
    (a dict, or None) gets each one-row transaction's tag -> commit time."""
    import psycopg2

    stop = time.monotonic() + seconds
    counts = [0] * WRITERS

    def loop(i):
        conn = psycopg2.connect(dsn, application_name=f"bench-{i}")
        cur = conn.cursor()
        n = 0
        values = ", ".join(["(%s)"] * rows)
        while time.monotonic() < stop:
            n += 1
            tag = f"{table}-{i}-{n}-{time.monotonic_ns()}"
            cur.execute(f"INSERT INTO {table} (item) VALUES {values}", [tag] * rows)
            conn.commit()
            if stamps is not None:
                stamps[tag] = time.monotonic()
            counts[i] += 1
        conn.close()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def _writers_once(dsn, table, stamps):
    """One fenced one-row transaction (``stamps``: its tag)."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    tag = f"sentinel-{time.monotonic_ns()}"
    conn.cursor().execute(f"INSERT INTO {table} (item) VALUES (%s)", (tag,))
    conn.commit()
    conn.close()
    stamps[tag] = time.monotonic()


class _Tail:
    """Stamps each line of a ``jsonl`` file with when it was first seen."""

    def __init__(self, path):
        self.path, self.seen, self.stopping = path, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        offset, partial = 0, b""
        while not self.stopping.is_set():
            if os.path.exists(self.path):
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
                offset += len(data)
                now = time.monotonic()
                partial += data
                *lines, partial = partial.split(b"\n")
                for line in lines:
                    if line.strip():
                        entry = json.loads(line)
                        for row in entry.get("rows", []):
                            self.seen.setdefault(row[0], now)
            self.stopping.wait(0.002)

    def stop(self):
        self.stopping.set()
        self._thread.join(10)


def run(dsn: str) -> None:
    """The phase (blocking: processes and threads)."""
    import psycopg2

    from tests.servers import free_port, wait_for
    from tests.test_cli import Daemon, base_config, http

    cleanups = _Cleanups()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    try:
        from replicator.config.streams import parse_stream
        from replicator.storage import schema
        from replicator.streams import fence

        config = parse_stream(STREAM, "streams[0]")
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        cur = conn.cursor()
        for statement in schema.table_ddl(config, True):
            cur.execute(statement)
        fence.install(cur, config, "streams[0]")
        conn.close()
        table = config.table
        totals = {(fenced, rows): 0 for fenced in (True, False) for rows in (1, BATCH)}
        for rows in (1, BATCH):
            for _ in range(ROUNDS):
                for fenced in (True, False):
                    _default(dsn, fenced)
                    totals[(fenced, rows)] += _writers(dsn, table, rows, SECONDS, None)
        _default(dsn, True)
        load = os.getloadavg()
        spent = ROUNDS * SECONDS
        print(f"foreign: {WRITERS} writers, {ROUNDS} rounds of {SECONDS:g} s per side; "
              f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
        record("foreign.insert_txn_per_s", totals[(True, 1)] / spent, "txn/s",
               "without the fence", totals[(False, 1)] / spent)
        record("foreign.insert_rows_per_s", totals[(True, BATCH)] * BATCH / spent,
               "rows/s", "without the fence", totals[(False, BATCH)] * BATCH / spent)

        rep_port = free_port()
        Daemon(cleanups, base_config(
            "master", free_port(), [STREAM], database={"postgres": dsn}, log_level="warn",
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"}), "master",
            env=env).start()
        worker = Daemon(cleanups, base_config(
            "worker1", free_port(), [STREAM], database={"postgres": dsn}, log_level="warn",
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            consumers=[{"type": "jsonl", "path": "facts.jsonl"}]), "worker1",
            env=env).start()
        wait_for(lambda: http(worker.http_base + "/health")[0] == 200, 60, "worker linked")
        tail = _Tail(os.path.join(worker.dir, "facts.jsonl"))
        cleanups.addCleanup(tail.stop)
        sentinel = {}
        _writers_once(dsn, table, sentinel)  # the rounds' backlog caught up first
        wait_for(lambda: all(tag in tail.seen for tag in sentinel), 900, "the worker caught up")
        stamps = {}
        live = 0
        for _ in range(ROUNDS):
            live += _writers(dsn, table, 1, SECONDS, stamps)
        wait_for(lambda: all(tag in tail.seen for tag in stamps), 900,
                 "every fenced fact at the worker")
        delays = sorted((tail.seen[tag] - at) * 1000.0 for tag, at in stamps.items())
        load = os.getloadavg()
        print(f"  delivery of {len(delays)} fenced facts ({live / spent:,.0f} txn/s), COMMIT "
              f"to the worker's file: p50 {percentile(delays, 50):.1f} ms, p99 "
              f"{percentile(delays, 99):.1f} ms, max {delays[-1]:.1f} ms; load average "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
        record("foreign.delivery.p99_ms", percentile(delays, 99), "ms", None, None,
               higher_is_better=False)
    finally:
        cleanups.run()


if __name__ == "__main__":
    from tests.servers import PostgresServer

    server = PostgresServer(fsync=True)
    try:
        run(server.create_database("foreignbench"))
    finally:
        server.stop()
