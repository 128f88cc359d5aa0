"""Stream ID tracking for single- and multi-writer streams.

A :class:`StreamIdGenerator` does not hand out IDs itself: IDs come from the
stream's database sequence (or, on SQLite, an in-process counter), inside the
writer's transaction.  The generator tracks what is *reserved but not yet
completed* for each local writer, and the positions learned from writers
running in other instances, so that no reader is ever told a position past an
unfinished ID.

Definitions (``docs/streams.md``), which every method keeps:

* ``Known`` is every ID this generator has heard of: the start positions,
  every reserved ID (completed or not) and every token passed to
  :meth:`advance`.
* The **linear** token is the largest ``x`` in ``Known`` such that every ID
  reserved by a local writer at or below ``x`` has completed and ``x`` is at
  most the position of every remote writer (a remote writer may have
  reservations we cannot see above its position).
* The **per-writer** token of a local writer ``W`` is the largest ``x`` among
  ``W``'s start, ``W``'s reserved IDs and the linear token such that every ID
  ``W`` reserved at or below ``x`` has completed; and, once ``W`` is *idle*
  (nothing of it in flight, no ``nextval`` under way here), at least the
  largest *finished* ID of ``Known`` (a start, a completed reservation, a
  remote writer's position).  The per-writer token of a remote writer is the
  largest position it announced.
* Both are monotonic.  A rollback is a completion (a fact with no rows).

Why an idle writer moves to the largest finished ID.  Otherwise an idle writer
could only follow the linear token, and with two idle writers (in different
instances) each one's position bounds the other's linear token: neither
ever moves, and the stream's linear token stays where the last write of
either left it, however far the busy writer goes (Synapse's writers move
the same way, to the largest ID they have seen allocated).  It is safe:

* For ``W`` itself: a per-writer token only speaks of ``W``'s facts, and
  none is unfinished.  Every known ID was handed out by the sequence (a
  peer's position above the sequence is refused on admission), so the
  next ``nextval`` for ``W`` returns more than any of them (it runs after
  ``begin_reservation``, which stops every token until the ID is
  registered: an ID handed out while a position is learned is never
  passed).
* For everyone else: the token may pass unfinished IDs of *other* writers,
  local or remote, even IDs we do not know of (another instance's
  reservations are invisible until it announces a position past them).
  No linear token is harmed: a linear token is the minimum over all
  writers, and the writer owning an unfinished ID has its own position
  below that ID (here ``_all`` keeps the local ones; a remote writer's
  announced position stays below its own reservations).

No read of the sequence is needed (nor made): the largest finished ID is
where the busiest writer's last fact is, all an idle writer must reach; a
read would have to be fenced against this instance's own reservations
racing with it.  What it relies on: the sequence hands every session
values above all it handed out before (PostgreSQL's default ``CACHE 1``,
what ``create`` makes), and one that went back (a crash restart) is moved
past every known ID on each new connection before any ``nextval``
(:meth:`.writes.WriteTransaction.sequence_past_positions`).

Reservations are registered from the database thread that called ``nextval``
(:meth:`begin_reservation` before the call, :meth:`reserved` after it), so that
a position learned meanwhile can never carry the tokens past an ID the
sequence has already handed out.  Completions and advances run on the reactor
thread; listeners are called there.

A local writer may also be *fenced* (:meth:`StreamIdGenerator.fence`, a
stream that takes plain-SQL writers: :mod:`.fence`): its token, and so the
linear token and what is persisted, never exceed the cap the fence last
gave (every plain-SQL transaction at or below it ended), whatever its own
bookkeeping says.  The cap starts at the writer's start position and only
moves up.

Every operation is O(log n) in the number of in-flight IDs (amortized).
"""

import heapq
import threading
from collections.abc import Callable, Iterable
from typing import Any

Listener = Callable[[str, int, int], None]


class UnknownWriter(KeyError):
    """A writer name that is not one of the stream's configured writers."""


class _WriterState:
    """The IDs in flight of one local writer.

    ``position`` is the largest of the writer's own IDs (or its start) below
    which nothing of the writer is unfinished.  ``inflight`` is a min-heap
    with lazy deletion (``live`` holds what is still unfinished); ``blocked``
    holds completed IDs above the smallest unfinished one.
    """

    __slots__ = ("position", "inflight", "live", "blocked")

    def __init__(self, position: int) -> None:
        self.position = position
        self.inflight: list[int] = []
        self.live: set[int] = set()
        self.blocked: list[int] = []

    def add(self, stream_id: int) -> None:
        if stream_id in self.live:
            raise ValueError(f"stream ID {stream_id} reserved twice")
        self.live.add(stream_id)
        heapq.heappush(self.inflight, stream_id)

    def finish(self, stream_id: int) -> None:
        """Mark ``stream_id`` complete; :meth:`settle` moves ``position``."""
        try:
            self.live.remove(stream_id)
        except KeyError:
            raise ValueError(f"stream ID {stream_id} is not in flight") from None
        heapq.heappush(self.blocked, stream_id)

    def learn(self, token: int) -> None:
        """``token`` is known and not in flight (a remote writer's position)."""
        if token > self.position:
            heapq.heappush(self.blocked, token)

    def settle(self) -> None:
        """Move ``position`` up to the largest known ID below the unfinished ones."""
        blocked = self.blocked
        if not blocked:
            return
        live = self.live
        inflight = self.inflight
        while inflight and inflight[0] not in live:
            heapq.heappop(inflight)
        floor = inflight[0] if inflight else None
        best = self.position
        while blocked and (floor is None or blocked[0] < floor):
            best = heapq.heappop(blocked)
        if best > self.position:
            self.position = best


class StreamIdGenerator:
    """Per-writer and linear positions of one stream, as seen by one instance.

    ``positions`` gives the start position of every writer of the stream
    (local and remote); ``local_writers`` names the ones that write through
    this generator.  At start nothing is in flight.
    """

    def __init__(
        self,
        name: str,
        positions: dict[str, int],
        local_writers: Iterable[str],
        call_from_thread: Callable[..., Any] | None = None,
        fenced: dict[str, int] | None = None,
    ) -> None:
        self.name = name
        #: Local writers whose token the fence caps, with the cap.
        self._caps: dict[str, int] = dict(fenced or {})
        local = list(local_writers)
        for w in local:
            if w not in positions:
                raise UnknownWriter(w)
        self._local: dict[str, _WriterState] = {
            w: _WriterState(positions[w]) for w in local
        }
        self._remote: dict[str, int] = {
            w: p for w, p in positions.items() if w not in self._local
        }
        self._lock = threading.Lock()
        self._call_from_thread = call_from_thread
        self._listeners: list[Listener] = []

        # The local part of the linear token: all local reservations at or
        # below it are complete.  Same structure as a writer's state, over
        # every local writer together.
        self._all = _WriterState(max(positions.values(), default=0))
        # One local writer and nobody else: its state is the whole state.
        if len(self._local) == 1 and not self._remote:
            (only,) = self._local.values()
            only.position = self._all.position
            self._all = only
        self._shared = len(self._local) == 1 and self._all is next(iter(self._local.values()))
        self._max_known = self._all.position
        self._max_done = self._max_known  # the largest finished ID of Known
        self._pending = 0
        self._dirty = False
        self._advance_idle()
        self._linear = self._compute_linear()
        self._tokens: dict[str, int] = {}
        self._tokens = self._current_tokens()

    # ----------------------------------------------------------- listeners
    def add_listener(self, listener: Listener, first: bool = False) -> None:
        """Call ``listener(writer, old, new)`` whenever a writer's token
        moves (``first``: before the listeners added so far)."""
        if first:
            self._listeners.insert(0, listener)
        else:
            self._listeners.append(listener)

    # ---------------------------------------------------------- reservation
    def begin_reservation(self) -> None:
        """Announce that a ``nextval`` is about to run (any thread).

        Until the matching :meth:`reserved` or :meth:`abort_reservation`, no
        token moves: the ID being reserved is not known yet.
        """
        with self._lock:
            self._pending += 1

    def abort_reservation(self) -> None:
        """The ``nextval`` announced by :meth:`begin_reservation` failed."""
        with self._lock:
            self._pending -= 1
            wake = self._pending == 0 and self._dirty
        if wake:
            self._wake()

    def reserved(self, writer: str, stream_ids: Iterable[int], pending: bool = True) -> None:
        """Register IDs a local writer got from the sequence (any thread).

        ``pending`` says whether :meth:`begin_reservation` was called first.
        All or nothing: an ID at or below the writer's position (a sequence
        that went back, e.g. PostgreSQL after a crash) or already in flight
        raises ``ValueError`` and registers none of them.
        """
        state = self._local.get(writer)
        if state is None:
            raise UnknownWriter(writer)
        stream_ids = list(stream_ids)
        with self._lock:
            try:
                # All or nothing: a refused ID leaves none of them in flight.
                for stream_id in stream_ids:
                    if stream_id <= state.position:
                        raise ValueError(
                            f"stream {self.name}: reserved ID {stream_id} is not "
                            f"above {writer}'s position {state.position}"
                        )
                    if stream_id in state.live:
                        raise ValueError(f"stream ID {stream_id} reserved twice")
                if len(set(stream_ids)) != len(stream_ids):
                    raise ValueError(f"stream {self.name}: an ID is reserved twice in {stream_ids}")
                for stream_id in stream_ids:
                    state.add(stream_id)
                    if not self._shared:
                        self._all.add(stream_id)
                    if stream_id > self._max_known:
                        self._max_known = stream_id
            finally:
                if pending:
                    self._pending -= 1
                wake = self._pending == 0 and self._dirty
        if wake:
            self._wake()

    def _wake(self) -> None:
        if self._call_from_thread is not None:
            self._call_from_thread(self._recompute)
        else:
            self._recompute()

    # ----------------------------------------------------------- completion
    def complete(self, writer: str, stream_id: int) -> None:
        """Mark a reserved ID complete, committed or rolled back."""
        self.complete_many(writer, (stream_id,))

    def complete_many(self, writer: str, stream_ids: Iterable[int]) -> None:
        """Mark reserved IDs complete (one transaction's): all of them or,
        if one is not in flight, none (``ValueError``)."""
        state = self._local.get(writer)
        if state is None:
            raise UnknownWriter(writer)
        ids = list(stream_ids)
        with self._lock:
            live = state.live
            for stream_id in ids:
                if stream_id not in live:
                    raise ValueError(
                        f"stream {self.name}: ID {stream_id} of {writer} is not in flight")
            shared = self._shared
            for stream_id in ids:
                state.finish(stream_id)
                if not shared:
                    self._all.finish(stream_id)
                if stream_id > self._max_done:
                    self._max_done = stream_id
        self._recompute()

    def advance(self, writer: str, token: int) -> None:
        """A remote writer has completed everything up to ``token``."""
        if writer in self._local:
            raise ValueError(
                f"stream {self.name}: {writer} writes here; its position is not learned"
            )
        if writer not in self._remote:
            raise UnknownWriter(writer)
        with self._lock:
            if token <= self._remote[writer]:
                return
            self._remote[writer] = token
            if token > self._max_known:
                self._max_known = token
            if token > self._max_done:
                self._max_done = token
            self._all.learn(token)
        self._recompute()

    def fence(self, writer: str, cap: int) -> None:
        """The fenced local ``writer``'s token may go up to ``cap`` (only
        ever raised: a lower one is ignored)."""
        with self._lock:
            if writer not in self._caps or cap <= self._caps[writer]:
                return
            self._caps[writer] = cap
            # Every ID up to the cap was handed out (the fence read it from
            # the sequence) and no plain-SQL transaction at or below it is
            # open: a finished ID, as a remote writer's position is; the
            # writer's own reservations still hold it where they are.
            self._local[writer].learn(cap)
            if not self._shared:
                self._all.learn(cap)
            if cap > self._max_known:
                self._max_known = cap
            if cap > self._max_done:
                self._max_done = cap
        self._recompute()

    def cap(self, writer: str) -> int | None:
        """The fenced ``writer``'s cap (None: not fenced)."""
        return self._caps.get(writer)

    # ------------------------------------------------------------- reload
    def add_remote(self, writer: str, position: int) -> None:
        """A writer of another instance joins the stream (a reload) at
        ``position``; the linear token never moves back for it.  Refused
        (ValueError) when this generator's one local writer is its whole
        state: such a stream gains another writer only at a restart."""
        with self._lock:
            if writer in self._local or writer in self._remote:
                return
            if self._shared:
                raise ValueError(f"stream {self.name}: written here alone")
            self._remote[writer] = position
            self._tokens = dict(self._tokens, **{writer: position})
        self._recompute()

    def remove_remote(self, writer: str) -> None:
        """A writer of another instance leaves the stream (a reload): the
        linear token no longer waits for it."""
        with self._lock:
            self._remote.pop(writer, None)
            self._tokens.pop(writer, None)
        self._recompute()

    # ------------------------------------------------------------- reading
    def _compute_linear(self) -> int:
        linear = self._all.position
        if self._remote:
            linear = min(linear, min(self._remote.values()))
        if self._caps:
            linear = min(linear, min(self._caps.values()))
        return linear

    def _current_tokens(self) -> dict[str, int]:
        linear = self._linear
        tokens = {w: (s.position if s.position > linear else linear)
                  for w, s in self._local.items()}
        for w, cap in self._caps.items():
            if tokens[w] > cap:
                tokens[w] = cap
        tokens.update(self._remote)
        return tokens

    def _recompute(self) -> None:
        with self._lock:
            if self._pending:
                self._dirty = True
                return
            self._dirty = False
            for state in self._local.values():
                state.settle()
            if not self._shared:
                self._all.settle()
            self._advance_idle()
            linear = self._compute_linear()
            if linear > self._linear:
                self._linear = linear
            new = self._current_tokens()
            old = self._tokens
            self._tokens = new
        if self._listeners:
            for writer, token in new.items():
                before = old.get(writer)
                if before is not None and token != before:
                    for listener in self._listeners:
                        listener(writer, before, token)

    def _advance_idle(self) -> None:
        """Idle local writers to the largest finished ID (module docstring);
        under the lock, with no reservation under way."""
        top = self._max_done
        for state in self._local.values():
            if state.position < top and not state.live:
                state.position = top

    def get_current_token(self, writer: str) -> int:
        """The per-writer current token."""
        try:
            return self._tokens[writer]
        except KeyError:
            raise UnknownWriter(writer) from None

    def get_linear_token(self) -> int:
        """The linear current token: the minimum over all writers."""
        return self._linear

    def get_positions(self) -> dict[str, int]:
        """Per-writer current tokens of every writer (a copy)."""
        return dict(self._tokens)

    def get_max_known(self) -> int:
        """The largest ID reserved here or learned from another writer."""
        return self._max_known

    def in_flight(self, writer: str | None = None) -> int:
        """How many IDs are reserved and unfinished (for one local writer or all)."""
        if writer is None:
            return len(self._all.live)
        state = self._local.get(writer)
        return len(state.live) if state is not None else 0

    def in_flight_ids(self, writer: str, limit: int = 10) -> list[int]:
        """The lowest ``limit`` IDs a local writer has reserved and not finished."""
        state = self._local.get(writer)
        return heapq.nsmallest(limit, state.live) if state is not None else []

    def prospective_token(self, writer: str, completing: list[int]) -> int:
        """A lower bound of the writer's token once ``completing`` is done.

        Taken inside the writing transaction, for persisting: it never claims
        an ID that is still unfinished afterwards.  O(log n).
        """
        with self._lock:
            bound = self._prospective(writer, completing)
            cap = self._caps.get(writer)
            return bound if cap is None or bound <= cap else cap

    def _prospective(self, writer: str, completing: list[int]) -> int:
        state = self._local[writer]
        bound = max(state.position, self._linear)
        if self._pending:
            # Another reservation is under way: its ID is not known yet.
            return bound
        live = state.live
        if len(live) == len(completing):
            return max(bound, max(completing))
        inflight = state.inflight
        while inflight and inflight[0] not in live:
            heapq.heappop(inflight)
        if inflight and inflight[0] in completing:
            bound = max(bound, inflight[0])
        return bound

    @property
    def local_writers(self) -> list[str]:
        return list(self._local)

    @property
    def writers(self) -> list[str]:
        return list(self._tokens)
