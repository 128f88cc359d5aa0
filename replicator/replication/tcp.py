"""TCP plumbing: the listening factory and the reconnecting upstream client.

Listeners and upstreams are Twisted endpoint strings
(``tcp:9092:interface=127.0.0.1``, ``ssl:...``, ``tcp:host=master:port=9092``,
``tls:master:9092``).  The client reconnects with exponential backoff through
``ClientService`` and, on every connection, sends NAME, PING and REPLICATE
(the protocol) and its own writers' POSITIONs (the handler), so it resumes
from its positions.
"""

from dataclasses import dataclass

from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet import endpoints
from twisted.internet.protocol import Factory

from .commands import MAX_LINE_LENGTH
from .peers import PeerPolicy, local_names
from .protocol import (
    MAX_QUEUED_LINES,
    PING_INTERVAL,
    PING_TIMEOUT,
    ClientReplicationProtocol,
    ServerReplicationProtocol,
)


@dataclass(frozen=True)
class ConnectionSettings:
    """Per-connection limits, the same on both sides."""

    max_line_length: int = MAX_LINE_LENGTH
    ping_interval: float = PING_INTERVAL
    ping_timeout: float = PING_TIMEOUT
    max_queued_lines: int = MAX_QUEUED_LINES

    def kwargs(self) -> dict:
        return dict(
            max_line_length=self.max_line_length, ping_interval=self.ping_interval,
            ping_timeout=self.ping_timeout, max_queued_lines=self.max_queued_lines,
        )


class ReplicationServerFactory(Factory):
    """Builds a server protocol per accepted connection, all on one handler.

    ``policy`` says who may connect and which names peers may take; by
    default no peer may take the name of the handler's instance (nor of a
    writer local to it)."""

    noisy = False

    def __init__(self, handler, server_name: str, settings: ConnectionSettings = None,
                 clock=None, policy: PeerPolicy = None):
        self.handler = handler
        self.server_name = server_name
        self.settings = settings or ConnectionSettings()
        self.clock = clock
        if policy is None:
            policy = PeerPolicy(reserved=local_names(handler))
        self.policy = policy

    def buildProtocol(self, addr):
        p = ServerReplicationProtocol(
            self.handler, self.server_name, policy=self.policy, clock=self.clock,
            **self.settings.kwargs())
        p.factory = self
        return p


class ReplicationClientFactory(Factory):
    """Builds the client protocol for each (re)connection to the upstream."""

    noisy = False

    def __init__(self, handler, client_name: str, server_name: str,
                 settings: ConnectionSettings = None, clock=None):
        self.handler = handler
        self.client_name = client_name
        self.server_name = server_name
        self.settings = settings or ConnectionSettings()
        self.clock = clock

    def buildProtocol(self, addr):
        p = ClientReplicationProtocol(
            self.handler, self.client_name, self.server_name, clock=self.clock,
            **self.settings.kwargs())
        p.factory = self
        return p


def upstream_service(reactor, endpoint: str, handler, client_name: str, server_name: str,
                     settings: ConnectionSettings = None, initial_delay: float = 0.5,
                     max_delay: float = 30.0, wrap_endpoint=None,
                     on_retry=None) -> ClientService:
    """A service that keeps one connection to the upstream server, forever.

    ``wrap_endpoint(endpoint)`` may wrap the parsed endpoint (e.g. to report
    each attempt); ``on_retry(attempt, delay)`` is told every retry delay."""
    factory = ReplicationClientFactory(handler, client_name, server_name, settings)
    client = endpoints.clientFromString(reactor, endpoint)
    if wrap_endpoint is not None:
        client = wrap_endpoint(client)
    policy = backoffPolicy(initialDelay=initial_delay, maxDelay=max_delay)
    if on_retry is not None:
        inner = policy

        def policy(attempt: int) -> float:
            delay = inner(attempt)
            on_retry(attempt, delay)
            return delay
    return ClientService(client, factory, retryPolicy=policy)
