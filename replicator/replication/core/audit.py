"""The delivery audit: every reader proves that what it handed on at or
below its position is what the table holds there.

A writer's POSITION and RDATA are claims; a reader that believed a wrong
one (a forged POSITION, a row committed by plain SQL after the reader had
moved past its ID, a defect of ours) would otherwise be behind in silence.
So each :class:`.Reader` keeps a :class:`DeliveredLog` of the facts it
handed on, ``(id, rows)``, and the :class:`Auditor` of the instance
compares it, range by range, with :meth:`.Stream.tally` of the same range
of the table.

Invariants:

* A *window* is ``(lo, hi]`` of one (stream, writer): ``hi`` is the
  reader's position when the window was sealed, ``lo`` the previous one's
  ``hi``; it holds every fact the reader handed on in that range, and
  nothing else.  At or below a position every fact of the writer is
  committed and final (what a POSITION means), so the table must hold
  exactly those facts there, row for row.
* A window is checked twice: ``first_check`` seconds after it was sealed
  (a difference is found within seconds), and again ``recheck`` seconds
  after (a row whose transaction committed late, below the position, is
  found then).  After its second check it is forgotten: a range is never
  read again.  The logs of one instance hold at most ``max_held`` facts
  waiting for their second check: past that the oldest window's second
  check is done at once (memory stays bounded; no window goes unchecked).
* Facts at or below the trim boundary are not compared (retention may
  have deleted them): the check covers the part of the window above it.
  Synapse's own tables do not keep their facts (an update deletes the
  user's older presence or receipt; old cache invalidations are pruned):
  there only a fact or row the table holds and the reader did not hand
  on is a difference.
* A check is one indexed statement that reads no row's values (count of
  IDs, their sum modulo a prime, count of rows); only a difference reads
  the range's ``(id, rows)`` list, to name what differs.  Contents are
  compared on a sample: of each window's facts, :data:`SAMPLE` drawn at
  random as they are handed on (a reservoir: every fact equally likely,
  whatever its place) keep a digest of their rows, and the first check
  reads those facts from the table and compares (a fact whose rows were
  replaced by others of the same count is found with the probability
  ``SAMPLE / facts in the window``; many such facts, surely).  Checks run one at
  a time, in the database pool; a failed one is tried again at the next
  tick.
* A difference is a :class:`Mismatch`: the handler stops the stream there,
  as for a retention gap (nothing more of it is delivered, nothing is
  skipped), and health names the stream, writer and IDs until an operator
  acts (``replicator rewind --to`` hands the facts on again).
"""

import hashlib
import json
import random
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import orjson
from twisted.application.service import Service
from twisted.internet import defer, task
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from ...observe import metrics
from ...streams.tally import ID_MODULUS, Tally, tally_of
from ...streams.trimmed import FactsTrimmed

log = Logger(namespace="replicator.audit")

#: Seconds between two seals of every reader's log.
INTERVAL = 2.0
#: Seconds from a seal to a window's first check.
FIRST_CHECK = 1.0
#: Seconds from a seal to a window's second (last) check.
RECHECK = 300.0
#: Facts held, over every reader, waiting for a second check.
MAX_HELD = 500_000
#: Facts of a window whose rows are compared with the table's.
SAMPLE = 16


def rows_digest(rows: Sequence[Any]) -> int:
    """A digest of a fact's rows, whatever their order (Synapse's tables
    give one ID's rows in heap order): the sum of each row's.  A row orjson
    cannot encode (a lone surrogate in a string, which JSON allows) is
    encoded by the standard library, which escapes it."""
    total = 0
    for row in rows:
        try:
            encoded = orjson.dumps(row, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # (orjson.JSONEncodeError)
            encoded = json.dumps(row, sort_keys=True).encode()
        total += int.from_bytes(hashlib.blake2b(encoded, digest_size=8).digest(), "big")
    return total & 0xFFFF_FFFF_FFFF_FFFF


class Mismatch(NamedTuple):
    """What an audit found different in ``(since, upto]`` of a writer.

    ``missing``: IDs the table holds that were not handed on; ``extra``:
    IDs handed on that the table does not hold; ``resized``: IDs whose
    number of rows differs.  Each list is sorted (and at most
    :data:`LISTED` long; ``counts`` has the full numbers)."""

    stream: str
    writer: str
    since: int
    upto: int
    missing: Sequence[int]
    extra: Sequence[int]
    resized: Sequence[int]
    counts: tuple[int, int, int]
    how: str  # what found it: "audit", or "late fact"

    @property
    def first(self) -> int:
        """The smallest ID that differs (a rewind to just below it hands
        everything from it on again)."""
        return min([*self.missing[:1], *self.extra[:1], *self.resized[:1]] or [self.since + 1])

    def describe(self) -> str:
        parts = []
        for count, ids, what in ((self.counts[0], self.missing, "in the table but never delivered"),
                                 (self.counts[1], self.extra, "delivered but not in the table"),
                                 (self.counts[2], self.resized,
                                  "delivered with other rows than the table's")):
            if count:
                shown = ", ".join(map(str, ids[:5])) + (", ..." if count > 5 else "")
                parts.append(f"{count} {'fact' if count == 1 else 'facts'} {what} ({shown})")
        return "; ".join(parts)


#: IDs listed per kind in a :class:`Mismatch`.
LISTED = 100


class Window(NamedTuple):
    lo: int
    hi: int
    ids: "array[int]"
    rows: "array[int]"
    sample: dict[int, int]  # id -> rows_digest of what was handed on


class DeliveredLog:
    """The facts one reader handed on since its last seal.

    ``lo`` is where the open window starts (None until the reader has a
    position).  Two flat arrays, 16 bytes a fact, and the digests of a
    random sample of at most :data:`SAMPLE` of them."""

    __slots__ = ("lo", "sampled", "_ids", "_rows", "_sample", "_seen")

    def __init__(self, lo: int | None, sampled: bool = True) -> None:
        self.lo = lo
        #: Whether contents are sampled (not for Synapse's tables: what a
        #: Synapse writer sends need not be what we read of its row).
        self.sampled = sampled
        self._reset()

    def _reset(self) -> None:
        self._ids: array[int] = array("q")
        self._rows: array[int] = array("q")
        self._sample: dict[int, int] = {}
        self._seen = 0

    def add(self, token: int, rows: Sequence[Any]) -> None:
        self._ids.append(token)
        self._rows.append(len(rows))
        self._draw(token, rows)

    def add_page(self, facts: Iterable[tuple[int, Sequence[Any]]]) -> None:
        ids, counts = self._ids, self._rows
        for token, fact_rows in facts:
            ids.append(token)
            counts.append(len(fact_rows))
            self._draw(token, fact_rows)

    def _draw(self, token: int, rows: Sequence[Any]) -> None:
        """Reservoir sampling: the ``n``-th fact is kept with chance
        ``SAMPLE / n``, in place of a random one kept before."""
        if not self.sampled:
            return
        self._seen += 1
        sample = self._sample
        if len(sample) < SAMPLE:
            digest = _digest_or_none(rows)
            if digest is not None:
                sample[token] = digest
        elif random.random() * self._seen < SAMPLE:
            digest = _digest_or_none(rows)
            if digest is not None:
                del sample[random.choice(list(sample))]
                sample[token] = digest

    def restart(self, position: int | None) -> None:
        """Forget the open window; the next starts at ``position`` (a
        rewind, or the reader's first position)."""
        self.lo = position
        self._reset()

    def seal(self, position: int | None) -> Window | None:
        """Close the open window at ``position`` (the reader's): the
        window, or None if it would be empty of IDs."""
        if position is None:
            return None
        if self.lo is None or position < self.lo:
            self.restart(position)
            return None
        if position == self.lo:
            return None
        window = Window(self.lo, position, self._ids, self._rows, self._sample)
        self.lo = position
        self._reset()
        return window

    def __len__(self) -> int:
        return len(self._ids)


def _digest_or_none(rows: Sequence[Any]) -> int | None:
    """:func:`rows_digest`, or None (not sampled) for rows it cannot take:
    the audit never stands in the way of a delivery."""
    try:
        return rows_digest(rows)
    except Exception:
        return None


def delivered_tally(window: Window, above: int) -> Tally:
    """The tally of the window's facts with IDs above ``above``: summed
    over the arrays as they are when every ID is above it (the usual
    case: a window of a catch-up holds hundreds of thousands, and a loop
    over them held the reactor for 0.3 s per million), else pair by pair."""
    ids, rows = window.ids, window.rows
    if not ids or min(ids) > above:
        return len(ids), sum(ids) % ID_MODULUS, sum(rows)
    return tally_of((i, n) for i, n in zip(ids, rows) if i > above)


def difference(stream: str, writer: str, since: int, upto: int, window: Window,
               table: Sequence[tuple[int, int]], how: str = "audit",
               altered: Sequence[int] = (), keeps_facts: bool = True) -> Mismatch | None:
    """The :class:`Mismatch` between the window's facts above ``since``
    and ``table``'s ``(id, rows)`` of ``(since, upto]`` (None: equal);
    ``altered``: facts whose rows the sample found different.  A table
    that does not keep its facts (Synapse's: :attr:`.Stream.keeps_facts`)
    may have lost some since they were handed on: there only what it
    holds beyond what was handed on is a difference."""
    delivered = {i: n for i, n in zip(window.ids, window.rows) if since < i <= upto}
    held = dict(table)
    missing = sorted(set(held) - set(delivered))
    extra = sorted(set(delivered) - set(held)) if keeps_facts else []
    both = set(held) & set(delivered)
    resized = sorted({i for i in both if held[i] != delivered[i]
                      and (keeps_facts or held[i] > delivered[i])}
                     | {i for i in altered if i in both and keeps_facts})
    if not (missing or extra or resized):
        return None
    return Mismatch(stream, writer, since, upto, missing[:LISTED], extra[:LISTED],
                    resized[:LISTED], (len(missing), len(extra), len(resized)), how)


class _Due(NamedTuple):
    when: float
    stream: str
    writer: str
    window: Window
    final: bool


class Auditor(Service):
    """Seals every reader's log each ``interval`` seconds and checks the
    windows against the table (see the module docstring).

    ``readers()`` gives ``{(stream name, writer): (stream, reader)}`` (a
    :class:`.Stream` and its :class:`.Reader`, whose ``delivered`` is a
    :class:`DeliveredLog`);
    ``found(mismatch)`` is told of each difference (once per (stream,
    writer): the handler stops that stream)."""

    def __init__(self, readers: Callable[[], dict[tuple[str, str], tuple[Any, Any]]],
                 found: Callable[[Mismatch], None], clock: IReactorTime, *,
                 interval: float = INTERVAL, first_check: float = FIRST_CHECK,
                 recheck: float = RECHECK, max_held: int = MAX_HELD) -> None:
        self._readers = readers
        self._found = found
        self._clock = clock
        self.interval = interval
        self.first_check = first_check
        self.recheck = max(recheck, first_check)
        self.max_held = max_held
        self._due: deque[_Due] = deque()  # first checks, in time order
        self._final: deque[_Due] = deque()  # second checks, in time order
        self._held = 0  # facts in self._final
        self._loop: task.LoopingCall | None = None
        self._running: defer.Deferred[Any] | None = None

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._loop = task.LoopingCall(self.tick)
        self._loop.clock = self._clock
        self._loop.start(self.interval, now=False).addErrback(
            lambda f: log.failure("audit loop failed", f))

    def stopService(self) -> Any:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        running, self._running = self._running, None
        return running

    @property
    def held(self) -> int:
        """Facts held for a check (first or second)."""
        return self._held + sum(len(d.window.ids) for d in self._due)

    def tick(self) -> defer.Deferred[Any] | None:
        """Seal every reader's log; start the checks that are due (one
        pass at a time)."""
        now = self._clock.seconds()
        for stream, reader in self._readers().values():
            log_ = getattr(reader, "delivered", None)
            if log_ is None or reader.gap is not None or reader.stopped:
                continue
            window = log_.seal(reader.position)
            if window is not None:
                self._due.append(_Due(now + self.first_check, stream.name, reader.writer,
                                      window, False))
        if self._running is None:
            self._running = defer.ensureDeferred(self._check_due())
            self._running.addBoth(self._done)
        return self._running

    def _done(self, result: Any) -> None:
        self._running = None
        if isinstance(result, Failure):
            log.failure("audit pass failed", result)

    async def _check_due(self) -> None:
        while True:
            now = self._clock.seconds()
            if self._due and self._due[0].when <= now:
                due = self._due[0]
                queue = self._due
            elif self._final and (self._final[0].when <= now or self._held > self.max_held):
                due = self._final[0]
                queue = self._final
            else:
                return
            stream, reader = self._readers().get((due.stream, due.writer), (None, None))
            if reader is None or reader.stopped:
                self._drop(queue)
                continue
            try:
                mismatch = await self.check(stream, due.writer, due.window,
                                            "audit" if not due.final else "audit (second check)")
            except Exception as e:
                log.warn("audit of {stream}/{writer} ({lo}, {hi}] not done: {e}; "
                         "tried again in {interval}s", stream=due.stream, writer=due.writer,
                         lo=due.window.lo, hi=due.window.hi, e=e, interval=self.interval)
                metrics.AUDIT_RANGES.labels(due.stream, "failed").inc()
                return
            self._drop(queue)
            if mismatch is not None:
                metrics.AUDIT_RANGES.labels(due.stream, "different").inc()
                self._found(mismatch)
                continue
            metrics.AUDIT_RANGES.labels(due.stream, "equal").inc()
            metrics.AUDIT_FACTS.labels(due.stream).inc(len(due.window.ids))
            if not due.final:
                self._final.append(due._replace(when=due.when - self.first_check + self.recheck,
                                                final=True))
                self._held += len(due.window.ids)

    def _drop(self, queue: deque[_Due]) -> None:
        due = queue.popleft()
        if queue is self._final:
            self._held -= len(due.window.ids)

    async def check(self, stream: Any, writer: str, window: Window,
                    how: str = "audit") -> Mismatch | None:
        """Compare ``window`` with the table: the :class:`Mismatch`, or None."""
        since = window.lo
        for _ in range(3):
            table, boundary = await stream.tally(writer, since, window.hi)
            if boundary <= since:
                break
            if boundary >= window.hi:
                return None  # all of it may have been trimmed: nothing to compare
            since = boundary  # compare the part above the boundary
        else:
            return None  # retention moves faster than the check: next window
        altered = await self._compare_sample(stream, writer, window, since) \
            if window.sample else []
        if table == delivered_tally(window, since) and not altered:
            return None
        listed = await stream.fact_sizes(writer, since, window.hi)
        found = difference(stream.name, writer, since, window.hi, window, listed, how,
                           altered, stream.keeps_facts)
        if found is None:
            # The table changed between the two statements (retention):
            # judged by the list, which is the later look.
            return None
        return found

    async def _compare_sample(self, stream: Any, writer: str, window: Window,
                              since: int) -> list[int]:
        """The sampled facts above ``since`` whose rows in the table are not
        the ones handed on (a fact no longer there is the tally's to say).
        The sample is read in one trip (:meth:`.Stream.facts_at`); if
        retention took one of its facts meanwhile, fact by fact, and the
        facts it took are not compared."""
        tokens = [token for token in sorted(window.sample) if token > since]
        if not tokens:
            return []
        try:
            held = await stream.facts_at(writer, tokens)
        except FactsTrimmed:
            held = await self._facts_one_by_one(stream, writer, tokens)
        altered = []
        for token in tokens:
            rows = held.get(token)
            if rows is None:
                continue
            digest = _digest_or_none(rows)
            if digest is not None and digest != window.sample[token]:
                altered.append(token)
        if altered:
            metrics.AUDIT_ALTERED.labels(stream.name).inc(len(altered))
        return altered

    @staticmethod
    async def _facts_one_by_one(stream: Any, writer: str,
                                tokens: list[int]) -> dict[int, Any]:
        """:meth:`.Stream.facts_at` a fact at a time, skipping those that
        retention took."""
        held = {}
        for token in tokens:
            try:
                facts, _, _ = await stream.fact_page(writer, token - 1, token, 1)
            except FactsTrimmed:
                continue  # deleted by retention since the tally: not comparable
            if facts and facts[0][0] == token:
                held[token] = facts[0][1]
        return held
