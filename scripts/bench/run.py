#!/usr/bin/env python3
"""`make bench`: every benchmark, each figure beside its same-run baseline.

Every figure is printed with its baseline and ratio and appended to
``bench-results.jsonl`` (``common.record``); ``scripts/bench/table.py``
turns the last run into the performance table of docs/performance.md.

Sections run in the order of ``SECTIONS``; each is one entry (name, title,
``async fn(pg, args)``) so that benchmarks can be added side by side.
``make bench BENCH="--only catchup,export"`` runs some; ``BENCH=--big``
adds the large sizes (export at 10 M rows, locally and on a loopback Spark
cluster; the read API's paged catch-up at 1 M facts; Redis channels: 10x
the facts).
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import bigfact  # noqa: E402
import catchup  # noqa: E402
import export  # noqa: E402
import follow  # noqa: E402
import foreign  # noqa: E402
import redis_bench  # noqa: E402
import redis_channels_bench  # noqa: E402
import sse  # noqa: E402
import streams  # noqa: E402
import tcp  # noqa: E402
from twisted.internet import defer, task, threads  # noqa: E402

from tests.servers import PostgresServer  # noqa: E402


async def _streams(pg, args):
    streams.run_idgen()
    await streams.run_pg(pg.create_database("bench"))


async def _tcp(pg, args):
    await tcp.run(pg.create_database("tcpbench"))


async def _redis(pg, args):
    await redis_bench.run(pg.create_database("redisbench"))


async def _redis_channels(pg, args):
    await redis_channels_bench.run(pg.create_database("redischannelsbench"), big=args.big)


async def _catchup(pg, args):
    await catchup.run(pg.create_database("catchupbench"))


async def _bigfact(pg, args):
    # Blocking (two daemon processes and pollers).
    await threads.deferToThread(bigfact.run, pg.create_database("bigfactbench"))


async def _follow(pg, args):
    # Blocking (two daemon processes, writer threads, Synapse's client).
    await threads.deferToThread(follow.run, pg.create_database("followbench"))


async def _export(pg, args):
    # Blocking (Spark drives itself, from the main thread), with its own PostgreSQL.
    # The cluster run: at 0.5 M rows, at 10 M with --big (beside local[2] there).
    export.main((0.5, 1.0, 2.0) + ((10.0,) if args.big else ()),
                cluster_size=10.0 if args.big else 0.5)


async def _foreign(pg, args):
    # Blocking (two daemon processes and writer threads).
    await threads.deferToThread(foreign.run, pg.create_database("foreignbench"))


async def _sse(pg, args):
    # Blocking (a daemon process, reader processes and writer threads).
    await threads.deferToThread(sse.run, pg, sse.PHASES, args.big)


SECTIONS = [
    ("streams", "streams core", _streams),
    ("tcp", "TCP replication", _tcp),
    ("redis", "Redis replication", _redis),
    ("redis-channels", "Redis: a channel per stream, sharded pub/sub", _redis_channels),
    ("catchup", "catch-up of a reader 1,000,000 facts behind", _catchup),
    ("bigfact", "a fact of 100,000 rows: /health beside the same daemons idle", _bigfact),
    ("follow", "a worker following its master: CPU per fact beside Synapse's client", _follow),
    ("export", "Spark export against a plain-Python pass", _export),
    ("sse", "read API: Server-Sent Events beside the TCP fan-out, catch-up through pages",
     _sse),
    ("foreign", "plain-SQL writers: inserts with the fence against without, delivery", _foreign),
]


async def main(reactor, argv):
    names = [name for name, _, _ in SECTIONS]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(names),
                   help=f"comma-separated sections to run, of {', '.join(names)}")
    p.add_argument("--big", action="store_true",
                   help="also the large sizes (export: 10 M rows; takes long, ~5 GB of disk; "
                        "sse: pages through 1 M facts)")
    args = p.parse_args(argv)
    only = args.only.split(",")
    unknown = sorted(set(only) - set(names))
    if unknown:
        p.error(f"unknown sections: {', '.join(unknown)}")
    pg = PostgresServer(fsync=True)
    try:
        for name, title, run in SECTIONS:
            if name in only:
                print(f"== {title}", flush=True)
                await run(pg, args)
    finally:
        pg.stop()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, sys.argv[1:])))
