"""The reader pipeline of one (stream, writer) written by another instance.

A :class:`Reader` turns the RDATA and POSITION lines of one writer, as they
arrive on any connection, into facts handed to ``deliver`` exactly once, in
token order, whole.  It needs no database: the rows of a gap come from the
injected ``source`` (``Stream.facts_since`` in the daemon), and retries
run on the injected clock.

Invariants:

* RDATA rows without a token (``batch``) are collected per connection until
  the row with the token ends the fact; a fact is only ever handed on whole.
  A POSITION of the writer ends its batch still open on that connection
  (the writer never sends one inside a fact: the rest was lost on the way);
  so does any other line of the writer there (the handler's
  :mod:`.admission` tells: ``drop_batch``).
* A ``batch`` row may come as its RDATA line (bytes, parsed once already):
  it is kept so, and decoded (:func:`.commands.rdata_row`) only when its
  fact is handed on, one fact at a time, ``DECODE_SLICE`` rows per reactor
  turn; a fact at or below the position is dropped without being decoded.  A parsed row can take 20
  times the
  memory of its line: what a partial batch holds is about its wire size.
* Lines of a connection count only once a POSITION of the writer arrived on
  it (before that, what the POSITION covers is fetched from the table).
* Commands are processed one at a time, in arrival order, across
  connections.  A POSITION whose ``prev`` is above the reader's position
  means facts were missed: they are read from ``source`` (in pages of
  ``fetch_limit`` rows, never splitting a fact; the next page read while
  one is handed on, the reactor let run between pages) before anything
  later.
* A POSITION that would move the position over IDs is not taken on the
  writer's word: unless every ID in the range is known to be another
  writer's (``known``), the table is asked (``probe``, one indexed
  statement) whether it holds a fact of the writer there; if it does, the
  range is caught up like a gap (and counted: the POSITION was wrong), else
  the range is remembered as *passed empty*.
* A fact at or below the position is dropped; ``position`` only grows.  A
  fact that arrives in a range passed empty contradicts the POSITION that
  passed it (a forged one, an impostor's, a row committed behind our
  back): the reader stops there (``on_mismatch``), never silent.
* Every fact handed on is noted in ``delivered`` (a
  :class:`.audit.DeliveredLog`, if given) once every consumer has it, and
  its ID in ``known``: the audit compares those notes with the table.
* :meth:`Reader.pause` holds the pipeline once the command in hand is
  done (lines still queue); while paused, :meth:`Reader.set_delivery` may
  hand facts to other consumers from then on and :meth:`Reader.rewind`
  move the position back, so that the facts above it are caught up from
  ``source`` first (a consumer started at a reload); :meth:`Reader.resume`
  goes on.
* Facts the catch-up needs that retention trimmed (``source`` raises
  :class:`..streams.trimmed.FactsTrimmed`) stop the reader for good, where
  it is: nothing later is handed on, nothing is skipped; ``gap`` says why
  and ``on_gap`` is told once (until an operator rewinds and restarts).
* Any other failure (of ``source`` or ``deliver``) stops the pipeline where it is;
  it resumes with the same command after a delay from the project's backoff
  policy (``retry_delay``, doubling up to 30 s); one log line when such an
  outage starts, one when it ends.
"""

from collections import deque
from collections.abc import Awaitable, Callable
from operator import itemgetter
from typing import Any

from twisted.internet import defer, task
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from ...background import Background
from ...net.backoff import Outage
from ...observe import metrics
from ...streams.trimmed import FactsTrimmed
from ..interfaces import IReplicationConnection
from ..wire.commands import rdata_row
from .audit import DeliveredLog, Mismatch

log = Logger()

Fact = tuple[int, list[list[Any]]]
#: ``batch`` rows of a fact decoded per reactor turn at most.
DECODE_SLICE = 1000
#: ``source(writer, from_token, to_token, limit)`` -> ``(facts, upto, limited)``:
#: ``(token, rows)`` facts, whole, in token order (``Stream.facts_since``)
Source = Callable[[str, int, int, int], Awaitable[tuple[list[Fact], int, bool]]]
#: ``probe(writer, from_token, to_token)`` -> the smallest ID of the writer's
#: facts in the table in ``(from_token, to_token]``, or None
#: (``Stream.first_fact_in``)
Probe = Callable[[str, int, int], Awaitable[int | None]]

#: Ranges passed empty remembered per reader (the newest).
PASSED_KEPT = 256


class Stopping(Exception):
    """Raised inside reader work once the reader is stopping."""


class Reader:
    """Reader state and pipeline of one (stream, writer).

    ``position`` is the token up to which every fact was handed on (None:
    nothing known yet; the first POSITION sets it without catching up).
    ``seen`` is the largest token the writer was heard to announce.

    Injected: ``source`` reads the facts of a gap, a page at a time; ``deliver(token, rows)``
    hands on one fact (may return a Deferred/awaitable);
    ``reached(token)`` is called, awaited, after a POSITION moved the
    position; ``advanced(token)`` after every move of the position, or
    once per page during catch-up (synchronous: the ID generator).
    ``deliver_many(facts)``, if given, takes a whole catch-up page of
    ``(token, rows)`` facts at once; if it fails the page is handed on
    again, so it must skip facts it already has (as the JSON-lines
    consumer does).
    """

    def __init__(
        self,
        stream_name: str,
        writer: str,
        position: int | None,
        source: Source,
        deliver: Callable[[int, list[list[Any]]], Any],
        clock: IReactorTime,
        deliver_many: Callable[[list[tuple[int, list[list[Any]]]]], Any] | None = None,
        reached: Callable[[int], Any] | None = None,
        advanced: Callable[[int], None] | None = None,
        fetch_limit: int = 1000,
        retry_delay: float = 1.0,
        background: Background | None = None,
        on_gap: Callable[[FactsTrimmed], None] | None = None,
        probe: Probe | None = None,
        known: Any | None = None,
        audit: bool = False,
        sample: bool = True,
        on_mismatch: Callable[[Mismatch], None] | None = None,
    ) -> None:
        self.stream_name = stream_name
        self._probe = probe
        self._known = known  # a streams.known.KnownIds, or None
        #: What was handed on since the audit's last seal (None: no audit).
        self.delivered: DeliveredLog | None = DeliveredLog(position, sample) if audit else None
        self._on_mismatch = on_mismatch
        self._passed: deque[tuple[int, int]] = deque(maxlen=PASSED_KEPT)
        self.gap: FactsTrimmed | None = None  # why it stopped for good, if it did
        self._on_gap = on_gap
        self._background = background if background is not None else Background()
        self.writer = writer
        self.position = position
        self.announced = position or 0  # largest token the writer announced
        self._source = source
        self._deliver = deliver
        self._deliver_many = deliver_many
        self._reached = reached
        self._advanced = advanced
        self._clock = clock
        self.fetch_limit = fetch_limit
        self.retry_delay = retry_delay
        self.queue: deque[tuple[Any, ...]] = deque()
        self.busy = False
        self._batches: dict[Any, list[Any]] = {}  # conn -> rows (or lines) of the fact under way
        self._positioned: set[Any] = set()  # connections with a POSITION seen
        self._retry: IDelayedCall | None = None
        self._outage = Outage(f"reader {stream_name}/{writer}", retry_delay)
        self._stopping = False
        self._paused = False
        self._idle: list[defer.Deferred[Any]] = []  # pause() callers waiting for the hand to empty

    # ------------------------------------------------------------ lines in
    def rdata(self, conn: IReplicationConnection, token: int | None, row: Any) -> None:
        """One RDATA row from ``conn``; ``token`` None for a ``batch`` row,
        which may be its line (bytes) rather than the decoded row."""
        if token is None:
            self._batches.setdefault(conn, []).append(row)
            return
        rows = self._batches.pop(conn, [])
        rows.append(row)
        if token > self.announced:
            self.announced = token
        if conn not in self._positioned:
            return  # the POSITION that follows makes us catch up
        self._enqueue(("rdata", token, rows))

    def position_line(self, conn: IReplicationConnection, prev: int, new: int) -> None:
        """A POSITION of the writer from ``conn``.

        The writer sends a POSITION only between facts: a batch of it still
        open on this connection lost its end on the way and is discarded; if
        that fact was committed, the POSITION covers it and it comes back
        whole through catch-up.  (A batch open on another connection is left
        to that connection: lines still arriving there late complete it, and
        whatever it completes at or below the position is dropped.)
        """
        self._batches.pop(conn, None)
        self._positioned.add(conn)
        if new > self.announced:
            self.announced = new
        self._enqueue(("position", prev, new))

    def positioned(self, conn: IReplicationConnection) -> bool:
        """Whether ``conn`` announced the writer's position: RDATA before
        that is not taken (the POSITION makes us read the table)."""
        return conn in self._positioned

    def drop_batch(self, conn: IReplicationConnection) -> None:
        """Forget the partial batch of ``conn`` (its next row was refused)."""
        self._batches.pop(conn, None)

    def connection_lost(self, conn: IReplicationConnection) -> None:
        """A partial batch dies with its connection."""
        self._batches.pop(conn, None)
        self._positioned.discard(conn)

    # ------------------------------------------------------------ pipeline
    def _enqueue(self, item: tuple[Any, ...]) -> None:
        if self._stopping:
            return  # stopped (a gap, a writer dropped, shutdown): nothing more runs
        self.queue.append(item)
        if not self.busy and not self._paused:
            self.busy = True
            self._background.run("reader", self._drain())

    async def _drain(self) -> None:
        try:
            while self.queue and not self._stopping and not self._paused:
                item = self.queue[0]
                try:
                    await self._apply(item)
                except Stopping:
                    return
                except FactsTrimmed as e:
                    self._trimmed(e)
                    return
                except Exception as e:
                    delay = self._outage.failed(e)
                    if not self._paused:  # else resume() tries again
                        self._retry = self._clock.callLater(delay, self._resume)
                    return
                self._outage.succeeded()
                self.queue.popleft()
        finally:
            if not self.queue or self._stopping or self._paused:
                self.busy = False
                self._release_idle()

    def _release_idle(self) -> None:
        waiting, self._idle = self._idle, []
        for d in waiting:
            d.callback(None)

    def _trimmed(self, gap: FactsTrimmed) -> None:
        """Facts needed were trimmed: stop here for good, skipping nothing."""
        self.gap = gap
        self.stop()
        self.queue.clear()
        if self._on_gap is not None:
            self._on_gap(gap)

    def _resume(self) -> None:
        self._retry = None
        self.busy = False
        if self.queue and not self._stopping and not self._paused:
            self.busy = True
            self._background.run("reader", self._drain())

    async def _apply(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "rdata":
            _, token, rows = item
            if self.position is not None and token <= self.position:
                if self._passed and self._was_passed(token):
                    self._contradicted(token)
                    raise Stopping()
                return  # already handled
            if len(rows) > 1:
                rows = await self._decoded(rows)
            await self._hand_on(token, rows)
            self._advance(token)
            return
        _, prev, new = item
        position = self.position
        if position is None:
            if self.delivered is not None:
                self.delivered.restart(new)
        elif prev <= position < new:
            await self._verify(position, new)
        elif prev <= position <= new:
            pass
        elif position > new:
            return  # stale
        else:
            await self._catch_up(position, new)
        if self.position is None or new > self.position:
            self._advance(new)
            if self._reached is not None:
                await maybe_await(self._reached(new))

    async def _verify(self, position: int, new: int) -> None:
        """Take a POSITION over ``(position, new]`` only once the table
        agrees that the writer has no fact there (see the invariants)."""
        if self._probe is None or (self._known is not None
                                   and self._known.covers(position, new)):
            return
        found = await self._probe(self.writer, position, new)
        if found is None:
            self._passed.append((position, new))
            return
        metrics.POSITIONS_CONTRADICTED.labels(self.stream_name).inc()
        log.warn("stream {stream}: a POSITION of writer {writer} claimed nothing in "
                 "({since}, {until}] but the table holds its fact {found}: caught up from "
                 "the table", stream=self.stream_name, writer=self.writer, since=position,
                 until=new, found=found)
        await self._catch_up(position, new)

    def _was_passed(self, token: int) -> bool:
        return any(lo < token <= hi for lo, hi in self._passed)

    def _contradicted(self, token: int) -> None:
        """A fact arrived in a range a POSITION had passed empty: stop."""
        metrics.POSITIONS_CONTRADICTED.labels(self.stream_name).inc()
        lo, hi = next((lo, hi) for lo, hi in self._passed if lo < token <= hi)
        found = Mismatch(self.stream_name, self.writer, lo, hi, [token], [], [], (1, 0, 0),
                         "late fact")
        self.stop()
        self.queue.clear()
        if self._on_mismatch is not None:
            self._on_mismatch(found)

    async def _decoded(self, rows: list[Any]) -> list[Any]:
        """A fact's rows, its ``batch`` lines decoded, ``DECODE_SLICE`` rows
        per reactor turn (the reactor runs between two slices)."""
        out: list[Any] = []
        for start in range(0, len(rows), DECODE_SLICE):
            if start:
                await task.deferLater(self._clock, 0, lambda: None)
            out.extend([rdata_row(row) if type(row) is bytes else row
                        for row in rows[start:start + DECODE_SLICE]])
        return out

    async def _catch_up(self, since: int, until: int) -> None:
        """Hand on the facts of ``(since, until]`` from ``source``, page by page.

        The next page is read (in the database pool) while this one is
        handed on: at most two pages are in hand.  Between pages the reactor
        runs (a ``callLater(0)`` when the next page is already there, once
        the read of the one after it is under way: the pool thread never
        waits for that turn), so a long catch-up never holds it for more than
        one page.  The position
        moves with every fact; ``advanced`` is told once per page (and where
        a page stopped, if it failed)."""
        metrics.CATCHUP_FETCHES.labels(self.stream_name).inc()
        log.info("Catching up {stream}/{writer} from {since} to {until}",
                 stream=self.stream_name, writer=self.writer, since=since, until=until)
        rows_counter = metrics.CATCHUP_ROWS.labels(self.stream_name)
        pending: defer.Deferred[Any] | None = self._read(since, until)
        first = True
        try:
            while since < until:
                assert pending is not None  # read while since < until
                ready = pending.called
                facts, upto, _ = await pending
                pending = self._read(upto, until) if upto < until else None
                if ready and not first:
                    # The reactor runs between pages, the next one being read meanwhile.
                    await task.deferLater(self._clock, 0, lambda: None)
                first = False
                rows_counter.inc(sum(map(len, map(_rows_of, facts))))
                await self._hand_on_page(facts)
                since = upto
        finally:
            if pending is not None:
                pending.addErrback(lambda _: None)  # read ahead, not needed any more

    def _read(self, since: int, until: int) -> defer.Deferred[Any]:
        return defer.maybeDeferred(self._source, self.writer, since, until, self.fetch_limit
                                   ).addCallback(_resolved)

    async def _hand_on_page(self, facts: list[Fact]) -> None:
        if self._deliver_many is not None:
            if self._stopping:
                raise Stopping()
            result = self._deliver_many(facts)
            if result is not None:
                await maybe_await(result)
            if facts:
                self._noted_page(facts)
                self._advance(facts[-1][0])
            return
        deliver = self._deliver
        last = None
        try:
            for token, rows in facts:
                if self._stopping:
                    raise Stopping()
                result = deliver(token, rows)
                if result is not None:
                    await maybe_await(result)
                self._noted(token, rows)
                self.position = last = token
        finally:
            if last is not None and self._advanced is not None:
                self._advanced(last)

    async def _hand_on(self, token: int, rows: list[list[Any]]) -> None:
        if self._stopping:
            raise Stopping()
        await maybe_await(self._deliver(token, rows))
        self._noted(token, rows)

    def _noted(self, token: int, rows: list[Any]) -> None:
        """A fact every consumer has: in the audit's log and known IDs."""
        if self.delivered is not None:
            self.delivered.add(token, rows)
        if self._known is not None:
            self._known.note((token,))

    def _noted_page(self, facts: list[Fact]) -> None:
        if self.delivered is not None:
            self.delivered.add_page(facts)
        if self._known is not None:
            self._known.note(map(_token_of, facts))

    def _advance(self, token: int) -> None:
        self.position = token
        if self._advanced is not None:
            self._advanced(token)

    # -------------------------------------------------------------- state
    @property
    def lag(self) -> int:
        return max(0, self.announced - (self.position or 0))

    def idle(self) -> bool:
        """Nothing in hand and nothing queued (once stopped, what is queued
        will not run: only the work in hand counts)."""
        return not self.busy and (not self.queue or self._stopping)

    def pause(self) -> defer.Deferred[Any]:
        """Take no more commands once the one in hand is done (a retry
        waiting for its delay is called off); fires then.  Lines still
        queue; :meth:`resume` goes on with them."""
        self._paused = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
            self._retry = None
            self.busy = False
        if not self.busy:
            return defer.succeed(None)
        d: defer.Deferred[Any] = defer.Deferred()
        self._idle.append(d)
        return d

    def resume(self) -> None:
        """Go on after :meth:`pause` with what queued meanwhile."""
        self._paused = False
        if self.queue and not self.busy and not self._stopping:
            self.busy = True
            self._background.run("reader", self._drain())

    def set_delivery(self, deliver: Callable[[int, list[list[Any]]], Any],
                     deliver_many: Callable[[list[Fact]], Any] | None,
                     reached: Callable[[int], Any] | None) -> None:
        """Hand facts on through these from now on (paused: between two
        commands)."""
        assert self._paused and not self.busy, "set_delivery() on a running reader"
        self._deliver, self._deliver_many, self._reached = deliver, deliver_many, reached

    def rewind(self, position: int) -> None:
        """Hand on again what is above ``position`` (paused): the facts up to
        the current position are caught up from ``source`` before anything
        queued.  A reader with no position yet starts from ``position``."""
        assert self._paused and not self.busy, "rewind() on a running reader"
        if self.position is None:
            self.position = position
        elif position < self.position:
            # A POSITION the reader is below: _apply catches up to it.
            self.queue.appendleft(("position", self.position, self.position))
            self.position = position
        if self.delivered is not None:
            self.delivered.restart(self.position)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (a gap, a mismatch, a writer
        dropped, shutdown)."""
        return self._stopping

    def stop(self) -> None:
        self._stopping = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None


_rows_of = itemgetter(1)
_token_of = itemgetter(0)


def _resolved(result: Any) -> Any:
    """A source may be an ``async def``: its coroutine, run to its value."""
    if hasattr(result, "__await__") and not isinstance(result, defer.Deferred):
        return defer.ensureDeferred(result)
    return result


async def maybe_await(result: Any) -> Any:
    """``result``, awaited first if it is a Deferred or an awaitable."""
    if isinstance(result, defer.Deferred) or hasattr(result, "__await__"):
        return await result
    return result
