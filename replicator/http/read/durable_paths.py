"""Durable Streams created over HTTP: ``PUT``/``POST``/``DELETE``/``GET``/
``HEAD`` of ``/_replicator/v1/ds/{stream}/{path}``, ``{stream}`` a stream
declared with ``durable_streams: true``.  docs/read-api.md, "Streams
created over HTTP", is the contract.

Such a stream is one replicator stream like any other (its table, its
sequence, its one writer, replicated to every instance); each of its facts
is one operation on the Durable Stream at ``path`` (its ``ds_path``):
``create`` (with the content type and the ``PUT`` body), ``append`` (the
``POST`` body), ``delete``.  Bodies are stored as base64 of their bytes,
or, in JSON mode (``application/json``), as the JSON array of the
messages they give.

Invariants:

* Offsets are :mod:`.durable`'s: a stream ID ``N`` (19 digits) is the
  position after every operation with ``stream_id <= N``.  The Durable
  Stream at ``path`` is the operations of ``path`` after its newest
  ``create`` at or below the linear token, if no ``delete`` came after it;
  its messages are the bodies of that ``create`` and of the ``append``\\ s
  after it, in stream-ID order.  Every instance reads them from the table
  up to its own linear token, so a worker answers an offset with the
  master's bytes.
* An append with a ``Stream-Seq`` is refused (409) unless it sorts
  after the path's last one: appends of a path are serialised, so the
  check and the write are one step.
* Only the stream's writer creates, appends and deletes (the write API's
  secret, its body limit, its 409 elsewhere); its operations on one path
  are serialised here, and each answers once its fact is readable (at or
  below the linear token): a reader that follows a write sees it.
* The read side is :class:`.durable.DurableRoutes`' own, on a
  :class:`PathView` of the stream; only the page read (one query on the
  ``(ds_path, stream_id)`` index, at most ``LIMIT`` rows and the page
  bytes) and the encodings differ.
"""

import base64
import re

import orjson
from twisted.internet import defer, threads

from ...jsontext import DuplicateKeyError, decode_json_strict
from ..answers import HttpError, excerpt
from .durable import LIMIT, NO_STORE, DurableRoutes, offset_text
from .pages import Page, PageFact
from .tokens import Positions

#: The longest path (percent-encoded, as the URL has it) and content type.
MAX_PATH = 512
MAX_CONTENT_TYPE = 200
MAX_SEQ = 200
#: Seconds a write waits for its fact to become readable before answering.
VISIBLE_WAIT = 10.0
DEFAULT_TYPE = "application/octet-stream"
CREATE, APPEND, DELETE = "create", "append", "delete"
_SEGMENT = r"[A-Za-z0-9._~!$'()*+,;=:@%-]+"
_PATH = re.compile(rf"{_SEGMENT}(/{_SEGMENT})*")
_CONTENT_TYPE = re.compile(r"[!-~][ -~]*")
_LINES = re.compile(rb"\r\n|\r|\n")
#: Request headers of protocol features this server does not implement:
#: refused (400 naming the header) rather than ignored, since a client
#: sending one relies on what it asks for.
UNSUPPORTED = (b"stream-ttl", b"stream-expires-at", b"stream-closed", b"producer-id",
               b"producer-epoch", b"producer-seq", b"stream-forked-from")
EXPOSE_WRITE = b"ETag, Stream-Next-Offset, Location"
WRITE_METHODS = b"GET, HEAD, PUT, POST, DELETE"
WRITE_HEADERS = b"Authorization, Content-Type, If-None-Match, Last-Event-ID"


def media_type(content_type: str) -> str:
    """The media type of a content type, without parameters, lowercased."""
    return content_type.split(";", 1)[0].strip().lower()


def is_json(content_type: str) -> bool:
    return media_type(content_type) == "application/json"


def is_text(content_type: str) -> bool:
    kind = media_type(content_type)
    return kind.startswith("text/") or kind == "application/json"


def check_path(path: str | None) -> str:
    """A Durable Stream's path as the URL gives it; 400 otherwise."""
    if path is None or len(path) > MAX_PATH or not _PATH.fullmatch(path):
        raise HttpError(400, f"a Durable Stream's path is 1 to {MAX_PATH} URL characters in "
                             f"non-empty segments, got {excerpt(path or '')}")
    return path


def encode_body(content_type: str, body: bytes, appending: bool) -> str | None:
    """A body as the ``body`` column holds it (None: no messages); 400
    for invalid JSON, or an append of no message (PROTOCOL.md 5.2)."""
    if is_json(content_type):
        if not body.strip():
            if appending:
                raise HttpError(400, "an append needs a body: one JSON value or an array")
            return None
        try:
            doc = decode_json_strict(body)
        except DuplicateKeyError as e:
            raise HttpError(400, f"invalid JSON: key {excerpt(e.key)} given twice in an "
                                 "object") from None
        except ValueError as e:
            raise HttpError(400, f"invalid JSON: {e}") from None
        messages = doc if isinstance(doc, list) else [doc]
        if not messages:
            if appending:
                raise HttpError(400, "an append of an empty JSON array has no message")
            return None
        return orjson.dumps(messages).decode()
    if not body:
        if appending:
            raise HttpError(400, "an append needs a non-empty body")
        return None
    return base64.b64encode(body).decode("ascii")


def decode_body(content_type: str, text: str) -> bytes:
    """What a stored body adds to a read: the messages inside the JSON
    array (JSON mode), or the bytes."""
    if is_json(content_type):
        return text[1:-1].encode()
    return base64.b64decode(text)


class PathView:
    """One Durable Stream created over HTTP, as :class:`.durable.DurableRoutes`
    reads a stream: the stream's own attributes (name, config, ID
    generator, sequence), with the path, the ID of its ``create`` and its
    content type."""

    def __init__(self, stream, path: str, created: int, content_type: str) -> None:
        self.stream = stream
        self.path = path
        self.created = created
        self.content_type = content_type

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _state(txn, db, config, path: str, upto: int) -> tuple[int, str] | None:
    """``(create ID, content type)`` of ``path`` at ``upto``, or None."""
    ids = config.id_column
    txn.execute(db.sql(f"SELECT {ids}, ds_op, content_type FROM {config.table} "
                       f"WHERE ds_path = %s AND ds_op IN ('{CREATE}', '{DELETE}') "
                       f"AND {ids} <= %s ORDER BY {ids} DESC LIMIT 1"), (path, upto))
    row = txn.fetchone()
    if row is None or row[1] != CREATE:
        return None
    return int(row[0]), row[2]


def _last_seq(txn, db, config, path: str, created: int) -> str | None:
    """The ``Stream-Seq`` of the newest append of ``path`` that gave one,
    since its creation ``created`` (writer; read back to that append)."""
    ids = config.id_column
    txn.execute(db.sql(f"SELECT seq FROM {config.table} WHERE ds_path = %s "
                       f"AND ds_op = '{APPEND}' AND seq IS NOT NULL AND {ids} > %s "
                       f"ORDER BY {ids} DESC LIMIT 1"), (path, created))
    row = txn.fetchone()
    return None if row is None else row[0]


def _rows(txn, db, config, view: PathView, after: int, upto: int, limit: int,
          max_bytes: int) -> tuple[list[tuple[int, bytes]], bool]:
    """The messages of ``view`` in ``(after, upto]``, decoded (pool
    thread): ``([(stream_id, bytes)], full)``, full when ``limit`` rows or
    ``max_bytes`` ended it."""
    ids = config.id_column
    txn.execute(db.sql(f"SELECT {ids}, body FROM {config.table} WHERE ds_path = %s "
                       f"AND ds_op IN ('{CREATE}', '{APPEND}') AND body IS NOT NULL "
                       f"AND {ids} > %s AND {ids} <= %s ORDER BY {ids} LIMIT %s"),
                (view.path, after, upto, limit))
    out: list[tuple[int, bytes]] = []
    size = 0
    for stream_id, text in txn.fetchall():
        data = decode_body(view.content_type, text)
        out.append((int(stream_id), data))
        size += len(data)
        if size >= max_bytes:
            return out, True
    return out, len(out) >= limit


class DurablePaths(DurableRoutes):
    """The routes of the Durable Streams created over HTTP (``writes``: the
    write API's :class:`..streams.StreamRoutes`, for its credential,
    limits and writes)."""

    def __init__(self, reads, writes, clock, **kwargs) -> None:
        super().__init__(reads, clock, **kwargs)
        self.writes = writes
        self._locks: dict[tuple[str, str], tuple[defer.DeferredLock, int]] = {}

    # ---------------------------------------------------------- reading
    async def preflight(self, request, name: str | None, path: str | None = None):
        self._headers(request)
        await self.reads.preflight(request, name, WRITE_METHODS, WRITE_HEADERS)

    async def get_path(self, request, name: str | None, path: str | None):
        self._headers(request)
        reader, stream = self.reads.open_stream(request, name)
        view = await self._view(self._kind(stream), check_path(path))
        return await self.read(request, reader, view)

    @staticmethod
    def _kind(stream):
        if not stream.config.durable_streams:
            raise HttpError(404, f"stream {stream.name} has no Durable Streams created over "
                                 "HTTP (it is not declared with durable_streams: true)")
        return stream

    async def _view(self, stream, path: str) -> PathView:
        state = await stream.db.runReads(_state, stream.db, stream.config, path,
                                         self.tail(stream))
        if state is None:
            raise HttpError(404, f"no Durable Stream {excerpt(path)} in stream {stream.name}")
        return PathView(stream, path, state[0], state[1] or DEFAULT_TYPE)

    async def _start(self, stream, text: str | None) -> tuple[int, bool]:
        position, _ = await super()._start(stream, text)
        # From its creation (an offset of an earlier one, deleted, reads
        # this one from its start).
        return max(position, stream.created - 1), False

    def _page(self, stream, since: Positions, host, max_bytes: int | None = None):
        def read(since: Positions, bounds: Positions, limit: int, final_below: int,
                 most: int):
            return self._read_page(stream, since, bounds, limit, final_below, most)
        return self.reads.page(stream, since, LIMIT, {w: self.tail(stream) for w in since},
                               host, max_bytes, read=read)

    async def _read_page(self, view: PathView, since: Positions, bounds: Positions,
                         limit: int, final_below: int, most: int) -> Page:
        """The page of ``view`` after ``since`` up to ``bounds``."""
        (writer,) = since
        after, upto = since[writer], bounds[writer]
        db = view.db
        found, full = await db.runReads(_rows, db, view.config, view, after, upto, limit,
                                        most)
        # As a page holds facts: (stream_id, writer, rows, encoded), the
        # encoding being what the fact adds to an answer.
        facts: list[PageFact] = [(i, writer, [], data) for i, data in found]
        end = found[-1][0] if full else max(after, upto)
        # Never final (cached as immutable): a path deleted and created
        # again answers the same URL with the new stream's messages.
        return Page(facts, {writer: end}, full, False)

    def content_type(self, stream) -> bytes:
        return stream.content_type.encode("ascii")

    def body(self, stream, page: Page) -> bytes:
        if is_json(stream.content_type):
            return b"[" + b",".join([f[3] for f in page.facts if f[3]]) + b"]"
        return b"".join([f[3] or b"" for f in page.facts])

    def sse_data(self, stream, page: Page) -> bytes:
        body = self.body(stream, page)
        if is_json(stream.content_type):
            lines = [body]
        elif is_text(stream.content_type):
            lines = _LINES.split(body)  # each a data line: no event boundary inside
        else:
            lines = [base64.b64encode(body)]
        return b"event: data\n" + b"".join([b"data:" + line + b"\n" for line in lines]) + b"\n"

    def sse_headers(self, stream) -> dict[bytes, bytes]:
        headers = {b"cache-control": b"no-cache, no-store", b"x-accel-buffering": b"no"}
        if not is_text(stream.content_type):
            headers[b"stream-sse-data-encoding"] = b"base64"
        return headers

    # ---------------------------------------------------------- writing
    def _writable(self, request, name: str | None, path: str | None):
        self._headers(request)
        request.setHeader(b"access-control-expose-headers", EXPOSE_WRITE)
        stream = self._kind(self.writes.writable(request, name))
        path = check_path(path)
        for header in UNSUPPORTED:
            if request.requestHeaders.hasHeader(header):
                raise HttpError(400, f"{header.decode()} is not supported by this server "
                                     "(docs/read-api.md, \"Streams created over HTTP\")")
        return stream, path

    @staticmethod
    def _content_type(request) -> str | None:
        values = request.requestHeaders.getRawHeaders(b"content-type") or []
        if not values:
            return None
        text = values[0].decode("latin-1").strip()
        if len(values) > 1 or len(text) > MAX_CONTENT_TYPE \
                or not _CONTENT_TYPE.fullmatch(text):
            raise HttpError(400, f"Content-Type must be one printable ASCII value of at most "
                                 f"{MAX_CONTENT_TYPE} characters, got {excerpt(text)}")
        return text

    @staticmethod
    def _seq(request) -> str | None:
        """An append's ``Stream-Seq``: printable ASCII, compared bytewise
        with the path's last (PROTOCOL.md 5.2); 400 otherwise."""
        values = request.requestHeaders.getRawHeaders(b"stream-seq") or []
        if not values:
            return None
        text = values[0].decode("latin-1")
        if len(values) > 1 or len(text) > MAX_SEQ or not _CONTENT_TYPE.fullmatch(text):
            raise HttpError(400, f"Stream-Seq must be one printable ASCII value of at most "
                                 f"{MAX_SEQ} characters, got {excerpt(text)}")
        return text

    @staticmethod
    def _body(request) -> bytes:
        request.content.seek(0)
        return request.content.read()

    async def _locked(self, key: tuple[str, str], fn):
        """``await fn()`` after every earlier write of the same path here."""
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = defer.DeferredLock()
        self._locks[key] = (lock, users + 1)
        try:
            await lock.acquire()
            try:
                return await fn()
            finally:
                lock.release()
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    async def _visible(self, stream, stream_id: int) -> None:
        """Once the fact ``stream_id`` is readable here (or after
        ``VISIBLE_WAIT`` seconds: it is written, only not yet readable)."""
        deadline = self._clock.seconds() + VISIBLE_WAIT
        while self.tail(stream) < stream_id:
            remaining = deadline - self._clock.seconds()
            if remaining <= 0:
                return
            d: defer.Deferred = defer.Deferred()

            def wake(_=None, d: defer.Deferred = d) -> None:
                if not d.called:
                    d.callback(None)
            cancel = self.reads.watch.once(stream, wake)
            timer = self._clock.callLater(remaining, wake)
            try:
                await d
            finally:
                cancel()
                if timer.active():
                    timer.cancel()

    async def _write(self, stream, path: str, op: str, content_type: str | None,
                     body: str | None, seq: str | None = None) -> int:
        stream_id = await self.writes.write_rows(stream, [[path, op, content_type, body,
                                                           seq]])
        await self._visible(stream, stream_id)
        return stream_id

    async def _current(self, stream, path: str) -> tuple[int, str] | None:
        return await stream.db.runReads(_state, stream.db, stream.config, path,
                                        self.tail(stream))

    @staticmethod
    def _done(request, code: int, headers: dict[bytes, bytes]) -> None:
        request.setResponseCode(code)
        request.setHeader(b"cache-control", NO_STORE)
        request.setHeader(b"content-length", b"0")
        for k, v in headers.items():
            request.setHeader(k, v)
        request.finish()

    async def put(self, request, name: str | None, path: str | None):
        """Create the Durable Stream at ``path`` (201), or nothing if it
        exists with the same content type (200; 409 otherwise)."""
        stream, path = self._writable(request, name, path)
        content_type = self._content_type(request) or DEFAULT_TYPE
        raw = self._body(request)
        body = await threads.deferToThread(encode_body, content_type, raw, False) \
            if len(raw) > 64 * 1024 else encode_body(content_type, raw, False)

        async def create():
            state = await self._current(stream, path)
            if state is not None:
                if media_type(state[1] or DEFAULT_TYPE) != media_type(content_type):
                    raise HttpError(409, f"Durable Stream {excerpt(path)} exists with "
                                         f"content type {excerpt(state[1])}")
                return 200, self.tail(stream)
            return 201, await self._write(stream, path, CREATE, content_type, body)

        code, position = await self._locked((stream.name, path), create)
        self._done(request, code, {b"content-type": content_type.encode("ascii"),
                                   b"location": request.uri.split(b"?", 1)[0],
                                   b"stream-next-offset": offset_text(position).encode()})
        return None

    async def post(self, request, name: str | None, path: str | None):
        """Append the body's messages (204); 404 without the Durable
        Stream, 409 for another content type."""
        stream, path = self._writable(request, name, path)
        given = self._content_type(request)
        if given is None:
            raise HttpError(400, "an append needs a Content-Type (the stream's)")
        seq = self._seq(request)
        raw = self._body(request)

        async def append():
            state = await self._current(stream, path)
            if state is None:
                raise HttpError(404, f"no Durable Stream {excerpt(path)} in stream "
                                     f"{stream.name}")
            content_type = state[1] or DEFAULT_TYPE
            if media_type(given) != media_type(content_type):
                raise HttpError(409, f"Content-Type {excerpt(given)} does not match the "
                                     f"stream's {excerpt(content_type)}")
            body = encode_body(content_type, raw, True)
            if seq is not None:
                last = await stream.db.runReads(_last_seq, stream.db, stream.config, path,
                                                state[0])
                if last is not None and seq.encode() <= last.encode():
                    raise HttpError(409, f"Stream-Seq {excerpt(seq)} is not after the last "
                                         f"one, {excerpt(last)}")
            return await self._write(stream, path, APPEND, None, body, seq)

        position = await self._locked((stream.name, path), append)
        self._done(request, 204, {b"stream-next-offset": offset_text(position).encode()})
        return None

    async def delete(self, request, name: str | None, path: str | None):
        """Delete the Durable Stream (204; 404 without it): its path reads
        404 until created again, and then only what came after."""
        stream, path = self._writable(request, name, path)

        async def remove():
            if await self._current(stream, path) is None:
                raise HttpError(404, f"no Durable Stream {excerpt(path)} in stream "
                                     f"{stream.name}")
            return await self._write(stream, path, DELETE, None, None)

        await self._locked((stream.name, path), remove)
        self._done(request, 204, {})
        return None
