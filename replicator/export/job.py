"""Running one export: plan -> Spark -> commit.

One run, for every selected stream:

1. **Plan** (:mod:`.plan`, driver, one-row queries): the range up to the
   linear persisted position and the date partitions to rewrite.
2. **Spark** (:mod:`.spark` for the session): JDBC read of the facts
   (grouped by the database) in ``partitions`` ID ranges, aggregation
   (:mod:`.aggregate`), Parquet per (stream, date) into the staging
   generation; the other partitions are hard-linked from the current one.
3. **Commit** (:mod:`.state`): state and Parquet appear together, atomically;
   a run with nothing new for any stream commits nothing at all.
"""

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ..config import DatabaseConfig, StreamConfig
from .options import ExportOptions
from .plan import StreamPlan, check_read, layout_of, next_state, observed_ranges, plan_stream
from .source import MIN_TOKEN, JdbcTarget, Metadata, SourceError, jdbc_target, read_facts
from .spark import Progress, RunSession
from .state import ExportState, OutputStore, Staging, StateError

if TYPE_CHECKING:  # PySpark is the exporter's extra, imported when a run starts
    from pyspark.sql import SparkSession

log = logging.getLogger("replicator.export")


@dataclass
class StreamReport:
    """One line of the summary table."""

    stream: str
    position: int
    lower: int | None
    upper: int | None
    status: str
    facts: int = 0
    rows: int = 0
    rollbacks: int = 0
    dates: list[str] = field(default_factory=list)
    seconds: float = 0.0
    trimmed: tuple[int, int] | None = None  # (lo, hi] accepted as trimmed by retention


@dataclass
class ExportResult:
    reports: list[StreamReport]
    generation: str | None  # the committed generation, None for a no-op
    seconds: float = 0.0

    @property
    def changed(self) -> bool:
        return self.generation is not None


# ------------------------------------------------------------------- run
def select_streams(streams: Sequence[StreamConfig], names: Sequence[str] | None
                   ) -> list[StreamConfig]:
    if not names:
        return list(streams)
    known = {s.name: s for s in streams}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SourceError(f"--streams: unknown stream(s) {', '.join(unknown)} "
                          f"(configured: {', '.join(known) or 'none'})")
    return [known[n] for n in names]


def run_export(db: DatabaseConfig, streams: Sequence[StreamConfig], options: ExportOptions,
               spark: Optional["SparkSession"] = None) -> ExportResult:
    """One export run (see the module docstring).  ``spark``: reuse a session.

    Raises SourceError/StateError (one-line problems) or whatever Spark
    raises; in every failure the previous export stays current.
    """
    started = time.monotonic()
    selected = select_streams(streams, options.streams)
    store = OutputStore(options.output, keep_previous=options.keep_previous)
    sessions = RunSession(spark, db, options)
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


def _run_locked(db: DatabaseConfig, selected: Sequence[StreamConfig], store: OutputStore,
                options: ExportOptions, sessions: RunSession, started: float) -> ExportResult:
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
        return _plan_and_export(db, selected, store, options, sessions, started, state, run_ms,
                                meta)
    finally:
        meta.close()


def _plan_and_export(db: DatabaseConfig, selected: Sequence[StreamConfig], store: OutputStore,
                     options: ExportOptions, sessions: RunSession, started: float,
                     state: ExportState, run_ms: int, meta: Metadata) -> ExportResult:
    plans = []
    for stream in selected:
        old = None if options.full else state.streams.get(stream.name)
        plan = plan_stream(meta, stream, old, options, run_ms)
        plans.append(plan)
        writers = ", ".join(f"{w}={plan.positions.get(w, 0)}" for w in stream.writers)
        trimmed = (f"; facts {_range(plan.trimmed)} were trimmed by retention (accepted)"
                   if plan.trimmed else "")
        if plan.advances:
            log.info("[%s] linear position %d (%s); exporting (%s, %d]%s%s", stream.name,
                     plan.position, writers, _tok(plan.lower), plan.upper,
                     f": {plan.note}" if plan.note else "", trimmed)
        else:
            log.info("[%s] linear position %d (%s): %s", stream.name, plan.position,
                     writers, plan.note or "nothing new")

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
            reports.append(_export_stream(spark, target, plan, staging, new_state, options,
                                          meta))
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


def _range(span: tuple[int, int]) -> str:
    return f"({_tok(span[0])}, {span[1]}]"


def _export_stream(spark: Optional["SparkSession"], target: JdbcTarget, plan: StreamPlan,
                   staging: Staging, new_state: ExportState, options: ExportOptions,
                   meta: Metadata) -> StreamReport:
    from .aggregate import AggregateInput, aggregate_stream, write_partitions

    t0 = time.monotonic()
    name = plan.stream.name
    report = StreamReport(name, plan.position, plan.lower, plan.upper,
                          plan.note or "nothing new", trimmed=plan.trimmed)
    if not plan.has_facts:
        if plan.state is not None:
            staging.carry_stream(name)
        if plan.advances or plan.state is not None:
            if plan.advances:
                new_state.streams[name] = next_state(plan, None)
            elif plan.state is not None:
                new_state.streams[name] = plan.state
        report.seconds = time.monotonic() - t0
        return report
    # A plan with facts has its read planned, and the run a session.
    floor, bounds, from_date = plan.floor, plan.bounds, plan.from_date
    assert spark is not None and floor is not None and bounds is not None \
        and bounds.max_id is not None and from_date is not None
    spark.sparkContext.setJobDescription(f"export {name}")
    facts = read_facts(spark, target, plan.stream, floor, bounds.max_id,
                       plan.chunk_len, observed_ranges(plan), plan.run_ms)
    inp = AggregateInput(
        new_above=plan.lower, prev=plan.prev, from_date=from_date,
        single_writer=len(plan.stream.writers) == 1,
        has_timestamp=plan.stream.timestamp_column is not None, chunk_prev=plan.chunk_prev,
    )
    agg = aggregate_stream(spark, facts, inp)
    try:
        log.info("[%s] %d new facts (%d rows, %d rollbacks); rewriting %d date partition(s) "
                 "from %s", name, agg.new_facts, agg.new_rows, agg.new_rollbacks,
                 len(agg.dates), plan.from_date)
        write_partitions(agg.minute, staging.stream_dir("minute", name))
        write_partitions(agg.hour, staging.stream_dir("hour", name))
    finally:
        agg.unpersist()
    check_read(meta, plan)  # every read of the stream is done
    if plan.state is not None:
        staging.carry_stream(name, keep_date=lambda d: d < from_date)
    new_state.streams[name] = next_state(plan, agg)
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
        status = (f"{r.status}; {_range(r.trimmed)} trimmed by retention (accepted)"
                  if r.trimmed else r.status)
        lines.append((r.stream, str(r.position), exported, str(r.facts), str(r.rows),
                      str(r.rollbacks), dates, f"{r.seconds:.1f}", status))
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
