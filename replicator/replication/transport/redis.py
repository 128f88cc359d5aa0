"""Replication over Redis pub/sub, on Synapse's wire (docs/protocol.md, section
"Redis"), driven by the same handler as TCP.

Every instance PUBLISHes its command lines on the channel ``<server_name>``
(USER_IP on ``<server_name>/USER_IP``) and SUBSCRIBEs to both.  There is no
hub: RDATA/POSITION go straight to every reader.  The lines of one write
(one fan-out) go inside one ``MULTI`` ... ``EXEC``: they reach the channel
all or nothing (:meth:`RedisReplication.publish_lines`).  That is the
``single`` layout; with ``channels: per_stream`` each line goes to its
stream's channel, and an instance subscribes to its own streams' channels
only (:mod:`.redis_channels` routes lines and names the subscriptions).

Two connections (a subscriber and a publisher), each kept by its own
``ClientService`` with the project's :class:`~replicator.net.backoff.Backoff`
(jittered, so that instances do not come back in lockstep after a Redis
restart), which never gives up — not after a refused connection, a
timeout, or a failed AUTH/SELECT (txredisapi's own factories stop retrying
then; ours do not) — and starts over only once a connection was ready and
stayed up for ``ping_interval``.  Each connection is PINGed every
``ping_interval`` seconds and replaced when a PING is not answered within
``ping_timeout``.  Both connect through the endpoint
:mod:`.redis_sentinel` gives: the configured endpoint string (``tcp:``,
``tls:``), or the master Sentinel names, followed through failovers.

``ClientService`` sees a Redis connection as up from the TCP connect on:
getting it ready (AUTH/SELECT, SUBSCRIBE) is our own business, outside
``ClientService``'s ``prepareConnection``.  A connection lost while that
step was pending would otherwise give ``ClientService`` a disconnect in a
state that has no transition for it (automat ``NoTransition`` in
``Connecting``, ``Waiting`` or ``Stopped``, logged as Unhandled Error): the
failed step fails the attempt from inside ``connectionLost`` and the
disconnect follows.  Here a lost connection cancels its readiness step,
and ``ClientService`` only ever sees connect, disconnect and stop.

The handler sees one logical connection, registered only while both Redis
connections are up and the subscription is confirmed.  On every
registration it announces this instance's own writers' positions (nobody
else will ask) and then sends REPLICATE, whose POSITION answers make it
catch up from the database on whatever was published while it was away.
Its own echoes (RDATA/POSITION/USER_SYNC naming this instance) are dropped;
lines it cannot parse, or for streams and commands it does not know (a real
Synapse publishes many on the same channel), are ignored with a debug log
and a counter.

Beside a Synapse (``synapse_server_name``), Synapse's channel is Synapse's:
we publish nothing there but one REPLICATE per registration (to hear its
positions; Synapse's own workers do the same), we answer none of its
REPLICATEs, and our own lines go to ``<server_name>/replicator`` (USER_IP to
``<server_name>/replicator/USER_IP``), which Synapse never subscribes to.
Every instance subscribes to its own channels and to Synapse's, reading
Synapse's facts from there.  (A POSITION for a stream Synapse does not know
breaks Synapse's subscription; a writer of a stream it has enters its ID
generators: neither can happen on a channel it does not read.)

Without that section a Synapse may still be on our channel (an operator
pointed us at its Redis and forgot the section): :mod:`.synapse_watch`
tells it apart, and once it was seen we publish nothing more there
(``synapse_seen``, a health problem).  To see it before harming it, every
registration asks first (REPLICATE) and holds our own lines for
``synapse_probe`` seconds, and every REPLICATE is answered that late.

With ``replication.redis.keys`` what we publish on our own channels is
signed and what we hear there is checked before it is parsed
(:mod:`.redis_signing`: :func:`.redis_bus.routed` signs, :meth:`RedisReplication.message_received`
verifies); Synapse's channel is neither.  A line that does not verify is
refused, never acted on; an unsigned one is still shown to the Synapse
watch.

(One job: the two Redis links and their readiness step change together.
The logical connection the handler sees, and a message's way in and out,
are :mod:`.redis_bus`, which :mod:`.redis_cluster` shares; the command
wire format itself is in :mod:`.commands`.)
"""

from collections.abc import Sequence
from typing import Any, cast

import txredisapi
from twisted.application.service import MultiService
from twisted.internet import defer, task
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from ...config import RedisConfig
from ...logs.printable import printable
from ...net.backoff import RECONNECT_INITIAL_DELAY, RECONNECT_MAX_DELAY, Backoff
from ...net.reconnect import ReconnectingService, failure_reason
from ...observe import metrics
from ..interfaces import LATE_CHECK, IRedisBus, IReplicationHandler
from ..wire.commands import ReplicateCommand
from .redis_bus import RedisConnection, deliver, parse_message, routed, text_of
from .redis_channels import ChannelLayout
from .redis_publish import at_rest, write_publishes
from .redis_sentinel import (
    SentinelEndpoint,
    SentinelWatch,
    address_text,
    check_master,
    redis_endpoint,
)
from .redis_signing import is_signed, signing, take
from .synapse_watch import SynapseWatch

log = Logger()

#: Without the ``synapse:`` section, how long a REPLICATE's answer (and, on
#: registration, our own announcements) waits for a Synapse to show itself.
SYNAPSE_PROBE = 1.0
#: Lines held that long at most; past that they are dropped, and the
#: positions announced at the end make readers catch up from the tables.
HOLD_MAX_LINES = 10_000


class _RedisFactory(Factory):
    """Builds txredisapi protocols for our ClientService.

    Provides the hooks txredisapi's protocol calls on its factory, without
    ever giving up: a failed AUTH/SELECT closes the connection and the
    service tries again after its backoff.
    """

    noisy = False
    isLazy = False

    def __init__(self, protocol_class: Any, config: RedisConfig, owner: "RedisReplication",
                 role: str) -> None:
        self.protocol_class = protocol_class
        self.config = config
        self.owner = owner
        self.role = role
        #: The protocol built last (ClientService keeps one at a time).
        self.current: _Link | None = None

    def buildProtocol(self, addr: Any) -> Any:
        # convertNumbers off: a message that reads as a number is a line of
        # text like any other (txredisapi would hand over an int), and no
        # message pays for the probe.
        p = self.protocol_class(password=self.config.password, dbid=self.config.dbid,
                                replyTimeout=None, convertNumbers=False)
        p.factory = self
        self.current = p
        return p

    def stopTrying(self) -> None:
        """txredisapi asks us to stop after an AUTH/SELECT failure: we don't."""

    def connectionError(self, why: str) -> None:
        """txredisapi's word that AUTH or SELECT failed (it closes the
        connection): counted, logged, retried.  Not when the connection was
        lost before the answer (a failed TLS handshake): its loss says why."""
        if self.current is not None and self.current.lost:
            return
        metrics.REDIS_AUTH_REFUSED.labels(self.role).inc()
        self.owner.last_error = why
        log.error("redis {role} connection: {why}; retrying", role=self.role, why=why)


class _Link:
    """What both our protocols add to txredisapi's: the time of the last
    bytes received, and the owner told of connect and loss (loss first, so
    that the readiness step is cancelled before txredisapi fails what was
    pending)."""

    last_data = 0.0
    lost = False
    readying: defer.Deferred[Any] | None = None
    healthy_call: IDelayedCall | None = None
    factory: "_RedisFactory"
    transport: Any  # txredisapi's

    def dataReceived(self, data: bytes, *args: Any) -> Any:
        self.last_data = self.factory.owner.clock.seconds()
        return super().dataReceived(data, *args)  # type: ignore[misc]

    def connectionMade(self) -> Any:
        self.last_data = self.factory.owner.clock.seconds()
        # A block goes out when it is written, not once the one before it
        # was acknowledged (Nagle's algorithm): as on TCP replication links.
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            try:
                set_no_delay(True)
            except OSError:
                pass  # not a TCP socket (a UNIX one): nothing to delay
        result = super().connectionMade()  # type: ignore[misc]  # AUTH/SELECT, in the background
        self.factory.owner.link_made(self)
        return result

    def connectionLost(self, why: Failure) -> None:
        self.lost = True
        reason = failure_reason(why)
        if reason.startswith("TLS: "):  # the retry line's reason (not "connection lost")
            self.factory.owner.last_error = reason
        self.factory.owner.link_lost(self)
        super().connectionLost(why)  # type: ignore[misc]


class _Subscriber(_Link, txredisapi.SubscriberProtocol):  # type: ignore[misc]
    role = "subscriber"

    def messageReceived(self, pattern: str, channel: str, message: Any) -> None:
        self.factory.owner.message_received(self, channel, message)


class _Publisher(_Link, txredisapi.RedisProtocol):  # type: ignore[misc]
    role = "publisher"


@implementer(IRedisBus)
class RedisReplication(MultiService):
    """Joins replication through Redis; ``connected`` tells whether it is in."""

    def __init__(self, reactor: Any, config: RedisConfig, handler: IReplicationHandler,
                 server_name: str, instance_name: str, ping_interval: float = 10.0,
                 ping_timeout: float = 5.0,
                 initial_delay: float = RECONNECT_INITIAL_DELAY,
                 max_delay: float = RECONNECT_MAX_DELAY, clock: IReactorTime | None=None,
                 synapse_server_name: str | None = None,
                 synapse_probe: float = SYNAPSE_PROBE) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.reactor = reactor
        #: Times pings, readiness, health and reconnect delays (default: reactor).
        self.clock = clock if clock is not None else reactor
        self.config = config
        self.handler = handler
        self.synapse_channel = synapse_server_name
        #: Where each line goes, what to subscribe to (:mod:`.redis_channels`).
        self.layout = ChannelLayout(server_name, synapse_server_name, config.channels)
        self.channel = self.layout.channel
        self.user_ip_channel = self.layout.user_ip_channel
        #: Channels the current subscriber is subscribed to (or asked for).
        self._subscribed_channels: set[str] = set()
        self.instance_name = instance_name
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.last_error: str | None = None
        self.subscriber: _Subscriber | None = None
        self.publisher: _Publisher | None = None
        self.conn: RedisConnection | None = None
        self._subscribed = False
        #: Without the section, what tells a Synapse on our channel apart.
        self.watch = (SynapseWatch(self.channel, [s.name for s in handler.registry])
                      if synapse_server_name is None and not self.layout.per_stream
                      else None)
        self.synapse_probe = synapse_probe
        #: While asking before announcing: our lines but REPLICATE, in order.
        self._held: list[Sequence[bytes]] | None = None
        self._held_count = 0
        self._answer_call: IDelayedCall | None = None
        self._own_prefixes = tuple(
            f"{name} {stream.name} {instance_name} "
            for stream in handler.registry for name in ("RDATA", "POSITION"))
        #: With ``keys``: our lines signed, those heard on our channels
        #: checked (:mod:`.redis_signing`); None: every publisher believed.
        self.signer, self.verifier = signing(config.keys, instance_name, self.clock,
                                               handler.registry)

        self.sub_backoff = Backoff(initial_delay, max_delay, name="redis-subscriber")
        self.pub_backoff = Backoff(initial_delay, max_delay, name="redis-publisher")
        endpoint, where = redis_endpoint(reactor, config, self.clock, ping_timeout * 4)
        self._factories = (_RedisFactory(_Subscriber, config, self, "subscriber"),
                           _RedisFactory(_Publisher, config, self, "publisher"))
        self._sub_service = ReconnectingService(
            endpoint, self._factories[0],
            self.sub_backoff, clock=self.clock, what="redis subscriber", where=where,
            lost_reason=lambda: self.last_error)
        self._pub_service = ReconnectingService(
            endpoint, self._factories[1],
            self.pub_backoff, clock=self.clock, what="redis publisher", where=where,
            lost_reason=lambda: self.last_error)
        #: With Sentinel: where the master is, and who hears it move.
        self.sentinel = endpoint if isinstance(endpoint, SentinelEndpoint) else None
        if self.sentinel is not None:
            SentinelWatch(reactor, self.sentinel, Backoff(initial_delay, max_delay,
                                                          name="redis-sentinel"),
                          self.follow_master, self.clock).setServiceParent(self)  # type: ignore[no-untyped-call]
        self._sub_service.setServiceParent(self)  # type: ignore[no-untyped-call]
        self._pub_service.setServiceParent(self)  # type: ignore[no-untyped-call]
        self._pinger = task.LoopingCall(self._ping)
        self._pinger.clock = self.clock

    @property
    def connected(self) -> bool:
        return self.conn is not None

    @property
    def where(self) -> str:
        """Where the links go (``/health``, log lines): the endpoint, or the
        Sentinel master and its last address."""
        master = self.sentinel.master if self.sentinel is not None else None
        if master is None:
            return self.config.where
        return f"master {self.config.master_name} at {address_text(master)} (Sentinel)"

    def follow_master(self, address: Any) -> None:
        """Sentinel names another master: drop every link (up or getting
        ready) so that each reconnects to it."""
        self.last_error = f"Sentinel moved the master to {address_text(address)}"
        for factory in self._factories:
            protocol = factory.current
            if protocol is not None and not protocol.lost and protocol.transport is not None:
                protocol.transport.abortConnection()

    @property
    def synapse_seen(self) -> str | None:
        """Why this instance no longer publishes (a Synapse on its channel,
        see :mod:`.synapse_watch`), for ``/health``; None while it does."""
        return self.watch.evidence if self.watch is not None else None

    # ---------------------------------------------------------- lifecycle
    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._pinger.start(self.ping_interval, now=False)

    def stopService(self) -> Any:
        if self._pinger.running:
            self._pinger.stop()
        self._unregister("shutdown")
        return super().stopService()  # type: ignore[no-untyped-call]

    # ---------------------------------------------------------- readiness
    def link_made(self, protocol: Any) -> None:
        """A TCP connection is up (ClientService counts it as connected):
        get it ready in the background.  Failing that, close it; the
        disconnect makes ClientService try again after its backoff."""
        d = defer.ensureDeferred(self._get_ready(protocol))
        protocol.readying = d
        d.addErrback(self._not_ready, protocol)

    async def _get_ready(self, protocol: Any) -> None:
        # AUTH and SELECT succeeded (a failure closes the connection, and
        # link_lost cancels this).
        ready = protocol.whenConnected()
        ready.addTimeout(self.ping_timeout * 4, self.clock)
        await ready
        if self.sentinel is not None:
            await check_master(protocol, self.ping_timeout * 4, self.clock)
        if protocol.role == "subscriber":
            channels = self.layout.subscriptions(self.handler.registry)
            subscribed = protocol.subscribe(channels)
            subscribed.addTimeout(self.ping_timeout * 4, self.clock)
            await subscribed
        protocol.readying = None
        if protocol.role == "subscriber":
            self.subscriber = protocol
            self._subscribed = True
            self._subscribed_channels = set(channels)
            log.info("redis: subscribed to {channel}", channel=self.channel)
        else:
            self.publisher = protocol
            log.info("redis: publisher connected to {endpoint}", endpoint=self.where)
        protocol.healthy_call = self.clock.callLater(self.ping_interval, self._healthy, protocol)
        self._maybe_register()

    def _not_ready(self, failure: Failure, protocol: Any) -> None:
        protocol.readying = None
        if protocol.lost:
            return  # link_lost cancelled us; nothing more to do
        self.last_error = self.last_error or failure.getErrorMessage()
        log.warn("redis {role} connection not ready ({error}); reconnecting",
                 role=protocol.role, error=printable(failure.getErrorMessage()))
        if protocol.transport is not None:
            protocol.transport.abortConnection()

    def _healthy(self, protocol: Any) -> None:
        """Ready and up for ``ping_interval``: the backoff starts over."""
        protocol.healthy_call = None
        if protocol.lost:
            return
        if protocol is self.subscriber:
            self.sub_backoff.reset()
        elif protocol is self.publisher:
            self.pub_backoff.reset()

    def _maybe_register(self) -> None:
        if self.conn is not None or not self._subscribed or self.publisher is None:
            return
        self.last_error = None
        self.conn = RedisConnection(self)
        if self.verifier is not None:
            self.verifier.reset()
        if self.watch is not None:
            # Ask first; announce once no Synapse answered (_answer).
            self._held, self._held_count = [], 0
            self._answer_later(self.conn)
        # The handler announces our writers' positions; then ask the others.
        self.handler.new_connection(self.conn)
        self.conn.send_command(ReplicateCommand())
        if self.synapse_channel is not None:
            # Synapse answers with its positions: readers of its streams
            # catch up on what they missed.  The only line we put there.
            self.publish_lines([b"REPLICATE\n"], channel=self.synapse_channel.encode("utf-8"))

    def _answer_later(self, conn: RedisConnection) -> None:
        """Answer REPLICATE ``synapse_probe`` seconds from now (one answer
        for every REPLICATE until then), unless a Synapse showed up: it
        answers a REPLICATE within a round trip, and announces its own
        positions right after its own."""
        if self._answer_call is None:
            self._answer_call = self.clock.callLater(self.synapse_probe, self._answer, conn)

    @property
    def holding(self) -> bool:
        return self._held is not None

    def hold(self, lines: Sequence[bytes], command_name: str) -> bool:
        """While registering without the ``synapse:`` section, keep our
        lines (but REPLICATE) for :meth:`_answer`; True if kept.  Bounded:
        past ``HOLD_MAX_LINES`` these and all later ones until the answer
        are dropped (counted), as for a lost publisher, and the answer's
        positions make readers catch up from the tables (a later fact
        published after a dropped one would leave a reader a gap)."""
        if command_name == "REPLICATE" and self._subscribe_new(lines):
            return True
        held = self._held
        if held is None or command_name == "REPLICATE":
            return False
        if self._held_count + len(lines) > HOLD_MAX_LINES:
            metrics.COMMANDS_DROPPED.labels(command_name, "synapse_probe").inc(
                len(lines) + sum(len(h) for h in held))
            held.clear()
            self._held_count = HOLD_MAX_LINES  # full until the answer
            return True
        held.append(lines)
        self._held_count += len(lines)
        return True

    def _subscribe_new(self, lines: Sequence[bytes]) -> bool:
        """With a channel per stream, a REPLICATE after a reload added a
        stream waits until its channel is subscribed (else the answering
        POSITIONs would go by unheard); True if it waits.  One SUBSCRIBE
        per channel, so that each has exactly one reply in the subscriber's
        reply queue.  A failure replaces the subscriber, whose new
        registration subscribes to everything and asks again."""
        subscriber, conn = self.subscriber, self.conn
        if not self.layout.per_stream or subscriber is None or conn is None:
            return False
        new = [channel for channel in self.layout.subscriptions(self.handler.registry)
               if channel not in self._subscribed_channels]
        if not new:
            return False
        self._subscribed_channels.update(new)
        asked = []
        for channel in new:
            d = subscriber.subscribe(channel)
            d.addTimeout(self.ping_timeout * 4, self.clock)
            asked.append(d)

        def subscribed(_: Any) -> None:
            log.info("redis: subscribed to {channels}", channels=", ".join(new))
            if conn is self.conn and subscriber is self.subscriber:
                self.publish_lines(lines)

        def failed(failure: Failure) -> None:
            if subscriber.lost:
                return
            log.warn("redis: subscribing to {channels} failed ({error}); reconnecting",
                     channels=", ".join(new), error=printable(failure.getErrorMessage()))
            if subscriber.transport is not None:
                subscriber.transport.abortConnection()

        defer.gatherResults(asked, consumeErrors=True).addCallbacks(subscribed, failed)
        return True

    def _answer(self, conn: RedisConnection) -> None:
        self._answer_call = None
        held, self._held = self._held, None
        if conn is not self.conn or self.synapse_seen is not None:
            return
        for lines in held or ():
            self.publish_lines(lines)
        cast(Any, self.handler).on_REPLICATE(conn, ReplicateCommand())

    def _stop_publishing(self, evidence: str) -> None:
        """A Synapse is on our channel: nothing more goes there (until a
        restart with the ``synapse:`` section); said once."""
        call, self._answer_call = self._answer_call, None
        if call is not None and call.active():
            call.cancel()
        self._held = None
        log.error("redis: {evidence}", evidence=evidence, instance=self.instance_name)

    def _unregister(self, reason: str) -> None:
        call, self._answer_call = self._answer_call, None
        if call is not None and call.active():
            call.cancel()
        self._held = None
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.closed = True
            self.handler.lost_connection(conn, reason)

    def link_lost(self, protocol: Any) -> None:
        readying, protocol.readying = protocol.readying, None
        if readying is not None and not readying.called:
            readying.cancel()
        call, protocol.healthy_call = protocol.healthy_call, None
        if call is not None and call.active():
            call.cancel()
        if protocol is self.subscriber:
            self.subscriber = None
            self._subscribed = False
        elif protocol is self.publisher:
            self.publisher = None
        else:
            return
        log.warn("redis: connection lost; reconnecting")
        self._unregister("connection_lost")

    # ------------------------------------------------------------ traffic
    def pause_reading(self) -> None:
        """Stop reading the subscription (while a claim is checked)."""
        subscriber = self.subscriber
        if subscriber is not None and subscriber.transport is not None:
            subscriber.transport.pauseProducing()

    def resume_reading(self) -> None:
        subscriber = self.subscriber
        if subscriber is not None and subscriber.transport is not None:
            subscriber.transport.resumeProducing()

    def publish_lines(self, lines: Sequence[bytes], channel: bytes | None = None) -> None:
        """PUBLISH each line on our channel (USER_IP on ours for it) unless
        ``channel`` is given, all in one write; more than one line inside
        ``MULTI`` ... ``EXEC``.

        So the lines of one call (one fan-out: whole facts, a ``batch`` run
        and its last line together) reach the channel all or nothing, and
        no other client's lines come between them: Redis runs a MULTI block
        at its EXEC, at once, and drops it unrun when the connection closes
        before EXEC arrives.  Without it, a link that stalled mid-fact and
        was replaced could deliver the start of a fact late, after our new
        link re-announced our positions, and the readers would join those
        rows to our next fact.

        Lines for a lost publisher are dropped, and so are those of a block
        whose EXEC fails or never answers (a lost link): the facts are in
        the database, and the reconnect re-announces our positions.  Nothing is
        published once a Synapse was seen on our channel.

        The commands are written by hand (:mod:`.redis_publish`, as the
        cluster's are), not through the library's ``publish``/``multi``."""
        if self.synapse_seen is not None:
            metrics.COMMANDS_DROPPED.labels("PUBLISH", "synapse_seen").inc(len(lines))
            return
        publisher = self.publisher
        if publisher is None or not publisher.connected or publisher.transport is None:
            return
        payloads, channels = routed(self.layout, lines, channel, self.signer)
        # A refused PUBLISH of a block makes its EXEC fail: EXEC's reply
        # (the last) says whether the block ran.
        replies = write_publishes(publisher, b"PUBLISH", list(zip(channels, payloads)))
        count = len(payloads)
        replies[-1].addCallbacks(self._published, self._publish_failed,
                                 callbackArgs=(publisher, count), errbackArgs=(count,))

    def _published(self, reply: Any, publisher: Any, count: int) -> None:
        # txredisapi hands over error replies and a lost connection as values;
        # EXEC's answer is a list (one subscriber count per PUBLISH).
        if isinstance(reply, list):
            at_rest(publisher)
            failed = [r for r in reply if isinstance(r, Exception)]
            if failed:
                self._publish_failed(Failure(failed[0]), len(failed))
        elif isinstance(reply, Exception):
            self._publish_failed(Failure(reply), count)

    def _publish_failed(self, failure: Failure, count: int = 1) -> None:
        # The facts are in the database: after the reconnect our POSITIONs
        # make every reader catch up.
        metrics.COMMANDS_DROPPED.labels("PUBLISH", "failed").inc(count)
        log.debug("redis: publish failed: {error}", error=failure.getErrorMessage())

    def message_received(self, protocol: Any, channel: str, message: Any) -> None:
        conn = self.conn
        if conn is None or protocol is not self.subscriber:
            # Not registered yet (REPLICATE will catch us up), or buffered
            # data of a subscriber already replaced: its lines belong to a
            # connection that is gone (a half batch must not leak over).
            return
        if self.verifier is not None and not self._on_synapse_channel(channel):
            if not take(self.verifier, channel, message,
                        lambda line: self._heard(conn, channel, line)):
                if self.watch is not None and not is_signed(message):
                    # A Synapse on our channel signs nothing: still seen.
                    cmd = parse_message(text_of(message), self._own_prefixes)
                    if cmd is not None:
                        evidence = self.watch.observe(cmd)
                        if evidence is not None:
                            self._stop_publishing(evidence)
            return
        self._heard(conn, channel, text_of(message))

    def _on_synapse_channel(self, channel: Any) -> bool:
        if self.synapse_channel is None:
            return False
        if isinstance(channel, bytes):
            channel = channel.decode("utf-8", "replace")
        return bool(channel == self.synapse_channel)

    def _heard(self, conn: RedisConnection, channel: Any, message: str) -> None:
        """One line heard (and, on our channels under keys, verified)."""
        cmd = parse_message(message, self._own_prefixes)
        if cmd is None:
            return
        if self.watch is not None:
            evidence = self.watch.observe(cmd)
            if evidence is not None:
                self._stop_publishing(evidence)
            if cmd.NAME == "REPLICATE":
                self._answer_later(conn)  # unless a Synapse shows up first
                return
        if cmd.NAME == "REPLICATE" and self._on_synapse_channel(channel):
            # Synapse's (or its workers'): we own nothing it may ask for.
            metrics.COMMANDS_DROPPED.labels(cmd.NAME, "synapse_channel").inc()
            return
        deliver(self.handler, conn, cmd, message, self.instance_name)

    # ---------------------------------------------------------- keepalive
    def _ping(self) -> None:
        for protocol in (self.subscriber, self.publisher):
            if protocol is not None:
                self._ping_one(protocol)

    def _ping_one(self, protocol: Any) -> None:
        try:
            d = protocol.ping()
        except txredisapi.ConnectionError:
            return  # going away; connectionLost does the rest
        d.addTimeout(self.ping_timeout, self.clock)

        def failed(failure: Failure) -> None:
            if self.clock.seconds() - protocol.last_data < self.ping_timeout:
                return  # busy, not dead: the answer waits behind data still arriving
            # The timeout may run before the reactor reads what waits in the
            # socket (this process was stopped, or its reactor held): judge
            # once it has had a turn to read.
            self.clock.callLater(LATE_CHECK, judge, failure.getErrorMessage())

        def judge(error: str) -> None:
            if self.clock.seconds() - protocol.last_data < self.ping_timeout:
                return
            log.warn("redis: PING failed ({error}); replacing the connection", error=error)
            if protocol.transport is not None:
                protocol.transport.abortConnection()

        d.addErrback(failed)
