"""TCP plumbing: the listening factory and the reconnecting upstream client.

Listeners and upstreams are Twisted endpoint strings
(``tcp:9092:interface=127.0.0.1``, ``ssl:...``, ``tcp:host=master:port=9092``,
``tls:master:9092``).  The client reconnects through ``ClientService`` with
the project's :class:`~replicator.net.backoff.Backoff`, reset only once a
connection has proven healthy, and, on every connection, sends NAME, PING
and REPLICATE (the protocol) and its own writers' POSITIONs (the handler),
so it resumes from its positions.

Who the listener lets in (so that idle sockets never lock a real peer out,
nor use up the process's file descriptors):

* Every connection is accepted, *unidentified* until it sends ``NAME`` (or
  ``REPLICATE`` first: an anonymous reader).  At most ``max_unidentified``
  are unidentified at once: a new connection closes the oldest
  unidentified one (``ERROR too many unidentified connections``), and one
  still unidentified ``identify_timeout`` seconds after connecting is
  closed (``ERROR NAME not received within ...``).  A peer that sends its
  NAME as it connects (ours and Synapse's do) always gets in.
* A writer given a secret (``writer_secrets``) is identified only once it
  proved its NAME (:mod:`.proof`): until then it is unidentified as above
  (capped, timed out) and holds nothing.
* A known name (a configured writer, this instance's ``allowed_peers``) is
  held by one live connection at a time: a second connection giving it is
  refused (``ERROR NAME <name> is held by a live connection``) and the
  holder is PINGed at once, so a holder whose peer host restarted is reset
  and the name freed; a half-open holder is freed by its ping timeout.
  Known names are counted in no cap (there are as many as the config says).
* Other identified connections (readers under names the config does not
  know, anonymous readers): at most ``max_connections`` in all and
  ``max_connections_per_address`` from one IP address; one more is answered
  ``ERROR too many connections`` (``... from <address>``) and closed.

So at most ``max_unidentified + max_connections`` + the known names are open.
"""

from dataclasses import dataclass
from typing import Any

from twisted.internet import endpoints
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Factory
from twisted.logger import Logger

from ...logs.printable import printable
from ...net.backoff import RECONNECT_INITIAL_DELAY, RECONNECT_MAX_DELAY, Backoff
from ...net.crowd import Crowd
from ...net.endpoint_strings import client_address
from ...net.reconnect import ReconnectingService, failure_reason
from ...observe import metrics
from ..interfaces import CONNECTION_LOST, REFUSED, REMOTE_ERROR, IReplicationHandler
from ..wire.encoding import MAX_LINE_LENGTH
from .link import (
    IDLE_TIMEOUT,
    MAX_QUEUED_BYTES,
    MAX_QUEUED_LINES,
    PING_INTERVAL,
    PING_TIMEOUT,
)
from .peers import PeerPolicy, local_names
from .protocol import ClientReplicationProtocol, ServerReplicationProtocol

log = Logger()

#: Default cap on a listener's identified connections (known names aside).
MAX_CONNECTIONS = 256
#: Default cap on the identified connections from one address (known names aside).
MAX_CONNECTIONS_PER_ADDRESS = 32
#: Default cap on the connections that have not sent NAME yet.
MAX_UNIDENTIFIED = 64
#: Default seconds a connection has to send NAME (or REPLICATE).
IDENTIFY_TIMEOUT = 10.0
#: At most one warning per cap this often (seconds).
WARN_INTERVAL = 60.0


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

    def kwargs(self) -> dict[Any, Any]:
        return dict(
            max_line_length=self.max_line_length, ping_interval=self.ping_interval,
            ping_timeout=self.ping_timeout, max_queued_lines=self.max_queued_lines,
            max_queued_bytes=self.max_queued_bytes, idle_timeout=self.idle_timeout,
        )


class ReplicationServerFactory(Factory):
    """Builds a server protocol per accepted connection, all on one handler,
    each timed on ``clock`` (the instance's reactor), and lets them in as
    the module docstring says (``live`` holds them all, ``crowd`` counts
    them, ``holders`` says which connection holds each known name).

    ``policy`` says who may connect and which names peers may take; by
    default no peer may take the name of the handler's instance (nor of a
    writer local to it).  The known names are the handler's
    ``known_names`` and the policy's ``allowed_peers``."""

    noisy = False

    def __init__(self, handler: IReplicationHandler, server_name: str,
                 settings: ConnectionSettings | None = None, *,
                 clock: IReactorTime, policy: PeerPolicy | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
                 max_unidentified: int = MAX_UNIDENTIFIED,
                 identify_timeout: float = IDENTIFY_TIMEOUT) -> None:
        self.handler = handler
        self.server_name = server_name
        self.settings = settings or ConnectionSettings()
        self.clock = clock
        self.max_connections = max_connections
        self.max_connections_per_address = max_connections_per_address
        self.max_unidentified = max_unidentified
        self.identify_timeout = identify_timeout
        self.live: set[ServerReplicationProtocol] = set()
        self.crowd = Crowd()
        self.holders: dict[str, ServerReplicationProtocol] = {}
        self._warned: dict[str, float] = {}  # cap -> when last warned about
        if policy is None:
            policy = PeerPolicy(reserved=local_names(handler))
        self.policy = policy

    @property
    def known_names(self) -> frozenset[str]:
        """The names one live connection at a time may hold: the handler's
        (the configured writers; a reload adds to them) and the policy's
        ``allowed_peers``, less this instance's own names."""
        return (frozenset(self.handler.known_names)
                | (self.policy.allowed_peers or frozenset())) - self.policy.reserved

    def set_policy(self, policy: PeerPolicy) -> int:
        """Take ``policy`` (a reload): new connections are checked by it; an
        open connection it would refuse (its address, or the NAME it gave)
        is closed with ``ERROR <why>``, the others stay open untouched.
        Returns how many were closed."""
        self.policy = policy
        closed = 0
        for conn in list(self.live):
            refusal = conn.refusal_under(policy)
            if refusal is not None:
                closed += 1
                conn.close(REFUSED, refusal, log_text=f"{refusal} (config reloaded)")
        return closed

    def buildProtocol(self, addr: Any) -> "ServerReplicationProtocol":
        while self.crowd.unidentified >= self.max_unidentified:
            oldest = self.crowd.oldest_unidentified()
            assert oldest is not None  # unidentified > 0
            self.crowd.leave(oldest)
            self._refused("max_unidentified", self.max_unidentified)
            oldest.close(REFUSED, "too many unidentified connections")
        p = ServerReplicationProtocol(
            self.handler, self.server_name, policy=self.policy, clock=self.clock,
            identify=self._identify, identify_timeout=self.identify_timeout,
            **self.settings.kwargs())
        p.factory = self
        p.on_lost = self._lost
        self.live.add(p)
        self.crowd.arrive(p, getattr(addr, "host", None))
        return p

    def _identify(self, conn: ServerReplicationProtocol, name: str | None) -> str | None:
        """``conn`` gave ``name`` (None: an anonymous reader): the refusal,
        or None once it is counted where it belongs."""
        if conn not in self.crowd:
            return "too many unidentified connections"  # made room for another
        if name is not None and name in self.known_names:
            holder = self.holders.get(name)
            if holder is not None and holder is not conn and holder.close_reason is None:
                metrics.CONNECTIONS_REFUSED.labels("name_held").inc()
                holder.poke()
                return f"NAME {name} is held by a live connection"
            self.holders[name] = conn
            self.crowd.identify(conn, exempt=True)
            return None
        host = self.crowd.host(conn)
        self.crowd.leave(conn)
        if self.crowd.identified >= self.max_connections:
            self._refused("max_connections", self.max_connections)
            return "too many connections"
        if host is not None and \
                self.crowd.identified_count(host) >= self.max_connections_per_address:
            self._refused("max_connections_per_address", self.max_connections_per_address)
            return f"too many connections from {host}"
        self.crowd.arrive(conn, host)
        self.crowd.identify(conn)
        return None

    def _refused(self, key: str, n: int) -> None:
        """A connection refused or closed for the cap ``key`` (of ``n``):
        counted; a warning at most once a minute per cap."""
        metrics.CONNECTIONS_REFUSED.labels(key).inc()
        now = self.clock.seconds()
        if now - self._warned.get(key, -WARN_INTERVAL) >= WARN_INTERVAL:
            self._warned[key] = now
            log.warn("Replication listener at its {key} ({n}): refusing or closing "
                     "connections (counted in replicator_connections_refused_total)",
                     key=key, n=n)

    def _lost(self, protocol: Any) -> None:
        self.live.discard(protocol)
        self.crowd.leave(protocol)
        name = protocol.instance_name
        if name is not None and self.holders.get(name) is protocol:
            del self.holders[name]


class ReplicationClientFactory(Factory):
    """Builds the client protocol for each (re)connection to the upstream;
    ``current`` is the latest one, whose health resets ``backoff``."""

    noisy = False

    def __init__(self, handler: IReplicationHandler, client_name: str, server_name: str,
                 settings: ConnectionSettings | None = None, *, clock: IReactorTime,
                 backoff: Backoff | None = None, secret: str | None = None) -> None:
        self.handler = handler
        self.secret = secret  # this writer's, to prove its NAME when asked (.proof)
        self.client_name = client_name
        self.server_name = server_name
        self.settings = settings or ConnectionSettings()
        self.clock = clock
        self.backoff = backoff
        self.current: ClientReplicationProtocol | None = None
        self.started_at = clock.seconds()
        #: When the last connection that answered the handshake last heard
        #: its server (None: none answered yet).
        self.answered_until: float | None = None

    def buildProtocol(self, addr: Any) -> "ClientReplicationProtocol":
        on_healthy = self.backoff.reset if self.backoff is not None else None
        p = ClientReplicationProtocol(
            self.handler, self.client_name, self.server_name, on_healthy=on_healthy,
            clock=self.clock, secret=self.secret, **self.settings.kwargs())
        p.factory = self
        p.on_lost = self._lost
        self.current = p
        return p

    def _lost(self, p: ClientReplicationProtocol) -> None:
        if p.answered:
            self.answered_until = p.last_received

    def down_since(self) -> float | None:
        """Since when the upstream has not been answering (None: it is):
        when it was last heard on a connection that answered the
        handshake, else since this factory was made (the start)."""
        p = self.current
        if p is not None and p.established:
            return None
        if p is not None and p.answered:
            return p.last_received
        return self.answered_until if self.answered_until is not None else self.started_at

    @property
    def connected(self) -> bool:
        """Whether the upstream named itself and the link is still up."""
        return self.current is not None and self.current.established

    def lost_reason(self) -> str | None:
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
    retry with its reason (:mod:`replicator.net.reconnect`).  ``connected``
    is true only while the server has answered the handshake (a socket that
    was accepted but stays silent is not connected, and is closed after
    ``ping_timeout``)."""

    def __init__(self, endpoint: Any, factory: ReplicationClientFactory, backoff: Backoff, *,
                 clock: IReactorTime, where: str = "", on_retry: Any=None) -> None:
        super().__init__(endpoint, factory, backoff, clock=clock, what="upstream",
                         where=where, lost_reason=factory.lost_reason, on_retry=on_retry)
        self.replication_factory = factory

    @property
    def connected(self) -> bool:
        return self.replication_factory.connected

    def down_since(self) -> float | None:
        """See :meth:`ReplicationClientFactory.down_since`."""
        return self.replication_factory.down_since()

    @property
    def ever_answered(self) -> bool:
        """Whether a connection of this service ever answered the handshake."""
        f = self.replication_factory
        return f.answered_until is not None or (f.current is not None and f.current.answered)


def upstream_service(reactor: Any, endpoint: str, handler: IReplicationHandler, client_name: str,
                     server_name: str, settings: ConnectionSettings | None = None,
                     initial_delay: float = RECONNECT_INITIAL_DELAY,
                     max_delay: float = RECONNECT_MAX_DELAY, clock: IReactorTime | None=None,
                     wrap_endpoint: Any=None,
                     on_retry: Any=None, secret: str | None = None) -> UpstreamService:
    """A service that keeps one connection to the upstream server, forever.

    ``reactor`` makes the connections; ``clock`` (default: the reactor)
    times the protocol and the reconnect delays.  ``wrap_endpoint(endpoint)``
    may wrap the parsed endpoint (e.g. to report each attempt);
    ``on_retry(failures, delay)`` is told every reconnect delay; ``secret``
    proves ``client_name`` to a server that asks (:mod:`.proof`)."""
    clock = clock if clock is not None else reactor
    backoff = Backoff(initial_delay, max_delay, name="upstream")
    factory = ReplicationClientFactory(handler, client_name, server_name, settings,
                                       clock=clock, backoff=backoff, secret=secret)
    client = endpoints.clientFromString(reactor, endpoint)
    if wrap_endpoint is not None:
        client = wrap_endpoint(client)
    return UpstreamService(client, factory, backoff, clock=clock,
                           where=client_address(endpoint), on_retry=on_retry)
