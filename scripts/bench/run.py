#!/usr/bin/env python3
"""`make bench`: every benchmark, each figure beside its same-run baseline."""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from twisted.internet import defer, task  # noqa: E402

import export  # noqa: E402
import redis_bench  # noqa: E402
import streams  # noqa: E402
import tcp  # noqa: E402
from tests.servers import PostgresServer  # noqa: E402


SECTIONS = ("streams", "tcp", "redis", "export")


async def main(reactor, argv):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, of {', '.join(SECTIONS)}")
    only = p.parse_args(argv).only.split(",")
    pg = PostgresServer(fsync=True)
    try:
        if "streams" in only:
            print("== streams core")
            streams.run_idgen()
            await streams.run_pg(pg.create_database("bench"))
        if "tcp" in only:
            print("== TCP replication")
            await tcp.run(pg.create_database("tcpbench"))
        if "redis" in only:
            print("== Redis replication")
            await redis_bench.run(pg.create_database("redisbench"))
    finally:
        pg.stop()
    if "export" in only:
        # Blocking (Spark drives itself); its own PostgreSQL, 2M rows.
        export.main()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, sys.argv[1:])))
