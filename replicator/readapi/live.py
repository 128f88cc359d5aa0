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
* The feed takes at most about half of the reactor: after a round whose
  writes took ``t`` seconds (a ``send`` per client: 1,000 clients take
  milliseconds), the next starts no sooner than ``t`` later (when ``t`` is
  a millisecond or more).  So the more
  clients, the more facts each write carries, instead of the writes
  starving everything else (the write API first); with few clients this
  is far below ``interval`` and changes nothing.
"""

import time
from typing import Any, Callable, List, Set

import orjson
from twisted.internet import defer

from ..net.backoff import Outage
from ..streams.pages import group
from .direct import Frames
from .pages import fact_object
from .tokens import Positions, encode

#: Rows read per round of the feed.
FETCH = 1000
#: Seconds before a failed read is first tried again (then with backoff).
RETRY = 1.0

#: What a round's writes are timed with (seconds).
perf_counter = time.perf_counter
#: Rounds whose writes took less than this (seconds) are followed by no rest.
MIN_REST = 0.001


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
        self._rest = -1e9  # no round before this (after a round of costly writes)
        self._spent = 0.0  # seconds the writes of the running round took
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
        less than ``interval`` ago, or the rest after a costly round is not
        over) later, taking every advance until then in one write per
        client."""
        if self._running:
            self._again = True
            return
        if self._timer is not None and self._timer.active():
            return
        wait = max(self._last + self.interval, self._rest) - self._clock.seconds()
        if wait > 0:
            self._timer = self._clock.callLater(wait, self.advanced)
            return
        self._running = True
        self._last = self._clock.seconds()
        defer.ensureDeferred(self._run())

    async def _run(self) -> None:
        self._spent = 0.0
        try:
            self._again = False
            bounds = self._bounds(self.stream)
            behind = [w for w in sorted(bounds) if bounds[w] > self.position.get(w, 0)]
            for writer in behind:
                await self._read(writer, bounds[writer])
            if behind:
                self._wake()
                # Moves during the read: the next round (after the rest).
                self._again = self._again or self._bounds(self.stream) != bounds
        except Exception as e:
            # One line when an outage starts, one when it ends (backoff).
            delay = self._outage.failed(e)
            if self._retry is None or not self._retry.active():
                self._retry = self._clock.callLater(delay, self.advanced)
        else:
            self._outage.succeeded()
        finally:
            self._running = False
            if self._spent >= MIN_REST:
                self._rest = self._clock.seconds() + self._spent
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
            self._send(b"".join(chunks), position)

    def _send(self, data: bytes, position: Positions) -> None:
        """``data`` (the events up to ``position``) to every live client."""
        started = perf_counter()
        frames = Frames(data)
        for client in list(self.clients):
            if data and not client.live_write(frames, position):
                self.clients.discard(client)
            else:
                client.position = position
        self.position = position
        self._spent += perf_counter() - started

    def _wake(self) -> None:
        moved, self._moved = self._moved, []
        for d in moved:
            d.callback(None)
