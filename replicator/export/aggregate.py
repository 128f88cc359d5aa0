"""The Spark aggregation of one stream's rows into minute and hour buckets.

It computes exactly the definitions of :mod:`.reference` (which is the
test oracle), from a DataFrame ``(id, writer, ts)`` holding every row with
``floor <= id <= upper``:

1. rows -> facts (group by ID: row count, smallest writer, smallest
   non-NULL timestamp), timed by the row time or the export run
   (``observed`` ranges), dated in UTC;
2. rollbacks: ``id - previous fact ID - 1``.  The previous fact is found by
   a lag over ID-range chunks (so the sort runs in parallel) patched at each
   chunk's start with the largest ID below the chunk (``chunk_prev``, found
   by the planner with one index probe per chunk), and at the range start
   with ``prev`` (the fact before ``floor``, from the state);
3. keep facts dated ``from_date`` or later (the partitions being rewritten;
   the rows below them were read only to find previous IDs);
4. delays: lag of the row time over (writer, date) in ID order;
5. group by (date, writer, bucket) for each granularity; on a multi-writer
   stream the rollbacks form rows of their own with ``writer = ""``.

The facts of step 1-4 are persisted once and feed both granularities and the
one small driver-side summary (dates; new dates for the state; totals).
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .reference import GRANULARITIES, PERCENTILES, SIZE_BINS

OUTPUT_COLUMNS = (
    "writer", "bucket_start", "facts", "rows", "multi_row_facts", "max_fact_rows",
) + tuple(b[0] for b in SIZE_BINS) + (
    "rollbacks", "first_token", "last_token", "facts_per_s", "rows_per_s",
) + tuple(p[0] for p in PERCENTILES) + ("date",)


@dataclass
class AggregateInput:
    """What the Spark job needs besides the rows.

    * ``floor``/``upper``: the ID range read (``upper`` = largest row ID);
    * ``new_above``: facts with a larger ID are new in this run (the
      previous token);
    * ``prev``: the fact ID just below ``floor`` (None at the stream start);
    * ``observed``: ``(lo, hi, ms)`` ranges timing facts without a row time;
      ``default_ms`` times any not covered (this run);
    * ``from_date``: partitions from this UTC date on are rewritten;
    * ``single_writer``: rollbacks belong to the one writer;
    * ``has_timestamp``: the stream has a timestamp column (rates);
    * ``chunk_len``/``chunk_prev``: the rollback lag runs per ID range
      ``[floor + k * chunk_len, floor + (k + 1) * chunk_len)``;
      ``chunk_prev[k]`` is the largest ID below chunk ``k`` that is at least
      ``floor`` (None: use ``prev``).  See :func:`chunking`.
    """

    floor: int
    upper: int
    new_above: int
    prev: Optional[int]
    observed: Sequence[Tuple[int, int, int]]
    default_ms: int
    from_date: str
    single_writer: bool
    has_timestamp: bool
    chunk_len: int = 1 << 62
    chunk_prev: Dict[int, Optional[int]] = field(default_factory=dict)


def chunking(floor: int, upper: int, chunks: int) -> Tuple[int, List[int]]:
    """``(chunk_len, starts)``: ``[floor, upper]`` cut into ``chunks`` ID ranges;
    ``starts`` are the first IDs of chunks 1.. (probe the largest ID below each)."""
    chunks = max(1, int(chunks))
    chunk_len = max(1, math.ceil((upper - floor + 1) / chunks))
    starts = [floor + k * chunk_len for k in range(1, chunks) if floor + k * chunk_len <= upper]
    return chunk_len, starts


@dataclass
class StreamAggregates:
    """The result for one stream: DataFrames to write plus driver-side facts."""

    minute: object
    hour: object
    new_dates: Dict[str, Tuple[int, Optional[int]]] = field(default_factory=dict)
    new_facts: int = 0
    new_rows: int = 0
    new_rollbacks: int = 0
    dates: List[str] = field(default_factory=list)
    _cached: list = field(default_factory=list)

    def unpersist(self) -> None:
        for df in self._cached:
            df.unpersist()
        self._cached.clear()


def _observed_expr(F, observed, default_ms):
    expr = None
    for lo, hi, ms in observed:
        cond = (F.col("id") > F.lit(int(lo))) & (F.col("id") <= F.lit(int(hi)))
        expr = F.when(cond, F.lit(int(ms))) if expr is None else expr.when(cond, F.lit(int(ms)))
    if expr is None:
        return F.lit(int(default_ms))
    return expr.otherwise(F.lit(int(default_ms)))


def build_facts(spark, rows, inp: AggregateInput):
    """Facts of the rows with time, date, rollbacks and delay (persisted)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F
    from pyspark.sql.window import Window

    facts = rows.groupBy("id").agg(
        F.count(F.lit(1)).alias("nrows"),
        F.min("writer").alias("writer"),
        F.min("ts").alias("rowtime"),
    )
    time_ms = F.coalesce(F.col("rowtime"), _observed_expr(F, inp.observed, inp.default_ms))
    facts = (
        facts.withColumn("time_ms", time_ms)
        .withColumn("date", F.date_format(F.timestamp_millis(F.col("time_ms")), "yyyy-MM-dd"))
        .withColumn("chunk", F.floor((F.col("id") - F.lit(inp.floor)) / F.lit(inp.chunk_len))
                    .cast("int"))
    )
    chunk_prev = None
    for chunk, p in sorted(inp.chunk_prev.items()):
        p = inp.prev if p is None else p
        if p is None:
            continue
        cond = F.col("chunk") == F.lit(chunk)
        chunk_prev = (F.when(cond, F.lit(int(p))) if chunk_prev is None
                      else chunk_prev.when(cond, F.lit(int(p))))
    if inp.prev is not None:
        start = F.col("chunk") == F.lit(0)
        chunk_prev = (F.when(start, F.lit(int(inp.prev))) if chunk_prev is None
                      else chunk_prev.when(start, F.lit(int(inp.prev))))
    chunk_prev = chunk_prev if chunk_prev is not None else F.lit(None).cast("long")
    by_chunk = Window.partitionBy("chunk").orderBy("id")
    prev_id = F.coalesce(F.lag("id").over(by_chunk), chunk_prev)
    with_prev = facts.withColumn("prev_id", prev_id).withColumn(
        "rollbacks",
        F.when(F.col("prev_id").isNull(), F.lit(0).cast("long"))
        .otherwise(F.col("id") - F.col("prev_id") - F.lit(1)),
    )
    kept = with_prev.where(F.col("date") >= F.lit(inp.from_date))
    by_day = Window.partitionBy("writer", "date").orderBy("id")
    final = kept.withColumn("delay", F.col("rowtime") - F.lag("rowtime").over(by_day)).persist(
        StorageLevel.MEMORY_AND_DISK)
    return final


def _bucket_aggregates(F, facts, granularity: str, inp: AggregateInput):
    length = GRANULARITIES[granularity]
    seconds = length / 1000.0
    bucket_ms = (F.floor(F.col("time_ms") / F.lit(length)) * F.lit(length)).cast("long")
    f = facts.withColumn("bucket_ms", bucket_ms)
    sizes = []
    for name, lo, hi in SIZE_BINS:
        cond = F.col("nrows") >= lo if hi is None else F.col("nrows").between(lo, hi)
        sizes.append(F.sum(F.when(cond, 1).otherwise(0)).cast("long").alias(name))
    rollbacks = (F.sum("rollbacks") if inp.single_writer else F.lit(0)).cast("long")
    pct = F.expr("percentile(delay, array({}))".format(
        ", ".join(str(p) for _n, p in PERCENTILES)))
    writers = f.groupBy("date", "writer", "bucket_ms").agg(
        F.count(F.lit(1)).alias("facts"),
        F.sum("nrows").cast("long").alias("rows"),
        F.sum(F.when(F.col("nrows") > 1, 1).otherwise(0)).cast("long").alias("multi_row_facts"),
        F.max("nrows").cast("long").alias("max_fact_rows"),
        *sizes,
        rollbacks.alias("rollbacks"),
        F.min("id").alias("first_token"),
        F.max("id").alias("last_token"),
        pct.alias("pct"),
    )
    if inp.has_timestamp:
        writers = writers.withColumn("facts_per_s", F.col("facts") / F.lit(seconds)) \
            .withColumn("rows_per_s", F.col("rows") / F.lit(seconds))
    else:
        writers = writers.withColumn("facts_per_s", F.lit(None).cast("double")) \
            .withColumn("rows_per_s", F.lit(None).cast("double"))
    for i, (name, _p) in enumerate(PERCENTILES):
        writers = writers.withColumn(name, F.col("pct").getItem(i).cast("double"))
    writers = writers.drop("pct")
    if not inp.single_writer:
        gaps = (
            f.where(F.col("rollbacks") > 0)
            .groupBy("date", "bucket_ms")
            .agg(F.sum("rollbacks").cast("long").alias("rollbacks"))
            .withColumn("writer", F.lit(""))
        )
        for name in ("facts", "rows", "multi_row_facts", "max_fact_rows") + tuple(
                b[0] for b in SIZE_BINS):
            gaps = gaps.withColumn(name, F.lit(0).cast("long"))
        for name in ("first_token", "last_token"):
            gaps = gaps.withColumn(name, F.lit(None).cast("long"))
        for name in ("facts_per_s", "rows_per_s") + tuple(p[0] for p in PERCENTILES):
            gaps = gaps.withColumn(name, F.lit(None).cast("double"))
        writers = writers.unionByName(gaps)
    out = writers.withColumn(
        "bucket_start", F.timestamp_millis(F.col("bucket_ms"))).drop("bucket_ms")
    return out.select(*OUTPUT_COLUMNS)


def aggregate_stream(spark, rows, inp: AggregateInput) -> StreamAggregates:
    """Aggregate one stream; the caller writes ``minute``/``hour`` and then
    calls :meth:`StreamAggregates.unpersist`."""
    from pyspark.sql import functions as F

    facts = build_facts(spark, rows, inp)
    result = StreamAggregates(
        minute=_bucket_aggregates(F, facts, "minute", inp),
        hour=_bucket_aggregates(F, facts, "hour", inp),
        _cached=[facts],
    )
    is_new = F.col("id") > F.lit(inp.new_above)
    new_id = F.when(is_new, F.col("id"))
    for r in facts.groupBy("date").agg(
            F.min(new_id).alias("first"),
            F.min_by("prev_id", new_id).alias("prev"),
            F.count(new_id).alias("facts"),
            F.sum(F.when(is_new, F.col("nrows"))).alias("rows"),
            F.sum(F.when(is_new, F.col("rollbacks"))).alias("rollbacks")).collect():
        result.dates.append(r["date"])
        if r["first"] is None:
            continue
        result.new_dates[r["date"]] = (int(r["first"]),
                                       None if r["prev"] is None else int(r["prev"]))
        result.new_facts += int(r["facts"])
        result.new_rows += int(r["rows"])
        result.new_rollbacks += int(r["rollbacks"])
    result.dates.sort()
    return result


def write_partitions(df, path: str) -> None:
    """Write one stream's buckets under ``path`` as ``date=D/`` partitions,
    one file per date."""
    df.repartition("date").write.mode("overwrite").partitionBy("date").parquet(path)
