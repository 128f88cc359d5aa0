"""Outgoing links that keep reconnecting and say why, in one line per retry.

:class:`ReconnectingService` is Twisted's ``ClientService`` with the
project's :class:`~replicator.net.backoff.Backoff` as its retry policy and its
own retry line instead of Twisted's (``Scheduling retry {attempt} to connect
{endpoint} in {delay} seconds``, which shows the endpoint object's repr and
an unrounded delay)::

    upstream 127.0.0.1:9092: connection refused; retry 3 in 1.8 s

what the link is, where it goes, why the last attempt ended (the failed
connect's reason, else what the owner says about the connection it lost),
the number of this retry in the current outage (the backoff's failures
since the link last proved healthy: 1, 2, 3...) and the wait, rounded to
a tenth of a second (a hundredth below that).
Reasons are in our words: ``connection refused``, ``timed out``, ``TLS:
<what the handshake said>``, ``closed by peer``, ``closed by peer: ERROR
<its text>``, ``DNS lookup of <host> failed``.

The first :data:`LOUD_RETRIES` retries of an outage are logged each; after
that one line per :data:`QUIET_INTERVAL` at most, so a peer gone for a day
costs a few thousand lines, not forty thousand.
"""

from collections.abc import Callable
from typing import Any

from twisted.application.internet import ClientService
from twisted.internet import defer, error
from twisted.internet.interfaces import (
    IProtocol,
    IProtocolFactory,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.logger import ILogObserver, Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from ..logs.printable import printable
from .backoff import Backoff

log = Logger()

#: Retries of one outage that are each logged.
LOUD_RETRIES = 10
#: After those, at most one retry line per this many seconds.
QUIET_INTERVAL = 60.0


@implementer(ILogObserver)
def _discard(event: Any) -> None:
    """An observer that drops every event (Twisted's retry line)."""


def _tls_reason(value: object) -> str | None:
    """What a TLS failure says, in a few words; None if ``value`` is not one."""
    try:
        from OpenSSL import SSL
    except ImportError:  # pragma: no cover - TLS needs pyOpenSSL anyway
        SSL = None  # type: ignore[assignment]
    if SSL is not None and isinstance(value, SSL.Error):
        texts = []
        for item in value.args[0] if value.args and isinstance(value.args[0], list) else []:
            if isinstance(item, tuple) and item:
                texts.append(str(item[-1]))
        return ", ".join(t for t in texts if t) or "handshake failed"
    try:
        from service_identity import VerificationError
    except ImportError:  # pragma: no cover
        return None
    if isinstance(value, VerificationError):
        names = []
        for mismatch in getattr(value, "errors", ()):
            ident = getattr(mismatch, "mismatched_id", None)
            name = getattr(ident, "hostname", None) or getattr(ident, "ip", None)
            if isinstance(name, bytes):
                name = name.decode("ascii", "replace")
            names.append(str(name) if name is not None else "?")
        return f"the certificate is not for {', '.join(names) or 'this peer'}"
    return None


def failure_reason(failure: Failure) -> str:
    """Why a connection attempt failed or a connection ended, in our words
    (one printable line, no object reprs)."""
    value = failure.value
    if failure.check(error.ConnectionRefusedError):
        return "connection refused"
    if failure.check(error.TimeoutError, TimeoutError, defer.TimeoutError):
        return "timed out"
    if failure.check(error.DNSLookupError):
        what = str(value).split(":")[-1].strip().rstrip(".") or "DNS lookup failed"
        return f"DNS lookup failed: {printable(what, 100)}"
    tls = _tls_reason(value)
    if tls is not None:
        return f"TLS: {printable(tls, 200)}"
    if failure.check(error.ConnectionDone):
        return "closed by peer"
    if failure.check(error.ConnectionLost, ConnectionResetError):
        return "connection lost"
    if isinstance(value, OSError) and value.strerror:
        return printable(value.strerror.lower(), 200)
    text = failure.getErrorMessage().strip().splitlines()
    return printable(text[0] if text else type(value).__name__, 200)


@implementer(IStreamClientEndpoint)
class _RememberingEndpoint:
    """The link's endpoint, remembering why its last connect failed (None
    once one succeeded)."""

    def __init__(self, endpoint: IStreamClientEndpoint) -> None:
        self.endpoint = endpoint
        self.failure: Failure | None = None

    def connect(self, factory: IProtocolFactory) -> "defer.Deferred[IProtocol]":
        def connected(protocol: IProtocol) -> IProtocol:
            self.failure = None
            return protocol

        def failed(failure: Failure) -> Failure:
            self.failure = failure
            return failure

        return self.endpoint.connect(factory).addCallbacks(connected, failed)


class ReconnectingService(ClientService):
    """Keeps one connection to ``endpoint`` with ``backoff``, logging each
    retry (see the module).

    ``what`` and ``where`` name the link in the retry line (``upstream``,
    ``127.0.0.1:9092``); ``lost_reason()`` says why the connection that was
    up ended (None: ``connection lost``); ``on_retry(retry, delay)`` is told
    every retry as well."""

    #: Twisted's own retry line is ours to say: its logger says nothing.
    _log = Logger(observer=_discard)

    def __init__(self, endpoint: IStreamClientEndpoint, factory: IProtocolFactory,
                 backoff: Backoff, *, clock: IReactorTime | None, what: str, where: str,
                 lost_reason: Callable[[], str | None] | None = None,
                 on_retry: Callable[[int, float], None] | None = None,
                 prepareConnection: Callable[[IProtocol], object] | None = None) -> None:
        if clock is None:
            from twisted.internet import reactor

            clock = reactor  # (it provides IReactorTime)
        self._attempts = _RememberingEndpoint(endpoint)
        super().__init__(self._attempts, factory, retryPolicy=self._retry, clock=clock,
                         prepareConnection=prepareConnection)
        self.backoff = backoff
        self.what = what
        self.where = where
        self._clock = clock
        self._lost_reason = lost_reason
        self._on_retry = on_retry
        self._last_line: float | None = None

    def reason(self) -> str:
        """Why the last attempt or connection ended."""
        if self._attempts.failure is not None:
            return failure_reason(self._attempts.failure)
        reason = self._lost_reason() if self._lost_reason is not None else None
        return printable(reason, 300) if reason else "connection lost"

    def _retry(self, attempt: int) -> float:
        delay = self.backoff.delay()
        retry = self.backoff.failures
        now = self._clock.seconds()
        if retry == 1:
            self._last_line = None  # a new outage
        if (retry <= LOUD_RETRIES or self._last_line is None
                or now - self._last_line >= QUIET_INTERVAL):
            if retry >= LOUD_RETRIES:
                self._last_line = now
            more = "; further retries logged once a minute" if retry == LOUD_RETRIES else ""
            log.warn("{what} {where}: {reason}; retry {retry} in {delay} s{more}",
                     what=self.what, where=self.where, reason=self.reason(), retry=retry,
                     delay=round(delay, 1 if delay >= 0.1 else 2), more=more)
        if self._on_retry is not None:
            self._on_retry(retry, delay)
        return delay
