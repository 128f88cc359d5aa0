"""The Spark aggregation of one stream's facts into minute and hour buckets.

It computes exactly the definitions of :mod:`.reference` (which is the
test oracle), from the facts :func:`.source.read_facts` reads: one row per
fact with ``floor <= id <= upper`` (the database grouped the rows per ID),
one partition per ID chunk ``[floor + k * chunk_len, floor + (k + 1) *
chunk_len)``, each fact with its time and its two lags within its chunk
(the previous fact; the previous fact of its writer and UTC day), so Spark
neither shuffles nor sorts the facts:

1. facts are dated in UTC from their time (the row time, or the export run:
   ``observed`` ranges);
2. rollbacks: ``id - previous fact ID - 1``; a chunk's first fact takes as
   previous the largest ID below the chunk (``chunk_prev``, found by the
   planner with one index probe per chunk), and at the range start ``prev``
   (the fact before ``floor``, from the state);
3. keep facts dated ``from_date`` or later (the partitions being rewritten;
   the rows below them were read only to find previous IDs); persisted;
4. one small job over them per (chunk, writer, date): the row time of each
   group's last fact (a later chunk's first fact of that writer and date
   takes it as its previous row time: gaps are the row time minus the
   previous one) and the driver-side summary (dates; new dates for the
   state; totals);
5. group by (date, writer, bucket) for each granularity; on a multi-writer
   stream the rollbacks form rows of their own with ``writer = ""``.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from .reference import GRANULARITIES, PERCENTILES, SIZE_BINS

if TYPE_CHECKING:  # PySpark is the exporter's extra, imported when a run starts
    from pyspark.sql import Column, DataFrame, SparkSession

#: ``(chunk, writer, date)``, and its row time (None: the fact has none).
GroupKey = tuple[int, str, str]

OUTPUT_COLUMNS = (
    "writer", "bucket_start", "facts", "rows", "multi_row_facts", "max_fact_rows",
) + tuple(b[0] for b in SIZE_BINS) + (
    "rollbacks", "first_token", "last_token", "facts_per_s", "rows_per_s",
) + tuple(p[0] for p in PERCENTILES) + ("date",)


@dataclass
class AggregateInput:
    """What the Spark job needs besides the facts.

    * ``new_above``: facts with a larger ID are new in this run (the
      previous token);
    * ``prev``: the fact ID just below the range read (None at the stream
      start);
    * ``from_date``: partitions from this UTC date on are rewritten;
    * ``single_writer``: rollbacks belong to the one writer;
    * ``has_timestamp``: the stream has a timestamp column (rates);
    * ``chunk_prev``: the facts are read and lagged per ID chunk
      (:func:`chunking`); ``chunk_prev[k]`` is the largest ID below chunk
      ``k`` that is in the range read (None: use ``prev``).
    """

    new_above: int
    prev: int | None
    from_date: str
    single_writer: bool
    has_timestamp: bool
    chunk_prev: dict[int, int | None] = field(default_factory=dict)


def chunking(floor: int, upper: int, chunks: int) -> tuple[int, list[int]]:
    """``(chunk_len, starts)``: ``[floor, upper]`` cut into ``chunks`` ID ranges;
    ``starts`` are the first IDs of chunks 1.. (probe the largest ID below each)."""
    chunks = max(1, int(chunks))
    chunk_len = max(1, math.ceil((upper - floor + 1) / chunks))
    starts = [floor + k * chunk_len for k in range(1, chunks) if floor + k * chunk_len <= upper]
    return chunk_len, starts


@dataclass
class StreamAggregates:
    """The result for one stream: DataFrames to write plus driver-side facts."""

    minute: "DataFrame"
    hour: "DataFrame"
    new_dates: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    new_facts: int = 0
    new_rows: int = 0
    new_rollbacks: int = 0
    dates: list[str] = field(default_factory=list)
    _cached: list["DataFrame"] = field(default_factory=list)

    def unpersist(self) -> None:
        for df in self._cached:
            df.unpersist()
        self._cached.clear()


def _chunk_prev_expr(F: ModuleType, inp: AggregateInput) -> "Column":
    """The fact before each chunk's first fact: ``chunk_prev``, ``prev`` at
    the range start (NULL: none)."""
    chunk_prev: Column | None = None
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
    if chunk_prev is not None:
        return chunk_prev
    none: Column = F.lit(None).cast("long")
    return none


def build_facts(spark: "SparkSession", facts: "DataFrame", inp: AggregateInput) -> "DataFrame":
    """The facts with date and rollbacks, from ``from_date`` on (persisted;
    the gaps need :func:`day_starts` first)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    prev_id = F.coalesce(F.col("chunk_prev_id"), _chunk_prev_expr(F, inp))
    return (
        facts.withColumn("date", F.date_format(F.timestamp_millis(F.col("time_ms")),
                                               "yyyy-MM-dd"))
        .withColumn("prev_id", prev_id)
        .withColumn("rollbacks", F.when(F.col("prev_id").isNull(), F.lit(0).cast("long"))
                    .otherwise(F.col("id") - F.col("prev_id") - F.lit(1)))
        .where(F.col("date") >= F.lit(inp.from_date))
        .persist(StorageLevel.MEMORY_AND_DISK)
    )


def day_starts(groups: Iterable[tuple[int, str, str, int | None]],
               ) -> dict[GroupKey, int | None]:
    """``{(chunk, writer, date): rowtime}``: for every (chunk, writer, date)
    group after the first of its (writer, date), the row time (maybe None) of
    that writer's last fact of the date in the chunks before it.

    ``groups``: ``(chunk, writer, date, last_rowtime)`` of every group
    (``last_rowtime``: the row time of its largest ID).
    """
    out: dict[GroupKey, int | None] = {}
    last: dict[tuple[str, str], int | None] = {}
    for chunk, writer, date, rowtime in sorted(groups, key=lambda g: g[0]):
        key = (writer, date)
        if key in last:
            out[(chunk, writer, date)] = last[key]
        last[key] = rowtime
    return out


def starts_frame(spark: "SparkSession", starts: dict[GroupKey, int | None]) -> "DataFrame":
    """:func:`day_starts` as a DataFrame (``chunk, writer, date,
    start_rowtime, started``) made of literals in the JVM: no Python task,
    so a cluster's executors need no Python (``createDataFrame`` of a list
    would run one)."""
    from pyspark.sql import functions as F

    def row(chunk: int | None, writer: str | None, date: str | None,
            rowtime: int | None, started: bool | None) -> "Column":
        return F.struct(F.lit(chunk).cast("int").alias("chunk"),
                        F.lit(writer).cast("string").alias("writer"),
                        F.lit(date).cast("string").alias("date"),
                        F.lit(rowtime).cast("long").alias("start_rowtime"),
                        F.lit(started).cast("boolean").alias("started"))

    rows = [row(c, w, d, t, True) for (c, w, d), t in sorted(starts.items())]
    if not rows:
        return spark.range(0).select(F.inline(F.array(row(None, None, None, None, None))))
    return spark.range(1).select(F.inline(F.array(*rows)))


def with_gaps(spark: "SparkSession", facts: "DataFrame",
              starts: dict[GroupKey, int | None]) -> "DataFrame":
    """``facts`` with ``gap``: the row time minus the previous row time of
    the same writer and date in ID order (the database's lag within a chunk,
    ``starts`` (:func:`day_starts`) for a chunk's first fact of a day)."""
    from pyspark.sql import functions as F

    joined = facts.join(F.broadcast(starts_frame(spark, starts)), ["chunk", "writer", "date"],
                        "left")
    gap = (F.when(F.col("day_prev_id").isNotNull(),
                  F.col("rowtime") - F.col("day_prev_rowtime"))
           .when(F.col("started"), F.col("rowtime") - F.col("start_rowtime")))
    return joined.withColumn("gap", gap)


def _bucket_aggregates(F: ModuleType, facts: "DataFrame", granularity: str,
                       inp: AggregateInput) -> "DataFrame":
    length = GRANULARITIES[granularity]
    seconds = length / 1000.0
    bucket_ms = (F.floor(F.col("time_ms") / F.lit(length)) * F.lit(length)).cast("long")
    f = facts.withColumn("bucket_ms", bucket_ms)
    sizes = []
    for name, lo, hi in SIZE_BINS:
        cond = F.col("nrows") >= lo if hi is None else F.col("nrows").between(lo, hi)
        sizes.append(F.sum(F.when(cond, 1).otherwise(0)).cast("long").alias(name))
    rollbacks = (F.sum("rollbacks") if inp.single_writer else F.lit(0)).cast("long")
    pct = F.expr("percentile(gap, array({}))".format(
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
        missing = (
            f.where(F.col("rollbacks") > 0)
            .groupBy("date", "bucket_ms")
            .agg(F.sum("rollbacks").cast("long").alias("rollbacks"))
            .withColumn("writer", F.lit(""))
        )
        for name in ("facts", "rows", "multi_row_facts", "max_fact_rows") + tuple(
                b[0] for b in SIZE_BINS):
            missing = missing.withColumn(name, F.lit(0).cast("long"))
        for name in ("first_token", "last_token"):
            missing = missing.withColumn(name, F.lit(None).cast("long"))
        for name in ("facts_per_s", "rows_per_s") + tuple(p[0] for p in PERCENTILES):
            missing = missing.withColumn(name, F.lit(None).cast("double"))
        writers = writers.unionByName(missing)
    out = writers.withColumn(
        "bucket_start", F.timestamp_millis(F.col("bucket_ms"))).drop("bucket_ms")
    return out.select(*OUTPUT_COLUMNS)


def aggregate_stream(spark: "SparkSession", facts: "DataFrame",
                     inp: AggregateInput) -> StreamAggregates:
    """Aggregate one stream's facts (:func:`.source.read_facts`); the caller
    writes ``minute``/``hour`` and then calls :meth:`StreamAggregates.unpersist`.

    One job over the persisted facts collects per (chunk, writer, date) what
    the driver needs: the gaps' chunk starts and the run's summary.
    """
    from pyspark.sql import functions as F

    cached = build_facts(spark, facts, inp)
    is_new = F.col("id") > F.lit(inp.new_above)
    new_id = F.when(is_new, F.col("id"))
    groups = cached.groupBy("chunk", "writer", "date").agg(
        F.max(F.struct("id", "rowtime")).getField("rowtime").alias("last_rowtime"),
        F.min(new_id).alias("first"),
        F.min_by("prev_id", new_id).alias("prev"),
        F.count(new_id).alias("facts"),
        F.sum(F.when(is_new, F.col("nrows"))).alias("rows"),
        F.sum(F.when(is_new, F.col("rollbacks"))).alias("rollbacks")).collect()
    facts = with_gaps(spark, cached, day_starts(
        (r["chunk"], r["writer"], r["date"], r["last_rowtime"]) for r in groups))
    result = StreamAggregates(
        minute=_bucket_aggregates(F, facts, "minute", inp),
        hour=_bucket_aggregates(F, facts, "hour", inp),
        _cached=[cached],
    )
    firsts: dict[str, tuple[int, int | None] | None] = {}
    for r in groups:
        date = r["date"]
        if r["first"] is None:
            firsts.setdefault(date, None)
            continue
        first = firsts.get(date)
        if first is None or r["first"] < first[0]:
            firsts[date] = (int(r["first"]), None if r["prev"] is None else int(r["prev"]))
        result.new_facts += int(r["facts"])
        result.new_rows += int(r["rows"])
        result.new_rollbacks += int(r["rollbacks"])
    result.dates = sorted(firsts)
    result.new_dates = {d: f for d, f in firsts.items() if f is not None}
    return result


def write_partitions(df: "DataFrame", path: str) -> None:
    """Write one stream's buckets under ``path`` as ``date=D/`` partitions,
    one file per date, its rows in (writer, bucket) order: the same data
    pages whatever order the shuffle delivered the rows in (a cluster's and
    a local run's files are equal; the sort is the one the partitioned
    write makes anyway, by date, extended)."""
    (df.repartition("date").sortWithinPartitions("date", "writer", "bucket_start")
     .write.mode("overwrite").partitionBy("date").parquet(path))
