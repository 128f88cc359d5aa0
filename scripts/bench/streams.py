"""Streams core benchmarks: ID tracking in process, writes on PostgreSQL.

- ``idgen.reserve_complete.inflight_N``: reserve+complete pairs per second
  with N IDs already in flight, completing in random order (no database);
  baseline for N=1 is a bare dict insert+delete pair, for larger N the N=1
  figure.
- ``pg.write.single`` / ``pg.write.batched``: facts per second through a
  Stream on a real PostgreSQL (durable: fsync on) against raw psycopg2 doing
  the same statements on one connection: ``nextval`` (n of them in one
  round trip when batched), then the rows' ``INSERT`` and the writer's
  position upsert in ``stream_positions`` in one round trip (ours persists
  the position in the fact's own transaction when nothing else of the
  writer is in flight, as here), commit.  ``single`` writes one fact at a
  time (one writer: concurrent writes would go together into one
  transaction, group commit, which ``e2e.facts_per_s`` measures).  Also
  printed, not recorded: the same raw loops without the position upsert
  (what a user who keeps no position would write).
"""

import random
import time

import psycopg2
from common import rate, record
from twisted.internet import defer, reactor

from replicator.config import parse_database, parse_streams
from replicator.storage import schema
from replicator.storage.database import Database
from replicator.streams.idgen import StreamIdGenerator
from replicator.streams.registry import StreamRegistry

PAIRS = 200_000


def bench_idgen_inflight(inflight, pairs=PAIRS):
    gen = StreamIdGenerator("bench", {"w": 0}, ["w"])
    rng = random.Random(1)
    live = list(range(1, inflight + 1))
    gen.reserved("w", live, pending=False)
    next_id = inflight + 1
    order = [rng.random() for _ in range(pairs)]
    reserved, complete = gen.reserved, gen.complete
    start = time.perf_counter()
    for r in order:
        reserved("w", (next_id,), False)
        live.append(next_id)
        next_id += 1
        i = int(r * len(live))
        live[i], live[-1] = live[-1], live[i]
        complete("w", live.pop())
    return rate(pairs, time.perf_counter() - start)


def bench_dict_pairs(pairs=PAIRS):
    d = {}
    start = time.perf_counter()
    for i in range(pairs):
        d[i] = True
        del d[i]
    return rate(pairs, time.perf_counter() - start)


def run_idgen():
    floor = bench_dict_pairs()
    one = bench_idgen_inflight(1)
    record("idgen.reserve_complete.inflight_1", one, "pairs/s", "dict insert+delete", floor)
    for n in (100, 10_000):
        value = bench_idgen_inflight(n)
        record(f"idgen.reserve_complete.inflight_{n}", value, "pairs/s",
               "idgen.reserve_complete.inflight_1", one)


STREAM = {
    "name": "bench", "table": "bench_stream",
    "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
    "writers": ["master"],
}
ROW = ["get_user_by_id", ["@user:example.com"], 1490197670513]


#: Ours persists the writer's position with the fact (when uncontended).
UPSERT = schema.upsert_position_sql("GREATEST")


def raw_single(dsn, n, position=True):
    conn = psycopg2.connect(dsn)
    cur = conn.cursor()
    insert = "INSERT INTO bench_stream VALUES (%s, %s, %s, %s::jsonb, %s)"
    if position:
        insert += "; " + UPSERT
    start = time.perf_counter()
    for _ in range(n):
        cur.execute("SELECT nextval('bench_stream_seq')")
        (i,) = cur.fetchone()
        params = (i, "raw", ROW[0], '["@user:example.com"]', ROW[2])
        cur.execute(insert, params + (("bench", "raw", i) if position else ()))
        conn.commit()
    elapsed = time.perf_counter() - start
    conn.close()
    return rate(n, elapsed)


def raw_batched(dsn, batches, size=100, position=True):
    conn = psycopg2.connect(dsn)
    cur = conn.cursor()
    insert = "INSERT INTO bench_stream VALUES " + ", ".join(["(%s, %s, %s, %s::jsonb, %s)"] * size)
    if position:
        insert += "; " + UPSERT
    start = time.perf_counter()
    for _ in range(batches):
        cur.execute("SELECT nextval('bench_stream_seq') FROM generate_series(1, %s)", (size,))
        ids = [r[0] for r in cur.fetchall()]
        params = []
        for i in ids:
            params += [i, "raw", ROW[0], '["@user:example.com"]', ROW[2]]
        if position:
            params += ["bench", "raw", ids[-1]]
        cur.execute(insert, params)
        conn.commit()
    elapsed = time.perf_counter() - start
    conn.close()
    return rate(batches * size, elapsed)


async def ours(registry, n, per_txn, window=8):
    stream = registry.get("bench")
    facts = [[ROW]] * per_txn
    done = 0
    start = time.perf_counter()

    async def worker(count):
        for _ in range(count):
            if per_txn == 1:
                await stream.write_fact([ROW])
            else:
                await stream.write_facts(facts)

    per = n // window
    await defer.gatherResults([defer.ensureDeferred(worker(per)) for _ in range(window)])
    done = per * window * per_txn
    return rate(done, time.perf_counter() - start)


async def alternating(raw, ours_fn, n, bare=None):
    """Rates of raw and ours over four slices (raw, ours, ours, raw; with
    ``bare``, the raw loop without the position, between them): the disk's
    fsync speed drifts too much here for back-to-back runs to be fair.
    Returns (ours, raw, bare) as total facts / total seconds."""
    totals = {"raw": [0, 0.0], "ours": [0, 0.0], "bare": [0, 0.0]}
    order = ("raw", "bare", "ours", "ours", "bare", "raw") if bare else ("raw", "ours", "ours",
                                                                         "raw")
    for who in order:
        rate = raw(n) if who == "raw" else bare(n) if who == "bare" else await ours_fn(n)
        totals[who][0] += n
        totals[who][1] += n / rate
    return tuple(totals[w][0] / totals[w][1] if totals[w][1] else None
                 for w in ("ours", "raw", "bare"))


async def run_pg(dsn):
    db = Database(parse_database({"postgres": dsn, "pool_min": 1, "pool_max": 1}))
    registry = StreamRegistry(db, "master", parse_streams([STREAM]), reactor=reactor)
    await registry.start()
    try:
        # Warm both paths up once.
        raw_single(dsn, 200)
        await ours(registry, 200, 1, window=1)
        value, base, bare = await alternating(
            lambda n: raw_single(dsn, n), lambda n: ours(registry, n, 1, window=1), 2000,
            lambda n: raw_single(dsn, n, position=False))
        print(f"    raw without the position upsert: {bare:,.0f} facts/s "
              f"(ours {value / bare:.2f}x that)", flush=True)
        record("pg.write.single", value, "facts/s",
               "raw psycopg2 nextval, INSERT+position upsert, commit", base)
        value, base, bare = await alternating(
            lambda n: raw_batched(dsn, n // 100), lambda n: ours(registry, n // 100, 100),
            10000, lambda n: raw_batched(dsn, n // 100, position=False))
        print(f"    raw without the position upsert: {bare:,.0f} facts/s "
              f"(ours {value / bare:.2f}x that)", flush=True)
        record("pg.write.batched", value, "facts/s",
               "raw psycopg2 100 nextval, INSERT+position upsert, commit", base)
    finally:
        await registry.stop()
        db.close()
