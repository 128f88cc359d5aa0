"""Replication over a Redis 7 cluster's sharded pub/sub
(``replication.redis.cluster``; docs/protocol.md, "Redis").

The channels are those of the ``per_stream`` layout
(:mod:`.redis_channels`), each a *shard channel*: ``SPUBLISH`` and
``SSUBSCRIBE`` on the master that serves the channel's hash slot, so a
stream's traffic touches one master only and the cluster's masters share
the streams.  txredisapi knows neither command: lines are written as raw
RESP (as :meth:`.redis.RedisReplication.publish_lines` does) and the
subscriber reads the ``smessage`` and ``sunsubscribe`` pushes itself.

One *generation* at a time: the slot map read from a seed node (``CLUSTER
SLOTS``), a publisher to every master and a subscriber to each master
serving one of our channels (one ``SSUBSCRIBE`` per channel), and, once all
are ready, one logical :class:`.redis_bus.RedisConnection` registered with the
handler (our positions announced, REPLICATE sent).  Anything that says the
map is stale or a link is gone ends the generation: a lost link, a PING
unanswered for ``ping_timeout``, a ``MOVED``/``ASK``/refused block on
publishing, or a ``sunsubscribe`` push (what Redis sends a shard
subscriber when the channel's slot moved, e.g. ``redis-cli --cluster
reshard``).  Then everything is unregistered and closed, and a new
generation starts after the project's backoff (reset once a generation
stayed up for ``ping_interval``).  What was published meanwhile comes back
from the tables: the new generation's announcements and REPLICATE make
every reader catch up, and a fact at or below a reader's position is
dropped, so nothing is lost or doubled.

Atomicity: the lines of one write go, per channel, in one ``MULTI`` ...
``EXEC`` on that channel's master (a cluster's MULTI must stay in one
slot; one channel is one slot).  A write of several streams' lines (the
positions announced at connect) is one block per stream: readers rely on
order and wholeness per stream only.

With ``replication.redis.keys`` the lines are signed and checked as on
plain pub/sub (:mod:`.redis_signing`).

Not supported here: a ``synapse:`` section (Synapse speaks plain pub/sub
on one channel), TLS to the nodes (the nodes' addresses come from ``CLUSTER
SLOTS`` as plain TCP).
"""

from collections.abc import Sequence
from typing import Any

import txredisapi
from twisted.application.service import MultiService
from twisted.internet import defer, endpoints, task
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from ...config import RedisConfig
from ...logs.printable import printable
from ...net.backoff import RECONNECT_INITIAL_DELAY, RECONNECT_MAX_DELAY, Backoff
from ...observe import metrics
from ..interfaces import IRedisBus, IReplicationHandler
from ..wire.commands import ReplicateCommand
from .redis_bus import RedisConnection, deliver, parse_message, routed, text_of
from .redis_channels import ChannelLayout
from .redis_publish import at_rest, write_publishes
from .redis_signing import signing, take

log = Logger()

SLOTS = 16384


def _crc16(data: bytes) -> int:
    """CRC16-CCITT (XModem), Redis Cluster's key hash."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def key_slot(key: bytes) -> int:
    """The hash slot of a key or shard channel (``{tag}`` rule included)."""
    start = key.find(b"{")
    if start != -1:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return _crc16(key) % SLOTS


SlotMap = list[tuple[int, int, str]]  # (first slot, last slot, "host:port")


def parse_slots(reply: Any, seed_host: str) -> SlotMap:
    """``CLUSTER SLOTS``'s reply as ranges and their masters' addresses
    (an empty host, a node that knows no address of its own, is the seed's)."""
    ranges = []
    for entry in reply:
        first, last, master = int(entry[0]), int(entry[1]), entry[2]
        host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
        ranges.append((first, last, f"{host or seed_host}:{int(master[1])}"))
    return sorted(ranges)


def owner(slots: SlotMap, slot: int) -> str | None:
    for first, last, node in slots:
        if first <= slot <= last:
            return node
    return None


class _Factory(Factory):
    """Builds our txredisapi protocols for one node of one generation; never
    gives up on its own (the generation ends instead)."""

    noisy = False
    isLazy = False

    def __init__(self, protocol_class: Any, config: RedisConfig, owner: "RedisClusterBus",
                 node: str, generation: int) -> None:
        self.protocol_class, self.config, self.owner = protocol_class, config, owner
        self.node, self.generation = node, generation

    def buildProtocol(self, addr: Any) -> Any:
        p = self.protocol_class(password=self.config.password, replyTimeout=None)
        p.factory = self
        return p

    def stopTrying(self) -> None:
        """txredisapi asks us to stop after an AUTH failure: the generation ends."""

    def connectionError(self, why: str) -> None:
        metrics.REDIS_AUTH_REFUSED.labels("cluster").inc()
        self.owner.last_error = why


class _Link:
    lost = False
    last_data = 0.0
    factory: _Factory

    def dataReceived(self, data: bytes, *args: Any) -> Any:
        self.last_data = self.factory.owner.clock.seconds()
        return super().dataReceived(data, *args)  # type: ignore[misc]

    def connectionLost(self, why: Any) -> None:
        self.lost = True
        super().connectionLost(why)  # type: ignore[misc]
        self.factory.owner.link_lost(self)


class _ShardSubscriber(_Link, txredisapi.SubscriberProtocol):  # type: ignore[misc]
    """SSUBSCRIBE's pushes: ``smessage`` (a message) and ``sunsubscribe``
    (Redis dropped us from a channel whose slot moved: we never send
    SUNSUBSCRIBE, so every one is a push, never a reply, even while a PING
    waits for its answer)."""

    role = "subscriber"

    def replyReceived(self, reply: Any) -> None:
        if isinstance(reply, list) and len(reply) == 3:
            kind = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
            if kind == "smessage":
                self.factory.owner.message_received(self, reply[1], reply[2])
                return
            if kind == "sunsubscribe":
                self.factory.owner.moved(self, reply[1])
                return
        super().replyReceived(reply)


class _Publisher(_Link, txredisapi.RedisProtocol):  # type: ignore[misc]
    role = "publisher"


@implementer(IRedisBus)
class RedisClusterBus(MultiService):
    """Joins replication through a Redis cluster's sharded pub/sub (see the
    module); ``connected`` tells whether it is in."""

    synapse_seen = None  # no Synapse on a cluster's shard channels

    def __init__(self, reactor: Any, config: RedisConfig, handler: IReplicationHandler,
                 server_name: str, instance_name: str, ping_interval: float = 10.0,
                 ping_timeout: float = 5.0, initial_delay: float = RECONNECT_INITIAL_DELAY,
                 max_delay: float = RECONNECT_MAX_DELAY,
                 clock: IReactorTime | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.reactor = reactor
        self.clock = clock if clock is not None else reactor
        self.config, self.handler, self.instance_name = config, handler, instance_name
        self.layout = ChannelLayout(server_name, None, "per_stream")
        self.channel = self.layout.channel
        self.ping_interval, self.ping_timeout = ping_interval, ping_timeout
        self.backoff = Backoff(initial_delay, max_delay, name="redis-cluster")
        self.last_error: str | None = None
        self.conn: RedisConnection | None = None
        self.generation = 0
        #: The current generation's slot map, links and channels.
        self.slots: SlotMap = []
        self.publishers: dict[str, Any] = {}
        self.subscribers: dict[str, Any] = {}
        self.channels: set[str] = set()
        self._seed = 0
        self._next: IDelayedCall | None = None
        self._healthy: IDelayedCall | None = None
        self._running: defer.Deferred[None] | None = None
        self._own_prefixes = tuple(
            f"{name} {stream.name} {instance_name} "
            for stream in handler.registry for name in ("RDATA", "POSITION"))
        #: With ``keys``: lines signed and checked (:mod:`.redis_signing`).
        self.signer, self.verifier = signing(config.keys, instance_name, self.clock,
                                               handler.registry)
        self._pinger = task.LoopingCall(self._ping)
        self._pinger.clock = self.clock
        #: Generations started and ended, for tests and the status of a move.
        self.generations_ended = 0

    @property
    def connected(self) -> bool:
        return self.conn is not None

    @property
    def subscriber(self) -> Any:
        """Some subscriber of this generation (None between generations)."""
        return next(iter(self.subscribers.values()), None)

    # ---------------------------------------------------------- lifecycle
    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._pinger.start(self.ping_interval, now=False)
        self._start_generation()

    def stopService(self) -> Any:
        if self._pinger.running:
            self._pinger.stop()
        call, self._next = self._next, None
        if call is not None and call.active():
            call.cancel()
        self._end_generation("shutdown", retry=False)
        return super().stopService()  # type: ignore[no-untyped-call]

    def _start_generation(self) -> None:
        self._next = None
        self.generation += 1
        d = defer.ensureDeferred(self._run_generation(self.generation))
        self._running = d
        d.addErrback(self._generation_failed, self.generation)

    async def _run_generation(self, generation: int) -> None:
        seeds = self.config.cluster
        seed = seeds[self._seed % len(seeds)]
        self._seed += 1
        seed_host = seed.split("host=", 1)[1].split(":", 1)[0] if "host=" in seed else "127.0.0.1"
        probe = await self._connect(seed, _Publisher, "seed", generation)
        try:
            reply = probe.execute_command("CLUSTER", "SLOTS")
            reply.addTimeout(self.ping_timeout, self.clock)
            slots = parse_slots(await reply, seed_host)
        finally:
            if probe.transport is not None:
                probe.transport.loseConnection()
        if not slots:
            raise RuntimeError("CLUSTER SLOTS: no slot is served")
        channels = self.layout.subscriptions(self.handler.registry)
        by_node: dict[str, list[str]] = {}
        for channel in channels:
            node = owner(slots, key_slot(channel.encode("utf-8")))
            if node is None:
                raise RuntimeError(f"no master serves channel {channel}")
            by_node.setdefault(node, []).append(channel)
        self.slots, self.channels = slots, set(channels)
        for node in sorted({n for _, _, n in slots}):
            self.publishers[node] = await self._connect(
                f"tcp:host={node.rsplit(':', 1)[0]}:port={node.rsplit(':', 1)[1]}",
                _Publisher, node, generation)
        for node, node_channels in sorted(by_node.items()):
            subscriber = await self._connect(
                f"tcp:host={node.rsplit(':', 1)[0]}:port={node.rsplit(':', 1)[1]}",
                _ShardSubscriber, node, generation)
            self.subscribers[node] = subscriber
            for channel in node_channels:
                answer = subscriber.execute_command("SSUBSCRIBE", channel)
                answer.addTimeout(self.ping_timeout * 4, self.clock)
                confirmed = await answer
                if isinstance(confirmed, Exception):  # MOVED: the map went stale
                    raise RuntimeError(f"SSUBSCRIBE {channel}: {confirmed}")
        if generation != self.generation:
            return
        log.info("redis cluster: {masters} masters; subscribed to {channels} channels on "
                 "{nodes}", masters=len(self.publishers), channels=len(channels),
                 nodes=", ".join(sorted(self.subscribers)))
        self.last_error = None
        self._healthy = self.clock.callLater(self.ping_interval, self.backoff.reset)
        self.conn = RedisConnection(self)
        if self.verifier is not None:
            self.verifier.reset()
        self.handler.new_connection(self.conn)
        self.conn.send_command(ReplicateCommand())

    async def _connect(self, endpoint: str, protocol_class: Any, node: str,
                       generation: int) -> Any:
        factory = _Factory(protocol_class, self.config, self, node, generation)
        connecting = endpoints.clientFromString(self.reactor, endpoint).connect(factory)
        connecting.addTimeout(self.ping_timeout * 4, self.clock)
        protocol = await connecting
        ready = protocol.whenConnected()
        ready.addTimeout(self.ping_timeout * 4, self.clock)
        await ready
        if generation != self.generation or self._next is not None:
            protocol.transport.loseConnection()
            raise RuntimeError("generation over")
        return protocol

    def _generation_failed(self, failure: Failure, generation: int) -> None:
        if generation != self.generation:
            return
        self.last_error = self.last_error or failure.getErrorMessage()
        log.warn("redis cluster: not ready ({error})",
                 error=printable(failure.getErrorMessage()))
        self._end_generation("connection_lost")

    def _end_generation(self, reason: str, retry: bool = True) -> None:
        """Unregister, close every link of this generation, and (``retry``)
        start the next one after the backoff."""
        if self._next is not None:
            return  # already ended, the next one scheduled
        self.generations_ended += 1
        call, self._healthy = self._healthy, None
        if call is not None and call.active():
            call.cancel()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.closed = True
            self.handler.lost_connection(conn, reason)
        links = list(self.publishers.values()) + list(self.subscribers.values())
        self.publishers, self.subscribers, self.slots, self.channels = {}, {}, [], set()
        self.generation += 1  # whatever the old one still awaits is void
        for link in links:
            if link.transport is not None:
                link.transport.abortConnection()
        if retry and self.running:
            delay = self.backoff.delay()
            self._next = self.clock.callLater(delay, self._start_generation)

    def link_lost(self, protocol: Any) -> None:
        if protocol.factory.generation != self.generation or protocol.factory.node == "seed":
            return
        if protocol in self.publishers.values() or protocol in self.subscribers.values():
            log.warn("redis cluster: {role} link to {node} lost; starting over",
                     role=protocol.role, node=protocol.factory.node)
            self._end_generation("connection_lost")

    def moved(self, protocol: Any, channel: Any) -> None:
        """Redis unsubscribed us from ``channel``: its slot moved."""
        if protocol.factory.generation != self.generation:
            return
        log.info("redis cluster: channel {channel} left {node} (slot moved); following it",
                 channel=channel, node=protocol.factory.node)
        self._end_generation("connection_lost")

    # ------------------------------------------------------------ traffic
    def hold(self, lines: Sequence[bytes], command_name: str) -> bool:
        """A REPLICATE after a reload added a stream: a new generation
        subscribes to its channel and asks again (True: this one is not sent)."""
        if command_name != "REPLICATE" or self.conn is None:
            return False
        wanted = set(self.layout.subscriptions(self.handler.registry))
        if wanted <= self.channels:
            return False
        log.info("redis cluster: new channels {channels}; subscribing",
                 channels=", ".join(sorted(wanted - self.channels)))
        self._end_generation("connection_lost")
        return True

    def pause_reading(self) -> None:
        for subscriber in self.subscribers.values():
            if subscriber.transport is not None:
                subscriber.transport.pauseProducing()

    def resume_reading(self) -> None:
        for subscriber in self.subscribers.values():
            if subscriber.transport is not None:
                subscriber.transport.resumeProducing()

    def publish_lines(self, lines: Sequence[bytes], channel: bytes | None = None) -> None:
        """SPUBLISH the lines, each on its channel: one write per master,
        the lines of one channel in one ``MULTI`` ... ``EXEC`` (one slot)."""
        if self.conn is None:
            return
        per_channel: dict[bytes, list[bytes]] = {}
        for payload, to in zip(*routed(self.layout, lines, channel, self.signer)):
            per_channel.setdefault(to, []).append(payload)
        for to, payloads in per_channel.items():
            node = owner(self.slots, key_slot(to))
            publisher = self.publishers.get(node) if node is not None else None
            if publisher is None or publisher.transport is None or not publisher.connected:
                metrics.COMMANDS_DROPPED.labels("PUBLISH", "failed").inc(len(payloads))
                continue
            pending = write_publishes(publisher, b"SPUBLISH", [(to, p) for p in payloads])
            defer.gatherResults(pending).addCallback(
                self._published, publisher, len(payloads)).addErrback(
                self._publish_failed, publisher, len(payloads))

    def _published(self, results: list[Any], publisher: Any, count: int) -> None:
        at_rest(publisher)
        errors = [r for r in results if isinstance(r, Exception)]
        last = results[-1]
        if isinstance(last, list):
            errors += [r for r in last if isinstance(r, Exception)]
        if errors:
            self._publish_failed(Failure(errors[0]), publisher, count)

    def _publish_failed(self, failure: Failure, publisher: Any, count: int) -> None:
        metrics.COMMANDS_DROPPED.labels("PUBLISH", "failed").inc(count)
        text = failure.getErrorMessage()
        if publisher.factory.generation != self.generation or publisher.lost:
            return  # its generation is over already
        # MOVED/ASK (the map went stale) or a refused block: a new
        # generation reads the map again; its announcements cover the gap.
        log.info("redis cluster: publishing failed ({error}); starting over",
                 error=printable(text, 200))
        self._end_generation("connection_lost")

    def message_received(self, protocol: Any, channel: Any, message: Any) -> None:
        conn = self.conn
        if conn is None or protocol.factory.generation != self.generation:
            return
        if self.verifier is not None:
            take(self.verifier, channel, message, lambda line: self._heard(conn, line))
        else:
            self._heard(conn, text_of(message))

    def _heard(self, conn: RedisConnection, message: str) -> None:
        cmd = parse_message(message, self._own_prefixes)
        if cmd is not None:
            deliver(self.handler, conn, cmd, message, self.instance_name)

    # ---------------------------------------------------------- keepalive
    def _ping(self) -> None:
        for protocol in list(self.publishers.values()) + list(self.subscribers.values()):
            self._ping_one(protocol)

    def _ping_one(self, protocol: Any) -> None:
        try:
            d = protocol.ping()
        except txredisapi.ConnectionError:
            return
        d.addTimeout(self.ping_timeout, self.clock)

        def failed(failure: Failure) -> None:
            if self.clock.seconds() - protocol.last_data < self.ping_timeout:
                return
            if protocol.factory.generation == self.generation:
                log.warn("redis cluster: PING to {node} failed; starting over",
                         node=protocol.factory.node)
                self._end_generation("connection_lost")

        d.addErrback(failed)
