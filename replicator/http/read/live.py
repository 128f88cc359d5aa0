"""A stream's new facts, read once and encoded once for every event
stream that is live (as the fan-out does RDATA for TCP connections).

:class:`LiveFeed` keeps a *position* (per writer) and follows the stream's
current tokens: when they move, it reads the facts in between (memory or
table, :meth:`replicator.streams.stream.Stream.updates_since`), encodes each
as one Server-Sent Event whose ``id`` is the token after that fact, joins
them into one bytes object and hands that object to every live client
(:mod:`.sse`).

Invariants:

* A live client is exactly at the feed's position: what the feed sends
  follows what the client has, nothing missing, nothing twice.  A client
  joins (:meth:`join`) only when its own position equals the feed's, in
  the same reactor turn as the check.
* A client that cannot take more (its transport paused it) is not written
  to: it leaves the live set at the position it had, and catches up from
  the table at its own pace (:mod:`.sse`).  Nobody waits for it.
* One read at a time; advances while it runs are taken by the next round.
  Under load, rounds start at most every ``interval`` seconds (the
  replication fan-out's ``fanout_interval``): a client gets one write per
  round, whatever the number of facts; when idle, a fact goes out at once.
  With no live client the feed only moves its position (nothing is read).
* A round's bytes go to :data:`SLICE` clients per turn of the reactor
  (straight to their sockets, :mod:`.direct`): between two slices the
  reactor answers everything else (the write API first), so a thousand
  clients slow their own rounds, not the writes.  The next round starts
  when this one is done, so the more clients, the more facts each write
  carries.  A client that joins during a round (it caught up to the
  round's start) gets the round's events too.
"""

from typing import Any, Callable, List, Set

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
        self._last = -1e9  # when the last round started
        self._timer = None
        self.position: Positions = bounds(stream)
        self.clients: Set[Any] = set()  # event streams (sse.EventStream) reading live
        self._moved: List[defer.Deferred] = []  # catch-up clients waiting for a move
        self._running = False
        self._again = False
        self._retry = None
        self._outage = Outage(f"event streams' live read of {stream.name}", RETRY)
        watch.always(stream, self.advanced)

    def join(self, client) -> bool:
        """Take ``client`` live if it is at the feed's position."""
        if client.position != self.position:
            return False
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
        """The stream moved: a round now, or (under load: a round started
        less than ``interval`` ago) once the interval is over, taking every
        advance until then in one write per client."""
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
        """Read, encode and send ``writer``'s facts up to ``bound``."""
        name = self.stream.name
        columns = list(self.stream.config.column_names)
        while self.position[writer] < bound:
            start = self.position[writer]
            if not self.clients:
                self.position = dict(self.position, **{writer: bound})
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
            await self._send(b"".join(chunks), position)

    async def _send(self, data: bytes, position: Positions) -> None:
        """``data`` (the events up to ``position``) to every live client,
        :data:`SLICE` clients per turn of the reactor."""
        frames = Frames(data)
        start = self.position
        clients = list(self.clients)
        for i in range(0, len(clients), SLICE):
            if i:
                await task.deferLater(self._clock, 0, lambda: None)
            self._write(frames, position, clients[i:i + SLICE])
        if len(clients) > SLICE:
            # Joined between two slices (at the round's start): theirs too.
            late = [c for c in self.clients
                    if c.position is not position and c.position == start]
            self._write(frames, position, late)
        self.position = position

    def _write(self, frames: Frames, position: Positions, clients: List[Any]) -> None:
        for client in clients:
            if client not in self.clients:
                continue  # gone, or left for the table, since the round began
            if frames.data and not client.live_write(frames, position):
                self.clients.discard(client)
            else:
                client.position = position

    def _wake(self) -> None:
        moved, self._moved = self._moved, []
        for d in moved:
            d.callback(None)
