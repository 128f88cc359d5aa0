"""One HTTP connection of the API: deadlines, a connection cap, and a JSON
answer to every request twisted.web refuses.

* A request's headers must arrive within ``header_timeout`` seconds of its
  first byte (or of the connection opening), its body within
  ``body_timeout`` seconds of its headers: a client sending a byte every few
  seconds (slowloris) resets twisted.web's idle timeout forever, not these.
  Past a deadline: ``408`` and close.  twisted.web's idle timeout (no byte
  for the site's ``timeout``) that strikes a request half received (a
  deadline longer than it) is a ``408`` too; between requests it closes
  quietly, as twisted.web does (nothing is owed).
* Connection slots (:mod:`.slots` decides, the channel tells it when a
  request starts and is answered): a connection with no request being
  answered may be closed to make room for a newcomer (``503``, or quietly
  when idle after an answer); a request on a slot reserved for health
  probes and writers that is neither is ``503`` before its body is read.
  A connection whose answer is out and that closes after it is never
  given a second answer.
* A malformed request (bad ``Content-Length``, two framing headers, a NUL in
  a header, too many or too large headers, a bad request line or chunk) is
  ``400`` or ``431`` with ``{"error": "..."}`` naming the problem, and closed.

Every refusal is one JSON line with ``Connection: close``; the connection is
half-closed after it and unread input discarded for a moment (closing with
unread input would make the kernel reset the connection and the client
could lose the answer), then closed.  Invariant: once refused, nothing more
of the connection is parsed.
"""

import re

from twisted.internet import protocol
from twisted.internet.interfaces import ISSLTransport
from twisted.web.http import HTTPChannel

from ..jsontext import encode_json

#: How long a refused connection is drained before it is closed.
DRAIN_TIME = 2.0
REASONS = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Request Entity Too Large",
           431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}
# RFC 9110 token characters: what a header name may be made of.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def error_body(message: str) -> bytes:
    """The body of every error answer: one JSON line."""
    return encode_json({"error": message}) + b"\n"


def refusal(code: int, message: str, extra: bytes = b"") -> tuple[bytes, int]:
    """The whole answer of a refusal (status line, headers, one JSON line)
    and the length of its body."""
    body = error_body(message)
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Cache-Control: no-store\r\nConnection: close\r\n%s\r\n"
            % (code, REASONS.get(code, b"Error"), len(body), extra)) + body, len(body)


def _close_after_answer(transport, clock, drain_time: float, close):
    """Half-close (the client reads the answer and sees the end), then close
    after ``drain_time`` with ``close`` (the channel's own, which first
    unregisters it as the transport's producer); returns the delayed call.  Over TLS there is no
    half-close (Twisted's TLS layer loses the answer and then fails on the
    peer's next bytes): the connection is closed after ``drain_time``, and a
    client that reads the answer (``Connection: close``) closes first."""
    if not ISSLTransport.providedBy(transport):
        try:
            transport.loseWriteConnection()
        except (AttributeError, NotImplementedError):
            transport.loseConnection()
    return clock.callLater(drain_time, close)


class Channel(HTTPChannel):
    """twisted.web's HTTP/1.1 channel with deadlines and JSON refusals.

    Why a subclass: twisted.web answers a malformed request in one private
    method (``_respondToBadRequestAndDisconnect``, a bare ``400`` with no
    body) and closes without a word on an overlong line
    (``LineReceiver.lineLengthExceeded``); neither has a public hook.  The
    deadlines need the points where a request starts (``dataReceived``), its
    headers end (``allHeadersReceived``) and its body ends
    (``allContentReceived``), which only the channel sees.  Everything else
    is twisted.web's own parsing: the overrides say *why* a request is
    refused (``_why``, set before each parsing step that may refuse) and
    answer instead of Twisted.
    """

    header_timeout = 10.0
    body_timeout = 30.0
    api = None  # the HttpApi: counts connections, logs refusals

    _why: tuple[int, str] | None = None
    _tail: bytes | None = b""  # None: this request's headers are complete
    _deadline = None
    _awaited = "headers"  # what the running deadline waits for
    _closer = None
    _served = False  # answered a request before
    _answered_last = False  # its last answer is out: it closes once flushed
    refused = False
    #: Method and path of the request being received, from its request line
    #: (for the access line of a refusal).
    _request_line: tuple[bytes | None, bytes | None] = (None, None)

    # ------------------------------------------------------------ events
    def connectionMade(self):
        super().connectionMade()
        if self.api is not None:
            self.api.open_connections += 1
        self._start_deadline("headers", self.header_timeout)

    def _slots(self):
        return getattr(self.site, "slots", None)

    def connectionLost(self, reason):
        slots = self._slots()
        if slots is not None:
            slots.leave(self)
        if self.api is not None:
            self.api.open_connections -= 1
            self.api = None
        self._cancel_deadline()
        if self._closer is not None and self._closer.active():
            self._closer.cancel()
        super().connectionLost(reason)

    def dataReceived(self, data):
        if self.refused:
            return  # drained
        if not self._handlingRequest and self.line_mode:
            if self._deadline is None:
                self._start_deadline("headers", self.header_timeout)
            if self._bare_lf(data):
                # twisted.web splits lines on CRLF only: a request with bare
                # LFs would wait for its deadline.
                self.refuse(400, "header lines must end with CRLF")
                return
        super().dataReceived(data)

    def _bare_lf(self, data: bytes) -> bool:
        """Whether the header part of ``data`` (with the last bytes seen
        before it) has an LF not preceded by CR.  Once the end of the
        headers is seen, nothing more is checked until the request is
        complete (a body may hold anything)."""
        tail = self._tail
        if tail is None:
            return False
        text = tail + data
        end = text.find(b"\r\n\r\n")
        head = text if end < 0 else text[:end]
        self._tail = None if end >= 0 else text[-3:]
        # Only the LFs of the new data: the tail's were checked before.
        i = head.find(b"\n", len(tail))
        while i >= 0:
            if i == 0 or head[i - 1] != 0x0D:
                return True
            i = head.find(b"\n", i + 1)
        return False

    def lineReceived(self, line):
        if self.refused:
            return
        if self._request_line[0] is None and line:
            method, _, rest = line.partition(b" ")
            self._request_line = (method, rest.partition(b" ")[0] or None)
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self._why = (431, f"request headers larger than {self.totalHeadersSize} bytes")
        else:
            self._why = (400, "malformed request line")
        super().lineReceived(line)

    def headerReceived(self, line):
        self._why = self._header_problem(line)
        return super().headerReceived(line)

    def allHeadersReceived(self):
        self._cancel_deadline()
        super().allHeadersReceived()
        slots = self._slots()
        if slots is not None and not self.refused:
            why, close_after = slots.check(self, self.requests[-1], self._command, self._path)
            if why is not None:
                self.refuse(503, why)
                return
            if close_after:
                self.persistent = False
                self.requests[-1].responseHeaders.setRawHeaders(b"connection", [b"close"])
        if self.length != 0 and not self.refused:
            self._start_deadline("body", self.body_timeout)

    def allContentReceived(self):
        if self.refused:
            return  # answered already (a bodiless request refused at its headers)
        slots = self._slots()
        if slots is not None:
            slots.started(self)  # a whole request: not to be closed to make room
        self._served = True
        self._cancel_deadline()
        self._tail = b""  # the next request's headers are checked afresh
        self._request_line = (None, None)
        super().allContentReceived()

    def requestDone(self, request):
        slots = self._slots()
        if slots is not None and not self.refused:
            # Answered: idle (or the next pipelined request makes it busy
            # again), or flushing its last answer before its close.
            slots.answered(self, bool(self.persistent))
        if not self.persistent:
            self._answered_last = True
        super().requestDone(request)

    def rawDataReceived(self, data):
        if self.refused:
            return
        self._why = (400, "malformed chunked body")
        super().rawDataReceived(data)

    def lineLengthExceeded(self, line):
        self.refuse(431, f"request headers larger than {self.MAX_LENGTH} bytes")

    def _respondToBadRequestAndDisconnect(self):
        code, message = self._why or (400, "malformed HTTP request")
        self.refuse(code, message)

    # ----------------------------------------------------------- helpers
    def _header_problem(self, line: bytes) -> tuple[int, str]:
        """Why twisted.web would refuse this header line, should it."""
        name, sep, value = line.partition(b":")
        if not sep:
            return 400, "malformed header line"
        if not _TOKEN.fullmatch(name):
            return 400, "invalid header name"
        value = value.strip(b" \t")
        if len(value.translate(None, b"\x00\r\n")) != len(value):
            return 400, "a header value contains NUL, CR or LF"
        lower = name.lower()
        if lower in (b"content-length", b"transfer-encoding"):
            if lower == b"content-length" and not value.isdigit():
                return 400, "invalid Content-Length header"
            if lower == b"transfer-encoding" and value.lower() not in (b"chunked",
                                                                       b"identity"):
                return 400, "unsupported Transfer-Encoding (only chunked)"
            if self._transferDecoder is not None:
                return 400, "more than one Content-Length or Transfer-Encoding header"
        if self._receivedHeaderCount + 1 > self.maxHeaders:
            return 431, f"more than {self.maxHeaders} header lines"
        return 400, "malformed header line"

    def timeoutConnection(self):
        """twisted.web's idle timeout: no byte for ``timeOut`` seconds."""
        if self.refused:
            return
        if self._deadline is None:
            super().timeoutConnection()  # idle between requests: closed quietly
            return
        self.refuse(408, f"request {self._awaited} not received: nothing sent for "
                         f"{self.timeOut:g}s")

    def _start_deadline(self, what: str, seconds: float) -> None:
        self._cancel_deadline()
        self._awaited = what
        self._deadline = self.callLater(  # type: ignore[call-arg]  # Twisted: (delay, f, *a)
            seconds, self.refuse, 408, f"request {what} not received within {seconds:g}s")

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            if self._deadline.active():
                self._deadline.cancel()
            self._deadline = None

    def evict(self, message: str) -> None:
        """Close to make room for a newcomer: quietly when idle after an
        answer (clients retry on a closed keep-alive connection), else with
        ``503`` and ``message``; nothing when its last answer is out (it
        closes once that is flushed: never a second answer)."""
        if self.refused:
            return
        if self._answered_last:
            return  # closes once its answer is flushed: never a second answer
        if self._served and self._deadline is None and not self._handlingRequest:
            self.refused = True
            self.setTimeout(None)
            assert self.transport is not None
            self.transport.loseConnection()
            return
        self.refuse(503, message)

    def refuse(self, code: int, message: str) -> None:
        """Answer ``code`` with ``message``, parse nothing more, close
        (nothing, after a last answer: it is closing already)."""
        if self.refused or self._answered_last:
            return
        self.refused = True
        self._cancel_deadline()
        self.setTimeout(None)
        answer, length = refusal(code, message)
        assert self.transport is not None
        self.transport.write(answer)
        self._closer = _close_after_answer(self.transport, self, DRAIN_TIME,
                                           self.loseConnection)
        if self.api is not None:
            method, path = self._request_line
            self.api.log_refusal(self.transport, code, length, message, method, path)


class Busy(protocol.Protocol):
    """A connection over the cap: a JSON 503, drained, closed."""

    def __init__(self, api, message: str, clock):
        self.api = api
        self.message = message
        self.clock = clock
        self._closer = None

    def connectionMade(self):
        message = self.message
        answer, length = refusal(503, message, b"Retry-After: 1\r\n")
        self.transport.write(answer)
        self._closer = _close_after_answer(self.transport, self.clock, DRAIN_TIME,
                                           self.transport.loseConnection)
        self.api.log_refusal(self.transport, 503, length, message, None, None)

    def dataReceived(self, data):
        pass  # drained

    def connectionLost(self, reason):
        if self._closer is not None and self._closer.active():
            self._closer.cancel()
