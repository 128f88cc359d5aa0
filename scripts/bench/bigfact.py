#!/usr/bin/env python3
"""A fact of 100,000 rows: how long ``/health`` waits while it goes through.

Two ``replicator run`` processes on PostgreSQL (fsync on): a master, and a
worker connected to it over TCP with a ``jsonl`` consumer.  A poller per
daemon (``catchup.HealthPoller``: a new connection per ``GET /health``,
every ``INTERVAL`` s) measures each answer's round trip.

``bigfact.health.master.p99_ms`` / ``bigfact.health.worker.p99_ms`` (baseline: the same daemon idle)
    ``ROUNDS`` facts of ``ROWS`` rows written through the master's write
    API, one at a time; each round's window runs from the ``POST`` to the
    fact's line being complete in the worker's file (so: the body's
    parse, the insert, the fan-out, the worker's catch-up read and its
    consumer).  The p99 of every round trip in the windows, against the
    p99 of the same daemon's round trips over an idle window of
    ``IDLE_SECONDS`` taken first.  The issue's target: 50 ms.  Also
    printed: p50, max, how many, each fact's seconds from ``POST`` to the
    worker's file, the disconnects either side saw (the target: none),
    and the load average.

The stream has one ``bigint`` column: 100,000 rows fit in the write API's
1 MiB body.  Run alone: ``python scripts/bench/bigfact.py`` (its own
PostgreSQL) or ``make bench BENCH="--only bigfact"``.
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

from catchup import HealthPoller  # noqa: E402
from common import percentile, record  # noqa: E402

ROWS = int(os.environ.get("BIGFACT_ROWS", "100000"))
ROUNDS = int(os.environ.get("BIGFACT_ROUNDS", "3"))
IDLE_SECONDS = 5.0
INTERVAL = 0.005
STREAM = {"name": "big", "table": "bigfact_stream", "columns": [{"n": "bigint"}],
          "writers": ["master"]}


class _Cleanups:
    """What ``tests.test_cli.Daemon`` asks of a test: ``addCleanup``."""

    def __init__(self):
        self.calls = []

    def addCleanup(self, fn, *args):
        self.calls.append((fn, args))

    def run(self):
        for fn, args in reversed(self.calls):
            fn(*args)


def _fact_in(path: str, token: int) -> bool:
    """Whether fact ``token``'s line is complete in a ``jsonl`` file."""
    if not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        for line in f:
            if line.endswith(b"\n") and b'"token":%d,' % token in line:
                return len(json.loads(line)["rows"]) == ROWS
    return False


def _spread(samples) -> str:
    ms = sorted(s * 1000.0 for s in samples)
    return (f"p50 {percentile(ms, 50):.1f} ms, p99 {percentile(ms, 99):.1f} ms, "
            f"max {ms[-1]:.1f} ms, {len(ms)} answers")


def run(dsn: str) -> None:
    """The phase (blocking: processes and threads)."""
    from tests.servers import free_port, wait_for
    from tests.test_cli import SECRET, Daemon, base_config, http

    cleanups = _Cleanups()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    try:
        rep_port = free_port()
        master = Daemon(cleanups, base_config(
            "master", free_port(), [STREAM], database={"postgres": dsn}, log_level="warn",
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"}), "master",
            env=env).start()
        worker = Daemon(cleanups, base_config(
            "worker1", free_port(), [STREAM], database={"postgres": dsn}, log_level="warn",
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            consumers=[{"type": "jsonl", "path": "facts.jsonl"}]), "worker1",
            env=env).start()
        wait_for(lambda: http(worker.http_base + "/health")[0] == 200, 60, "worker linked")
        daemons = {"master": master, "worker": worker}
        pollers = {}
        for name, daemon in daemons.items():
            poller = pollers[name] = HealthPoller(int(daemon.http_base.rsplit(":", 1)[1]),
                                                  INTERVAL)
            poller.start()
            cleanups.addCleanup(poller.stopping.set)
        time.sleep(IDLE_SECONDS)
        idle = {name: p.take() for name, p in pollers.items()}
        busy = {name: [] for name in pollers}
        body = json.dumps({"rows": [[i] for i in range(ROWS)]}).encode()
        path = os.path.join(worker.dir, "facts.jsonl")
        took = []
        for _ in range(ROUNDS):
            time.sleep(1.0)  # between rounds: not in any window
            for p in pollers.values():
                p.take()
            start = time.monotonic()
            status, answer = http(f"{master.http_base}/_replicator/v1/streams/big/facts",
                                  body, SECRET)
            if status != 200:
                raise RuntimeError(f"the write answered {status}: {answer[:200]!r}")
            token = json.loads(answer)["stream_id"]
            wait_for(lambda token=token: _fact_in(path, token), 300,
                     f"fact {token} at the worker")
            took.append(time.monotonic() - start)
            for name, p in pollers.items():
                busy[name].extend(p.take())
        disconnects = {name: len(json.loads(http(d.http_base + "/status.json")[1])
                                 ["disconnects"]) for name, d in daemons.items()}
        load = os.getloadavg()
        print(f"bigfact: {ROUNDS} facts of {ROWS:,} rows, POST to the worker's file "
              f"{', '.join(f'{t:.2f}' for t in took)} s; disconnects {disconnects}; "
              f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
        for name in pollers:
            print(f"  {name}: idle {_spread(idle[name])}; "
                  f"during the facts {_spread(busy[name])}", flush=True)
            record(f"bigfact.health.{name}.p99_ms",
                   percentile(sorted(s * 1000.0 for s in busy[name]), 99), "ms",
                   f"{name} idle", percentile(sorted(s * 1000.0 for s in idle[name]), 99),
                   higher_is_better=False)
    finally:
        cleanups.run()


if __name__ == "__main__":
    from tests.servers import PostgresServer

    server = PostgresServer(fsync=True)
    try:
        run(server.create_database("bigfactbench"))
    finally:
        server.stop()
