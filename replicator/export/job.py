"""Planning and running one export: positions -> ranges -> Spark -> commit.

One run, for every selected stream:

1. **Plan** (driver, one-row queries): the linear persisted position ``L``
   (minimum over the configured writers; a missing writer counts as 0), the
   range ``(token, upper]`` with ``upper = L`` (or less with ``--until``),
   and the ID/time bounds of its rows.  Nothing above ``L`` is ever read, so
   a fact still in flight -- or an ID below it that could still complete on
   another writer -- is never exported, half-written or skipped.
2. **Re-aggregation range**: the partitions rewritten are the dates from the
   earliest date among the new facts on (a late fact can land on a date
   already exported); they are read from the first fact of the earliest such
   date, known from the state, so every bucket written is complete.
3. **Spark**: JDBC read in ``partitions`` ID ranges, aggregation
   (:mod:`.aggregate`), Parquet per (stream, date) into the staging
   generation; the other partitions are hard-linked from the current one.
4. **Commit** (:mod:`.state`): state and Parquet appear together, atomically;
   a run with nothing new for any stream commits nothing at all.
"""

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..config import DatabaseConfig, StreamConfig
from .aggregate import chunking
from .reference import utc_date
from .source import (MIN_TOKEN, JdbcTarget, Metadata, RangeBounds, SourceError, find_jdbc_jar,
                     jdbc_target, linear_position, read_rows)
from .state import ExportState, OutputStore, StateError, StreamState, now_iso

log = logging.getLogger("replicator.export")


@dataclass
class ExportOptions:
    """Everything a run takes besides the database and the streams."""

    output: str
    master: Optional[str] = None
    partitions: int = 4
    shuffle_partitions: int = 8
    streams: Optional[Sequence[str]] = None  # names; None = all configured
    since_ms: Optional[int] = None
    until_ms: Optional[int] = None
    full: bool = False
    jdbc_jar: Optional[str] = None
    plot: Optional[str] = None
    plot_hours: float = 24.0
    progress_interval: float = 2.0
    spark_conf: Dict[str, str] = field(default_factory=dict)  # --conf KEY=VALUE
    now_ms: Optional[int] = None  # the run's time (tests); default: the clock
    keep_previous: int = 1  # generations kept below the current one (--keep)


@dataclass
class StreamPlan:
    """What one stream's run will do (see the module docstring)."""

    stream: StreamConfig
    positions: Dict[str, int]
    position: int
    state: Optional[StreamState]
    lower: int  # exclusive: the previous token (MIN_TOKEN on a first export)
    upper: int  # inclusive: the token this run advances to
    bounds: Optional[RangeBounds] = None
    run_ms: int = 0
    from_date: Optional[str] = None
    floor: Optional[int] = None
    prev: Optional[int] = None
    chunk_len: int = 1
    chunk_prev: Dict[int, Optional[int]] = field(default_factory=dict)
    note: str = ""

    @property
    def advances(self) -> bool:
        return self.upper > self.lower

    @property
    def has_facts(self) -> bool:
        return self.bounds is not None and self.bounds.min_id is not None


@dataclass
class StreamReport:
    """One line of the summary table."""

    stream: str
    position: int
    lower: Optional[int]
    upper: Optional[int]
    status: str
    facts: int = 0
    rows: int = 0
    rollbacks: int = 0
    dates: List[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class ExportResult:
    reports: List[StreamReport]
    generation: Optional[str]  # the committed generation, None for a no-op
    seconds: float = 0.0

    @property
    def changed(self) -> bool:
        return self.generation is not None


def layout_of(stream: StreamConfig) -> Dict[str, Optional[str]]:
    return {"table": stream.table, "id_column": stream.id_column,
            "writer_column": stream.writer_column,
            "timestamp_column": stream.timestamp_column}


# ------------------------------------------------------------------ plan
def plan_stream(meta: Metadata, stream: StreamConfig, state: Optional[StreamState],
                options: ExportOptions, run_ms: int) -> StreamPlan:
    positions = meta.positions(stream.positions_key)
    position = linear_position(positions, stream.writers)
    if state is not None and state.observed:
        run_ms = max(run_ms, max(ms for _lo, _hi, ms in state.observed))
    lower = state.token if state is not None else MIN_TOKEN
    plan = StreamPlan(stream, positions, position, state, lower, max(lower, position),
                      run_ms=run_ms)
    missing = [w for w in stream.writers if w not in positions]
    if missing:
        plan.upper = lower
        plan.note = f"no persisted position for {', '.join(missing)}"
        return plan
    if position <= lower:
        plan.upper = lower
        plan.note = "nothing new"
        return plan
    ts = stream.timestamp_column
    since, until = options.since_ms, options.until_ms
    if ts is None:
        # Facts are timed by this run: the window applies to the run's time.
        if (until is not None and run_ms >= until) or (since is not None and run_ms < since):
            plan.upper = lower
            plan.note = "outside --since/--until (timed by the export run)"
            return plan
    else:
        if until is not None:
            hit = meta.first_id_at(stream, lower, plan.upper, until, null_counts=run_ms >= until)
            if hit is not None:
                plan.upper = hit - 1
        if state is None and since is not None:
            hit = meta.first_id_at(stream, lower, plan.upper, since, null_counts=run_ms >= since)
            plan.lower = plan.upper if hit is None else hit - 1
            lower = plan.lower
    if plan.upper <= lower:
        plan.upper = lower
        plan.note = "nothing new" if until is None else "nothing before --until"
        return plan
    plan.bounds = meta.bounds(stream, lower, plan.upper)
    if not plan.has_facts:
        plan.note = "no facts (rollbacks only)"
        return plan
    dates = []
    if plan.bounds.min_ts is not None:
        dates.append(utc_date(plan.bounds.min_ts))
    if plan.bounds.has_null_ts:
        dates.append(utc_date(run_ms))
    plan.from_date = min(dates)
    plan.floor = plan.bounds.min_id
    plan.prev = state.last_fact if state is not None and lower == state.token else None
    if state is not None:
        for date, (first, prev) in state.dates.items():
            if date >= plan.from_date and first < plan.floor:
                plan.floor, plan.prev = first, prev
    # The rollback lag runs per ID chunk; each chunk starts from the largest
    # ID below it (an index probe each).
    plan.chunk_len, starts = chunking(plan.floor, plan.bounds.max_id,
                                      max(options.shuffle_partitions, options.partitions))
    for k, start in enumerate(starts, 1):
        plan.chunk_prev[k] = meta.max_id_below(stream, plan.floor, start)
    return plan


def _observed_ranges(plan: StreamPlan) -> List[Tuple[int, int, int]]:
    """Observed-time ranges relevant to the read range, this run's included."""
    ranges = []
    if plan.state is not None:
        ranges = [tuple(r) for r in plan.state.observed if r[1] >= plan.floor]
    if plan.bounds.has_null_ts:
        ranges.append((plan.lower, plan.upper, plan.run_ms))
    return ranges


def _next_state(plan: StreamPlan, agg) -> StreamState:
    stream = plan.stream
    old = plan.state
    st = StreamState(token=plan.upper, layout=layout_of(stream))
    if old is not None:
        st.last_fact, st.dates = old.last_fact, dict(old.dates)
        st.observed = [list(r) for r in old.observed]
        st.facts, st.rows, st.rollbacks = old.facts, old.rows, old.rollbacks
    st.updated_at = now_iso()
    if agg is None:
        return st
    st.last_fact = plan.bounds.max_id
    for date, (first, prev) in agg.new_dates.items():
        st.dates.setdefault(date, [first, prev])
    st.facts += agg.new_facts
    st.rows += agg.new_rows
    st.rollbacks += agg.new_rollbacks
    if plan.bounds.has_null_ts:
        st.observed.append([plan.lower, plan.upper, plan.run_ms])
    if stream.timestamp_column is None and st.observed:
        # Runs only move forward in time: an untimestamped stream re-aggregates
        # at most the latest run's date, so older ranges are never needed.
        latest = utc_date(st.observed[-1][2])
        st.observed = [r for r in st.observed if utc_date(r[2]) == latest]
    return st


# ----------------------------------------------------------------- spark
def spark_session(master: Optional[str], jars: Sequence[str], shuffle_partitions: int = 8,
                  extra_conf: Optional[Dict[str, str]] = None):
    """The SparkSession of this process (created if needed).

    ``master`` None leaves the master to ``spark-submit`` when launched by
    it, else ``local[*]``.  The JDBC jars go on ``spark.jars`` (local mode
    needs nothing else; on a cluster give them to ``spark-submit --jars``).
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("replicator-export")
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    if master:
        builder = builder.master(master)
    elif not submitted:
        builder = builder.master("local[*]")
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    if not submitted:
        builder = builder.config("spark.ui.enabled", "false")
    builder = (
        builder.config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    for key, value in (extra_conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def _configure(spark, shuffle_partitions: int) -> None:
    conf = spark.conf
    conf.set("spark.sql.session.timeZone", "UTC")
    conf.set("spark.sql.shuffle.partitions", str(shuffle_partitions))
    conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")


class Progress:
    """Prints the running Spark stages of the current stream every few seconds."""

    def __init__(self, spark, interval: float):
        self.sc = spark.sparkContext
        self.interval = interval
        self.stream = ""
        self._stop = threading.Event()
        self._thread = None
        self._last = None

    def start(self) -> "Progress":
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="export-progress", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        tracker = self.sc.statusTracker()
        while not self._stop.wait(self.interval):
            try:
                parts = []
                for sid in sorted(tracker.getActiveStageIds()):
                    info = tracker.getStageInfo(sid)
                    if info is not None:
                        parts.append(f"stage {sid} {info.numCompletedTasks}/{info.numTasks}")
            except Exception:  # the context is stopping
                return
            line = ", ".join(parts)
            if line and line != self._last:
                log.info("[%s] %s tasks done", self.stream, line)
            self._last = line

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


# ------------------------------------------------------------------- run
def select_streams(streams: Sequence[StreamConfig], names: Optional[Sequence[str]]
                   ) -> List[StreamConfig]:
    if not names:
        return list(streams)
    known = {s.name: s for s in streams}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SourceError(f"--streams: unknown stream(s) {', '.join(unknown)} "
                          f"(configured: {', '.join(known) or 'none'})")
    return [known[n] for n in names]


def run_export(db: DatabaseConfig, streams: Sequence[StreamConfig], options: ExportOptions,
               spark=None) -> ExportResult:
    """One export run (see the module docstring).  ``spark``: reuse a session.

    Raises SourceError/StateError (one-line problems) or whatever Spark
    raises; in every failure the previous export stays current.
    """
    started = time.monotonic()
    selected = select_streams(streams, options.streams)
    store = OutputStore(options.output, keep_previous=options.keep_previous)
    sessions = _Sessions(spark, db, options)
    store.lock()
    try:
        result = _run_locked(db, selected, store, options, sessions, started)
        current = store.current_path()
        if options.plot and current is not None:
            from .plot import plot_facts_per_minute

            path = plot_facts_per_minute(
                sessions.get(), os.path.join(current, "minute"), options.plot,
                options.plot_hours, timed=[s.name for s in streams if s.timestamp_column],
                now_ms=options.now_ms)
            log.info("plot %s", f"written to {path}" if path else "skipped: no data")
        result.seconds = time.monotonic() - started
        return result
    finally:
        store.unlock()
        sessions.stop()


class _Sessions:
    """The SparkSession of a run: the caller's, or one started on first need
    (and stopped at the end)."""

    def __init__(self, spark, db: DatabaseConfig, options: ExportOptions):
        self.spark = spark
        self.db = db
        self.options = options
        self.own = False

    def get(self):
        if self.spark is None:
            from pyspark.sql import SparkSession

            self.spark = SparkSession.getActiveSession()  # e.g. a test's, a notebook's
        if self.spark is None:
            jar = find_jdbc_jar(self.db.engine, self.options.jdbc_jar)
            log.info("starting Spark (%s)", self.options.master or "local[*]")
            self.spark = spark_session(self.options.master, [jar],
                                       self.options.shuffle_partitions, self.options.spark_conf)
            self.own = True
        _configure(self.spark, self.options.shuffle_partitions)
        return self.spark

    def stop(self) -> None:
        if self.own and self.spark is not None:
            self.spark.stop()
            self.spark = None


def _run_locked(db, selected, store: OutputStore, options: ExportOptions, sessions: _Sessions,
                started: float) -> ExportResult:
    state = store.load_state()
    run_ms = options.now_ms if options.now_ms is not None else int(time.time() * 1000)
    for stream in selected:
        old = state.streams.get(stream.name)
        if old is not None and not options.full and old.layout and old.layout != layout_of(stream):
            raise StateError(
                f"stream {stream.name}: table layout changed since the last export "
                f"({old.layout} -> {layout_of(stream)}); rerun with --full")
    meta = Metadata(db)
    try:
        plans = []
        for stream in selected:
            old = None if options.full else state.streams.get(stream.name)
            plan = plan_stream(meta, stream, old, options, run_ms)
            plans.append(plan)
            writers = ", ".join(f"{w}={plan.positions.get(w, 0)}" for w in stream.writers)
            if plan.advances:
                log.info("[%s] linear position %d (%s); exporting (%s, %d]%s", stream.name,
                         plan.position, writers, _tok(plan.lower), plan.upper,
                         f": {plan.note}" if plan.note else "")
            else:
                log.info("[%s] linear position %d (%s): %s", stream.name, plan.position,
                         writers, plan.note or "nothing new")
    finally:
        meta.close()

    if not options.full and not any(p.advances for p in plans):
        reports = [StreamReport(p.stream.name, p.position, p.lower, p.upper, p.note or
                                "nothing new") for p in plans]
        return ExportResult(reports, None, time.monotonic() - started)

    target = jdbc_target(db)
    spark = sessions.get() if any(p.has_facts for p in plans) else None
    progress = Progress(spark, options.progress_interval).start() if spark is not None else None
    staging = store.begin()
    try:
        reports = []
        new_state = ExportState(generation=state.generation)
        selected_names = {p.stream.name for p in plans}
        for name, st in state.streams.items():
            if name not in selected_names:
                new_state.streams[name] = st
                staging.carry_stream(name)
        for plan in plans:
            if progress is not None:
                progress.stream = plan.stream.name
            reports.append(_export_stream(spark, target, plan, staging, new_state, options))
        generation = store.commit(staging, new_state)
    except BaseException:
        store.abort(staging)
        raise
    finally:
        if progress is not None:
            progress.stop()
    log.info("committed %s", generation)
    return ExportResult(reports, generation, time.monotonic() - started)


def _tok(token: int) -> str:
    return "start" if token == MIN_TOKEN else str(token)


def _export_stream(spark, target: JdbcTarget, plan: StreamPlan, staging, new_state,
                   options: ExportOptions) -> StreamReport:
    from .aggregate import AggregateInput, aggregate_stream, write_partitions

    t0 = time.monotonic()
    name = plan.stream.name
    report = StreamReport(name, plan.position, plan.lower, plan.upper,
                          plan.note or "nothing new")
    if not plan.has_facts:
        if plan.state is not None:
            staging.carry_stream(name)
        if plan.advances or plan.state is not None:
            new_state.streams[name] = (_next_state(plan, None) if plan.advances
                                       else plan.state)
        report.seconds = time.monotonic() - t0
        return report
    spark.sparkContext.setJobDescription(f"export {name}")
    rows = read_rows(spark, target, plan.stream, plan.floor, plan.bounds.max_id,
                     options.partitions)
    inp = AggregateInput(
        floor=plan.floor, upper=plan.bounds.max_id, new_above=plan.lower, prev=plan.prev,
        observed=_observed_ranges(plan), default_ms=plan.run_ms, from_date=plan.from_date,
        single_writer=len(plan.stream.writers) == 1,
        has_timestamp=plan.stream.timestamp_column is not None,
        chunk_len=plan.chunk_len, chunk_prev=plan.chunk_prev,
    )
    agg = aggregate_stream(spark, rows, inp)
    try:
        log.info("[%s] %d new facts (%d rows, %d rollbacks); rewriting %d date partition(s) "
                 "from %s", name, agg.new_facts, agg.new_rows, agg.new_rollbacks,
                 len(agg.dates), plan.from_date)
        write_partitions(agg.minute, staging.stream_dir("minute", name))
        write_partitions(agg.hour, staging.stream_dir("hour", name))
    finally:
        agg.unpersist()
    if plan.state is not None:
        staging.carry_stream(name, keep_date=lambda d: d < plan.from_date)
    new_state.streams[name] = _next_state(plan, agg)
    report.status = "exported"
    report.facts, report.rows, report.rollbacks = agg.new_facts, agg.new_rows, agg.new_rollbacks
    report.dates = agg.dates
    report.seconds = time.monotonic() - t0
    log.info("[%s] done in %.1fs", name, report.seconds)
    return report


def format_summary(result: ExportResult) -> str:
    """The summary table printed at the end of a run."""
    header = ("stream", "position", "exported", "facts", "rows", "rollbacks", "dates",
              "seconds", "status")
    lines = [header]
    for r in result.reports:
        exported = f"({_tok(r.lower)}, {r.upper}]" if r.upper is not None and \
            r.lower is not None and r.upper > r.lower else "-"
        dates = ("-" if not r.dates else r.dates[0] if len(r.dates) == 1
                 else f"{r.dates[0]}..{r.dates[-1]} ({len(r.dates)})")
        lines.append((r.stream, str(r.position), exported, str(r.facts), str(r.rows),
                      str(r.rollbacks), dates, f"{r.seconds:.1f}", r.status))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = []
    for i, row in enumerate(lines):
        out.append("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(row)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    tail = (f"committed {result.generation}" if result.generation
            else "nothing new: the export is unchanged")
    out.append(f"{tail} ({result.seconds:.1f}s)")
    return "\n".join(out)
