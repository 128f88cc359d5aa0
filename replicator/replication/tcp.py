"""TCP plumbing: the listening factory and the reconnecting upstream client.

Listeners and upstreams are Twisted endpoint strings
(``tcp:9092:interface=127.0.0.1``, ``ssl:...``, ``tcp:host=master:port=9092``,
``tls:master:9092``).  The client reconnects through ``ClientService`` with
the project's :class:`~replicator.backoff.Backoff`, reset only once a
connection has proven healthy, and, on every connection, sends NAME, PING
and REPLICATE (the protocol) and its own writers' POSITIONs (the handler),
so it resumes from its positions.

The listener holds at most ``max_connections`` connections at once: one
more is answered ``ERROR too many connections`` and closed at once, and
counted, so idle sockets cannot use up the process's file descriptors.
"""

from dataclasses import dataclass
from typing import Optional, Set

from twisted.internet import endpoints
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from .. import metrics
from ..backoff import RECONNECT_INITIAL_DELAY, RECONNECT_MAX_DELAY, Backoff
from ..endpoint_strings import client_address
from ..logs import printable
from ..reconnect import ReconnectingService, failure_reason
from .commands import MAX_LINE_LENGTH
from .peers import PeerPolicy, local_names
from .link import (CONNECTION_LOST, IDLE_TIMEOUT, MAX_QUEUED_BYTES, MAX_QUEUED_LINES,
                   PING_INTERVAL, PING_TIMEOUT, REMOTE_ERROR)
from .protocol import ClientReplicationProtocol, ServerReplicationProtocol

log = Logger()

#: Default cap on a listener's concurrent connections.
MAX_CONNECTIONS = 256


@dataclass(frozen=True)
class ConnectionSettings:
    """Per-connection limits, the same on both sides (``idle_timeout``
    applies to server-side connections only)."""

    max_line_length: int = MAX_LINE_LENGTH
    ping_interval: float = PING_INTERVAL
    ping_timeout: float = PING_TIMEOUT
    max_queued_lines: int = MAX_QUEUED_LINES
    max_queued_bytes: int = MAX_QUEUED_BYTES
    idle_timeout: float = IDLE_TIMEOUT

    def kwargs(self) -> dict:
        return dict(
            max_line_length=self.max_line_length, ping_interval=self.ping_interval,
            ping_timeout=self.ping_timeout, max_queued_lines=self.max_queued_lines,
            max_queued_bytes=self.max_queued_bytes, idle_timeout=self.idle_timeout,
        )


class _Refuse(Protocol):
    """Answers one connection over the cap: ``ERROR`` and close."""

    def connectionMade(self):
        self.transport.write(b"ERROR too many connections\n")
        self.transport.loseConnection()


class ReplicationServerFactory(Factory):
    """Builds a server protocol per accepted connection, all on one handler,
    at most ``max_connections`` at a time (``live`` holds them), each timed
    on ``clock`` (the instance's reactor).

    ``policy`` says who may connect and which names peers may take; by
    default no peer may take the name of the handler's instance (nor of a
    writer local to it)."""

    noisy = False

    def __init__(self, handler, server_name: str, settings: ConnectionSettings = None, *,
                 clock, policy: PeerPolicy = None, max_connections: int = MAX_CONNECTIONS):
        self.handler = handler
        self.server_name = server_name
        self.settings = settings or ConnectionSettings()
        self.clock = clock
        self.max_connections = max_connections
        self.live: Set[ServerReplicationProtocol] = set()
        self._refusing = False
        if policy is None:
            policy = PeerPolicy(reserved=local_names(handler))
        self.policy = policy

    def buildProtocol(self, addr):
        if len(self.live) >= self.max_connections:
            metrics.CONNECTIONS_REFUSED.labels("max_connections").inc()
            if not self._refusing:
                # Once per burst: until a connection closes again.
                self._refusing = True
                log.warn("Replication listener at its {n} connections (max_connections): "
                         "refusing more", n=self.max_connections)
            return _Refuse()
        p = ServerReplicationProtocol(
            self.handler, self.server_name, policy=self.policy, clock=self.clock,
            **self.settings.kwargs())
        p.factory = self
        p.on_lost = self._lost
        self.live.add(p)
        return p

    def _lost(self, protocol) -> None:
        self.live.discard(protocol)
        self._refusing = False


class ReplicationClientFactory(Factory):
    """Builds the client protocol for each (re)connection to the upstream;
    ``current`` is the latest one, whose health resets ``backoff``."""

    noisy = False

    def __init__(self, handler, client_name: str, server_name: str,
                 settings: ConnectionSettings = None, *, clock,
                 backoff: Optional[Backoff] = None):
        self.handler = handler
        self.client_name = client_name
        self.server_name = server_name
        self.settings = settings or ConnectionSettings()
        self.clock = clock
        self.backoff = backoff
        self.current: Optional[ClientReplicationProtocol] = None

    def buildProtocol(self, addr):
        on_healthy = self.backoff.reset if self.backoff is not None else None
        p = ClientReplicationProtocol(
            self.handler, self.client_name, self.server_name, on_healthy=on_healthy,
            clock=self.clock, **self.settings.kwargs())
        p.factory = self
        self.current = p
        return p

    @property
    def connected(self) -> bool:
        """Whether the upstream named itself and the link is still up."""
        return self.current is not None and self.current.established

    def lost_reason(self) -> Optional[str]:
        """Why the last connection ended, for the retry line: the peer's
        ``ERROR``, our own close's reason, or what the transport said."""
        p = self.current
        if p is None:
            return None
        if p.remote_error_text is not None:
            return f"closed by peer: ERROR {printable(p.remote_error_text, 200)}"
        if p.close_reason not in (None, CONNECTION_LOST, REMOTE_ERROR):
            return f"closed ({p.close_reason.replace('_', ' ')})"
        if p.lost_failure is not None:
            return failure_reason(p.lost_failure)
        return None


class UpstreamService(ReconnectingService):
    """Keeps one connection to the upstream server, forever, logging each
    retry with its reason (:mod:`replicator.reconnect`).  ``connected``
    is true only while the server has answered the handshake (a socket that
    was accepted but stays silent is not connected, and is closed after
    ``ping_timeout``)."""

    def __init__(self, endpoint, factory: ReplicationClientFactory, backoff: Backoff, *,
                 clock, where: str = "", on_retry=None):
        super().__init__(endpoint, factory, backoff, clock=clock, what="upstream",
                         where=where, lost_reason=factory.lost_reason, on_retry=on_retry)
        self.replication_factory = factory

    @property
    def connected(self) -> bool:
        return self.replication_factory.connected


def upstream_service(reactor, endpoint: str, handler, client_name: str, server_name: str,
                     settings: ConnectionSettings = None,
                     initial_delay: float = RECONNECT_INITIAL_DELAY,
                     max_delay: float = RECONNECT_MAX_DELAY, clock=None, wrap_endpoint=None,
                     on_retry=None) -> UpstreamService:
    """A service that keeps one connection to the upstream server, forever.

    ``reactor`` makes the connections; ``clock`` (default: the reactor)
    times the protocol and the reconnect delays.  ``wrap_endpoint(endpoint)``
    may wrap the parsed endpoint (e.g. to report each attempt);
    ``on_retry(failures, delay)`` is told every reconnect delay."""
    clock = clock if clock is not None else reactor
    backoff = Backoff(initial_delay, max_delay, name="upstream")
    factory = ReplicationClientFactory(handler, client_name, server_name, settings,
                                       clock=clock, backoff=backoff)
    client = endpoints.clientFromString(reactor, endpoint)
    if wrap_endpoint is not None:
        client = wrap_endpoint(client)
    return UpstreamService(client, factory, backoff, clock=clock,
                           where=client_address(endpoint), on_retry=on_retry)
