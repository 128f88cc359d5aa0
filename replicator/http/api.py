"""The HTTP API of one instance: the routes, dispatch, and the answers.

The routes, their secrets and their status codes are listed in the README
("HTTP API"); each group lives in its own module: the stream API
(:mod:`.streams`), the master's bookkeeping (:mod:`.bookkeeping_pages`), the health
probe (:mod:`.probe`); the status page and ``/metrics`` are here.  Every
JSON answer is one line followed by ``\\n``; errors are ``{"error": "..."}``.
Any other path is 404, any other method 405 (with ``Allow``; HEAD goes with
GET), and an unexpected exception a logged 500 with a generic message.  The
secret is never written into an answer or a log line (:class:`.redact.Redactor`).
"""

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import Resource

from ..config import InstanceConfig
from ..jsontext import encode_json
from ..observe.health import Finding
from ..observe.roles import has_replication_link, role
from ..observe.status import StatusRecorder, snapshot
from ..observe.status_html import CSP, SCRIPT, STYLE, render_html
from ..observe.writers import writer_watch
from ..streams.idempotency import IdempotencyKeys
from .answers import JSON_TYPE, HttpError, Response
from .bookkeeping_pages import BookkeepingRoutes
from .channel import error_body
from .idempotent import IdempotentWrites
from .probe import DB_TIMEOUT, HealthRoute
from .read.durable_paths import DurablePaths
from .redact import Redactor
from .site import MAX_BODY_SIZE, AccessLog, Site
from .streams import StreamRoutes

log = Logger(namespace="replicator.http")

API_PREFIX = "/_replicator/v1"

Route = Callable[..., Any]


class _Root(Resource):
    isLeaf = True

    def __init__(self, api: "HttpApi"):
        super().__init__()
        self._api = api

    def render(self, request):
        return self._api.render(request)


class HttpApi:
    """The HTTP API of one instance.

    ``replication_status()`` returns ``(connected, detail)``; it decides
    health on an instance with a link of its own (``replication.upstream``
    or ``replication.redis``: :func:`replicator.observe.roles.has_replication_link`)
    and is only reported on a TCP master.  Its role (``master``/``worker``)
    is :func:`replicator.observe.roles.role`.  ``writers`` is its
    :class:`replicator.observe.writers.WriterWatch` (by default a new one).  ``health`` is
    the instance's :class:`replicator.observe.health.HealthMonitor` (by default one
    that is not started: replication problems only); ``status`` its
    :class:`replicator.observe.status.StatusRecorder` (by default one not started:
    no lag history).
    """

    def __init__(self, *, config: InstanceConfig, registry, handler, db,
                 replication_status: Callable[[], tuple[bool, str]], clock,
                 max_body_size: int = MAX_BODY_SIZE, db_timeout: float = DB_TIMEOUT,
                 idle_timeout: float = 60.0, lag_grace: float = 10.0,
                 health=None, status=None, writers=None):
        self.config = config
        self.registry = registry
        self.handler = handler
        self.instance_name = config.instance_name
        self.max_body_size = max_body_size
        self.idle_timeout = idle_timeout
        self.header_timeout = config.http.header_timeout
        self.body_timeout = config.http.body_timeout
        self.max_connections = config.http.max_connections
        self.max_connections_per_address = config.http.max_connections_per_address
        self.reserved_for_health = config.http.reserved_for_health
        self.reserved_for_writers = config.http.reserved_for_writers
        #: HTTP connections open now (counted by the channels).
        self.open_connections = 0
        self.role = role(config)
        self.is_worker = has_replication_link(config)  # health counts the link and lag
        secret = config.http.secret
        secret_bytes = secret.encode("utf-8") if secret else None
        #: Who may use the connections reserved for writers (:mod:`.slots`).
        self.write_secret = secret_bytes
        # Strings never to show: the HTTP secret, and the Redis password
        # which a replication status detail might carry.
        from .read.auth import ReaderAuth  # (the read API imports .answers)
        from .read.routes import ReadRoutes

        read_auth = ReaderAuth(secret, config.http.readers)
        self.redact = Redactor([*read_auth.secrets,
                                getattr(config.replication.redis, "password", None)])
        self.access = AccessLog(self.redact)
        self._clock = clock
        if writers is None:
            writers = writer_watch(config, registry, handler, clock)
        self.writers = writers
        if health is None:
            from ..observe.health import HealthMonitor

            health = HealthMonitor(registry=registry, handler=handler, db=db, clock=clock,
                                   lag_grace=lag_grace, expect_upstream=self.is_worker,
                                   writers=writers)
        self.health = HealthRoute(
            instance_name=self.instance_name, role=self.role, registry=registry,
            handler=handler, db=db, monitor=health, replication_status=replication_status,
            redact=self.redact, db_timeout=db_timeout, clock=clock)
        if status is None:
            status = StatusRecorder(handler=handler, findings=self.current_findings, clock=clock)
        self.status = status
        self.streams = StreamRoutes(
            instance_name=self.instance_name, registry=registry, handler=handler,
            secret=secret_bytes, max_body_size=max_body_size,
            max_line_length=config.replication.max_line_length, redact=self.redact,
            idempotent=IdempotentWrites(
                IdempotencyKeys(db, config.http.idempotency_window, clock)),
            writers=writers)
        self.bookkeeping = BookkeepingRoutes(handler, secret_bytes)
        self.reads = ReadRoutes(  # the read API: docs/read-api.md
            registry=registry, auth=read_auth, clock=clock,
            max_waiting=config.http.max_waiting_reads,
            max_waiting_per_address=config.http.max_waiting_reads_per_address,
            heartbeat=config.http.heartbeat_interval,
            max_page_bytes=config.http.max_page_bytes,
            feed_interval=config.replication.fanout_interval,
            ds_long_poll=config.http.ds_long_poll)
        # Durable Streams created over HTTP (docs/read-api.md).
        self.ds_paths = DurablePaths(self.reads, self.streams, clock,
                                     long_poll=config.http.ds_long_poll)
        self._root = _Root(self)

    # --------------------------------------------------------------- public
    def resource(self) -> Resource:
        """The root resource (every route; works under a plain Site too)."""
        return self._root

    def set_readers(self, readers) -> None:
        """The read API's credentials from now on (a reload): open event
        streams keep going; their secrets, like every one before, stay
        hidden from answers and logs."""
        from .read.auth import ReaderAuth

        auth = ReaderAuth(self.config.http.secret, readers)
        self.redact.hide(auth.secrets)
        self.reads.auth = auth

    def site(self) -> server.Site:
        """A Site with the body limit, deadlines and a one-line access log."""
        return Site(self._root, self, self.max_body_size, self.idle_timeout, self._clock)

    def log_access(self, request, code: int | None = None, note: str = "") -> None:
        """The access line of a request (see :class:`.site.AccessLog`)."""
        self.access.request(request, code, note)

    def log_refusal(self, transport, code: int, length: int, message: str,
                    method: bytes | None, path: bytes | None) -> None:
        """The access line of a request the channel refused."""
        self.access.refusal(transport, code, length, message, method, path)

    def check_database(self) -> defer.Deferred:
        """See :meth:`.probe.HealthRoute.check_database`."""
        return self.health.check_database()

    def current_problem(self) -> str | None:
        """See :meth:`.probe.HealthRoute.current_problem`."""
        return self.health.current_problem()

    def current_findings(self) -> list[Finding]:
        """See :meth:`.probe.HealthRoute.current_findings`."""
        return self.health.current_findings()

    # ---------------------------------------------------------- rendering
    def _routes(self, path: bytes) -> tuple[dict[bytes, Route], tuple]:
        """The methods of ``path`` and the route's arguments; 404 if none."""
        if path == b"/health":
            return {b"GET": self.health.get}, ()
        if path in (b"/", b"/status.json", b"/status.js", b"/status.css"):
            return {b"GET": self._status}, ()
        if path == b"/metrics":
            return {b"GET": self._metrics}, ()
        prefix = API_PREFIX.encode() + b"/"
        if path.startswith(prefix):
            rest = path[len(prefix):]
            simple = {
                b"positions": self.streams.positions,
                b"user_syncs": self.bookkeeping.user_syncs,
                b"federation_acks": self.bookkeeping.federation_acks,
                b"user_ips": self.bookkeeping.user_ips,
            }
            if rest in simple:
                return {b"GET": simple[rest]}, ()
            parts = rest.split(b"/")
            if len(parts) > 2 and parts[0] == b"ds" and parts[1]:
                name, ds_path = None, None
                try:
                    name = unquote(parts[1].decode("ascii"), errors="strict")
                    ds_path = b"/".join(parts[2:]).decode("ascii")
                except (UnicodeDecodeError, ValueError):
                    name = ds_path = None
                paths = self.ds_paths  # docs/read-api.md, "Streams created over HTTP"
                return {b"GET": paths.get_path, b"OPTIONS": paths.preflight,
                        b"PUT": paths.put, b"POST": paths.post,
                        b"DELETE": paths.delete}, (name, ds_path)
            if len(parts) == 2 and parts[0] == b"ds" and parts[1]:
                try:
                    name = unquote(parts[1].decode("ascii"), errors="strict")
                except (UnicodeDecodeError, ValueError):
                    name = None
                ds = self.reads.durable  # docs/read-api.md, "Durable Streams"
                return {b"GET": ds.get, b"OPTIONS": ds.preflight, b"PUT": ds.refuse_write,
                        b"POST": ds.refuse_write, b"DELETE": ds.refuse_write}, (name,)
            if len(parts) == 3 and parts[0] == b"streams" and parts[2] in (b"facts", b"events") \
                    and parts[1]:
                try:
                    name = unquote(parts[1].decode("ascii"), errors="strict")
                except (UnicodeDecodeError, ValueError):
                    name = None
                if parts[2] == b"events":
                    return {b"GET": self.reads.events, b"OPTIONS": self.reads.preflight}, (name,)
                return {b"POST": self.streams.post_facts, b"GET": self.reads.facts,
                        b"OPTIONS": self.reads.preflight}, (name,)
        raise HttpError(404, "no such endpoint")

    def render(self, request) -> int:
        """Dispatch; the answer is always written later (NOT_DONE_YET)."""
        request.setHeader(b"server", b"replicator")
        gone: list[Any] = []
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
        d.addErrback(lambda f: self.redact.log_failure("Answering {path} failed", f,
                                                       path=self.redact.path(request.path)))
        return server.NOT_DONE_YET

    def _failed(self, request, gone, failure) -> None:
        if failure.check(HttpError):
            e = failure.value
            request.error_text = self.redact(e.message)  # for the access line
            self._answer(request, gone, e.code, {**e.extra, e.key: request.error_text},
                         e.headers)
            return
        self.redact.log_failure("Unexpected error answering {method} {path}", failure,
                                method=self.redact.method(request.method),
                                path=self.redact.path(request.path))
        request.error_text = "internal error"
        self._answer(request, gone, 500, {"error": "internal error"})

    def _answer(self, request, gone, code: int, result, headers=None) -> None:
        if gone or request.finished:
            if gone:
                self.log_access(request, code=code, note="client gone")
            return
        if isinstance(result, Response):
            body, content_type = result.body, result.content_type
            headers = {**result.headers, **(headers or {})}
        else:
            try:
                body = encode_json(result) + b"\n"
            except (TypeError, ValueError):
                self.redact.log_failure("Cannot encode the answer to {path}", Failure(),
                                        path=self.redact.path(request.path))
                code, body = 500, error_body("internal error")
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

    # ------------------------------------------------ status page, metrics
    def status_snapshot(self) -> dict[str, Any]:
        """What the status page shows (``/status.json``): no secret needed."""
        return snapshot(instance=self.instance_name, role=self.role,
                        registry=self.registry, handler=self.handler, recorder=self.status,
                        findings=self.current_findings(), clock=self._clock,
                        redact=self.redact, writers=self.writers,
                        http_readers=self.reads.status)

    async def _status(self, request):
        path = request.path
        if path == b"/status.js":
            return Response(SCRIPT, b"text/javascript; charset=utf-8")
        if path == b"/status.css":
            return Response(STYLE, b"text/css; charset=utf-8")
        snap = self.status_snapshot()
        if path == b"/status.json":
            return snap
        return Response(render_html(snap), b"text/html; charset=utf-8",
                        {b"content-security-policy": CSP, b"referrer-policy": b"no-referrer",
                         b"x-frame-options": b"DENY"})

    async def _metrics(self, request):
        # In a thread: the live metrics' sources read snapshots.
        text = await threads.deferToThread(generate_latest, REGISTRY)
        return Response(text, CONTENT_TYPE_LATEST.encode("ascii"))
