#!/usr/bin/env python3
"""`make bench`: every benchmark, each figure beside its same-run baseline."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from twisted.internet import defer, task  # noqa: E402

import streams  # noqa: E402
from tests.servers import PostgresServer  # noqa: E402


async def main(reactor):
    print("== streams core")
    streams.run_idgen()
    pg = PostgresServer(fsync=True)
    try:
        await streams.run_pg(pg.create_database("bench"))
    finally:
        pg.stop()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor)))
