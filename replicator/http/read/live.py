"""A stream's new facts, read once and encoded once for every event
stream that is live (as the fan-out does RDATA for TCP connections).

:class:`LiveFeed` keeps a *position* (per writer: its *head*) and follows
the stream's current tokens: when they move, it reads the facts in between
(memory or table, :meth:`replicator.streams.stream.Stream.updates_since`),
encodes each as one Server-Sent Event whose ``id`` is the token after that
fact, joins them into one bytes object, a *segment*, and appends it to a
short log.  Its *passes* hand every live client (:mod:`.sse`) the segments
after its own place in the log, joined once for all the clients at the
same place.

Invariants:

* A live client is at a segment boundary of the log (``client.seq``, with
  ``client.position`` the positions there): what the feed sends it is the
  segments after that boundary, nothing missing, nothing twice.  A client
  joins (:meth:`join`) only at the head (its own position equals the
  feed's), in the same reactor turn as the check.
* A client that cannot take more (its transport paused it) is not written
  to: it leaves the live set at the position it had, and catches up from
  the table at its own pace (:mod:`.sse`).  Nobody waits for it.
* One read at a time; advances while it runs are taken by the next read.
  Reads start at most every ``interval`` seconds (the replication
  fan-out's ``fanout_interval``) under load; when idle a fact is read at
  once.  With no live client the feed only moves its position (nothing is
  read).
* A pass writes :data:`SLICE` clients per turn of the reactor (straight to
  their sockets, :mod:`.direct`): between two slices the reactor answers
  everything else (the write API first), so a thousand clients slow their
  own passes, not the writes.  A segment read while a pass runs goes to
  the clients the pass has not reached yet in that same pass (and to the
  others in the next), so a fact waits for at most one pass, not for the
  end of the one under way and then a whole one of its own.  A client gets
  at most one write per pass, whatever the number of facts.
* The log holds only what some live client has not been given: segments
  at or below every live client's place are dropped after each pass (and
  all of it when no client is live).
"""

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson
from twisted.internet import defer, task

from ...net.backoff import Outage
from ...streams.pages import group
from .direct import Frames
from .pages import fact_object
from .tokens import Positions, encode

#: Rows read per round of the feed.
FETCH = 1000
#: Seconds before a failed read is first tried again (then with backoff).
RETRY = 1.0
#: Live clients written per turn of the reactor: between two slices it
#: answers the rest (the write API first), whatever the number of clients.
SLICE = 100


def event(token: str, fact_json: bytes) -> bytes:
    """One Server-Sent Event carrying a fact."""
    return b"id: " + token.encode("ascii") + b"\nevent: fact\ndata: " + fact_json + b"\n\n"


class LiveFeed:
    """The live events of one stream (reactor thread)."""

    def __init__(self, stream, bounds: Callable[[object], Positions], watch, clock,
                 interval: float = 0.003):
        self.stream = stream
        self._bounds = bounds
        self._clock = clock
        self.interval = interval
        self._last = -1e9  # when the last read started
        self._timer = None
        self.position: Positions = bounds(stream)
        self.clients: set[Any] = set()  # event streams (sse.EventStream) reading live
        self._moved: list[defer.Deferred] = []  # catch-up clients waiting for a move
        self._running = False
        self._again = False
        self._retry = None
        self._outage = Outage(f"event streams' live read of {stream.name}", RETRY)
        # The log: segment k (``_seq - len(_log) < k <= _seq``) holds the
        # events from boundary k - 1 to boundary k; ``_seq`` is the head's.
        self._seq = 0
        self._log: deque[bytes] = deque()
        self._passing = False
        watch.always(stream, self.advanced)

    def join(self, client) -> bool:
        """Take ``client`` live if it is at the feed's position."""
        if client.position != self.position:
            return False
        client.seq = self._seq
        self.clients.add(client)
        return True

    def leave(self, client) -> None:
        self.clients.discard(client)

    def moved(self) -> defer.Deferred:
        """Fires at the feed's next move."""
        d: defer.Deferred[None] = defer.Deferred()
        self._moved.append(d)
        return d

    def advanced(self) -> None:
        """The stream moved: a read now, or (under load: a read started
        less than ``interval`` ago) once the interval is over, taking every
        advance until then in one read."""
        if self._running:
            self._again = True
            return
        if self._timer is not None and self._timer.active():
            return
        wait = self._last + self.interval - self._clock.seconds()
        if wait > 0:
            self._timer = self._clock.callLater(wait, self.advanced)
            return
        self._running = True
        self._last = self._clock.seconds()
        defer.ensureDeferred(self._run())

    async def _run(self) -> None:
        try:
            while True:
                self._again = False
                bounds = self._bounds(self.stream)
                behind = [w for w in sorted(bounds) if bounds[w] > self.position.get(w, 0)]
                if not behind:
                    break
                for writer in behind:
                    await self._read(writer, bounds[writer])
                self._wake()
        except Exception as e:
            # One line when an outage starts, one when it ends (backoff).
            delay = self._outage.failed(e)
            if self._retry is None or not self._retry.active():
                self._retry = self._clock.callLater(delay, self.advanced)
        else:
            self._outage.succeeded()
        finally:
            self._running = False
        if self._again:
            self.advanced()

    async def _read(self, writer: str, bound: int) -> None:
        """Read and encode ``writer``'s facts up to ``bound``, as segments."""
        name = self.stream.name
        columns = list(self.stream.config.column_names)
        while self.position[writer] < bound:
            start = self.position[writer]
            if not self.clients:
                self.position = dict(self.position, **{writer: bound})
                self._log.clear()
                return
            updates, upto, _ = await self.stream.updates_since(writer, start, bound, FETCH)
            if self.position[writer] != start:
                return  # (cannot happen: one read at a time)
            position = dict(self.position)
            chunks = []
            for fact in group(updates):
                position[writer] = fact[0]
                chunks.append(event(encode(name, position),
                                    orjson.dumps(fact_object(columns, (fact[0], writer,
                                                                       fact[1])))))
            position[writer] = max(upto, start)
            self._append(b"".join(chunks), position)

    def _append(self, data: bytes, position: Positions) -> None:
        """A segment up to ``position`` (the new head); a pass unless one
        runs.  (An empty one moves the clients' positions, writing nothing.)"""
        self._seq += 1
        self._log.append(data)
        self.position = position
        if not self._passing:
            self._passing = True
            defer.ensureDeferred(self._passes())

    def _since(self, seq: int) -> Frames:
        """The bytes of the segments after boundary ``seq``."""
        first = len(self._log) - (self._seq - seq)
        assert 0 <= first < len(self._log), (seq, self._seq, len(self._log))
        if first == len(self._log) - 1:
            return Frames(self._log[-1])
        return Frames(b"".join(itertools.islice(self._log, first, None)))

    async def _passes(self) -> None:
        """Passes over the live clients until none is behind the head."""
        try:
            while True:
                clients = [c for c in self.clients if c.seq != self._seq]
                if not clients:
                    break
                for i in range(0, len(clients), SLICE):
                    if i:
                        await task.deferLater(self._clock, 0, lambda: None)
                    self._write(clients[i:i + SLICE])
        finally:
            self._passing = False
            self._trim()

    def _write(self, clients: list[Any]) -> None:
        """Each of ``clients`` still live the segments it does not have
        (one :class:`.direct.Frames` per place in the log, this turn)."""
        shared: dict[int, Frames] = {}
        seq, position = self._seq, self.position
        for client in clients:
            if client not in self.clients or client.seq == seq:
                continue  # gone, or left for the table, or joined at the head since
            frames = shared.get(client.seq)
            if frames is None:
                frames = shared[client.seq] = self._since(client.seq)
            if frames.data and not client.live_write(frames, position):
                self.clients.discard(client)
            else:
                client.position = position
                client.seq = seq

    def _trim(self) -> None:
        """Drop the segments every live client has."""
        oldest = min((c.seq for c in self.clients), default=self._seq)
        for _ in range(len(self._log) - (self._seq - oldest)):
            self._log.popleft()

    def _wake(self) -> None:
        moved, self._moved = self._moved, []
        for d in moved:
            d.callback(None)
