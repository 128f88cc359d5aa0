#!/usr/bin/env python3
"""Catch-up benchmark: a reader 1,000,000 facts behind, against raw SQL.

One PostgreSQL (fsync on) holds a stream of ``--facts`` facts of the writer
``master`` (every tenth fact has three rows, the others one), generated
inside PostgreSQL.  A master instance runs in this process and announces
its position; each round then

* starts a reader instance in its own process (``catchup_reader.py``: the
  real ``Instance``, JSON-lines consumer with fsync, HTTP API) whose
  consumer file says it is at 0, so the master's POSITION makes it fetch
  every fact from the table (pages of ``replication.fetch_limit``); it
  reports the catch-up time, its worst reactor stall (a ``LoopingCall``'s
  lateness), its peak RSS and the CPU time of each of its threads (reactor,
  database pool, the consumer's file thread), while this process times ``GET /health``
  round trips to it from a thread;
* checks the consumer file: every fact once, in order, whole;
* runs the baseline: a raw psycopg2 keyset-paginated ``SELECT`` of the same
  rows, pages of 1,000, ``fetchall`` each (its wall and CPU time printed);
* and the floor for reading rows out of PostgreSQL in Python: the ADBC
  PostgreSQL driver (``adbc-driver-postgresql``) reading the same rows in
  one ``SELECT ... ORDER BY``, which it runs as a binary ``COPY`` into
  Arrow record batches (counted, not turned into Python objects).

Rounds alternate reader / raw; medians are recorded:
``catchup.facts_per_s`` (baseline: raw SELECT, same facts),
``catchup.facts_per_s.vs_adbc`` (baseline: the ADBC pass), and, with no
baseline, ``catchup.stall_max_ms`` (and ``_p99_ms`` of the 5 ms ticks),
``catchup.health_rtt_max_ms``,
``catchup.rss_peak_mb``.  ``python scripts/bench/catchup.py --profile``
prints a cProfile of the reader process's catch-up.
"""

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from common import rate, record  # noqa: E402
from twisted.internet import threads  # noqa: E402

FACTS = 1_000_000
ROUNDS = 3
PAGE = 1000
STREAM = {"name": "catchup", "table": "catchup_stream", "writers": ["master"],
          "columns": [{"body": "text"}, {"n": "bigint"}]}
SECRET = "catchup-bench-secret"
#: The reader's ``replication.fetch_limit`` (None: the default, 1,000 rows).
FETCH_LIMIT = int(os.environ.get("CATCHUP_FETCH_LIMIT", "0")) or None


def rows_of(token: int) -> int:
    return 3 if token % 10 == 0 else 1


def generate(dsn: str, facts: int) -> int:
    """Fill the (empty) stream table; returns its row count."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute(
        "INSERT INTO catchup_stream (stream_id, instance_name, body, n) "
        "SELECT g, 'master', 'fact ' || g || ' row ' || k || ' ' || md5(g::text), g * 10 + k "
        "FROM generate_series(1, %s) g, "
        "LATERAL generate_series(1, CASE WHEN g %% 10 = 0 THEN 3 ELSE 1 END) k "
        "ORDER BY g, k", (facts,))
    cur.execute("SELECT setval('catchup_stream_seq', %s)", (facts,))
    cur.execute("VACUUM ANALYZE catchup_stream")
    cur.execute("SELECT count(*) FROM catchup_stream")
    rows = cur.fetchone()[0]
    conn.close()
    return rows


def raw_pass(dsn: str, facts: int) -> "tuple[float, float]":
    """Keyset pagination over (id, ctid), pages of ``PAGE`` rows: seconds,
    and the CPU seconds of the thread that ran it."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    cur = conn.cursor()
    start = time.monotonic()
    cpu = time.thread_time()
    last = (0, "(0,0)")
    seen = 0
    while True:
        cur.execute(
            "SELECT stream_id, body, n, ctid FROM catchup_stream "
            "WHERE instance_name = %s AND (stream_id, ctid) > (%s, %s::tid) "
            "AND stream_id <= %s ORDER BY stream_id, ctid LIMIT %s",
            ("master", last[0], last[1], facts, PAGE))
        page = cur.fetchall()
        conn.commit()
        if not page:
            break
        seen += len(page)
        last = (page[-1][0], page[-1][3])
    took = time.monotonic() - start
    cpu = time.thread_time() - cpu
    conn.close()
    return took, cpu


def adbc_pass(dsn: str, facts: int) -> "tuple[float, float]":
    """The same rows through the ADBC PostgreSQL driver: one statement
    (binary COPY), Arrow record batches streamed and counted; seconds, and
    the CPU seconds of this process (the driver reads in threads of its own)."""
    import adbc_driver_postgresql.dbapi as adbc

    conn = adbc.connect(dsn)
    try:
        cur = conn.cursor()
        start = time.monotonic()
        cpu = time.process_time()
        cur.execute("SELECT stream_id, body, n FROM catchup_stream "
                    f"WHERE instance_name = 'master' AND stream_id <= {int(facts)} "
                    "ORDER BY stream_id, ctid")
        rows = sum(batch.num_rows for batch in cur.fetch_record_batch())
        took = time.monotonic() - start
        cpu = time.process_time() - cpu
        cur.close()
    finally:
        conn.close()
    expect = facts + 2 * (facts // 10)
    if rows != expect:
        raise AssertionError(f"ADBC read {rows} rows of {expect}")
    return took, cpu


def check_file(path: str, facts: int) -> None:
    """Every fact once, in token order, with all its rows."""
    expect = 1
    with open(path, "rb") as f:
        for line in f:
            doc = json.loads(line)
            if "token" not in doc:
                continue
            token = doc["token"]
            if token != expect:
                raise AssertionError(f"fact {token} where {expect} was expected")
            if len(doc["rows"]) != rows_of(token):
                raise AssertionError(f"fact {token} has {len(doc['rows'])} rows")
            expect += 1
    if expect != facts + 1:
        raise AssertionError(f"{expect - 1} facts of {facts}")


class HealthPoller(threading.Thread):
    """``GET /health`` in a loop (a new connection each, ``interval`` s
    apart); the worst round trip once stopped, and each one's seconds in
    ``samples`` (:meth:`take` empties it)."""

    def __init__(self, port: int, interval: float = 0.02):
        super().__init__(daemon=True)
        self.port = port
        self.interval = interval
        self.worst = 0.0
        self.count = 0
        self.samples = []
        self.stopping = threading.Event()

    def take(self) -> list:
        """The round trips since the last call, in seconds."""
        taken, self.samples = self.samples, []
        return taken

    def run(self):
        while not self.stopping.is_set():
            start = time.monotonic()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                conn.request("GET", "/health")
                conn.getresponse().read()
                conn.close()
            except OSError:
                time.sleep(0.05)  # not listening yet
                continue
            took = time.monotonic() - start
            self.worst = max(self.worst, took)
            self.count += 1
            self.samples.append(took)
            time.sleep(self.interval)


def reader_config(dsn: str, upstream_port: int, http_port: int, path: str,
                  audit: bool = True) -> dict:
    return {
        "server_name": "bench.test", "instance_name": "reader",
        "database": {"postgres": dsn},
        "replication": {"upstream": f"tcp:host=127.0.0.1:port={upstream_port}",
                        "audit": audit,
                        **({"fetch_limit": FETCH_LIMIT} if FETCH_LIMIT else {})},
        "http": {"listen": f"tcp:{http_port}:interface=127.0.0.1", "secret": SECRET},
        "streams": [STREAM],
        "consumers": [{"type": "jsonl", "path": path}],
    }


def reader_round(dsn, upstream_port, facts, profile=None, audit=True) -> dict:
    """One catch-up in a fresh reader process (a thread: blocks); ``audit``
    False turns the delivery audit off (its cost's baseline)."""
    from tests.servers import free_port

    tmp = tempfile.mkdtemp(prefix="catchup-")
    path = os.path.join(tmp, "facts.jsonl")
    with open(path, "w") as f:  # the consumer is at 0: everything is behind
        f.write(json.dumps({"stream": "catchup", "writer": "master", "position": 0}) + "\n")
    http_port = free_port()
    cmd = [sys.executable, os.path.join(HERE, "catchup_reader.py"),
           "--config", json.dumps(reader_config(dsn, upstream_port, http_port, path,
                                                              audit)),
           "--stream", "catchup", "--writer", "master", "--target", str(facts)]
    if profile:
        cmd += ["--profile", profile]
    poller = HealthPoller(http_port)
    poller.start()
    try:
        out = subprocess.run(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             check=True, timeout=1800).stdout
    finally:
        poller.stopping.set()
        poller.join()
    result = json.loads(out.decode().strip().splitlines()[-1])
    result["health_rtt_max_ms"] = poller.worst * 1000
    result["health_checks"] = poller.count
    check_file(path, facts)
    shutil.rmtree(tmp)  # the consumer's file and its lock and state files
    return result


async def start_master(reactor, dsn):
    from replicator.config import parse_instance
    from replicator.daemon.service import Instance

    master = Instance(parse_instance({
        "server_name": "bench.test", "instance_name": "master",
        "database": {"postgres": dsn},
        "replication": {"listen": "tcp:0:interface=127.0.0.1"},
        "streams": [STREAM],
    }), reactor)
    await master.start()
    return master


async def run(dsn: str, facts: int = FACTS, rounds: int = ROUNDS, profile=None):
    from twisted.internet import reactor

    master = await start_master(reactor, dsn)  # creates the table
    await master.stop()
    rows = await threads.deferToThread(generate, dsn, facts)
    print(f"catch-up: {facts:,} facts, {rows:,} rows", flush=True)
    master = await start_master(reactor, dsn)  # announces position `facts`
    port = master.port_of("replication")
    readers, raws, unaudited, adbcs = [], [], [], []
    try:
        for i in range(rounds):
            # The audit's cost: the same catch-up without it, alternating.
            bare = await threads.deferToThread(reader_round, dsn, port, facts, None, False)
            unaudited.append(bare["seconds"])
            r = await threads.deferToThread(reader_round, dsn, port, facts,
                                            profile if i == 0 else None)
            raw, raw_cpu = await threads.deferToThread(raw_pass, dsn, facts)
            adbc, adbc_cpu = await threads.deferToThread(adbc_pass, dsn, facts)
            print(f"  round {i + 1}: reader {r['seconds']:.2f} s ({r['pages']} pages, stall "
                  f"{r['stall_max_ms']:.0f} ms (p99 {r['stall_p99_ms']:.0f}, longest GC "
                  f"{r['gc_max_ms']:.0f}), /health worst {r['health_rtt_max_ms']:.0f} ms "
                  f"of {r['health_checks']}, peak RSS {r['rss_peak_kb'] / 1024:.0f} MB from "
                  f"{r['rss_start_kb'] / 1024:.0f} MB; CPU s by thread {r['threads_cpu']}), "
                  f"raw {raw:.2f} s (CPU {raw_cpu:.2f} s), ADBC {adbc:.2f} s (CPU "
                  f"{adbc_cpu:.2f} s), load {os.getloadavg()[0]:.1f}", flush=True)
            readers.append(r)
            raws.append(raw)
            adbcs.append(adbc)
    finally:
        await master.stop()
    med = statistics.median
    entries = [
        record("catchup.facts_per_s", rate(facts, med([r["seconds"] for r in readers])),
               "facts/s", "raw keyset SELECT", rate(facts, med(raws))),
        record("catchup.facts_per_s.vs_adbc", rate(facts, med([r["seconds"] for r in readers])),
               "facts/s", "ADBC PostgreSQL, one binary COPY into Arrow", rate(facts, med(adbcs))),
        record("catchup.audited_facts_per_s", rate(facts, med([r["seconds"] for r in readers])),
               "facts/s", "the same catch-up, audit off", rate(facts, med(unaudited))),
        record("catchup.stall_max_ms", med([r["stall_max_ms"] for r in readers]), "ms",
               None, None),
        record("catchup.stall_p99_ms", med([r["stall_p99_ms"] for r in readers]), "ms",
               None, None),
        record("catchup.health_rtt_max_ms", med([r["health_rtt_max_ms"] for r in readers]),
               "ms", None, None),
        record("catchup.rss_peak_mb", med([r["rss_peak_kb"] / 1024 for r in readers]), "MB",
               None, None),
    ]
    return entries


if __name__ == "__main__":
    from twisted.internet import defer, task

    def go(reactor):
        p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        p.add_argument("--facts", type=int, default=FACTS)
        p.add_argument("--rounds", type=int, default=ROUNDS)
        p.add_argument("--profile", action="store_true",
                       help="cProfile the first round's reader; print the top functions")
        args = p.parse_args()

        async def main():
            from tests.servers import PostgresServer

            pg = PostgresServer(fsync=True)
            prof = tempfile.mktemp(suffix=".prof") if args.profile else None
            try:
                await run(pg.create_database("catchup"), args.facts, args.rounds, prof)
            finally:
                pg.stop()
            if prof:
                import pstats

                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        return defer.ensureDeferred(main())

    task.react(go)
