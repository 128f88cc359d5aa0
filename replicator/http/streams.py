"""The stream API: ``POST .../streams/{stream}/facts`` (write one fact) and
``GET .../positions`` (every stream's positions), both behind the secret.

A facts body is parsed here (JSON, ``{"rows": [list, ...]}`` and nothing
else; an object anywhere in it that gives a key twice is refused, not read
as its last value: :func:`replicator.jsontext.decode_json_strict`); its rows are checked once, by
the stream's row codec
(:meth:`replicator.streams.stream.Stream.prepare`), which also refuses a row
whose RDATA line could never be replicated.  Everything is checked before
anything is written, in this order: 401 (no or malformed Authorization),
403 (wrong secret), 413 (body over the limit), 404 (unknown stream), 409
(not a writer of it here), 400 (``Idempotency-Key``, body or rows); 503
when the streams are not loaded yet or the database write fails (logged;
the answer is generic).  A write with an ``Idempotency-Key`` goes through
:mod:`.idempotent` (a retry answered again, 409/422).
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from twisted.internet import threads
from twisted.logger import Logger
from twisted.python.failure import Failure

from ..jsontext import DuplicateKeyError, decode_json_strict
from ..observe.status import Positions
from ..replication.interfaces import IReplicationView
from ..streams.idempotency import KeyTaken
from ..streams.rows import RowError
from ..streams.writes import TxnHook
from .answers import HttpError, authorize, excerpt
from .idempotent import IdempotentWrites, idempotency_key
from .redact import Redactor
from .site import too_large

if TYPE_CHECKING:
    from ..observe.writers import WriterWatch
    from ..streams.registry import StreamRegistry
    from ..streams.stream import Stream

log = Logger()

#: Bodies above this are parsed and checked in a thread, not on the reactor.
THREAD_PARSE_SIZE = 64 * 1024


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def parse_fact_body(body: bytes) -> list[Any]:
    """The rows of a facts request body (not yet checked against the
    stream); raises :class:`HttpError` 400.  Pure and thread-safe."""
    try:
        doc = decode_json_strict(body)
    except DuplicateKeyError as e:
        raise HttpError(400, f"invalid JSON: key {excerpt(e.key)} given twice in an "
                             "object") from None
    except ValueError as e:  # orjson.JSONDecodeError among them
        raise HttpError(400, f"invalid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise HttpError(400, 'expected a JSON object {"rows": [[...], ...]}, '
                             f"got {_json_type(doc)}")
    for key in doc:
        if key != "rows":
            raise HttpError(400, f"unexpected key {excerpt(key)}: the body is "
                                 '{"rows": [[...], ...]} and nothing else')
    if "rows" not in doc:
        raise HttpError(400, 'missing "rows": the body is {"rows": [[...], ...]}')
    rows = doc["rows"]
    if not isinstance(rows, list):
        raise HttpError(400, f'"rows" must be an array of rows, got {_json_type(rows)}')
    return rows


def _parse_and_prepare(stream: "Stream", body: bytes, writer: str,
                       max_line_length: int) -> Any:
    try:
        return stream.prepare([parse_fact_body(body)], writer, max_line_length)
    except RowError as e:
        raise HttpError(400, str(e)) from None


class StreamRoutes:
    """Writing facts and reading positions."""

    def __init__(self, *, instance_name: str, registry: "StreamRegistry",
                 handler: IReplicationView, secret: bytes | None,
                 max_body_size: int, max_line_length: int, redact: Redactor,
                 idempotent: IdempotentWrites, writers: "WriterWatch | None" = None) -> None:
        self.instance_name = instance_name
        self.registry = registry
        self.handler = handler
        self._secret = secret
        self.max_body_size = max_body_size
        self.max_line_length = max_line_length
        self.redact = redact
        self.writers = writers  # a WriterWatch: links and linear holders, or None
        self.idempotent = idempotent  # writes with an Idempotency-Key
        #: Writes failed per stream since its last success (an outage).
        self._failing: dict[str, int] = {}

    def writable(self, request: Any, name: str | None) -> "Stream":
        """The stream a request may write here, or the 401, 403, 413, 404,
        409 (not a writer of it on this instance) or 503 (not loaded)."""
        authorize(request, self._secret)
        if too_large(request, self.max_body_size):
            raise HttpError(413, f"request body larger than {self.max_body_size} bytes")
        if name is None:
            raise HttpError(404, "unknown stream: the name is not percent-encoded UTF-8")
        stream = self.registry.find(name)
        if stream is None:
            raise HttpError(404, f"unknown stream {excerpt(name)}")
        writer = self.instance_name
        if writer not in stream.local_writers:
            raise HttpError(409, f"not a writer of stream {stream.name} on this instance "
                                 f"({writer})")
        if not stream.loaded:
            raise HttpError(503, f"stream {stream.name} is not loaded yet")
        return stream

    async def write_rows(self, stream: "Stream", rows: list[Any]) -> int:
        """Write one fact of ``rows`` (checked by the stream's codec: 400)
        from this instance; its ID once committed, or 503."""
        try:
            prepared = stream.prepare([rows], self.instance_name, self.max_line_length)
        except RowError as e:
            raise HttpError(400, str(e)) from None
        return await self._write(stream, prepared)

    async def post_facts(self, request: Any, name: str | None) -> dict[str, Any]:
        stream = self.writable(request, name)
        writer = self.instance_name
        key = idempotency_key(request)
        request.content.seek(0)
        body = request.content.read()
        if len(body) > THREAD_PARSE_SIZE:
            prepared = await threads.deferToThread(
                _parse_and_prepare, stream, body, writer, self.max_line_length)
        else:
            prepared = _parse_and_prepare(stream, body, writer, self.max_line_length)
        if key is None:
            return {"stream_id": await self._write(stream, prepared)}
        stream_id, replayed = await self.idempotent.write(
            stream, prepared, key, lambda p, hooks: self._write(stream, p, hooks))
        if replayed:
            request.setHeader(b"idempotent-replayed", b"true")
        return {"stream_id": stream_id}

    async def _write(self, stream: "Stream", prepared: Any,
                     hooks: Sequence[TxnHook] = ()) -> int:
        """The fact's ID once committed; 503 if the database write failed
        (:class:`KeyTaken`, a key recorded already, passes through)."""
        try:
            (stream_id,) = await stream.write_prepared(prepared, hooks)
        except KeyTaken:
            raise
        except Exception:
            self._write_failed(stream.name, Failure())
            raise HttpError(503, "database write failed") from None
        failed = self._failing.pop(stream.name, None)
        if failed is not None:
            log.info("writes of {stream} succeed again after {n} failed",
                     stream=stream.name, n=failed)
        return int(stream_id)

    def _write_failed(self, stream: str, failure: Failure) -> None:
        """The first failed write of a stream logs its traceback; the
        others are counted until a write succeeds (one line then): an
        outage is two log lines per stream, not one traceback a request.
        Each request still answers 503."""
        failed = self._failing.get(stream)
        self._failing[stream] = (failed or 0) + 1
        if failed is None:
            self.redact.log_failure("Writing a fact of {stream} failed; further failures "
                                    "are counted until a write succeeds", failure,
                                    stream=stream)

    async def positions(self, request: Any) -> dict[str, Any]:
        authorize(request, self._secret)
        seen = Positions(self.handler)
        streams: dict[str, Any] = {}
        for stream in self.registry:
            gen = stream.id_gen
            if gen is None:
                streams[stream.name] = {"linear": None, "writers": {}}
                continue
            positions = gen.get_positions()
            writers = {}
            for writer in stream.config.writers:
                entry = seen.writer_row(stream, writer, positions)
                if not entry["local"]:
                    if self.writers is not None:
                        link = self.writers.link(writer, stream.name)
                        entry.update(connected=link["connected"], since=link["since"],
                                     heard_age=link["heard_age"], link=link["text"])
                writers[writer] = entry
            holder = self.writers.linear_holder(stream) if self.writers is not None else None
            streams[stream.name] = {"linear": gen.get_linear_token(), "linear_holder": holder,
                                    "writers": writers}
        return {"instance": self.instance_name, "streams": streams}
