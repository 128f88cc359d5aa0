"""The API's twisted.web site: request body limits, the access log, and
redaction of what must never be shown.

* A request never holds more than ``max_body_size`` bytes of body in memory:
  an oversized body is read and dropped up to :data:`DRAIN_FACTOR` times the
  limit (the route answers 413); beyond that, or when the client waits for
  ``100 Continue``, the channel refuses it at once (413, closed).
* One access line per request: client, method, path (no query), status,
  bytes, duration, and for an error the answer's message (cut to
  :data:`ERROR_TEXT_LIMIT` characters, printable); never a header.
* The secrets (and the Redis password a replication detail might carry)
  are replaced by ``[redacted]`` in every answer and log line, in any
  spelling, and so is the value of a parameter that carries a credential
  (:mod:`.redact`).
"""

import io
import time
from typing import cast

from twisted.logger import Logger
from twisted.web import server

from ..logs.printable import printable
from .channel import Busy, Channel
from .redact import Redactor
from .slots import Slots

access_log = Logger(namespace="replicator.http.access")

MAX_BODY_SIZE = 1 << 20
#: A body declared or sent beyond this many times the limit is refused at
#: once and the connection closed; up to it an oversized body is read and
#: thrown away so that the client gets its 413 (closing on unread data makes
#: the kernel reset the connection, and the client would see that instead).
DRAIN_FACTOR = 4
#: How much of an error answer's message its access line shows.
ERROR_TEXT_LIMIT = 120


class AccessLog:
    """The access log: one line per request, at DEBUG for a success (a
    write per request would flood the log at INFO), at INFO for a refusal
    or error."""

    def __init__(self, redact: Redactor):
        self.redact = redact

    def request(self, request, code: int | None = None, note: str = "") -> None:
        """The line of a request twisted.web parsed."""
        try:
            addr = request.getClientAddress()
            client = getattr(addr, "host", None) or "-"
        except Exception:
            client = "-"
        started = getattr(request, "started", None)
        ms = (time.monotonic() - started) * 1000 if started is not None else 0.0
        path = getattr(request, "path", None)
        code = code if code is not None else request.code
        error = getattr(request, "error_text", None)
        error = printable(error, ERROR_TEXT_LIMIT) if error else None
        notes = "; ".join(n for n in (note, error) if n)
        emit = access_log.info if not isinstance(code, int) or code >= 400 else access_log.debug
        emit('{client} "{method} {path}" {code} {length} {duration_ms:.1f}ms{note}',
             client=client, method=self.redact.method(request.method),
             path=self.redact.path(path) if isinstance(path, bytes) else "-",
             code=code, length=getattr(request, "sentLength", 0),
             duration_ms=round(ms, 1), note=f" ({notes})" if notes else "", error=error)

    def refusal(self, transport, code: int, length: int, message: str,
                method: bytes | None, path: bytes | None) -> None:
        """The line of a request the channel refused (malformed, too large,
        too slow, over the connection cap); ``length`` is the body's."""
        try:
            client = getattr(transport.getPeer(), "host", None) or "-"
        except Exception:
            client = "-"
        path_text = self.redact.path(path.split(b"?")[0]) if isinstance(path, bytes) else "-"
        access_log.info('{client} "{method} {path}" {code} {length} 0.0ms ({note})',
                        client=client, method=self.redact.method(method), path=path_text,
                        code=code, length=length, duration_ms=0.0,
                        note=printable(message, ERROR_TEXT_LIMIT),
                        error=printable(message, ERROR_TEXT_LIMIT))


class Request(server.Request):
    """A request that never holds more than the site's body limit in memory
    (``too_large`` is set when its body was over it)."""

    too_large = False
    _received = 0
    started = None
    #: An error answer's message, for the access line.
    error_text: str | None = None

    def _limits(self) -> tuple[int, int]:
        site = getattr(self.channel, "site", None)
        limit = getattr(site, "max_body_size", MAX_BODY_SIZE)
        return limit, limit * DRAIN_FACTOR

    def _refuse(self, limit: int) -> None:
        """413 before the body, by the channel (which closes)."""
        self.requestHeaders.removeHeader(b"expect")  # no 100 Continue after this
        cast("Channel", self.channel).refuse(413, f"request body larger than {limit} bytes")

    def gotLength(self, length):
        self.started = time.monotonic()
        self.content = io.BytesIO()
        limit, drain = self._limits()
        if length is not None and length > limit:
            self.too_large = True
            expect = self.requestHeaders.getRawHeaders(b"expect") or [b""]
            if length > drain or expect[0].lower() == b"100-continue":
                self._refuse(limit)

    def handleContentChunk(self, data):
        if self.channel.refused:
            return
        self._received += len(data)
        limit, drain = self._limits()
        if self._received > drain:
            self._refuse(limit)
        elif self._received > limit:
            if not self.too_large:
                self.too_large = True
                self.content = io.BytesIO()
        elif not self.too_large:
            self.content.write(data)

    def process(self):
        if self.channel.refused:
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


class Site(server.Site):
    """The API's site: its channels have deadlines and JSON refusals
    (:mod:`replicator.http.channel`), and hold one of its connection slots
    (:mod:`replicator.http.slots`: ``api.max_connections`` ordinary ones,
    ``api.max_connections_per_address`` of them from one address, and those
    reserved for ``/health`` and writers).  A newcomer with no slot free
    closes an idle connection to make room; only when none can be closed
    is it refused (503).  ``slots`` keeps the books."""

    requestFactory = Request
    protocol = Channel  # type: ignore[assignment]  # Twisted declares a callable
    noisy = False

    def __init__(self, root, api, max_body_size: int, timeout: float, reactor):
        super().__init__(root, timeout=timeout, reactor=reactor)
        self.api = api
        self.max_body_size = max_body_size
        self.slots = Slots(max_connections=api.max_connections,
                           max_connections_per_address=api.max_connections_per_address,
                           reserved_for_health=api.reserved_for_health,
                           reserved_for_writers=api.reserved_for_writers,
                           secret=api.write_secret)

    def buildProtocol(self, addr):
        api = self.api
        channel = super().buildProtocol(addr)
        why = self.slots.admit(channel, getattr(addr, "host", None))
        if why is not None:
            return self._busy(why)
        channel.header_timeout = api.header_timeout
        channel.body_timeout = api.body_timeout
        channel.api = api
        return channel

    def _busy(self, message: str) -> Busy:
        busy = Busy(self.api, message, self.reactor)
        busy.factory = self
        return busy

    def log(self, request):
        self.api.log_access(request)


def too_large(request, limit: int) -> bool:
    """Whether ``request``'s body was over ``limit`` (measured, under a
    plain twisted.web Site)."""
    flag = getattr(request, "too_large", None)
    if flag is not None:
        return flag
    content = request.content
    if content is None:
        return False
    position = content.tell()
    size = content.seek(0, 2)
    content.seek(position)
    return size > limit
