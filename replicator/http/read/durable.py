"""Every stream read as a Durable Stream (the open protocol of
durable-streams/durable-streams, PROTOCOL.md sections 5.5-5.8, 8-10): the
read side only, JSON mode, at ``/_replicator/v1/ds/{stream}``.
docs/read-api.md, "Durable Streams", is the contract.

A *message* is one fact, as a page of the read API shows it
(``{"stream_id", "writer", "rows"}``, :func:`.pages.fact_json`).  An
*offset* is one stream ID ``N``, written as 19 decimal digits: the position
after every fact of the stream (of any writer) with ``stream_id <= N``.

Invariants:

* Offsets are lexicographically ordered as the positions they name (fixed
  width), and never ``-1`` or ``now``.
* A read after offset ``N`` gives the facts of every writer with ``N <
  stream_id <= L``, in ascending ``stream_id``, ``L`` being the stream's
  *linear token* on this instance (the minimum over its writers' current
  tokens): below it every writer's facts are final, so no fact can later
  appear below an offset already handed out, and the merged order is the
  same on every instance.  A worker answers an offset with the same
  messages as the master, up to its own linear token.
* Everything else is the read API's: credentials (:mod:`.auth`), pages
  (:mod:`.pages`, built in the per-address turns of :mod:`.builds`), the
  trim boundary (410), the cap on waiting reads (:class:`.book.Slots`),
  immutable caching of final pages (:mod:`.persisted`).
"""

import random
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import orjson
from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.web.http import Request
from zope.interface import implementer

from ..answers import HttpError, Response, excerpt
from .auth import ReadGrant
from .book import client_host
from .pages import Page, etag, fact_json, unless_cached
from .params import ParameterError, TrimmedError, one
from .source import Readable
from .tokens import MAX_POSITION, Positions

if TYPE_CHECKING:  # the routes make their Durable Streams routes
    from .routes import ReadRoutes

#: What a :class:`DurableRoutes` reads: a stream, or a view of one.
S = TypeVar("S", bound=Readable)

#: Messages per answer, at most (and at most ``http.max_page_bytes``).
LIMIT = 1000
#: Seconds a long-poll waits by default (the ``timeout`` parameter, 0-30,
#: changes it), and an SSE answer lasts before the server ends it (the
#: client reconnects from its last offset: what lets a CDN collapse them).
LONG_POLL = 20.0
MAX_TIMEOUT = 30
SSE_SECONDS = 60.0
#: Seconds of the cursor's interval, and its epoch (2024-10-09T00:00:00Z),
#: as PROTOCOL.md section 10.1 gives them.
CURSOR_INTERVAL = 20
CURSOR_EPOCH = 1728432000
#: An SSE answer is written at most this many bytes of messages at a time.
SSE_WRITE = 64 * 1024

JSON = b"application/json"
SECURITY = {b"x-content-type-options": b"nosniff",
            b"cross-origin-resource-policy": b"cross-origin"}
EXPOSE = b"ETag, Stream-Next-Offset, Stream-Up-To-Date, Stream-Cursor, Stream-Closed"
NO_STORE = b"no-store"
IMMUTABLE = b"public, max-age=31536000, immutable"
_DIGITS = re.compile(r"[0-9]{19}")
_SECONDS = re.compile(r"[0-9]{1,2}(\.[0-9]{1,3})?")


def offset_text(position: int) -> str:
    """The offset of ``position`` (19 digits: sorts as the number)."""
    return f"{position:019d}"


def offset_of(text: str) -> int:
    """The position an offset names; 400 naming ``offset`` otherwise."""
    if not _DIGITS.fullmatch(text) or int(text) > MAX_POSITION:
        raise ParameterError(400, "offset", "offset must be -1, now or an offset this "
                                            f"server gave (19 digits), got {excerpt(text)}")
    return int(text)


def cursor(now: float, echoed: str | None,
           rand: Callable[[int, int], int] = random.randint) -> str:
    """The ``Stream-Cursor`` of an answer (PROTOCOL.md 10.1): the current
    interval, or, when the client echoes one at or past it, that one plus
    1-180 intervals (a jitter of up to an hour), so cursors never go back
    and a cached empty answer is never served for ever.  A malformed echo
    is ignored (it only keys caches)."""
    interval = max(0, int((now - CURSOR_EPOCH) // CURSOR_INTERVAL))
    if echoed is not None and echoed.isascii() and echoed.isdigit() and len(echoed) <= 18:
        if int(echoed) >= interval:
            return str(int(echoed) + rand(1, 3600 // CURSOR_INTERVAL))
    return str(interval)


def body_of(columns: list[str], page: Page) -> bytes:
    """A JSON-mode answer: the page's messages as one JSON array."""
    return b"[" + b",".join([fact_json(columns, f) for f in page.facts]) + b"]"


def end_of(page: Page) -> int:
    """The position a page ends at (its ``Stream-Next-Offset``)."""
    return min(page.next.values())


@implementer(IPushProducer)
class _Flow:
    """Whether an SSE answer's transport can take more (its producer)."""

    def __init__(self) -> None:
        self.paused = False
        self._resumed: defer.Deferred[None] | None = None
        self.stopped = False

    def wait(self) -> defer.Deferred[None]:
        if not self.paused or self.stopped:
            return defer.succeed(None)
        self._resumed = defer.Deferred()
        return self._resumed

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        self._fire()

    def stopProducing(self) -> None:
        self.stopped = True
        self._fire()

    def _fire(self) -> None:
        if self._resumed is not None:
            d, self._resumed = self._resumed, None
            d.callback(None)


class DurableRoutes(Generic[S]):
    """``GET``/``HEAD``/``OPTIONS`` of ``/_replicator/v1/ds/{stream}``, on
    the read API's machinery (``reads``: :class:`.routes.ReadRoutes`)."""

    def __init__(self, reads: "ReadRoutes", clock: IReactorTime, long_poll: float = LONG_POLL,
                 sse_seconds: float = SSE_SECONDS) -> None:
        self.reads = reads
        self._clock = clock
        self.long_poll = long_poll
        self.sse_seconds = sse_seconds

    @staticmethod
    def tail(stream: Readable) -> int:
        """How far a Durable Streams reader may read on this instance."""
        return stream.id_gen.get_linear_token()

    def _headers(self, request: Request) -> None:
        for key, value in SECURITY.items():
            request.setHeader(key, value)

    async def preflight(self, request: Request, name: str | None) -> None:
        """A browser's CORS preflight."""
        self._headers(request)
        await self.reads.preflight(request, name)

    async def refuse_write(self, request: Request, name: str | None) -> None:
        """``PUT``/``POST``/``DELETE``: a stream is declared in the
        configuration (its table, columns and writers) and written through
        the write API; this endpoint only reads."""
        self._headers(request)
        raise HttpError(405, "this Durable Streams endpoint is read-only: streams are "
                             "declared in the configuration and written with POST "
                             "/_replicator/v1/streams/{stream}/facts",
                        {b"allow": b"GET, HEAD, OPTIONS"})

    async def get(self, request: Request, name: str | None) -> Response | None:
        self._headers(request)
        reader, stream = self.reads.open_stream(request, name)
        # Routed only for the routes' own DurableRoutes[Stream] (the paths'
        # routes read their views: get_path).
        return await self.read(request, reader, cast(S, stream))

    def content_type(self, stream: S) -> bytes:
        """The content type of the stream's answers (JSON mode)."""
        return JSON

    def body(self, stream: S, page: Page) -> bytes:
        """A page's messages as an answer's body (JSON mode)."""
        return body_of(list(stream.config.column_names), page)

    def sse_data(self, stream: S, page: Page) -> bytes:
        """A page's messages as one SSE ``data`` event."""
        return b"event: data\ndata: " + self.body(stream, page) + b"\n\n"

    def sse_headers(self, stream: S) -> dict[bytes, bytes]:
        """The headers of an SSE answer, beside its content type."""
        return {b"cache-control": NO_STORE, b"x-accel-buffering": b"no"}

    async def read(self, request: Request, reader: ReadGrant,
                   stream: S) -> Response | None:
        """``GET``/``HEAD`` of ``stream`` (the stream, or a view of one with
        the same methods: :mod:`.durable_paths`) once ``reader`` may."""
        gone: list[object] = []
        finished = request.notifyFinish()
        finished.addErrback(gone.append)
        request.setHeader(b"access-control-expose-headers", EXPOSE)
        args = request.args
        text = one(args, "offset")
        live = one(args, "live")
        echoed = one(args, "cursor")
        if live not in (None, "long-poll", "sse"):
            raise ParameterError(400, "live", "live must be long-poll or sse, got "
                                              f"{excerpt(live)}")
        timeout = self._timeout(one(args, "timeout"))
        if request.method == b"HEAD":
            return Response(b"", self.content_type(stream), {b"cache-control": NO_STORE,
                                        b"stream-next-offset":
                                            offset_text(self.tail(stream)).encode()})
        if live is not None and text is None:
            raise ParameterError(400, "offset", f"live={live} needs an offset")
        start, oldest = await self._start(stream, text)
        host = client_host(request)
        if live == "sse":
            await self._sse(request, reader, stream, start, oldest, echoed, gone, finished,
                            host)
            return None
        since, page = await self._first(stream, start, oldest, host)
        if live == "long-poll" and not page.facts:
            polled = await self.reads._long_poll(
                finished, gone, request, reader, stream, page, LIMIT, timeout,
                again=lambda after: self._page(stream, after, host))
            if polled is None:
                return None  # the client went away
            page = polled
            if not page.facts:
                self.reads.book.reached(reader.name, stream.name, page.next)
                request.setResponseCode(204)
                for k, v in {b"cache-control": NO_STORE, b"stream-up-to-date": b"true",
                             b"stream-next-offset": offset_text(end_of(page)).encode(),
                             b"stream-cursor": cursor(self._clock.seconds(),
                                                      echoed).encode()}.items():
                    request.setHeader(k, v)
                request.finish()
                return None
        self.reads.book.reached(reader.name, stream.name, page.next)
        return self._answer(request, stream, since, page, text == "now", echoed)

    def _timeout(self, text: str | None) -> float:
        if text is None:
            return self.long_poll
        if not _SECONDS.fullmatch(text) or float(text) > MAX_TIMEOUT:
            raise ParameterError(400, "timeout", "timeout must be a number of seconds from 0 "
                                                 f"to {MAX_TIMEOUT}, got {excerpt(text)}")
        return float(text)

    async def _start(self, stream: S, text: str | None) -> tuple[int, bool]:
        """``(position, from the oldest retained fact)`` of ``offset``;
        400 for a malformed one or one beyond the stream's sequence."""
        if text is None or text == "-1":
            return 0, True
        tail = self.tail(stream)
        if text == "now":
            return tail, False
        position = offset_of(text)
        if position > tail:
            # Ahead of this instance (a reader that came from a master
            # further on, or this instance restarted): fine below the
            # sequence, where facts can still come.
            top = await stream.sequence_value()
            if position > top:
                raise ParameterError(400, "offset", "offset beyond the stream: above "
                                                    f"{top}, the largest ID stream "
                                                    f"{stream.name} has handed out")
        return position, False

    def _at(self, stream: S, position: int) -> Positions:
        return {w: position for w in stream.config.writers}

    def _page(self, stream: S, since: Positions, host: str | None,
              max_bytes: int | None = None) -> Awaitable[Page]:
        tail = self.tail(stream)
        return self.reads.page(stream, since, LIMIT, {w: tail for w in since}, host,
                               max_bytes)

    async def _first(self, stream: S, start: int, oldest: bool, host: str | None,
                     max_bytes: int | None = None) -> tuple[int, Page]:
        """``(start, page)``: the first page, the start moved up to the
        trim boundary when reading from the oldest retained fact."""
        since = self._at(stream, start)
        while True:
            try:
                return min(since.values()), await self._page(stream, since, host, max_bytes)
            except TrimmedError as e:
                if not oldest:
                    raise e.named("offset") from None
                since = {w: max(p, e.boundary) for w, p in since.items()}

    def _answer(self, request: Request, stream: S, start: int, page: Page, now: bool,
                echoed: str | None) -> Response | None:
        body = self.body(stream, page)
        headers = {b"stream-next-offset": offset_text(end_of(page)).encode(),
                   b"stream-cursor": cursor(self._clock.seconds(), echoed).encode(),
                   b"cache-control": IMMUTABLE if page.final else NO_STORE}
        if not page.full:
            headers[b"stream-up-to-date"] = b"true"
        if now:
            return Response(body, self.content_type(stream), headers)
        headers[b"etag"] = etag(b"%d:%d:" % (start, end_of(page)) + body)
        return unless_cached(request, body, self.content_type(stream), headers)

    # ---------------------------------------------------------------- SSE
    async def _sse(self, request: Request, reader: ReadGrant, stream: S, start: int,
                   oldest: bool, echoed: str | None, gone: list[object],
                   finished: defer.Deferred[None], host: str | None) -> None:
        """``live=sse``: ``event: data`` (a JSON array of messages) and
        ``event: control`` after each, pages read at the client's pace
        (its transport paused: nothing more is read for it), waiting on
        the stream's moves at the tail; ended after ``sse_seconds``."""
        # The start checked (400/410) before the answer is 200.
        start, first = await self._first(stream, start, oldest, host, SSE_WRITE)
        if gone:
            return None
        self.reads.slots.take(host)
        self.reads.book.opened(reader.name, stream.name)
        flow = _Flow()
        woke: list[defer.Deferred[None]] = []

        def wake(_: object = None) -> None:
            # Only the wait under way: firing it runs the loop on to its
            # next wait (in this call), which is the next move's to end.
            if woke:
                d = woke.pop()
                if not d.called:
                    d.callback(None)

        finished.addBoth(wake)
        try:
            request.setResponseCode(200)
            request.setHeader(b"content-type", b"text/event-stream")
            for k, v in self.sse_headers(stream).items():
                request.setHeader(k, v)
            request.registerProducer(flow, True)
            deadline = self._clock.seconds() + self.sse_seconds
            page: Page | None = first
            since = self._at(stream, start)
            while not gone and not flow.stopped:
                if page is None:
                    try:
                        page = await self._page(stream, since, host, SSE_WRITE)
                    except TrimmedError:
                        break  # (the client's reconnect is answered 410)
                if gone:
                    break
                end = end_of(page)
                control: dict[str, object] = {
                    "streamNextOffset": offset_text(end),
                    "streamCursor": cursor(self._clock.seconds(), echoed)}
                if not page.full:
                    control["upToDate"] = True
                out = []
                if page.facts:
                    out.append(self.sse_data(stream, page))
                if page.facts or page is first or end != min(since.values()):
                    # (No space after "data:": the suite's parsers want none; SSE allows both.)
                    out.append(b"event: control\ndata:" + orjson.dumps(control) + b"\n\n")
                    request.write(b"".join(out))
                self.reads.book.reached(reader.name, stream.name, page.next)
                since = page.next
                full = page.full
                page = None
                await flow.wait()
                remaining = deadline - self._clock.seconds()
                if remaining <= 0:
                    break
                if full:
                    continue
                d: defer.Deferred[None] = defer.Deferred()
                woke.append(d)
                cancel = self.reads.watch.once(stream, wake)
                timer = self._clock.callLater(min(remaining, self.reads.heartbeat), wake)
                try:
                    await d
                finally:
                    cancel()
                    if timer.active():
                        timer.cancel()
                if not gone and self._clock.seconds() < deadline \
                        and self.tail(stream) <= min(since.values()):
                    request.write(b": ping\n\n")  # (a heartbeat: nothing new)
        finally:
            self.reads.slots.give(host)
            self.reads.book.closed(reader.name, stream.name)
            if not gone and not request.finished:
                try:
                    request.unregisterProducer()
                    request.finish()
                except Exception:
                    pass
        return None
