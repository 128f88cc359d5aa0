#!/usr/bin/env python3
"""Export benchmark: Spark ``local[2]`` vs plain Python, 0.5 / 1 / 2 M rows.

One PostgreSQL (fsync on) holds one stream table of about 2 million rows,
generated inside PostgreSQL with ``generate_series``: two writers, ~5 %
rolled-back IDs, 10 % three-row facts, 1 % eighteen-row facts, one
timestamp per 50 ms.  For each size ``n`` in 0.5, 1 and 2 million rows the
stream's persisted position is set to the ID where the first ``n`` rows end
and

* the exporter (:func:`replicator.export.job.run_export`, a first export
  into an empty output: JDBC read in 4 partitions, aggregation, Parquet,
  commit) runs on a SparkSession started once beforehand and warmed up by
  one small export (JVM start and warm-up are reported, not counted);
* the baseline aggregates the same rows in one pass in plain Python
  (:class:`replicator.export.reference.Aggregator`) fed by a psycopg2
  server-side cursor (``ORDER BY id``, 10,000 rows a fetch).

* the reference a data engineer would reach for: the ADBC PostgreSQL
  driver (binary ``COPY`` into Arrow) reads the rows into one Arrow table,
  pyarrow groups them into facts and buckets (percentiles by t-digest,
  approximate) and writes one Parquet file per granularity
  (:func:`adbc_pass`).

Figures (appended to ``bench-results.jsonl`` through ``common.record``):
``export.rows_per_s.2m`` (baseline: the Python pass at 2 M),
``export.seconds.0.5m/1m/2m`` (baseline: the Python pass at the same size;
ratio > 1 means Spark was faster) and ``export.seconds.<size>.vs_adbc``
(baseline: the ADBC path at the same size).  The Python and Spark results
are checked equal at 0.5 M rows, and the ADBC path's fact, row and
rollback counts against the Python pass's at every size.

Then the same export on a standalone Spark cluster on loopback (a master
and two workers of one core each, started as docs/operations.md says,
:mod:`tests.spark_cluster`), at ``cluster_size`` million rows (0.5 by
default; 10 with ``make bench BENCH=--big``):
``export.cluster.seconds.<size>`` against ``local[2]`` at the same size
in the same run (ratio > 1: the cluster was faster).  Both share the
machine's cores, so on one host the cluster shows its overhead, not its
scale.

``main()`` runs it all and returns the recorded entries; ``--sizes`` picks
other sizes (millions of rows) for a quick try, ``--cluster-size`` the
cluster's (0: no cluster run).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from common import rate, record  # noqa: E402

BASE_MS = 1_709_337_000_000
STREAM = {"name": "bench_events", "table": "bench_ev", "writers": ["w1", "w2"],
          "columns": [{"body": "text"}, {"ts": "bigint"}], "timestamp_column": "ts"}


def generate(dsn, rows_wanted):
    """Fill the stream table with about ``rows_wanted`` rows; returns the
    table's row count."""
    import psycopg2

    # Rows per ID on average: 0.95 * (0.89 * 1 + 0.10 * 3 + 0.01 * 18) = 1.30
    ids = int(rows_wanted / 1.30) + 1000
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute("CREATE TABLE IF NOT EXISTS stream_positions (stream_name TEXT NOT NULL, "
                "instance_name TEXT NOT NULL, stream_id BIGINT NOT NULL, "
                "PRIMARY KEY (stream_name, instance_name))")
    cur.execute("CREATE TABLE bench_ev (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL, "
                "body TEXT NOT NULL, ts BIGINT NOT NULL)")
    cur.execute(
        """
        INSERT INTO bench_ev
        SELECT i, CASE WHEN (i * 7919) %% 3 = 0 THEN 'w2' ELSE 'w1' END,
               'fact ' || i || ' row ' || k,
               %s + i * 50 + ((i * 104729) %% 400) - 200 + k
        FROM generate_series(1::bigint, %s::bigint) AS i,
             generate_series(1, CASE WHEN i %% 100 = 7 THEN 18
                                     WHEN i %% 10 = 3 THEN 3 ELSE 1 END) AS k
        WHERE (i * 15485863) %% 20 <> 11
        """,
        (BASE_MS, ids),
    )
    cur.execute("CREATE INDEX bench_ev_id ON bench_ev (stream_id)")
    cur.execute("ANALYZE bench_ev")
    cur.execute("SELECT count(*) FROM bench_ev")
    (count,) = cur.fetchone()
    conn.close()
    return count


def position_for(dsn, rows):
    """The ID at which the first ``rows`` rows (in ID order) end, rounded up to
    a whole fact; and the exact row count at or below it."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    cur = conn.cursor()
    cur.execute("SELECT stream_id FROM bench_ev ORDER BY stream_id OFFSET %s LIMIT 1",
                (rows - 1,))
    (pos,) = cur.fetchone()
    cur.execute("SELECT count(*) FROM bench_ev WHERE stream_id <= %s", (pos,))
    (count,) = cur.fetchone()
    conn.close()
    return pos, count


def set_position(dsn, pos):
    import psycopg2

    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    cur = conn.cursor()
    for w in ("w1", "w2"):
        cur.execute("INSERT INTO stream_positions VALUES (%s, %s, %s) ON CONFLICT "
                    "(stream_name, instance_name) DO UPDATE SET stream_id = excluded.stream_id",
                    (STREAM["name"], w, pos))
    conn.close()


def python_pass(dsn, pos):
    """The plain-Python single pass; returns (seconds, rows, aggregates)."""
    import psycopg2

    from replicator.export.reference import Aggregator

    start = time.perf_counter()
    conn = psycopg2.connect(dsn)
    conn.autocommit = False
    cur = conn.cursor(name="bench_export")
    cur.itersize = 10_000
    cur.execute("SELECT stream_id, instance_name, ts FROM bench_ev WHERE stream_id <= %s "
                "ORDER BY stream_id", (pos,))
    agg = Aggregator(2, True)
    agg.feed(cur)
    result = agg.result()
    cur.close()
    conn.close()
    return time.perf_counter() - start, agg.row_count, result


def adbc_pass(dsn, pos, want=None):
    """ADBC PostgreSQL -> Arrow -> pyarrow -> Parquet: the rows at or
    below ``pos`` in one Arrow table, grouped into facts (rows, smallest
    writer and time), rollbacks from the gaps between fact IDs, gaps
    between a writer's facts of one day, and per (granularity, writer,
    bucket) facts, rows, the largest fact, first and last token and the
    gaps' p50/p95/p99 (t-digest), rollbacks on ``writer = ""`` rows;
    written as Parquet.  Returns seconds; with ``want`` (the Python
    pass's aggregates) checks facts, rows and rollbacks against them."""
    import adbc_driver_postgresql.dbapi as adbc
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from replicator.export.reference import GRANULARITIES

    out = tempfile.mkdtemp(prefix="bench-adbc-")
    start = time.perf_counter()
    conn = adbc.connect(dsn)
    try:
        cur = conn.cursor()
        cur.execute("SELECT stream_id, instance_name, ts FROM bench_ev "
                    f"WHERE stream_id <= {int(pos)}")
        table = cur.fetch_arrow_table()
        cur.close()
    finally:
        conn.close()
    facts = table.group_by("stream_id").aggregate(
        [("instance_name", "min"), ("ts", "min"), ("stream_id", "count")]).sort_by("stream_id")
    ids = facts["stream_id"].to_numpy()
    ts = facts["ts_min"].to_numpy()
    rows = facts["stream_id_count"].to_numpy()
    writer = facts["instance_name_min"].combine_chunks().dictionary_encode()
    codes = writer.indices.to_numpy()
    rollbacks = np.zeros(len(ids), dtype=np.int64)
    rollbacks[1:] = ids[1:] - ids[:-1] - 1
    day = ts // 86_400_000
    order = np.lexsort((ids, day, codes))
    gaps = np.full(len(ids), np.nan)
    same = (codes[order][1:] == codes[order][:-1]) & (day[order][1:] == day[order][:-1])
    gaps[order[1:]] = np.where(same, (ts[order][1:] - ts[order][:-1]).astype(float), np.nan)
    writers = writer.dictionary.take(pa.array(codes))
    digest = pc.TDigestOptions(q=[0.5, 0.95, 0.99])
    for g, ms in GRANULARITIES.items():
        bucket = pa.array(ts // ms * ms)
        per = pa.table({"writer": writers, "bucket": bucket, "stream_id": ids, "rows": rows,
                        "gap": pa.array(gaps, from_pandas=True)})
        agg = per.group_by(["writer", "bucket"]).aggregate([
            ("stream_id", "count"), ("rows", "sum"), ("rows", "max"), ("stream_id", "min"),
            ("stream_id", "max"), ("gap", "tdigest", digest)])
        lost = pa.table({"bucket": bucket, "rollbacks": rollbacks}).group_by("bucket").aggregate(
            [("rollbacks", "sum")])
        lost = lost.filter(pc.greater(lost["rollbacks_sum"], 0))
        pq.write_table(agg, os.path.join(out, f"{g}.parquet"))
        pq.write_table(lost, os.path.join(out, f"{g}_rollbacks.parquet"))
        if want is not None:
            got = {(g, w, b): (f, r) for w, b, f, r in zip(
                agg["writer"].to_pylist(), agg["bucket"].to_pylist(),
                agg["stream_id_count"].to_pylist(), agg["rows_sum"].to_pylist())}
            got.update({(g, "", b): n for b, n in zip(lost["bucket"].to_pylist(),
                                                      lost["rollbacks_sum"].to_pylist())})
            expect = {k: ((v["facts"], v["rows"]) if k[1] else v["rollbacks"])
                      for k, v in want.items() if k[0] == g}
            if got != expect:
                bad = sorted(k for k in expect.keys() | got.keys()
                             if got.get(k) != expect.get(k))[:3]
                raise AssertionError(f"ADBC path differs from the Python pass at {bad}")
    elapsed = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return elapsed


def spark_pass(spark, db, streams, pos):
    """A first export into a fresh output; returns (seconds, output dir)."""
    from replicator.export.job import run_export
    from replicator.export.options import ExportOptions

    out = tempfile.mkdtemp(prefix="bench-export-")
    start = time.perf_counter()
    result = run_export(db, streams, ExportOptions(output=out, partitions=4,
                                                   shuffle_partitions=4,
                                                   progress_interval=0), spark=spark)
    elapsed = time.perf_counter() - start
    assert result.reports[0].upper == pos, result.reports
    return elapsed, out


def check_equal(spark, out, want):
    from pyspark.sql import functions as F

    from replicator.export.reference import GRANULARITIES

    got = {}
    for g in GRANULARITIES:
        path = os.path.join(out, "current", g)
        df = spark.read.option("basePath", path).parquet(path)
        for r in df.withColumn("ms", F.unix_millis("bucket_start")).collect():
            got[(g, r["writer"], r["ms"])] = (r["facts"], r["rows"], r["rollbacks"],
                                              r["gap_ms_p95"])
    expect = {k: (v["facts"], v["rows"], v["rollbacks"], v["gap_ms_p95"])
              for k, v in want.items()}
    if got.keys() != expect.keys():
        raise AssertionError(f"bucket keys differ: {len(got)} vs {len(expect)}")
    for k, v in expect.items():
        g = got[k]
        if g[:3] != v[:3] or (v[3] is None) != (g[3] is None) or (
                v[3] is not None and abs(g[3] - v[3]) > 1e-6 * max(1, abs(v[3]))):
            raise AssertionError(f"bucket {k}: spark {g} != python {v}")


def main(sizes=(0.5, 1.0, 2.0), master="local[2]", cluster_size=0.5):
    """Run the export benchmark; returns the entries recorded."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from replicator.config import parse_database, parse_streams
    from replicator.export.source import find_jdbc_jar
    from replicator.export.spark import spark_session
    from tests.servers import PostgresServer

    entries = []
    pg = PostgresServer(fsync=True)
    spark = None
    outputs = []
    try:
        dsn = pg.create_database("bench_export")
        t0 = time.perf_counter()
        total = generate(dsn, int(max(sizes + (cluster_size,)) * 1_000_000))
        print(f"== export: generated {total:,} rows in {time.perf_counter() - t0:.1f}s",
              flush=True)
        db = parse_database({"postgres": dsn})
        streams = parse_streams([STREAM])
        t0 = time.perf_counter()
        spark = spark_session(master, [find_jdbc_jar("postgres")], shuffle_partitions=4,
                              extra_conf={"spark.driver.memory": "2g"})
        spark.sparkContext.setLogLevel("ERROR")
        jvm = time.perf_counter() - t0
        print(f"   SparkSession ({master}) started in {jvm:.1f}s (not counted)", flush=True)
        entries.append(record("export.jvm_start_s", jvm, "s", None, None,
                              higher_is_better=False))
        # Warm-up (JIT, class loading, first JDBC connection) at the smallest
        # size: not counted.
        warm = int(min(sizes) * 1_000_000)
        pos, _rows = position_for(dsn, warm)
        set_position(dsn, pos)
        t0 = time.perf_counter()
        _s, out = spark_pass(spark, db, streams, pos)
        shutil.rmtree(out, ignore_errors=True)
        python_pass(dsn, pos)
        print(f"   warm-up export of {warm:,} rows: {time.perf_counter() - t0:.1f}s "
              "(not counted)", flush=True)
        local_s = {}
        for size in sizes:
            label = f"{size:g}m"
            pos, rows = position_for(dsn, int(size * 1_000_000))
            set_position(dsn, pos)
            py_s, py_rows, want = python_pass(dsn, pos)
            assert py_rows == rows, (py_rows, rows)
            adbc_pass(dsn, pos, want)  # checked (and warm), not counted
            adbc_s = adbc_pass(dsn, pos)
            sp_s, out = spark_pass(spark, db, streams, pos)
            outputs.append(out)
            local_s[size] = sp_s
            if size == min(sizes):
                check_equal(spark, out, want)
                print(f"   {label}: Spark and Python aggregates are equal", flush=True)
            print(f"   {label}: {rows:,} rows: spark {sp_s:.1f}s ({rate(rows, sp_s):,.0f} rows/s), "
                  f"python {py_s:.1f}s ({rate(rows, py_s):,.0f} rows/s), ADBC/Arrow/Parquet "
                  f"{adbc_s:.1f}s, load {os.getloadavg()[0]:.1f}", flush=True)
            entries.append(record(f"export.seconds.{label}", sp_s, "s",
                                  f"python single pass {label}", py_s,
                                  higher_is_better=False))
            entries.append(record(f"export.seconds.{label}.vs_adbc", sp_s, "s",
                                  f"ADBC -> Arrow -> Parquet (pyarrow) {label}", adbc_s,
                                  higher_is_better=False))
            if size == max(sizes):
                entries.append(record(f"export.rows_per_s.{label}", rate(rows, sp_s),
                                      "rows/s", f"python single pass {label}",
                                      rate(rows, py_s)))
            shutil.rmtree(out, ignore_errors=True)
        if cluster_size:
            spark.stop()
            spark = None
            entries += cluster_pass(dsn, db, streams, cluster_size, local_s.get(cluster_size),
                                    master)
    finally:
        if spark is not None:
            spark.stop()
        for out in outputs:
            shutil.rmtree(out, ignore_errors=True)
        pg.stop()
    return entries


def cluster_pass(dsn, db, streams, size, local_seconds, local_master):
    """The export of ``size`` million rows on a two-worker standalone
    cluster on loopback, beside ``local_seconds`` (``local_master`` at the
    same size, this run); returns the entries recorded."""
    from replicator.export.source import find_jdbc_jar
    from replicator.export.spark import spark_session
    from tests.spark_cluster import SparkCluster

    t0 = time.perf_counter()
    cluster = SparkCluster(workers=2, cores=1, memory="2g")
    spark = None
    try:
        spark = spark_session(cluster.url, [find_jdbc_jar("postgres")], shuffle_partitions=4,
                              extra_conf={"spark.driver.memory": "2g",
                                          "spark.executor.memory": "1500m"})
        spark.sparkContext.setLogLevel("ERROR")
        print(f"   Spark cluster (2 workers x 1 core) and its session started in "
              f"{time.perf_counter() - t0:.1f}s (not counted)", flush=True)
        pos, _rows = position_for(dsn, int(min(size, 0.5) * 1_000_000))
        set_position(dsn, pos)
        _s, out = spark_pass(spark, db, streams, pos)  # warm-up, not counted
        shutil.rmtree(out, ignore_errors=True)
        label = f"{size:g}m"
        pos, rows = position_for(dsn, int(size * 1_000_000))
        set_position(dsn, pos)
        seconds, out = spark_pass(spark, db, streams, pos)
        shutil.rmtree(out, ignore_errors=True)
        print(f"   cluster {label}: {rows:,} rows: {seconds:.1f}s "
              f"({rate(rows, seconds):,.0f} rows/s)", flush=True)
        return [record(f"export.cluster.seconds.{label}", seconds, "s",
                       f"{local_master} {label}" if local_seconds else None, local_seconds,
                       higher_is_better=False)]
    finally:
        if spark is not None:
            spark.stop()
        cluster.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5,1,2",
                        help="millions of rows, comma-separated (default: 0.5,1,2)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--cluster-size", type=float, default=0.5,
                        help="millions of rows exported on a loopback Spark cluster "
                             "(default: 0.5; 0: none)")
    args = parser.parse_args()
    main(tuple(float(s) for s in args.sizes.split(",")), args.master, args.cluster_size)
