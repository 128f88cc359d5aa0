"""Planning one stream's export: which range to read, which dates to rewrite.

For every selected stream, on the driver with one-row queries only:

1. **Range**: the linear persisted position ``L`` (minimum over the
   configured writers; a missing writer counts as 0), the range
   ``(token, upper]`` with ``upper = L`` (or less with ``--until``), and the
   ID/time bounds of its rows.  Nothing above ``L`` is ever read, so a fact
   still in flight -- or an ID below it that could still complete on
   another writer -- is never exported, half-written or skipped.
2. **Re-aggregation range**: the partitions rewritten are the dates from the
   earliest date among the new facts on (a late fact can land on a date
   already exported); they are read from the first fact of the earliest such
   date, known from the state, so every bucket written is complete.
3. **Trimmed facts** (retention, docs/streams.md): the stream's trim
   boundary ``B``.  A first export begins after it (what retention deleted
   before any export is not the export's).  Otherwise a run that needs a
   fact at or below ``B`` -- a new fact (``B`` above the previous token) or
   one of a date it re-aggregates -- has a gap: refused
   (:class:`.source.TrimmedError`, nothing committed) unless
   ``--accept-trimmed``, which reads from the first fact above ``B`` and
   records the range in the state (``trimmed``) and the summary.  The run
   reads ``B`` again once the stream is read (:func:`check_read`): a trim
   into the range it read, while it read, is refused either way (run again).

:func:`next_state` is the stream's state after the run commits.
"""

from dataclasses import dataclass, field

from ..config import StreamConfig
from .aggregate import StreamAggregates, chunking
from .options import ExportOptions
from .reference import utc_date
from .source import MIN_TOKEN, Metadata, RangeBounds, TrimmedError, linear_position
from .state import StreamState, now_iso


@dataclass
class StreamPlan:
    """What one stream's run will do (see the module docstring)."""

    stream: StreamConfig
    positions: dict[str, int]
    position: int
    state: StreamState | None
    lower: int  # exclusive: the previous token (MIN_TOKEN on a first export)
    upper: int  # inclusive: the token this run advances to
    bounds: RangeBounds | None = None
    run_ms: int = 0
    from_date: str | None = None
    floor: int | None = None
    prev: int | None = None
    chunk_len: int = 1
    chunk_prev: dict[int, int | None] = field(default_factory=dict)
    note: str = ""
    boundary: int = 0  # the trim boundary when planned
    trimmed: tuple[int, int] | None = None  # (lo, hi] accepted as trimmed

    @property
    def advances(self) -> bool:
        return self.upper > self.lower

    @property
    def has_facts(self) -> bool:
        return self.bounds is not None and self.bounds.min_id is not None


def layout_of(stream: StreamConfig) -> dict[str, str | None]:
    return {"table": stream.table, "id_column": stream.id_column,
            "writer_column": stream.writer_column,
            "timestamp_column": stream.timestamp_column}


def plan_stream(meta: Metadata, stream: StreamConfig, state: StreamState | None,
                options: ExportOptions, run_ms: int) -> StreamPlan:
    """What ``stream``'s run will read and write (steps 1 and 2 above).

    Only one-row queries on ``meta``; ``state`` is the stream's previous
    export (None: a first export or ``--full``); ``run_ms`` the run's time.
    """
    positions = meta.positions(stream.positions_key)
    position = linear_position(positions, stream.writers)
    boundary = meta.trimmed_through(stream)
    if state is not None and state.observed:
        run_ms = max(run_ms, max(ms for _lo, _hi, ms in state.observed))
    # A first export begins after what retention trimmed before it.
    lower = state.token if state is not None else (boundary if boundary else MIN_TOKEN)
    plan = StreamPlan(stream, positions, position, state, lower, max(lower, position),
                      run_ms=run_ms, boundary=boundary)
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
    if boundary and boundary > lower:  # new facts trimmed before this run read them
        _gap(plan, options, lower, min(boundary, plan.upper), "before this export read them")
    bounds = plan.bounds = meta.bounds(stream, lower, plan.upper)
    if bounds.min_id is None or bounds.max_id is None:
        plan.note = "no facts (rollbacks only)"
        return plan
    dates = []
    if bounds.min_ts is not None:
        dates.append(utc_date(bounds.min_ts))
    if bounds.has_null_ts:
        dates.append(utc_date(run_ms))
    from_date = plan.from_date = min(dates)
    floor = bounds.min_id
    prev = state.last_fact if state is not None and lower == state.token else None
    if state is not None:
        for date, (first, first_prev) in state.dates.items():
            if date >= from_date and first is not None and first < floor:
                floor, prev = first, first_prev
    if boundary and floor <= boundary:  # a date re-aggregated from a trimmed fact
        _gap(plan, options, min(lower, floor - 1), boundary,
             f"while the re-aggregation of {from_date} (and later dates) still needs them")
        kept = meta.bounds(stream, boundary, plan.upper).min_id
        assert kept is not None  # the new facts are above the boundary
        floor, prev = kept, None
    plan.floor, plan.prev = floor, prev
    # The read partitions are ID chunks; the lags run within each, and each
    # chunk starts from the largest ID below it (an index probe each).
    plan.chunk_len, starts = chunking(floor, bounds.max_id, options.partitions)
    for k, start in enumerate(starts, 1):
        plan.chunk_prev[k] = meta.max_id_below(stream, floor, start)
    return plan


def _gap(plan: StreamPlan, options: ExportOptions, lo: int, hi: int, why: str) -> None:
    """Facts ``(lo, hi]`` this run needs were trimmed: refuse, or record
    them with ``--accept-trimmed``."""
    name = plan.stream.name
    shown = "start" if lo == MIN_TOKEN else str(lo)
    if not options.accept_trimmed:
        raise TrimmedError(
            f"stream {name}: facts ({shown}, {hi}] were trimmed by retention {why} (its trim "
            f"boundary is {plan.boundary}); nothing was committed: to export what the table "
            f"keeps and record ({shown}, {hi}] as trimmed in state.json, run again with "
            f"--accept-trimmed")
    if plan.trimmed is not None:
        lo, hi = min(lo, plan.trimmed[0]), max(hi, plan.trimmed[1])
    plan.trimmed = (lo, hi)


def check_read(meta: Metadata, plan: StreamPlan) -> None:
    """After the stream's facts were read: refuse if retention trimmed into
    the range read while it was read (the read may have missed facts)."""
    boundary = meta.trimmed_through(plan.stream)
    if plan.floor is None or boundary <= plan.boundary or boundary < plan.floor:
        return
    raise TrimmedError(
        f"stream {plan.stream.name}: retention trimmed facts up to {boundary} while this "
        f"export read [{plan.floor}, {plan.upper}] (the trim boundary was {plan.boundary} "
        f"when it began); nothing was committed: run again (a run starts from the boundary "
        f"as it is then, with --accept-trimmed past a gap; retention that trims faster than "
        f"an export reads cannot be exported whole)")


def observed_ranges(plan: StreamPlan) -> list[tuple[int, int, int]]:
    """Observed-time ranges relevant to the read range (a planned read:
    ``plan.has_facts``), this run's included."""
    floor, bounds = plan.floor, plan.bounds
    assert floor is not None and bounds is not None, "the plan reads facts"
    ranges: list[tuple[int, int, int]] = []
    if plan.state is not None:
        ranges = [(lo, hi, ms) for lo, hi, ms in plan.state.observed if hi >= floor]
    if bounds.has_null_ts:
        ranges.append((plan.lower, plan.upper, plan.run_ms))
    return ranges


def next_state(plan: StreamPlan, agg: StreamAggregates | None) -> StreamState:
    """The stream's state once ``plan`` is committed (``agg``: the run's
    :class:`.aggregate.StreamAggregates`, None when no fact was read)."""
    stream = plan.stream
    old = plan.state
    st = StreamState(token=plan.upper, layout=layout_of(stream))
    if old is not None:
        st.last_fact, st.dates = old.last_fact, dict(old.dates)
        st.observed = [list(r) for r in old.observed]
        st.facts, st.rows, st.rollbacks = old.facts, old.rows, old.rollbacks
    st.updated_at = now_iso()
    if old is not None:
        st.trimmed = [list(r) for r in old.trimmed]
    if plan.trimmed is not None:
        lo, hi = plan.trimmed
        if st.trimmed and lo <= st.trimmed[-1][1]:  # one range, run after run
            st.trimmed[-1] = [min(lo, st.trimmed[-1][0]), max(hi, st.trimmed[-1][1])]
        else:
            st.trimmed.append([lo, hi])
    if agg is None:
        return st
    assert plan.bounds is not None, "facts were read"
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
