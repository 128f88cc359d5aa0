"""One event stream (Server-Sent Events) of the read API.

The answer is ``text/event-stream``: ``retry: 2000`` first, then one event
per fact (``id:`` the token after it, ``event: fact``, ``data:`` the fact as
in a page), and a comment line (``: ping``) every ``heartbeat`` seconds.

A client is *live* (in its stream's :class:`.live.LiveFeed`: it gets the
shared bytes of new facts) or *catching up* (it reads pages from the table
at its own pace, bounded by the feed's position, and joins the feed once it
is there).  It starts catching up from its token.

Backpressure: the client is the streaming producer of its request.  When
its transport's buffer is over the transport's bound, the transport pauses
it: a live client leaves the feed at the next write (nothing is queued for
it); a catching-up client reads no next page until resumed.  So a client
holds at most its transport's bound plus one write, whatever the stream's
rate, and nobody else waits for it: a catch-up page is written (its events
made into one write of about :data:`WRITE_SIZE`) and let go before the
client waits for anything (its transport, or its turn for the next page),
and it asks the table for about as many facts as one write holds
(:func:`next_limit`), not for many more that the page's cut would drop.
"""

from collections.abc import Callable

import orjson
from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from zope.interface import implementer

from ...net.twisted_private import waiting_for_transport
from ..answers import HttpError
from .direct import Direct, Frames
from .live import event
from .pages import fact_json
from .tokens import Positions, encode

log = Logger()

RETRY = b"retry: 2000\n\n"
PING = b": ping\n\n"
#: Facts per catch-up page, at most; the first asks for :data:`FIRST_PAGE`.
CATCH_UP_PAGE = 256
FIRST_PAGE = 32
#: A catching-up client is written this many bytes at a time, and no more
#: once its transport paused it; its pages are cut at this many bytes too
#: (the fact that reaches it ends the page), so a page is written whole,
#: and a slow client makes the daemon read no fact twice.
WRITE_SIZE = 64 * 1024


def next_limit(limit: int, page) -> int:
    """How many facts the catch-up page after ``page`` (asked for with
    ``limit``) asks for: twice as many when ``page`` held ``limit`` facts
    (all of them fit in one write), a quarter more than it held when one
    write's bytes cut it (facts of about the same size fill the next), the
    same at the bounds; at most :data:`CATCH_UP_PAGE`.  A table read then
    gives about one write's facts, not up to :data:`CATCH_UP_PAGE` facts of
    which the cut keeps a few (each read again by the page after)."""
    held = len(page.facts)
    if held >= limit:
        return min(CATCH_UP_PAGE, 2 * limit)
    if page.full:
        return min(CATCH_UP_PAGE, held + held // 4 + 1)
    return limit


def error_event(error: HttpError) -> bytes:
    """An ``error`` event carrying the JSON an HTTP answer would hold."""
    return b"event: error\ndata: " + orjson.dumps({**error.extra, error.key: error.message}) \
        + b"\n\n"


@implementer(IPushProducer)
class SseClient:
    """One event stream: live or catching up (see the module docstring).

    ``read_page(position, limit, bounds, max_bytes)`` reads a page
    (:mod:`.pages`).
    """

    def __init__(self, request, stream, feed, position: Positions,
                 read_page: Callable, clock, heartbeat: float,
                 finished: defer.Deferred | None = None):
        self.request = request
        self.stream = stream
        self.feed = feed
        self.position = position
        self._read_page = read_page
        self._clock = clock
        self._heartbeat = heartbeat
        self.paused = False
        self.closed = False
        self.live = False
        self.seq = 0  # its place in the feed's log while live (.live)
        self.switched = 0  # times it left the feed for the table
        self.ended_by: HttpError | None = None  # why the server ended it, if it did
        self._resumed: defer.Deferred | None = None
        self._ping = None
        self._out = Direct(request)  # (remade once the head is sent: see start)
        self.done: defer.Deferred[None] = defer.Deferred()  # fires when the stream ends
        # The request's end (``notifyFinish``, asked for before any wait).
        self._finished = finished if finished is not None else request.notifyFinish()

    # ------------------------------------------------------------ start
    def start(self) -> None:
        request = self.request
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-accel-buffering", b"no")  # nginx: pass events on at once
        request.setHeader(b"x-content-type-options", b"nosniff")
        channel = getattr(request, "channel", None)
        if channel is not None and hasattr(channel, "setTimeout"):
            channel.setTimeout(None)  # heartbeats keep it going, not client bytes
        request.registerProducer(self, True)
        if waiting_for_transport(channel):
            self.paused = True
        self._finished.addBoth(self._gone)
        request.write(RETRY)
        self._out = Direct(request)  # the answer's head is sent: chunked or not is known
        self._schedule_ping()
        defer.ensureDeferred(self._catch_up())

    # --------------------------------------------------------- catch-up
    async def _catch_up(self) -> None:
        """Read pages at the client's pace until it is at the feed's position."""
        self.live = False
        name = self.stream.name
        limit = min(FIRST_PAGE, CATCH_UP_PAGE)
        try:
            while not self.closed:
                if self.paused:
                    self._resumed = defer.Deferred()
                    await self._resumed
                    continue
                if self.feed.join(self):
                    self.live = True
                    return
                bounds = dict(self.feed.position)
                found, limit = await self._next_page(bounds, limit)
                if self.closed:
                    return
                if not found and self.position != self.feed.position \
                        and bounds == self.feed.position:
                    # Ahead of the feed on some writer: wait for it to move.
                    await self.feed.moved()
        except HttpError as e:
            # A failed read (logged once per outage; the client retries), or
            # the trim boundary passed it (410): said in an error event, as
            # a reconnect from its position would be refused.
            self.ended_by = e
            if e.code == 410 and not self.closed:
                self.request.write(error_event(e))
            self.close()
        except Exception:
            log.failure("stream {stream}: an event stream's catch-up failed; closing it",
                        stream=name)
            self.close()

    async def _next_page(self, bounds: Positions, limit: int) -> tuple[bool, int]:
        """Read the page after the client's position (at most ``limit``
        facts, up to ``bounds``) and write it: ``(whether it held facts,
        the next page's limit)``.  The page is let go when this returns:
        nothing of it is held while the client waits."""
        page = await self._read_page(self.position, limit, bounds, WRITE_SIZE)
        if self.closed:
            return False, limit
        if self._write_page(page, list(self.stream.config.column_names)):
            self.position = page.next
        return bool(page.facts), next_limit(limit, page)

    def _write_page(self, page, columns) -> bool:
        """Write a page's events, :data:`WRITE_SIZE` bytes at a time; stop
        (with the position after the last fact written) once paused.
        Whether the whole page was written."""
        name = self.stream.name
        position = dict(self.position)
        chunks = []
        size = 0
        for fact in page.facts:
            position[fact[1]] = fact[0]
            chunk = event(encode(name, position), fact_json(columns, fact))
            chunks.append(chunk)
            size += len(chunk)
            if size >= WRITE_SIZE:
                self._out.write(b"".join(chunks))
                chunks, size = [], 0
                self.position = dict(position)
                if self.paused and fact is not page.facts[-1]:
                    return False
        if chunks:
            self._out.write(b"".join(chunks))
        return True

    # -------------------------------------------------------------- live
    def live_write(self, frames: Frames, position: Positions) -> bool:
        """The feed's next events (the same :class:`.direct.Frames` for
        every client, written straight to its socket when it can take
        them: :mod:`.direct`); False (nothing written) when paused: the
        client then catches up from the table."""
        if self.closed:
            return False
        if self.paused:
            self.live = False
            self.switched += 1
            defer.ensureDeferred(self._catch_up())
            return False
        self._out.write_frames(frames)
        return True

    # --------------------------------------------------------- producer
    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        if self._resumed is not None:
            d, self._resumed = self._resumed, None
            d.callback(None)

    def stopProducing(self) -> None:
        self.close()

    # --------------------------------------------------------- heartbeat
    def _schedule_ping(self) -> None:
        self._ping = self._clock.callLater(self._heartbeat, self._send_ping)

    def _send_ping(self) -> None:
        if self.closed:
            return
        if not self.paused:
            self._out.write(PING)
        self._schedule_ping()

    # ------------------------------------------------------------- end
    def close(self) -> None:
        """End the stream (the server's side)."""
        if not self.closed:
            try:
                self.request.unregisterProducer()
                self.request.finish()
            except Exception:
                pass
            self._gone(None)

    def _gone(self, _) -> None:
        if self.closed:
            return
        self.closed = True
        self.feed.leave(self)
        if self._ping is not None and self._ping.active():
            self._ping.cancel()
        if self._resumed is not None:
            d, self._resumed = self._resumed, None
            d.callback(None)
        self.done.callback(None)
