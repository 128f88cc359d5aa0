"""The export's aggregates in plain Python, in one pass over rows in ID order.

This is the specification the Spark job (:mod:`.aggregate`) is tested
against, and the baseline of ``make bench`` (fed by a psycopg2 server-side
cursor).  It shares no code with the Spark job, only these definitions:

Facts
    The rows sharing one stream ID form one *fact*.  ``rows`` is how many;
    its ``writer`` is the smallest writer value among them; its *row time*
    is the smallest non-NULL timestamp among them (None if none has one).

Time
    A fact's *time* is its row time, or -- for a stream without a timestamp
    column, or a fact whose rows have NULL timestamps -- the time of the
    export run that first exported it (``observed(id)``; the exporter keeps
    those per ID range in its state so that a re-aggregation times them the
    same way).  ``date`` is the UTC day of the time (``YYYY-MM-DD``); the
    minute and hour buckets are ``floor(time / 60000) * 60000`` and
    ``floor(time / 3600000) * 3600000`` (milliseconds, UTC).

Rollbacks (missing IDs)
    An ID that was reserved but rolled back leaves no row.  For a fact ``f``
    let ``p`` be the largest exported fact ID below ``f`` (any writer);
    ``rollbacks(f) = f - p - 1``, and 0 for the very first exported fact (IDs
    before the first exported fact are history, not rollbacks).  Missing IDs
    are therefore counted only below an exported fact, i.e. within the exported
    range and at or below the linear position; IDs above the last exported
    fact are counted by the run that exports the next fact.  They are
    reported in the bucket of ``f``: attributed to ``f``'s writer when the
    stream has exactly one configured writer, else (all writers draw from one
    sequence, the table cannot say whose ID it was) on a row of its own with
    ``writer = ""`` whose fact counts are 0, emitted only when non-zero.

Gaps between facts
    ``gap(f) = rowtime(f) - rowtime(q)`` in milliseconds, where ``q`` is
    the previous fact (by ID) of the same writer on the same date; undefined
    when there is no such ``q`` or either row time is None.  It is how far
    apart in event time a writer's consecutive facts are, not a replication
    delay (nothing here knows when a fact reached a reader).  Bounding it by
    the day keeps each (stream, date) partition computable on its own.
    ``gap_ms_p50/p95/p99`` are exact percentiles with linear interpolation
    between closest ranks (position ``p * (n - 1)``), None when no gap is
    defined in the bucket.

Per (granularity, writer, bucket) the metrics are ``facts``, ``rows``,
``multi_row_facts`` (facts of more than one row), ``max_fact_rows``, the
size histogram ``size_1``, ``size_2``, ``size_3_4``, ``size_5_8``,
``size_9_16``, ``size_17_up`` (facts by row count), ``rollbacks``,
``first_token``/``last_token`` (smallest/largest fact ID; None on a
``writer = ""`` row), ``facts_per_s``/``rows_per_s`` (count divided by the
bucket's length in seconds; None without a timestamp column and on
``writer = ""`` rows) and the gap percentiles.
"""

import datetime
import math
from collections.abc import Callable, Iterable, Sequence

GRANULARITIES = {"minute": 60_000, "hour": 3_600_000}
SIZE_BINS = (("size_1", 1, 1), ("size_2", 2, 2), ("size_3_4", 3, 4),
             ("size_5_8", 5, 8), ("size_9_16", 9, 16), ("size_17_up", 17, None))
PERCENTILES = (("gap_ms_p50", 0.5), ("gap_ms_p95", 0.95), ("gap_ms_p99", 0.99))
COUNT_METRICS = ("facts", "rows", "multi_row_facts", "max_fact_rows") + tuple(
    b[0] for b in SIZE_BINS) + ("rollbacks",)

#: One aggregate bucket: (granularity, writer, bucket_ms).
BucketKey = tuple[str, str, int]
#: One bucket's metrics by name (counts, tokens, rates, percentiles, date).
Metrics = dict[str, int | float | str | None]


def utc_date(ms: int) -> str:
    """The UTC day of a time in milliseconds since the epoch."""
    return (datetime.datetime(1970, 1, 1) + datetime.timedelta(milliseconds=ms)).strftime(
        "%Y-%m-%d")


def percentile(values: Sequence[float], p: float) -> float | None:
    """Exact percentile, linear interpolation at position ``p * (n - 1)``."""
    if not values:
        return None
    values = sorted(values)
    pos = p * (len(values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    if lo == hi:
        return float(values[lo])
    return (hi - pos) * values[lo] + (pos - lo) * values[hi]


def size_bin(rows: int) -> str:
    for name, lo, hi in SIZE_BINS:
        if rows >= lo and (hi is None or rows <= hi):
            return name
    raise ValueError(rows)


class _Bucket:
    __slots__ = ("date", "counts", "first", "last", "gaps")

    def __init__(self, date: str):
        self.date = date
        self.counts = dict.fromkeys(COUNT_METRICS, 0)
        self.first: int | None = None
        self.last: int | None = None
        self.gaps: list[int] = []


class Aggregator:
    """Feed rows ``(id, writer, ts)`` in ascending ID order; read :meth:`result`.

    ``writers`` is the number of configured writers (1 → rollbacks are the
    writer's), ``has_timestamp`` whether the stream has a timestamp column,
    ``observed(id)`` the export-run time of a fact without a row time.
    ``prev_id`` is the fact ID before the first row fed (None: none).
    """

    def __init__(self, writers: int, has_timestamp: bool,
                 observed: Callable[[int], int] = lambda _id: 0,
                 prev_id: int | None = None):
        self.single_writer = writers == 1
        self.has_timestamp = has_timestamp
        self.observed = observed
        self.prev_id = prev_id
        self.buckets: dict[BucketKey, _Bucket] = {}
        # (writer, date) -> row time of that writer's previous fact that day
        self.last_of_day: dict[tuple[str, str], int | None] = {}
        self._id: int | None = None
        self._rows = 0
        self._writer = ""  # (of the fact being fed: _id's)
        self._ts: int | None = None
        self.facts = 0
        self.row_count = 0

    def add(self, id_: int, writer: str, ts: int | None) -> None:
        if id_ != self._id:
            if self._id is not None:
                if id_ < self._id:
                    raise ValueError(f"rows out of order: {id_} after {self._id}")
                self._flush()
            self._id, self._rows, self._writer, self._ts = id_, 0, writer, ts
        else:
            if writer < self._writer:
                self._writer = writer
            if ts is not None and (self._ts is None or ts < self._ts):
                self._ts = ts
        self._rows += 1

    def feed(self, rows: Iterable[tuple[int, str, int | None]]) -> "Aggregator":
        add = self.add
        for id_, writer, ts in rows:
            add(id_, writer, ts)
        return self

    def _bucket(self, granularity: str, writer: str, bucket: int, date: str) -> _Bucket:
        key = (granularity, writer, bucket)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(date)
        return b

    def _flush(self) -> None:
        id_, rows, writer, rowtime = self._id, self._rows, self._writer, self._ts
        assert id_ is not None, "a fact is being fed"
        self.facts += 1
        self.row_count += rows
        time = rowtime if rowtime is not None else self.observed(id_)
        date = utc_date(time)
        missing = 0 if self.prev_id is None else id_ - self.prev_id - 1
        self.prev_id = id_
        day_key = (writer, date)
        gap = None
        if day_key in self.last_of_day:
            before = self.last_of_day[day_key]
            if before is not None and rowtime is not None:
                gap = rowtime - before
        self.last_of_day[day_key] = rowtime
        sbin = size_bin(rows)
        for granularity, length in GRANULARITIES.items():
            start = (time // length) * length
            b = self._bucket(granularity, writer, start, date)
            c = b.counts
            c["facts"] += 1
            c["rows"] += rows
            if rows > 1:
                c["multi_row_facts"] += 1
            if rows > c["max_fact_rows"]:
                c["max_fact_rows"] = rows
            c[sbin] += 1
            if b.first is None:
                b.first = id_
            b.last = id_
            if gap is not None:
                b.gaps.append(gap)
            if missing:
                target = b if self.single_writer else self._bucket(granularity, "", start, date)
                target.counts["rollbacks"] += missing

    def result(self) -> dict[BucketKey, Metrics]:
        """Every bucket's metrics (see the module docstring), by key."""
        if self._id is not None:
            self._flush()
            self._id = None
        out: dict[BucketKey, Metrics] = {}
        for (granularity, writer, start), b in self.buckets.items():
            seconds = GRANULARITIES[granularity] / 1000.0
            row: Metrics = dict(b.counts)
            row["date"] = b.date
            row["first_token"] = b.first
            row["last_token"] = b.last
            if self.has_timestamp and writer != "":
                row["facts_per_s"] = b.counts["facts"] / seconds
                row["rows_per_s"] = b.counts["rows"] / seconds
            else:
                row["facts_per_s"] = row["rows_per_s"] = None
            for name, p in PERCENTILES:
                row[name] = percentile(b.gaps, p)
            out[(granularity, writer, start)] = row
        return out
