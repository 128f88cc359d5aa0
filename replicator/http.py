"""The HTTP API of one instance (twisted.web): write facts, positions, health,
metrics, and the master's USER_SYNC / FEDERATION_ACK / USER_IP bookkeeping.

Routes (every JSON answer is one line followed by ``\\n``; errors are
``{"error": "..."}``):

``POST /_replicator/v1/streams/{stream}/facts``
    Body ``{"rows": [[...], ...]}``, header ``Authorization: Bearer <secret>``.
    Writes one fact (every row shares its stream ID; ``[]`` is a fact without
    rows, a position-only advance) as this instance's writer of the stream and
    answers ``{"stream_id": N}`` after the commit.  Everything is checked
    before anything is written, in this order: 401 (no or malformed
    Authorization; with ``WWW-Authenticate: Bearer``), 403 (wrong secret,
    compared in constant time), 413 (body over ``max_body_size``; declared
    beyond four times that, or sent with ``Expect: 100-continue``, it is
    answered before the body is read, and the connection closed), 404
    (unknown stream), 409 (this instance is not a writer of the stream), 400
    (not JSON, not ``{"rows": [list, ...]}``, a row that does not fit the
    stream's columns, a ``json`` value nested deeper than 100 levels, an
    integer outside the bigint range, or whose RDATA line could never be
    replicated because it exceeds ``replication.max_line_length``).  503 when the database write
    fails (logged with its traceback; the answer is generic) or the streams
    are not loaded yet.
Reading the instance's state needs the same secret as writing (401/403 as
above): positions and the master's bookkeeping tell who runs what and who
is online.  ``/health`` and ``/metrics`` stay open for probes and
Prometheus.

``GET /_replicator/v1/positions`` (secret required)
    Per stream its linear token and, per writer, its position; local writers
    add ``in_flight`` and ``announced``, remote ones ``reader_position`` and
    ``lag``.
``GET /_replicator/v1/federation_acks`` (secret required)
    ``{"acks": {instance: token}, "next": cursor}``.
``GET /_replicator/v1/user_syncs`` (secret required: user IDs are personal)
    ``{"user_syncs": {instance: [{user_id, device_id, last_sync_ms}, ...]},
    "next": cursor}``.
``GET /_replicator/v1/user_ips`` (secret required: IP addresses are personal)
    ``{"user_ips": [{user_id, device_id, ip, user_agent, last_seen}, ...],
    "next": cursor}``.

    These three are paged (:mod:`replicator.pages`): ``?limit=N`` entries
    (at most 1000, the default) in key order, from the cursor
    ``?from=`` a previous page's ``next`` gave; ``next`` is null on the
    last page.  Each page is built and encoded in a thread.
``GET /health``
    200 ``{"status": "ok", ...summary}`` once ``SELECT 1`` answers within
    ``db_timeout`` and replication is keeping up (see :mod:`replicator.health`);
    otherwise 503 ``{"status": "unhealthy", "reason": "..."}`` with the first
    problem found.
``GET /metrics``
    Prometheus text format, refreshed and generated in a thread.
``GET /`` (no secret)
    The status page (:mod:`replicator.status`): HTML under a strict
    Content-Security-Policy, refreshed by ``/status.js`` (with
    ``/status.css``) from ``GET /status.json``, which returns exactly what
    the page shows: positions, lag with its last 15 minutes, in-flight IDs,
    connections, recent disconnects and health problems; nothing secret.

Any other path is 404, any other method 405 (with ``Allow``; HEAD goes with
GET), and an unexpected exception a logged 500 with a generic message.  The
secret is never written into an answer or a log line: error texts and logged
fields pass through :meth:`HttpApi._redact`, the access log has neither
headers nor query strings.

Before any of this, each connection's channel (:mod:`replicator.http_channel`)
enforces ``http.header_timeout``, ``http.body_timeout`` and
``http.max_connections`` and answers a request twisted.web cannot parse
with a JSON 400/431 (408 past a deadline, 503 over the cap).
"""

import hmac
import io
import time
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import unquote

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import Resource

from . import pages
from .config import InstanceConfig
from .http_channel import Busy, Channel
from .replication.commands import encode_json
from .status import CSP, SCRIPT, STYLE, StatusRecorder, render_html, snapshot
from .streams.rows import RowError, check_rows

log = Logger(namespace="replicator.http")
access_log = Logger(namespace="replicator.http.access")

API_PREFIX = "/_replicator/v1"
MAX_BODY_SIZE = 1 << 20
#: A body declared or sent beyond this is answered at once and the connection
#: closed; up to it an oversized body is read and thrown away so that the
#: client gets its 413 (closing on unread data makes the kernel reset the
#: connection, and the client would see that instead).
DRAIN_FACTOR = 4
DB_TIMEOUT = 2.0
#: Bodies above this are parsed and checked in a thread, not on the reactor.
THREAD_PARSE_SIZE = 64 * 1024
#: A ``json`` column value may nest arrays and objects this deep (the value
#: itself is level 1); deeper is a 400.
MAX_JSON_DEPTH = 100
#: The RDATA line estimate assumes a token of this many digits.
TOKEN_DIGITS = 20
JSON_TYPE = b"application/json"

class HttpError(Exception):
    """An answer other than success: status, one-line message, extra headers."""

    #: The key the message goes under in the JSON answer.
    key = "error"
    #: Other members of the JSON answer.
    extra: Dict[str, Any] = {}

    def __init__(self, code: int, message: str, headers: Optional[Dict[bytes, bytes]] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.headers = headers or {}


class _Response:
    """A successful answer that is not JSON (metrics, the status page)."""

    def __init__(self, body: bytes, content_type: bytes,
                 headers: Optional[Dict[bytes, bytes]] = None):
        self.body = body
        self.content_type = content_type
        self.headers = headers or {}


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


def _excerpt(text: str, limit: int = 60) -> str:
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _json_problem(value: Any) -> Optional[str]:
    """What makes a decoded JSON column value unfit to store and replicate:
    a NUL in a string or key, or nesting deeper than :data:`MAX_JSON_DEPTH`
    (encoders and peers' decoders recurse).  Iterative, so any depth the
    body parser accepted is checked without recursion."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return "contains a NUL character"
        elif isinstance(v, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                return f"is nested deeper than {MAX_JSON_DEPTH} levels"
            if isinstance(v, list):
                stack.extend((item, depth + 1) for item in v)
            else:
                for k, item in v.items():
                    if "\x00" in k:
                        return "contains a NUL character"
                    stack.append((item, depth + 1))
    return None


def parse_fact_body(body: bytes, columns, line_prefix: int, max_line_length: int) -> List[list]:
    """The rows of a facts request body, checked; raises :class:`HttpError` 400.

    ``line_prefix`` is the length of ``RDATA <stream> <writer> <token> `` with
    the longest token: a row whose line would exceed ``max_line_length``
    could never be replicated.  Pure and thread-safe.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise HttpError(400, f"invalid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise HttpError(400, 'expected a JSON object {"rows": [[...], ...]}, '
                             f"got {_json_type(doc)}")
    for key in doc:
        if key != "rows":
            raise HttpError(400, f"unexpected key {_excerpt(key)}: the body is "
                                 '{"rows": [[...], ...]} and nothing else')
    if "rows" not in doc:
        raise HttpError(400, 'missing "rows": the body is {"rows": [[...], ...]}')
    rows = doc["rows"]
    if not isinstance(rows, list):
        raise HttpError(400, f'"rows" must be an array of rows, got {_json_type(rows)}')
    try:
        rows = check_rows(columns, rows)
    except RowError as e:
        raise HttpError(400, str(e)) from None
    json_columns = [(i, c.name) for i, c in enumerate(columns) if c.type == "json"]
    room = max_line_length - line_prefix
    for n, row in enumerate(rows):
        for i, name in json_columns:
            problem = _json_problem(row[i])
            if problem is not None:
                raise HttpError(400, f"row {n}: column {name!r} {problem}")
        try:
            size = len(encode_json(row))
        except (TypeError, ValueError):
            raise HttpError(400, f"row {n}: not encodable as JSON") from None
        if size > room:
            raise HttpError(
                400, f"row {n}: its RDATA line would be {line_prefix + size} bytes, more than "
                     f"replication.max_line_length ({max_line_length}): it could never be "
                     "replicated")
    return rows


# ------------------------------------------------------------- twisted.web
class _Request(server.Request):
    """A request that never holds more than the site's body limit in memory.

    An oversized body is read and dropped (``too_large`` set) up to the drain
    limit; beyond it, or when the client waits for ``100 Continue``, the 413
    is written at once and the connection closed.
    """

    too_large = False
    _received = 0
    _rejected = False
    started = None

    def _limits(self) -> Tuple[int, int]:
        site = getattr(self.channel, "site", None)
        limit = getattr(site, "max_body_size", MAX_BODY_SIZE)
        return limit, limit * DRAIN_FACTOR

    def gotLength(self, length):
        self.started = time.monotonic()
        self.content = io.BytesIO()
        limit, drain = self._limits()
        if length is not None and length > limit:
            self.too_large = True
            expect = self.requestHeaders.getRawHeaders(b"expect") or [b""]
            if length > drain or expect[0].lower() == b"100-continue":
                self._reject_now()

    def handleContentChunk(self, data):
        if self._rejected:
            return
        self._received += len(data)
        limit, drain = self._limits()
        if self._received > drain:
            self._reject_now()
        elif self._received > limit:
            if not self.too_large:
                self.too_large = True
                self.content = io.BytesIO()
        elif not self.too_large:
            self.content.write(data)

    def _reject_now(self) -> None:
        """Answer 413 before the body and close (no further request is parsed
        on a channel while this one's body is read, so nothing is reordered)."""
        self._rejected = True
        self.requestHeaders.removeHeader(b"expect")  # no 100 Continue after this
        site = getattr(self.channel, "site", None)
        limit, _ = self._limits()
        body = _error_body(f"request body larger than {limit} bytes")
        head = (b"HTTP/1.1 413 Request Entity Too Large\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        try:
            self.channel.transport.write(head + body)
            self.channel.loseConnection()
        except Exception:
            log.failure("Rejecting an oversized request failed")
        api = getattr(site, "api", None)
        if api is not None:
            # The request line is still the channel's: the request gets it
            # only once its body is complete.
            api.log_access(self, code=413, length=len(body),
                           method=getattr(self.channel, "_command", None),
                           path=getattr(self.channel, "_path", b"-").split(b"?")[0])

    def process(self):
        if self._rejected:
            return  # answered already; the connection is closing
        if self.started is None:
            self.started = time.monotonic()
        if self.path == b"*":
            # twisted.web answers "*" itself (a bodiless 405); to the API it
            # is a path like any other (a JSON 404).
            self.site = self.channel.site
            self.prepath, self.postpath = [], []
            self.render(self.site.resource)
            return
        super().process()


class _Site(server.Site):
    """The API's site: its channels have deadlines and JSON refusals
    (:mod:`replicator.http_channel`), and at most ``max_connections`` are
    open at once."""

    requestFactory = _Request
    protocol = Channel
    noisy = False

    def __init__(self, root, api: "HttpApi", max_body_size: int, timeout: float):
        super().__init__(root, timeout=timeout)
        self.api = api
        self.max_body_size = max_body_size

    def buildProtocol(self, addr):
        api = self.api
        if api.open_connections >= api.max_connections:
            busy = Busy(api, api.max_connections, self.reactor)
            busy.factory = self
            return busy
        channel = super().buildProtocol(addr)
        channel.header_timeout = api.header_timeout
        channel.body_timeout = api.body_timeout
        channel.api = api
        return channel

    def log(self, request):
        self.api.log_access(request)


def _error_body(message: str) -> bytes:
    return encode_json({"error": message}) + b"\n"


class _Root(Resource):
    isLeaf = True

    def __init__(self, api: "HttpApi"):
        super().__init__()
        self._api = api

    def render(self, request):
        return self._api.render(request)


# ------------------------------------------------------------------- the API
Route = Callable[..., Any]


class HttpApi:
    """The HTTP API of one instance.

    ``replication_status()`` returns ``(connected, detail)``; it decides
    health on a worker (an instance with ``replication.upstream`` or
    ``replication.redis``) and is only reported on a master.
    """

    def __init__(self, *, config: InstanceConfig, registry, handler, db,
                 replication_status: Callable[[], Tuple[bool, str]],
                 max_body_size: int = MAX_BODY_SIZE, db_timeout: float = DB_TIMEOUT,
                 idle_timeout: float = 60.0, lag_grace: float = 10.0, clock=None,
                 health=None, status=None):
        self.config = config
        self.registry = registry
        self.handler = handler
        self.db = db
        self.replication_status = replication_status
        self.instance_name = config.instance_name
        self.max_body_size = max_body_size
        self.db_timeout = db_timeout
        self.idle_timeout = idle_timeout
        self.header_timeout = config.http.header_timeout
        self.body_timeout = config.http.body_timeout
        self.max_connections = config.http.max_connections
        #: HTTP connections open now (counted by the channels).
        self.open_connections = 0
        self.is_worker = bool(config.replication.upstream or config.replication.redis)
        secret = config.http.secret
        self._secret: Optional[bytes] = secret.encode("utf-8") if secret else None
        # Strings never to show: the HTTP secret, and the Redis password
        # which a replication status detail might carry.
        self._hidden = [s for s in (secret, getattr(config.replication.redis, "password", None))
                        if s]
        if clock is None:
            from twisted.internet import reactor as clock
        self._clock = clock
        if health is None:  # replication problems only (no periodic database check)
            from .health import HealthMonitor

            health = HealthMonitor(registry=registry, handler=handler, db=db, clock=clock,
                                   lag_grace=lag_grace, expect_upstream=self.is_worker)
        self.health = health
        if status is None:  # no lag history unless a started recorder is given
            status = StatusRecorder(handler=handler, problem=self.current_problem, clock=clock)
        self.status = status
        self._db_probe: Optional[defer.Deferred] = None
        self._db_waiters: List[defer.Deferred] = []
        self._root = _Root(self)

    # --------------------------------------------------------------- public
    def resource(self) -> Resource:
        """The root resource (every route; works under a plain Site too)."""
        return self._root

    def site(self) -> server.Site:
        """A Site with the body limit and a one-line access log."""
        return _Site(self._root, self, self.max_body_size, self.idle_timeout)

    def refresh_metrics(self) -> None:
        """Set the USER_SYNC / FEDERATION_ACK gauges from the handler's
        bookkeeping (labelled only by configured names; from snapshots, so
        it may also run in a scrape thread: it is registered with
        ``metrics.add_refresher``)."""
        refresh = getattr(self.handler, "refresh_metrics", None)
        if refresh is not None:
            refresh()

    # ---------------------------------------------------------- rendering
    def _routes(self, path: bytes) -> Tuple[Dict[bytes, Route], tuple]:
        """The methods of ``path`` and the route's arguments; 404 if none."""
        if path == b"/health":
            return {b"GET": self._health}, ()
        if path in (b"/", b"/status.json", b"/status.js", b"/status.css"):
            return {b"GET": self._status}, ()
        if path == b"/metrics":
            return {b"GET": self._metrics}, ()
        prefix = API_PREFIX.encode() + b"/"
        if path.startswith(prefix):
            rest = path[len(prefix):]
            simple = {
                b"positions": self._positions,
                b"user_syncs": self._user_syncs,
                b"federation_acks": self._federation_acks,
                b"user_ips": self._user_ips,
            }
            if rest in simple:
                return {b"GET": simple[rest]}, ()
            parts = rest.split(b"/")
            if len(parts) == 3 and parts[0] == b"streams" and parts[2] == b"facts" and parts[1]:
                try:
                    name = unquote(parts[1].decode("ascii"), errors="strict")
                except (UnicodeDecodeError, ValueError):
                    name = None
                return {b"POST": self._post_facts}, (name,)
        raise HttpError(404, "no such endpoint")

    def render(self, request) -> int:
        """Dispatch; the answer is always written later (NOT_DONE_YET)."""
        request.setHeader(b"server", b"replicator")
        gone: List[Any] = []
        request.notifyFinish().addErrback(gone.append)
        try:
            routes, args = self._routes(request.path)
            method = request.method
            fn = routes.get(b"GET" if method == b"HEAD" else method)
            if fn is None:
                allowed = sorted(routes) + ([b"HEAD"] if b"GET" in routes else [])
                raise HttpError(405, f"method {method.decode('ascii', 'replace')[:40]} "
                                     "not allowed",
                                {b"allow": b", ".join(allowed)})
            d = defer.ensureDeferred(fn(request, *args))
        except Exception:
            d = defer.fail()
        d.addCallbacks(lambda result: self._answer(request, gone, 200, result),
                       lambda f: self._failed(request, gone, f))
        d.addErrback(lambda f: self._log_failure("Answering {path} failed", f,
                                                 path=self._log_path(request)))
        return server.NOT_DONE_YET

    def _failed(self, request, gone, failure) -> None:
        if failure.check(HttpError):
            e = failure.value
            self._answer(request, gone, e.code, {**e.extra, e.key: self._redact(e.message)},
                         e.headers)
            return
        self._log_failure("Unexpected error answering {method} {path}", failure,
                          method=self._redact(request.method.decode("ascii", "replace"))[:20],
                          path=self._log_path(request))
        self._answer(request, gone, 500, {"error": "internal error"})

    def _answer(self, request, gone, code: int, result, headers=None) -> None:
        if gone or request.finished:
            if gone:
                self.log_access(request, code=code, note="client gone")
            return
        if isinstance(result, _Response):
            body, content_type = result.body, result.content_type
            headers = {**result.headers, **(headers or {})}
        else:
            try:
                body = encode_json(result) + b"\n"
            except (TypeError, ValueError):
                self._log_failure("Cannot encode the answer to {path}", Failure(),
                                  path=self._log_path(request))
                code, body = 500, _error_body("internal error")
            content_type = JSON_TYPE
        request.setResponseCode(code)
        request.setHeader(b"content-type", content_type)
        request.setHeader(b"content-length", b"%d" % len(body))
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-content-type-options", b"nosniff")
        for name, value in (headers or {}).items():
            request.setHeader(name, value)
        request.write(body)
        request.finish()

    # ------------------------------------------------------------- helpers
    def _redact(self, text: str) -> str:
        """One line, without the secret (or the Redis password)."""
        text = " ".join(str(text).splitlines())
        for hidden in self._hidden:
            text = text.replace(hidden, "[redacted]")
        return text[:2000]

    def _log_failure(self, fmt: str, failure: Failure, **fields) -> None:
        """``log.failure``, unless the traceback text would show a hidden
        string: then the redacted traceback is logged as text instead."""
        text = failure.getTraceback()
        if any(hidden in text for hidden in self._hidden):
            log.error(fmt + "\n{traceback}", traceback=self._redact_lines(text), **fields)
        else:
            log.failure(fmt, failure, **fields)

    def _redact_lines(self, text: str) -> str:
        for hidden in self._hidden:
            text = text.replace(hidden, "[redacted]")
        return text

    def _log_path(self, request) -> str:
        return self._clean_path(request.path)

    def _clean_path(self, raw: bytes) -> str:
        path = self._redact(raw.decode("ascii", "backslashreplace"))
        return path if len(path) <= 200 else path[:200] + "..."

    def log_access(self, request, code: Optional[int] = None, note: str = "",
                   length: Optional[int] = None, method: Optional[bytes] = None,
                   path: Optional[bytes] = None) -> None:
        """One line per request: client, method, path (no query), status,
        bytes, duration; at DEBUG for a success, at INFO for a 4xx/5xx.  No
        header is ever logged."""
        try:
            addr = request.getClientAddress()
            client = getattr(addr, "host", None) or "-"
        except Exception:
            client = "-"
        started = getattr(request, "started", None)
        ms = (time.monotonic() - started) * 1000 if started is not None else 0.0
        method = method if method is not None else request.method
        method = self._redact(method.decode("ascii", "backslashreplace"))[:20] \
            if isinstance(method, bytes) else "-"
        path = path if path is not None else getattr(request, "path", None)
        path = self._clean_path(path) if isinstance(path, bytes) else "-"
        code = code if code is not None else request.code
        # Successes at DEBUG (a write per request would flood the log at
        # INFO); refusals and errors at INFO.
        emit = access_log.info if not isinstance(code, int) or code >= 400 else access_log.debug
        emit(
            '{client} "{method} {path}" {code} {length} {duration_ms:.1f}ms{note}',
            client=client, method=method, path=path,
            code=code,
            length=length if length is not None else getattr(request, "sentLength", 0),
            duration_ms=ms, note=f" ({note})" if note else "",
        )

    def log_refusal(self, transport, code: int, length: int, message: str,
                    method: Optional[bytes], path: Optional[bytes]) -> None:
        """The access line of a request refused by the channel (malformed,
        too slow, over the connection cap)."""
        try:
            client = getattr(transport.getPeer(), "host", None) or "-"
        except Exception:
            client = "-"
        method_text = self._redact(method.decode("ascii", "backslashreplace"))[:20] \
            if isinstance(method, bytes) else "-"
        path_text = self._clean_path(path.split(b"?")[0]) if isinstance(path, bytes) else "-"
        access_log.info('{client} "{method} {path}" {code} {length} 0.0ms ({note})',
                        client=client, method=method_text, path=path_text, code=code,
                        length=length, duration_ms=0.0, note=message)

    def _authorize(self, request) -> None:
        challenge = {b"www-authenticate": b'Bearer realm="replicator"'}
        values = request.requestHeaders.getRawHeaders(b"authorization")
        if not values:
            raise HttpError(401, "missing Authorization header: expected 'Bearer <secret>'",
                            challenge)
        scheme, _, token = values[0].strip().partition(b" ")
        token = token.strip()
        if len(values) != 1 or scheme.lower() != b"bearer" or not token:
            raise HttpError(401, "malformed Authorization header: expected 'Bearer <secret>'",
                            challenge)
        if self._secret is None:
            raise HttpError(403, "no http secret is configured on this instance")
        if not hmac.compare_digest(token, self._secret):
            raise HttpError(403, "wrong secret")

    @staticmethod
    def _too_large(request, limit: int) -> bool:
        flag = getattr(request, "too_large", None)
        if flag is not None:
            return flag
        content = request.content  # a plain twisted Request: measure it
        if content is None:
            return False
        position = content.tell()
        size = content.seek(0, 2)
        content.seek(position)
        return size > limit

    # ---------------------------------------------------------------- routes
    async def _post_facts(self, request, name: Optional[str]):
        self._authorize(request)
        if self._too_large(request, self.max_body_size):
            raise HttpError(413, f"request body larger than {self.max_body_size} bytes")
        if name is None:
            raise HttpError(404, "unknown stream: the name is not percent-encoded UTF-8")
        stream = self.registry.find(name)
        if stream is None:
            raise HttpError(404, f"unknown stream {_excerpt(name)}")
        writer = self.instance_name
        if writer not in stream.local_writers:
            raise HttpError(409, f"not a writer of stream {stream.name} on this instance "
                                 f"({writer})")
        if stream.id_gen is None:
            raise HttpError(503, f"stream {stream.name} is not loaded yet")
        request.content.seek(0)
        body = request.content.read()
        max_line = self.config.replication.max_line_length
        prefix = (len(b"RDATA ") + len(stream.name.encode()) + 1 + len(writer.encode()) + 1
                  + TOKEN_DIGITS + 1)
        columns = stream.config.columns
        if len(body) > THREAD_PARSE_SIZE:
            rows = await threads.deferToThread(parse_fact_body, body, columns, prefix, max_line)
        else:
            rows = parse_fact_body(body, columns, prefix, max_line)
        try:
            stream_id = await stream.write_fact(rows, writer=writer)
        except RowError as e:  # checked above; kept for safety
            raise HttpError(400, str(e)) from None
        except Exception:
            self._log_failure("Writing a fact of {stream} failed", Failure(),
                              stream=stream.name)
            raise HttpError(503, "database write failed") from None
        return {"stream_id": stream_id}

    async def _positions(self, request):
        self._authorize(request)
        handler = self.handler
        announced = handler.announced_positions()
        readers = handler.reader_positions()
        lags = handler.reader_lag()
        streams = {}
        for stream in self.registry:
            gen = stream.id_gen
            if gen is None:
                streams[stream.name] = {"linear": None, "writers": {}}
                continue
            positions = gen.get_positions()
            writers = {}
            for writer in stream.config.writers:
                key = (stream.name, writer)
                local = writer in stream.local_writers
                entry: Dict[str, Any] = {"position": positions.get(writer), "local": local}
                if local:
                    entry["in_flight"] = gen.in_flight(writer)
                    entry["announced"] = announced.get(key)
                else:
                    entry["reader_position"] = readers.get(key)
                    entry["lag"] = lags.get(key, 0)
                writers[writer] = entry
            streams[stream.name] = {"linear": gen.get_linear_token(), "writers": writers}
        return {"instance": self.instance_name, "streams": streams}

    # The bookkeeping tables are paged and each page is built in a thread
    # (see replicator.pages): the handler's tables are only read there, by
    # C-level copies, never iterated on the reactor.
    async def _page(self, request, keys, lookup, render, width: int) -> _Response:
        self._authorize(request)
        try:
            limit, cursor = pages.page_args(request.args)
            body = await threads.deferToThread(pages.build_page, keys, lookup, render, limit,
                                               cursor, width)
        except pages.PageError as e:
            raise HttpError(400, str(e)) from None
        return _Response(body, JSON_TYPE)

    async def _user_syncs(self, request):
        handler = self.handler

        def keys():
            return [(instance, user, device)
                    for instance, users in list(handler.user_syncs.items())
                    for (user, device) in list(users)]

        def lookup(key):
            return handler.user_syncs.get(key[0], {}).get(key[1:])

        def render(entries):
            out: Dict[str, list] = {}
            for (instance, user, device), ms in entries:
                out.setdefault(instance, []).append(
                    {"user_id": user, "device_id": device, "last_sync_ms": ms})
            return {"user_syncs": out}

        return await self._page(request, keys, lookup, render, 3)

    async def _federation_acks(self, request):
        acks = self.handler.federation_acks
        return await self._page(
            request, lambda: [(instance,) for instance in list(acks)],
            lambda key: acks.get(key[0]),
            lambda entries: {"acks": {key[0]: token for key, token in entries}}, 1)

    async def _user_ips(self, request):
        handler = self.handler

        def render(entries):
            return {"user_ips": [
                {"user_id": user, "device_id": device, "ip": seen.get("ip"),
                 "user_agent": seen.get("user_agent"), "last_seen": seen.get("last_seen")}
                for (user, device), seen in entries]}

        return await self._page(request, lambda: list(handler.user_ips),
                                lambda key: handler.user_ips.get(key), render, 2)

    # ---------------------------------------------------------- status page
    def current_problem(self) -> Optional[str]:
        """The first replication problem ``/health`` would give (streams not
        loaded, link, unreceived, lag), without the database probe; None if
        there is none."""
        unloaded = [s.name for s in self.registry if s.id_gen is None]
        if unloaded:
            return f"streams not loaded: {', '.join(unloaded)}"
        return self._replication_problem(*self._replication())

    def status_snapshot(self) -> Dict[str, Any]:
        """What the status page shows (``/status.json``): no secret needed."""
        return snapshot(instance=self.instance_name,
                        role="worker" if self.is_worker else "master",
                        registry=self.registry, handler=self.handler, recorder=self.status,
                        problem=self.current_problem(), clock=self._clock,
                        redact=self._redact)

    async def _status(self, request):
        path = request.path
        if path == b"/status.js":
            return _Response(SCRIPT, b"text/javascript; charset=utf-8")
        if path == b"/status.css":
            return _Response(STYLE, b"text/css; charset=utf-8")
        snap = self.status_snapshot()
        if path == b"/status.json":
            return snap
        return _Response(render_html(snap), b"text/html; charset=utf-8",
                         {b"content-security-policy": CSP, b"referrer-policy": b"no-referrer",
                          b"x-frame-options": b"DENY"})

    def _metrics_text(self) -> bytes:
        """Runs in a thread: the refreshers work on snapshots."""
        self.refresh_metrics()
        refresh = getattr(self.registry, "refresh_metrics", None)
        if refresh is not None:
            refresh()
        return generate_latest(REGISTRY)

    async def _metrics(self, request):
        text = await threads.deferToThread(self._metrics_text)
        return _Response(text, CONTENT_TYPE_LATEST.encode("ascii"))

    # ---------------------------------------------------------------- health
    def check_database(self) -> defer.Deferred:
        """Fires with None if ``SELECT 1`` answers within ``db_timeout``, else
        with the reason.  At most one probe runs at a time: a hung database
        ties up one pool thread, not one per health check."""
        waiter: defer.Deferred = defer.Deferred(
            lambda d: self._db_waiters.remove(d) if d in self._db_waiters else None)
        self._db_waiters.append(waiter)
        if self._db_probe is None:
            try:
                probe = self.db.runQuery("SELECT 1")
            except Exception:  # e.g. a pool already closed
                probe = defer.fail()
            self._db_probe = probe
            probe.addBoth(self._db_probe_done)
        waiter.addTimeout(self.db_timeout, self._clock)

        def reason(f):
            if f.check(defer.TimeoutError):
                return f"database unreachable: no answer within {self.db_timeout:g}s"
            log.warn("Health check: the database is unreachable: {error}",
                     error=self._redact(f.getErrorMessage()))
            return f"database unreachable: {f.type.__name__}"

        waiter.addCallbacks(lambda _: None, reason)
        return waiter

    def _db_probe_done(self, result) -> None:
        self._db_probe = None
        waiters, self._db_waiters = self._db_waiters, []
        for waiter in waiters:
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(None)
        return None

    def _replication(self) -> Tuple[bool, str]:
        try:
            connected, detail = self.replication_status()
            return bool(connected), self._redact(str(detail))
        except Exception:
            self._log_failure("replication_status() failed", Failure())
            return False, "replication status unavailable"

    def _replication_problem(self, connected: bool, detail: str) -> Optional[str]:
        return self.health.problem(connected, detail)

    async def _health(self, request):
        problem = await self.check_database()
        if problem is None:
            unloaded = [s.name for s in self.registry if s.id_gen is None]
            if unloaded:
                problem = f"streams not loaded: {', '.join(unloaded)}"
        connected, detail = self._replication()
        if problem is None:
            problem = self._replication_problem(connected, detail)
        if problem is not None:
            raise _Unhealthy(problem)
        return {
            "status": "ok",
            "instance": self.instance_name,
            "role": "worker" if self.is_worker else "master",
            "replication": {"connected": connected, "detail": detail},
            "connections": len(self.handler.connections),
            "positions": {s.name: s.id_gen.get_positions() for s in self.registry},
        }


class _Unhealthy(HttpError):
    """503 ``{"status": "unhealthy", "reason": "..."}``."""

    key = "reason"
    extra = {"status": "unhealthy"}

    def __init__(self, reason: str):
        super().__init__(503, reason)
