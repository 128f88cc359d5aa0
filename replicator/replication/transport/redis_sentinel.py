"""Where the Redis links connect: an endpoint string, or the master that
Redis Sentinel names (``replication.redis.sentinels`` + ``master_name``),
followed through failovers.

:func:`redis_endpoint` gives :class:`.redis.RedisReplication` the endpoint
both its links connect through.  With Sentinel that is a
:class:`SentinelEndpoint`: each connect first asks the sentinels, in turn
(the one that answered last first), ``SENTINEL get-master-addr-by-name``,
then connects to that address.  It is an ordinary endpoint to the links'
:class:`~replicator.net.reconnect.ReconnectingService`, so a master that
cannot be found or reached is one more failed attempt, retried with the
project's one :class:`~replicator.net.backoff.Backoff` and said in its
retry line (``no sentinel answered: ...``).

The links follow a failover three ways, whichever comes first:

* the old master dies: the links drop, and the reconnect asks Sentinel
  again (it names the old master until it has promoted a replica: those
  attempts are refused, and backed off);
* Sentinel announces ``+switch-master`` for our master (a
  :class:`SentinelWatch` subscribes to it on one sentinel at a time, and
  on every connection to one asks where the master is, so a switch missed
  while it was away is seen too): the owner drops links that are not on
  the new master, and they reconnect;
* every new link asks ``ROLE`` before it is used (:func:`check_master`): a
  node that says it is not a master (Sentinel's answer was stale: a
  demoted master that came back as a replica) fails the attempt.

Invariant: a link is used only once the node it reached said ``ROLE``
master; every link not on the master Sentinel names last is dropped.
"""

from collections.abc import Callable, Sequence
from typing import Any

import txredisapi
from twisted.internet import defer, endpoints
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from ...config import RedisConfig
from ...logs.printable import printable
from ...net.backoff import Backoff
from ...net.endpoint_strings import client_address
from ...net.reconnect import ReconnectingService, failure_reason

log = Logger()

Address = tuple[str, int]
#: The Sentinel channel that announces a promotion.
SWITCH_MASTER = "+switch-master"


class SentinelError(Exception):
    """No sentinel named the master (each one's reason in the message)."""


class NotMaster(Exception):
    """The node a link reached says it is not a master."""


def address_text(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def redis_endpoint(reactor: Any, config: RedisConfig, clock: IReactorTime,
                   timeout: float) -> tuple[Any, str]:
    """``(endpoint, where)``: what the Redis links connect through, and how
    their log lines name it."""
    if config.endpoint is not None:
        return (endpoints.clientFromString(reactor, config.endpoint),
                client_address(config.endpoint))
    assert config.master_name is not None
    endpoint = SentinelEndpoint(reactor, config.sentinels, config.master_name, clock, timeout)
    return endpoint, f"master {config.master_name}"


async def _ask(reactor: Any, address: Address, timeout: float, clock: IReactorTime,
               *command: str) -> Any:
    """One command on a short-lived connection to ``address``; its reply."""
    host, port = address
    endpoint = endpoints.HostnameEndpoint(reactor, host, port, timeout=max(1, int(timeout)))
    protocol = txredisapi.RedisProtocol(replyTimeout=None)
    connecting = endpoints.connectProtocol(endpoint, protocol)
    connecting.addTimeout(timeout, clock)
    await connecting
    try:
        reply = protocol.execute_command(*command)
        reply.addTimeout(timeout, clock)
        answer = await reply
    finally:
        if protocol.transport is not None:
            protocol.transport.loseConnection()
    if isinstance(answer, Exception):  # txredisapi hands error replies over as values
        raise answer
    return answer


def _master_reply(answer: Any) -> Address | None:
    """``get-master-addr-by-name``'s reply as an address (None: unknown name)."""
    if answer is None:
        return None
    host, port = answer
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    return str(host), int(port)


@implementer(IStreamClientEndpoint)
class SentinelEndpoint:
    """Connects to the master ``master_name`` that the sentinels name (see
    the module).  ``master`` is the address it last connected to."""

    def __init__(self, reactor: Any, sentinels: Sequence[Address], master_name: str,
                 clock: IReactorTime, timeout: float) -> None:
        self.reactor = reactor
        self.sentinels = list(sentinels)
        self.master_name = master_name
        self.clock = clock
        self.timeout = timeout
        self.master: Address | None = None

    async def master_address(self) -> Address:
        """The master's address from the first sentinel that knows it
        (trying them in turn, the last one that answered first)."""
        reasons = []
        for i, sentinel in enumerate(list(self.sentinels)):
            try:
                address = _master_reply(await _ask(
                    self.reactor, sentinel, self.timeout, self.clock,
                    "SENTINEL", "get-master-addr-by-name", self.master_name))
            except Exception as e:
                reasons.append(f"{address_text(sentinel)} {failure_reason(Failure(e))}")
                continue
            if address is None:
                reasons.append(f"{address_text(sentinel)} does not know it")
                continue
            if i:  # ask this one first next time
                self.sentinels.insert(0, self.sentinels.pop(i))
            return address
        raise SentinelError(f"no sentinel named master {self.master_name}: "
                            + "; ".join(reasons))

    def connect(self, factory: Any) -> "defer.Deferred[Any]":
        async def connect() -> Any:
            address = await self.master_address()
            self.master = address
            host, port = address
            endpoint = endpoints.HostnameEndpoint(self.reactor, host, port,
                                                  timeout=max(1, int(self.timeout)))
            return await endpoint.connect(factory)

        return defer.ensureDeferred(connect())


async def check_master(protocol: Any, timeout: float, clock: IReactorTime) -> None:
    """Raise :class:`NotMaster` unless the node on ``protocol`` says
    ``ROLE`` master (before the link subscribes or publishes)."""
    reply = protocol.execute_command("ROLE")
    reply.addTimeout(timeout, clock)
    answer = await reply
    if isinstance(answer, Exception):
        raise answer
    role = answer[0] if isinstance(answer, list) and answer else answer
    if isinstance(role, bytes):
        role = role.decode("ascii", "replace")
    if role != "master":
        peer = protocol.transport.getPeer() if protocol.transport is not None else None
        where = f"{peer.host}:{peer.port}" if peer is not None else "the node"
        raise NotMaster(f"{where} is not the master (ROLE {printable(str(role), 40)})")


class _WatchProtocol(txredisapi.SubscriberProtocol):  # type: ignore[misc]
    """A subscription to ``+switch-master`` on one sentinel, after asking it
    where the master is."""

    factory: "_WatchFactory"

    def connectionMade(self) -> Any:
        result = super().connectionMade()
        defer.ensureDeferred(self.factory.watch.watching(self)).addErrback(
            self.factory.watch.not_watching, self)
        return result

    def messageReceived(self, pattern: Any, channel: Any, message: Any) -> None:
        self.factory.watch.announced(message)


class _WatchFactory(Factory):
    noisy = False

    def __init__(self, watch: "SentinelWatch") -> None:
        self.watch = watch

    def buildProtocol(self, addr: Any) -> Any:
        p = _WatchProtocol(replyTimeout=None)
        p.factory = self
        return p

    def stopTrying(self) -> None:
        """Never: the service retries."""

    def connectionError(self, why: str) -> None:
        """No AUTH or SELECT on a sentinel: nothing fails here."""


@implementer(IStreamClientEndpoint)
class _EachSentinel:
    """Connects to the sentinels in turn, one more each attempt."""

    def __init__(self, reactor: Any, sentinels: Sequence[Address], timeout: float) -> None:
        self.reactor = reactor
        self.sentinels = list(sentinels)
        self.timeout = timeout
        self.next = 0

    def connect(self, factory: Any) -> "defer.Deferred[Any]":
        host, port = self.sentinels[self.next % len(self.sentinels)]
        self.next += 1
        return endpoints.HostnameEndpoint(self.reactor, host, port,
                                          timeout=max(1, int(self.timeout))).connect(factory)


class SentinelWatch(ReconnectingService):
    """Hears Sentinel's ``+switch-master`` for ``endpoint``'s master and
    calls ``on_master(address)`` whenever the master it names (announced,
    or asked at each connection) is not where the links went last."""

    def __init__(self, reactor: Any, endpoint: SentinelEndpoint, backoff: Backoff,
                 on_master: Callable[[Address], None], clock: IReactorTime) -> None:
        self.endpoint = endpoint
        self.on_master = on_master
        self._timeout = endpoint.timeout
        super().__init__(_EachSentinel(reactor, endpoint.sentinels, endpoint.timeout),
                         _WatchFactory(self), backoff, clock=clock, what="redis sentinel watch",
                         where=", ".join(address_text(s) for s in endpoint.sentinels))
        self._watch_clock = clock

    async def watching(self, protocol: Any) -> None:
        ready = protocol.whenConnected()
        ready.addTimeout(self._timeout, self._watch_clock)
        await ready
        answer = protocol.execute_command("SENTINEL", "get-master-addr-by-name",
                                          self.endpoint.master_name)
        answer.addTimeout(self._timeout, self._watch_clock)
        reply = await answer
        if isinstance(reply, Exception):
            raise reply
        subscribed = protocol.subscribe(SWITCH_MASTER)
        subscribed.addTimeout(self._timeout, self._watch_clock)
        await subscribed
        self.backoff.reset()
        address = _master_reply(reply)
        if address is not None:
            self._master(address, "asked")

    def not_watching(self, failure: Failure, protocol: Any) -> None:
        log.warn("redis sentinel watch: {error}; trying the next sentinel",
                 error=failure_reason(failure))
        if protocol.transport is not None:
            protocol.transport.abortConnection()

    def announced(self, message: Any) -> None:
        """A ``+switch-master`` message: ``name old-ip old-port new-ip new-port``."""
        if isinstance(message, bytes):
            message = message.decode("utf-8", "replace")
        fields: list[str] = str(message).split()
        if len(fields) != 5 or fields[0] != self.endpoint.master_name or not fields[4].isdigit():
            return
        self._master((fields[3], int(fields[4])), "+switch-master")

    def _master(self, address: Address, how: str) -> None:
        if self.endpoint.master is None or address == self.endpoint.master:
            return
        log.warn("Sentinel names {new} the master {name} ({how}; the links were on "
                 "{old}): they reconnect", new=address_text(address), how=how,
                 name=self.endpoint.master_name, old=address_text(self.endpoint.master))
        self.on_master(address)
