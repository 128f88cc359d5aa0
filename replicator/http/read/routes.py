"""The read API's routes: ``GET .../streams/{stream}/facts`` (pages and
long-poll) and ``GET .../streams/{stream}/events`` (Server-Sent Events,
:mod:`.sse`).  docs/read-api.md is the contract.

Checked in this order: 401/403 (credential, :mod:`.auth`), 403 (a stream
the credential does not cover), 404 (unknown stream), 503 (streams not
loaded yet), 400 (``limit``, ``wait``, ``from``: a malformed or foreign
token, or one beyond the stream's sequence), 406 (an ``Accept`` of pages
that takes none of their formats, :mod:`.formats`), 410 (``from`` or
``Last-Event-ID`` below the stream's trim boundary: facts after it were
trimmed by retention), then 503 when too many reads are open already
(long-polls that wait, event streams).
"""


from collections.abc import Awaitable, Callable
from typing import Any, cast

from twisted.internet import defer, threads
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.http import Request

from ...observe import metrics
from ...streams.registry import StreamRegistry
from ...streams.stream import Stream
from ...streams.trimmed import FactsTrimmed
from ..answers import HttpError, Response, excerpt
from . import formats, readahead
from .auth import ReaderAuth, ReadGrant
from .book import ReaderBook, Slots, client_host
from .builds import PageBuilds
from .live import LiveFeed
from .pages import THREAD_ENCODE_ROWS, Page, etag, read_page, unencoded_rows, unless_cached
from .params import ParameterError, TrimmedError, limit_of, one, positions_of, wait_of
from .persisted import PersistedLinear
from .source import Readable
from .sse import SseClient
from .tokens import Positions
from .watch import StreamWatch

log = Logger()

#: Any page may read a stream with a secret (never with cookies: with "*"
#: a browser sends none cross-origin), and see every answer and ETag.
CORS = {b"access-control-allow-origin": b"*",
        b"access-control-expose-headers": b"ETag"}
IMMUTABLE = b"public, max-age=31536000, immutable"
NEWEST = b"no-store"
#: A page's format follows the request's Accept (:mod:`.formats`): a cache
#: keeps one answer per Accept.
VARY = {b"vary": b"Accept"}

#: ``read(since, bounds, limit, final_below, max_bytes)``: a page read
#: instead of :func:`.pages.read_page` (:meth:`ReadRoutes.page`).
PageRead = Callable[[Positions, Positions, int, int, int], Awaitable[Page]]
#: ``again(positions)``: the page after ``positions`` (a long-poll's).
PageAgain = Callable[[Positions], Awaitable[Page]]


class ReadRoutes:
    """Reading streams over HTTP (one per :class:`replicator.http.HttpApi`)."""

    def __init__(self, *, registry: StreamRegistry, auth: ReaderAuth, clock: IReactorTime,
                 max_waiting: int = 128,
                 max_waiting_per_address: int = 32, heartbeat: float = 15.0,
                 feed_interval: float = 0.003, max_page_bytes: int = 4 * 1024 * 1024,
                 ds_long_poll: float | None = None) -> None:
        self.registry = registry
        self.auth = auth
        self._clock = clock
        self.watch = StreamWatch()
        self.book = ReaderBook(clock)
        self.persisted = PersistedLinear(clock)
        self.slots = Slots(max_waiting, max_waiting_per_address)
        self.heartbeat = heartbeat
        self.feed_interval = feed_interval
        self.max_page_bytes = max_page_bytes
        self.builds = PageBuilds()  # page reads at once (per address, in all)
        self.readahead = readahead.ReadAhead(clock)  # pages built ahead for walking readers
        self._live: dict[str, LiveFeed] = {}  # stream name -> its live feed (.live)
        self._failing: dict[str, int] = {}  # page reads failed per stream (an outage)
        from .durable import DurableRoutes

        # The same, as Durable Streams.
        self.durable: DurableRoutes[Stream] = DurableRoutes(self, clock, **(
            {} if ds_long_poll is None else {"long_poll": ds_long_poll}))
        self.trimmed_streams = 0  # event streams the trim boundary passed (ended)

    # ------------------------------------------------------- what it shows
    def status(self) -> list[dict[str, Any]]:
        """The readers for the status page and ``/status.json``."""
        return self.book.rows(self.registry)

    def metric_samples(self) -> list[metrics.Sample]:
        """The readers' live metrics (a :data:`replicator.observe.metrics.Source`)."""
        out: list[metrics.Sample] = []
        for row in self.book.rows(self.registry):
            labels = (row["reader"], row["stream"])
            out.append((metrics.HTTP_READERS_CONNECTED, labels, row["connected"]))
            if row["position"] is not None:
                out.append((metrics.HTTP_READER_POSITION, labels, row["position"]))
            if row["lag"] is not None:
                out.append((metrics.HTTP_READER_LAG, labels, row["lag"]))
        return out

    # ------------------------------------------------------------ common
    async def preflight(self, request: Request, name: str | None, methods: bytes = b"GET, HEAD",
                        headers: bytes = b"Authorization, Last-Event-ID, If-None-Match",
                        ) -> None:
        """``OPTIONS``: a browser's CORS preflight of a cross-origin read
        (one that sends ``Authorization`` or ``Last-Event-ID``), or of
        ``methods`` sending ``headers``."""
        request.setResponseCode(204)
        for key, value in CORS.items():
            request.setHeader(key, value)
        request.setHeader(b"access-control-allow-methods", methods)
        request.setHeader(b"access-control-allow-headers", headers)
        request.setHeader(b"access-control-max-age", b"86400")
        request.setHeader(b"cache-control", b"no-store")
        request.finish()

    def open_stream(self, request: Request, name: str | None) -> tuple[ReadGrant, Stream]:
        """``(reader, stream)`` for a request, or the 401/403/404/503."""
        for key, value in CORS.items():
            request.setHeader(key, value)
        reader = self.auth.reader(request)
        if name is not None:
            # Before the stream's existence: a scoped reader learns nothing
            # of the streams it may not read.
            self.auth.check(reader, name)
        stream = self.registry.find(name) if name is not None else None
        if stream is None:
            raise ParameterError(404, "stream", "unknown stream" + (
                f" {excerpt(name)}" if name is not None else
                ": the name is not percent-encoded UTF-8"))
        self.auth.check(reader, stream.name)
        if stream.id_gen is None:
            raise HttpError(503, f"stream {stream.name} is not loaded yet")
        return reader, stream

    @staticmethod
    def bounds(stream: Readable) -> Positions:
        """Every writer's current token: how far a reader may read now."""
        current = stream.id_gen.get_positions()
        return {w: current.get(w, 0) for w in stream.config.writers}

    async def start_positions(self, stream: Stream, text: str | None) -> Positions:
        """Where a read starts (``from``); 400 for a bad token, or one
        beyond what the stream's sequence ever handed out."""
        now = self.bounds(stream)
        since = positions_of(text, stream, now)
        if any(p > now.get(w, 0) for w, p in since.items()):
            # Ahead of what this instance knows (it restarted, or another
            # writer's announcement is on its way): possible only below the
            # sequence; above it the token claims facts that never existed.
            top = await stream.sequence_value()
            if any(p > top for p in since.values()):
                raise ParameterError(400, "from", "token beyond the stream: it names a "
                                                  f"position above {top}, the largest ID "
                                                  f"stream {stream.name} has handed out")
        return since

    # ------------------------------------------------------------- pages
    async def facts(self, request: Request, name: str | None) -> Response | None:
        gone: list[object] = []  # the client went away (heard from the start: see events)
        finished = request.notifyFinish()
        finished.addErrback(gone.append)
        reader, stream = self.open_stream(request, name)
        args = request.args
        limit = limit_of(args)
        wait = wait_of(args)
        text = one(args, "from")
        since = await self.start_positions(stream, text)
        form = formats.negotiate(request.requestHeaders.getRawHeaders(b"accept"))
        host = client_host(request)
        ahead = readahead.key(stream.name, since, limit, form.name)
        page = await self.readahead.take(ahead) if text is not None else None
        if page is None:
            _, page = await self.first_page(stream, since, limit, text is None, host, form)
        if not page.facts and wait > 0:
            polled = await self._long_poll(finished, gone, request, reader, stream, page,
                                           limit, wait, form)
            if polled is None:
                return None  # the client went away
            page = polled
        self.book.reached(reader.name, stream.name, page.next)
        self.readahead.served(ahead, page, lambda after: self.page(stream, after, limit,
                                                                   host=host, form=form))
        return await self._page_answer(request, stream, page, form)

    async def first_page(self, stream: Stream, since: Positions, limit: int, oldest: bool,
                         host: str | None, form: formats.PageFormat = formats.JSON,
                         ) -> tuple[Positions, Page]:
        """``(start, page)``: the page after ``since``; with ``oldest`` (no
        token given: from the oldest retained fact) ``since`` moved up to
        the trim boundary first if retention trimmed below it, else 410
        (:class:`.params.TrimmedError`)."""
        while True:
            try:
                return since, await self.page(stream, since, limit, host=host, form=form)
            except TrimmedError as e:
                if not oldest:
                    raise
                # (Again only if the boundary moved meanwhile: it only rises.)
                since = {w: max(p, e.boundary) for w, p in since.items()}

    async def page(self, stream: Readable, since: Positions, limit: int,
                   bounds: Positions | None = None, host: str | None = None,
                   max_bytes: int | None = None,
                   form: formats.PageFormat = formats.JSON,
                   read: PageRead | None = None) -> Page:
        """A page (:func:`.pages.read_page`) up to ``bounds`` (by default
        the writers' current tokens), at most ``max_page_bytes`` of facts
        (or ``max_bytes`` if smaller) encoded in ``form``
        (:mod:`.pages`), built in the turn of ``host`` (:mod:`.builds`).
        Facts after ``since`` trimmed by retention are 410 naming ``from``
        (no log: the reader's doing).  A failed read is 503; the first of
        an outage is logged with its traceback, the others counted until a
        read succeeds (one line then).  ``read(since, bounds, limit,
        final_below, max_bytes)``, if given, reads the page instead of
        :func:`.pages.read_page` (a Durable Stream created over HTTP,
        :mod:`.durable_paths`)."""
        linear = stream.id_gen.get_linear_token()
        most = min(self.max_page_bytes, max_bytes or self.max_page_bytes)
        upto = bounds if bounds is not None else self.bounds(stream)
        try:
            if read is not None:
                page = await self.builds.run(host, lambda: read(since, upto, limit, linear,
                                                                most))
            else:
                # Without ``read`` it is a stream (a view gives its own read).
                table = cast(Stream, stream)
                page = await self.builds.run(host, lambda: read_page(
                    table, since, upto, limit, final_below=linear,
                    columns=stream.config.column_names, max_bytes=most, form=form))
        except FactsTrimmed as e:
            raise TrimmedError("from", e.writer, e.since, e.boundary) from None
        except Exception:
            failed = self._failing.get(stream.name)
            self._failing[stream.name] = (failed or 0) + 1
            if failed is None:
                log.failure("Reading a page of {stream} failed; further failures are counted "
                            "until a read succeeds", stream=stream.name)
            raise HttpError(503, "database read failed") from None
        failed = self._failing.pop(stream.name, None)
        if failed is not None:
            log.info("reads of {stream} succeed again after {n} failed", stream=stream.name,
                     n=failed)
        if page.final:
            # Final for good only at or below the persisted positions.
            page.final = page.facts[-1][0] <= await self.persisted.get(stream)
        return page

    async def _long_poll(self, finished: defer.Deferred[None], gone: list[object],
                         request: Request, reader: ReadGrant, stream: Readable, page: Page,
                         limit: int, wait: float, form: formats.PageFormat = formats.JSON,
                         again: PageAgain | None = None) -> Page | None:
        """Wait up to ``wait`` seconds for a fact after ``page.next``; each
        move of the stream reads the page after it again (``again(positions)``,
        by default :meth:`page` in ``form`` up to the writers' current tokens)."""
        host = client_host(request)
        if again is None:
            def again(after: Positions) -> Awaitable[Page]:
                return self.page(stream, after, limit, host=host, form=form)
        self.slots.take(host)
        self.book.opened(reader.name, stream.name)
        woke: defer.Deferred[None] | None = None

        def wake(_: object = None) -> None:
            if woke is not None and not woke.called:
                woke.callback(None)

        finished.addBoth(wake)  # (``gone`` says whether the client went)
        deadline = self._clock.seconds() + wait
        try:
            while not page.facts and not gone:
                remaining = deadline - self._clock.seconds()
                if remaining <= 0:
                    break
                woke = defer.Deferred()
                cancel = self.watch.once(stream, wake)
                timer = self._clock.callLater(remaining, wake)
                try:
                    await woke
                finally:
                    cancel()
                    if timer.active():
                        timer.cancel()
                if gone:
                    break
                page = await again(page.next)
        finally:
            self.slots.give(host)
            self.book.closed(reader.name, stream.name)
        return None if gone else page

    async def _page_answer(self, request: Request, stream: Stream, page: Page,
                           form: formats.PageFormat) -> Response | None:
        columns = list(stream.config.column_names)
        if unencoded_rows(page) > THREAD_ENCODE_ROWS:
            body = await threads.deferToThread(form.body, stream.name, columns, page)
        else:
            body = form.body(stream.name, columns, page)
        if not page.final:
            return Response(body, form.media_type, {b"cache-control": NEWEST, **VARY})
        headers = {b"cache-control": IMMUTABLE, b"etag": etag(body), **VARY}
        return unless_cached(request, body, form.media_type, headers)

    # ------------------------------------------------------------ events
    async def events(self, request: Request, name: str | None) -> Response | None:
        """A Server-Sent Events stream of ``stream``'s facts (:mod:`.sse`)
        from ``Last-Event-ID`` if given, else ``from``."""
        # Heard from the start: a client that goes while the start is
        # checked must not leave a stream (and a slot) behind.
        gone: list[object] = []
        finished = request.notifyFinish()
        finished.addErrback(gone.append)
        reader, stream = self.open_stream(request, name)
        ids = request.requestHeaders.getRawHeaders(b"last-event-id") or []
        if len(ids) > 1:
            raise ParameterError(400, "Last-Event-ID", f"Last-Event-ID given {len(ids)} times")
        last = ids[0] if ids else None
        parameter = "from"
        if last:  # (an empty one is no id: the start is from)
            parameter = "Last-Event-ID"
            try:
                since = await self.start_positions(stream, last.decode("utf-8"))
            except UnicodeDecodeError:
                raise ParameterError(400, "Last-Event-ID", "Last-Event-ID is not UTF-8") from None
            except ParameterError as e:
                e.extra = {"parameter": "Last-Event-ID"}
                raise
            oldest = False
        else:
            text = one(request.args, "from")
            since = await self.start_positions(stream, text)
            oldest = text is None
        try:
            # A one-fact page checks the start against the trim boundary
            # before the stream answers 200 (EventSource takes a non-200 as
            # final); from the oldest retained fact if no token was given.
            since, _ = await self.first_page(stream, since, 1, oldest, client_host(request))
        except TrimmedError as e:
            raise e.named(parameter) from None
        if request.method == b"HEAD":
            return Response(b"", b"text/event-stream; charset=utf-8")
        if gone:
            return None
        host = client_host(request)
        self.slots.take(host)
        client = None
        try:
            feed = self.feed(stream)
            client = SseClient(request, stream, feed, since,
                               lambda position, limit, bounds, max_bytes: self.page(
                                   stream, position, limit, bounds, host, max_bytes),
                               self._clock, self.heartbeat, finished)
            self.book.opened(reader.name, stream.name)
            self.book.attach(reader.name, stream.name, client)
            client.start()
            await client.done
            if isinstance(client.ended_by, TrimmedError):
                self.trimmed_streams += 1
                metrics.HTTP_READER_TRIMMED.labels(reader.name, stream.name).inc()
                log.info("reader {reader}: an event stream of {stream} fell behind the trim "
                         "boundary ({error}); it ended with an error event",
                         reader=reader.name, stream=stream.name, error=client.ended_by.message)
        finally:
            self.slots.give(host)
            if client is not None:
                self.book.detach(reader.name, stream.name, client)
                self.book.closed(reader.name, stream.name)
        return None

    def feed(self, stream: Stream) -> LiveFeed:
        """The live feed of ``stream`` (made at its first event stream)."""
        feed = self._live.get(stream.name)
        if feed is None or feed.stream is not stream:
            feed = self._live[stream.name] = LiveFeed(stream, self.bounds, self.watch,
                                                      self._clock, self.feed_interval)
        return feed
