"""The command handler: what every connection of one instance calls into.

One handler per instance.  It keeps the connections (labels, metrics, who
receives fan-out) and dispatches commands to the parts that do the work:

* :mod:`.admission` — what a peer's RDATA/POSITION must satisfy before
  anything acts on them (tokens within the stream's sequence, rows that fit
  the stream, bounded partial batches);
* :mod:`.fanout` — the writer side: facts of this instance's writers as
  RDATA/POSITION to every connection;
* :mod:`.reader` — per (stream, writer) written elsewhere: exactly once, in
  order, whole facts to the consumers, gaps caught up from the table;
* :mod:`.delivery` — a reader's facts and positions to the consumers;
* :mod:`.relay` — on a TCP server, writer clients' facts to everyone else;
* :mod:`.connections` — the open connections, their metrics labels, the
  last disconnects, and writing lines to many of them;
* :mod:`.bookkeeping` — USER_SYNC, CLEAR_USER_SYNC, FEDERATION_ACK, USER_IP.

The interface the transports use is :class:`.interfaces.IReplicationHandler`
(``new_connection``, ``lost_connection``, ``count_*``, ``client_may_write``
and one ``on_<NAME>(conn, cmd)`` per command handled); a connection is an
:class:`.interfaces.IReplicationConnection`.  Relayed lines are the bytes
received (``conn.current_line``), never a re-encoding.

* :mod:`.audit_kept` — the audit's findings kept in the database across
  a restart.

(One job: it is the one surface the protocols call, one short
``on_<NAME>`` per command; every part with state of its own is in one of
the modules above.)
"""

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import (
    Any,
)

from twisted.internet import defer, task
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from ...background import Background
from ...consumers import Consumer
from ...keys import Key
from ...observe import metrics
from ...observe.health import Finding
from ...streams.registry import StreamRegistry
from ...streams.stream import Stream
from ...streams.trimmed import FactsTrimmed
from ..interfaces import (
    INVALID_COMMAND,
    REFUSED,
    ConnectionSeen,
    Disconnect,
    IPeerConnection,
    IReplicationConnection,
    IReplicationHandler,
    IReplicationView,
    metrics_label,
)
from ..wire.commands import (
    ClearUserSyncCommand,
    Command,
    FederationAckCommand,
    NameCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    ReplicateCommand,
    UserIpCommand,
    UserSyncCommand,
)
from ..wire.encoding import MAX_LINE_LENGTH, encode_position_line
from . import audit_kept
from .admission import MAX_BATCH_BYTES, MAX_BATCH_ROWS, Admission
from .audit import Auditor, Mismatch
from .bookkeeping import Bookkeeping
from .connections import Connections
from .delivery import consumers_for, make_reader, rewire
from .fanout import Fanout
from .gaps import TrimGaps
from .reader import Reader
from .relay import Relay

log = Logger()



@implementer(IReplicationHandler, IReplicationView)
class ReplicationHandler:
    """Replication logic of one instance; protocols call into it.

    ``is_server`` says whether connections are accepted here (relays happen
    only there).  ``consumers`` receive facts of other instances' writers.
    """

    def __init__(
        self,
        registry: StreamRegistry,
        instance_name: str,
        server_name: str,
        consumers: Iterable[Consumer] = (),
        fetch_limit: int = 1000,
        max_line_length: int = MAX_LINE_LENGTH,
        clock: IReactorTime | None=None,
        retry_delay: float = 1.0,
        fanout_interval: float = 0.003,
        max_batch_rows: int = MAX_BATCH_ROWS,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        known_names: Iterable[str] = (),
        max_user_syncs: int = 50_000,
        max_user_ips: int = 20_000,
        max_federation_acks: int = 1_000,
        bookkeeping_max_age: float = 86_400.0,
        audit: bool = True,
        audit_recheck: float = 300.0,
    ) -> None:
        self.registry = registry
        self.instance_name = instance_name
        self.server_name = server_name
        self.consumers = list(consumers)
        self.fetch_limit = fetch_limit
        self.max_line_length = max_line_length
        self.retry_delay = retry_delay
        self.fanout_interval = fanout_interval
        if clock is None:  # the registry's reactor, which its streams use
            clock = registry.reactor
        self._clock = clock
        self.connections = Connections(clock)
        self._broadcast = self.connections.broadcast
        self.background = Background()  # fan-outs and reader pipelines running
        self.fanout = Fanout(
            self._broadcast, clock, fetch_limit=fetch_limit, max_line_length=max_line_length,
            retry_delay=retry_delay, fanout_interval=fanout_interval,
            max_batch_rows=max_batch_rows,
            max_batch_bytes=max_batch_bytes, background=self.background)
        self.relay = Relay(self._broadcast)
        self.admission = Admission(
            registry, self._admitted, self._inadmissible, clock, max_batch_rows=max_batch_rows,
            max_batch_bytes=max_batch_bytes, retry_delay=retry_delay, stale=self._stale_batch)
        self._refusals_logged: dict[Any, set[str]] = {}  # conns that cannot be closed
        # Names the configuration knows: metrics are labelled only by these.
        self.known_names = frozenset(known_names) | {instance_name} | {
            writer for stream in registry for writer in stream.config.writers}
        self.bookkeeping = Bookkeeping(
            clock, self.known_names, max_user_syncs=max_user_syncs, max_user_ips=max_user_ips,
            max_federation_acks=max_federation_acks, max_age=bookkeeping_max_age)
        self._readers: dict[Key, Reader] = {}
        self.gaps = TrimGaps()  # streams stopped: facts trimmed, or not what the table holds
        #: The delivery audit of every reader (a service: the daemon starts it).
        self.audit = audit
        self.auditor = Auditor(self.audited, self._mismatch, clock, recheck=audit_recheck)
        self._heard: dict[Key, float] = {}  # read key -> when its last POSITION/RDATA came
        self._started = False
        self._stopping = False
        self.listeners: list[Any] = []  # objects with optional on_<NAME>(conn, cmd)

    # ------------------------------------------------------------- startup
    def start(self) -> None:
        """Hook into the streams' generators; call after the registry loaded."""
        if self._started:
            return
        self._started = True
        consumer_positions = [c.positions() for c in self.consumers]
        for stream in self.registry:
            self._start_stream(stream, consumer_positions)

    def _start_stream(self, stream: Stream, consumer_positions: Any, reload: bool = False) -> None:
        for writer in stream.config.writers:
            if writer in stream.local_writers:
                self.fanout.add_writer(stream, writer)
            else:
                self._add_reader(stream, writer, consumer_positions, reload)
        stream.id_gen.add_listener(self._make_advance_listener(stream))

    def _add_reader(self, stream: Stream, writer: str, consumer_positions: Any,
                    reload: bool = False) -> None:
        """The reader of ``writer`` on ``stream``, from the consumers'
        smallest position for it; without one, from where the writer's
        first POSITION says at a start, and at a reload from its position
        loaded from the table (the facts it wrote before this instance read
        it are caught up, not skipped)."""
        key = (stream.name, writer)
        known = [p[key] for p in consumer_positions if key in p]
        position = min(known) if known else (
            stream.id_gen.get_current_token(writer) if reload else None)
        reader = self._readers[key] = self._make_reader(stream, writer, position)
        reader.pause()  # not running yet: each consumer's start set (start: beginning|now)
        rewire(reader, self.consumers, self.consumers, stream.trimmed_through,
               stream.id_gen.get_current_token(writer))
        reader.resume()
        if self.gaps.stopped(stream.name):
            reader.stop()  # a writer added at a reload to a stream stopped by a gap

    # -------------------------------------------------------------- reload
    def stream_added(self, stream: Stream) -> None:
        """A stream new at a reload (already in the registry and loaded):
        its local writers fanned out, the others read."""
        self._start_stream(stream, [c.positions() for c in self.consumers], reload=True)
        self._know(frozenset(stream.config.writers))
        self._announce(stream, stream.local_writers)
        if any(w not in stream.local_writers for w in stream.config.writers):
            self._ask_positions()

    def writers_changed(self, stream: Stream, old_writers: Sequence[str]) -> None:
        """``stream`` took a config whose other-instance writers differ from
        ``old_writers``: a reader for each one added (from the consumers'
        positions), the reader of each one dropped stopped."""
        positions = [c.positions() for c in self.consumers]
        added = [w for w in stream.config.writers
                 if w not in old_writers and w not in stream.local_writers]
        for writer in added:
            self._add_reader(stream, writer, positions, reload=True)
        if added:
            self._ask_positions()
        for writer in old_writers:
            if writer not in stream.config.writers:
                reader = self._readers.pop((stream.name, writer), None)
                if reader is not None:
                    reader.stop()
                self._heard.pop((stream.name, writer), None)
        self._know(frozenset(stream.config.writers))

    async def pause_readers(self) -> None:
        """Hold every reader between two facts (a reload changing the
        consumers); :meth:`resume_readers` goes on."""
        await defer.gatherResults([r.pause() for r in self._readers.values()],
                                  consumeErrors=True)

    def set_consumers(self, consumers: Iterable[Consumer], started: Iterable[Consumer]) -> None:
        """The (paused) readers hand facts to ``consumers`` from now on;
        each of ``started`` from its own persisted position
        (:func:`.delivery.rewire`), the others from where they are."""
        self.consumers = list(consumers)
        started = list(started)
        for reader in self._readers.values():
            stream = self.registry.get(reader.stream_name)
            rewire(reader, self.consumers, started, stream.trimmed_through,
                   stream.id_gen.get_current_token(reader.writer))

    def resume_readers(self) -> None:
        for reader in self._readers.values():
            reader.resume()

    def _announce(self, stream: Stream, writers: Sequence[str]) -> None:
        """POSITION of ``writers`` (local) to every connection receiving
        fan-out: a peer's reader added at a reload starts from it."""
        lines = [encode_position_line(stream.name, w, token, token)
                 for w in writers
                 for token in (self.fanout.announced.get((stream.name, w), 0),)]
        if lines:
            self._broadcast(lines, "POSITION")

    def _ask_positions(self) -> None:
        """``REPLICATE`` again on every connection this instance made (its
        upstream, its Redis link): the answer's POSITIONs start the readers
        a reload added.  Connections accepted here get POSITIONs from their
        writers as those reload (:meth:`_announce`)."""
        for conn in list(self.connections):
            if not conn.accepted:
                conn.send_command(ReplicateCommand())

    def _know(self, names: AbstractSet[str]) -> None:
        """Names the configuration now knows label metrics too."""
        self.known_names = self.known_names | frozenset(names)
        self.bookkeeping.known_names = self.known_names

    def _make_reader(self, stream: Stream, writer: str, position: int | None) -> Reader:
        return make_reader(stream, writer, position, self.consumers, clock=self._clock,
                           fetch_limit=self.fetch_limit, retry_delay=self.retry_delay,
                           background=self.background, on_gap=self._trimmed,
                           on_mismatch=self._mismatch, audit=self.audit,
                           current=lambda: self.consumers)

    def audited(self) -> dict[Key, tuple[Stream, Reader]]:
        """Every reader with its stream, by (stream, writer): what the
        audit (:attr:`auditor`) checks."""
        return {key: (self.registry.get(key[0]), reader)
                for key, reader in self._readers.items()}

    def _mismatch(self, found: Mismatch, kept: bool = False) -> None:
        """What a reader handed on differs from the table (:mod:`.audit`):
        the whole stream stops here, like at a retention gap, and the
        finding is kept in the database for the next start (unless it
        came from there: ``kept``)."""
        if self.gaps.mismatch(found.stream, found.writer) is not None:
            return
        self.gaps.report_mismatch(found, consumers_for(self.consumers, found.stream))
        for (stream, _), reader in self._readers.items():
            if stream == found.stream:
                reader.stop()
        if not kept:
            self.background.run("audit finding", audit_kept.keep(
                self.registry.db, self.instance_name, found, self._clock))

    async def load_findings(self) -> None:
        """Before :meth:`start`: the audit's findings kept by an earlier run
        of this instance stop their streams again, or are dropped
        (:func:`.audit_kept.load`)."""
        await audit_kept.load(self.registry, self.instance_name, self.consumers,
                              lambda found: self._mismatch(found, kept=True))

    def _trimmed(self, gap: FactsTrimmed) -> None:
        """A reader needs facts retention trimmed: the whole stream stops
        here (every reader of it), skipping nothing (:mod:`.gaps`)."""
        self.gaps.report(gap, consumers_for(self.consumers, gap.stream))
        for (stream, _), reader in self._readers.items():
            if stream == gap.stream:
                reader.stop()

    def _make_advance_listener(self, stream: Stream) -> Callable[[str, int, int], None]:
        def advanced(writer: str, old: int, new: int) -> None:
            if writer in stream.local_writers and not self._stopping:
                self.fanout.advanced(stream, writer)
        return advanced

    # ---------------------------------------------------------- connections
    def new_connection(self, conn: IReplicationConnection) -> None:
        # Nobody asks an upstream or a bus for our positions: announce them,
        # unless the connection holds our writes back for now (a proof of
        # our NAME may be asked for first: writes_released comes then).
        announce = not conn.accepted and not getattr(conn, "writes_held", False)
        label = "unnamed" if conn.role == "client" else conn.role  # named at its NAME
        self.connections.add(conn, replicating=announce, label=label)
        if announce:
            self._announce_to(conn)

    def writes_released(self, conn: IReplicationConnection) -> None:
        """An upstream that held our writes back takes them now: our
        positions first (readers there catch up on what went meanwhile),
        then the fan-out."""
        state = self.connections.get(conn)
        if state is None or state.replicating:
            return
        state.replicating = True
        self._announce_to(conn)

    def _announce_to(self, conn: IReplicationConnection) -> None:
        """Our positions, to an upstream or a bus (nobody asks there)."""
        lines = [
            encode_position_line(s, w, token, token)
            for (s, w), token in self.fanout.announced.items()
        ]
        if lines:
            conn.send_lines(lines, "POSITION")

    def lost_connection(self, conn: IReplicationConnection, reason: str) -> None:
        if self.connections.remove(conn, reason) is None:
            return
        self.bookkeeping.connection_lost(conn)
        self._refusals_logged.pop(conn, None)
        self._drop_partial(conn)

    def _drop_partial(self, conn: IReplicationConnection) -> None:
        """A partial batch dies with its connection (or its refusal)."""
        self.admission.connection_lost(conn)
        self.relay.connection_lost(conn)
        for reader in self._readers.values():
            reader.connection_lost(conn)

    # ------------------------------------------------ what observers see
    def open_connections(self) -> list[ConnectionSeen]:
        return self.connections.seen()

    def last_lost(self, name: str) -> float | None:
        return self.connections.last_lost.get(name)

    def recent_disconnects(self) -> list[Disconnect]:
        return self.connections.disconnects()

    def findings(self) -> list[Finding]:
        return self.gaps.findings()

    def bookkeeping_samples(self) -> list[metrics.Sample]:
        return self.bookkeeping.metric_samples()

    def on_NAME(self, conn: IReplicationConnection, cmd: NameCommand) -> None:
        if conn not in self.connections:
            return
        self.bookkeeping.named(conn, cmd.client_name)
        self.connections.relabel(conn, metrics_label(cmd.client_name, self.known_names))

    def count_inbound(self, conn: IReplicationConnection, name: str) -> None:
        self.connections.counter(conn, metrics.COMMANDS_IN, name).inc()

    def count_outbound(self, conn: IReplicationConnection, name: str, n: int) -> None:
        self.connections.counter(conn, metrics.COMMANDS_OUT, name).inc(n)

    def count_dropped(self, conn: IReplicationConnection, name: str, n: int) -> None:
        metrics.COMMANDS_DROPPED.labels(name, "too_long").inc(n)

    def client_may_write(self, stream_name: str, instance_name: str) -> bool:
        stream = self.registry.find(stream_name)
        return stream is not None and instance_name in stream.config.writers \
            and instance_name not in stream.local_writers

    # ----------------------------------------------------------- commands
    def on_REPLICATE(self, conn: IReplicationConnection, cmd: ReplicateCommand) -> None:
        state = self.connections.get(conn)
        if state is None:
            return
        lines = []
        announced = self.fanout.announced
        relayed = self.relay.relayed
        # A hub (TCP server) answers for every writer it knows; a peer on a
        # bus (Redis) only for its own writers: the others answer themselves.
        hub = conn.accepted
        for stream in self.registry:
            for writer in stream.config.writers:
                key = (stream.name, writer)
                if key in announced:
                    token = announced[key]
                elif not hub:
                    continue
                else:
                    token = max(relayed.get(key, 0), stream.id_gen.get_current_token(writer))
                lines.append(encode_position_line(stream.name, writer, token, token))
        state.replicating = True
        if lines:
            conn.send_lines(lines, "POSITION")

    def on_RDATA(self, conn: IReplicationConnection, cmd: RdataCommand) -> None:
        if conn not in self.connections:
            return
        key = (cmd.stream_name, cmd.instance_name)
        reader = self._readers.get(key)
        if reader is None:
            metrics.COMMANDS_DROPPED.labels("RDATA", "unknown_stream").inc()
            log.debug("Ignoring RDATA for {key} (not a stream writer we read)", key=key)
            return
        self.admission.offer(conn, self.registry.get(key[0]), key, cmd, _wire_line(conn, cmd))

    def on_POSITION(self, conn: IReplicationConnection, cmd: PositionCommand) -> None:
        if conn not in self.connections:
            return
        key = (cmd.stream_name, cmd.instance_name)
        reader = self._readers.get(key)
        if reader is None:
            if key not in self.fanout.announced:
                metrics.COMMANDS_DROPPED.labels("POSITION", "unknown_stream").inc()
            return
        self.admission.offer(conn, self.registry.get(key[0]), key, cmd, _wire_line(conn, cmd))

    def _admitted(self, conn: IReplicationConnection, key: Key, cmd: Any,
                  line: bytes | None) -> None:
        """An RDATA/POSITION that :mod:`.admission` let through."""
        if conn not in self.connections:
            return
        reader = self._readers.get(key)
        if reader is None:  # a reload dropped the writer while the line waited
            metrics.COMMANDS_DROPPED.labels(cmd.NAME, "unknown_stream").inc()
            return
        self._heard[key] = self._clock.seconds()
        relay = conn.accepted  # from a writer client: to everyone else
        if cmd.NAME == "RDATA":
            # Only what this instance takes is passed on: RDATA before the
            # writer's POSITION on this connection is neither (the POSITION
            # relayed next makes everyone read the table).
            if relay and line is not None and reader.positioned(conn):
                self.relay.rdata(conn, key, cmd.token, line)
            if cmd.token is None and line is not None:
                # A partial batch is held as its lines (the relay's bytes,
                # shared): parsed, a row can take 20 times its line.
                reader.rdata(conn, None, line)
            else:
                reader.rdata(conn, cmd.token, cmd.row)
        else:
            if relay and line is not None:
                self.relay.position(conn, key, cmd.new_token, line)
            reader.position_line(conn, cmd.prev_token, cmd.new_token)

    def _stale_batch(self, conn: IReplicationConnection, key: Key) -> None:
        """A later line of the writer on ``conn`` shows that its partial
        batch of ``key`` there lost its end (:mod:`.admission`)."""
        self.relay.drop_batch(conn, key)
        reader = self._readers.get(key)
        if reader is not None:
            reader.drop_batch(conn)

    def _inadmissible(self, conn: IReplicationConnection, key: Key, reason: str,
                      text: str) -> None:
        """A peer's RDATA/POSITION that cannot be true: counted, never acted
        on.  One peer's connection (TCP: :class:`.interfaces.IPeerConnection`)
        is closed with ``ERROR`` (one log line) and what it held is dropped.
        On a bus (Redis) there is no one peer to close: the line is dropped
        with that writer's partial batch, logged the first time per reason
        and counted every time."""
        metrics.INBOUND_REFUSED.labels(key[0], reason).inc()
        if IPeerConnection.providedBy(conn):
            conn.close(INVALID_COMMAND, text, log_text=text)
            self._drop_partial(conn)
            return
        self.relay.drop_batch(conn, key)
        self._readers[key].drop_batch(conn)
        logged = self._refusals_logged.setdefault(conn, set())
        if reason not in logged:
            logged.add(reason)
            log.warn("Refused from {conn}: {text} (further refusals of this kind are only "
                     "counted: replicator_inbound_refused_total)", conn=conn, text=text)

    def on_USER_SYNC(self, conn: IReplicationConnection, cmd: UserSyncCommand) -> None:
        if not self._refused(conn, cmd, self.bookkeeping.user_sync(
                conn, cmd, track=conn in self.connections)):
            self._notify(conn, cmd)

    def on_CLEAR_USER_SYNC(self, conn: IReplicationConnection, cmd: ClearUserSyncCommand) -> None:
        if not self._refused(conn, cmd, self.bookkeeping.clear_user_sync(conn, cmd)):
            self._notify(conn, cmd)

    def on_FEDERATION_ACK(self, conn: IReplicationConnection, cmd: FederationAckCommand) -> None:
        if not self._refused(conn, cmd, self.bookkeeping.federation_ack(conn, cmd)):
            self._notify(conn, cmd)

    def on_USER_IP(self, conn: IReplicationConnection, cmd: UserIpCommand) -> None:
        if not self._refused(conn, cmd, self.bookkeeping.user_ip(conn, cmd)):
            self._notify(conn, cmd)

    def on_PING(self, conn: IReplicationConnection, cmd: PingCommand) -> None:
        # Every peer PINGs every few seconds: old bookkeeping goes meanwhile.
        self.bookkeeping.expire()

    def _refused(self, conn: IReplicationConnection, cmd: Any, why: str | None) -> bool:
        """If ``why``: the peer may not do ``cmd``; ``ERROR why`` and close
        (one peer's connection; a bus goes on: the command is dropped)."""
        if why is None:
            return False
        metrics.COMMANDS_DROPPED.labels(cmd.NAME, "refused").inc()
        log.warn("Refusing {command} from {conn}: {why}", command=cmd.NAME, conn=conn, why=why)
        if IPeerConnection.providedBy(conn):
            conn.close(REFUSED, why)
        return True

    def _relay(self, conn: IReplicationConnection, cmd: Any) -> None:
        if conn.accepted:
            line = _wire_line(conn, cmd)
            if line is None or len(line) > self.max_line_length + 1:
                metrics.COMMANDS_DROPPED.labels(cmd.NAME, "too_long").inc()
            else:
                self._broadcast([line], cmd.NAME, exclude=conn, replicating_only=False)
        self._notify(conn, cmd)

    on_REMOTE_SERVER_UP = on_LOCK_RELEASED = on_NEW_ACTIVE_TASK = on_CANCEL_TASK = _relay

    def _notify(self, conn: IReplicationConnection, cmd: Any) -> None:
        for listener in self.listeners:
            method = getattr(listener, "on_" + cmd.NAME, None)
            if method is not None:
                method(conn, cmd)

    # ---------------------------------------------------------- bookkeeping
    @property
    def user_syncs(self) -> dict[str, dict[tuple[str, str | None], int]]:
        return self.bookkeeping.user_syncs

    @property
    def federation_acks(self) -> dict[str, int]:
        return self.bookkeeping.federation_acks

    @property
    def user_ips(self) -> dict[Any, dict[Any, Any]]:
        return self.bookkeeping.user_ips

    # -------------------------------------------------------------- state
    def reader_positions(self) -> dict[Key, int | None]:
        return {key: r.position for key, r in self._readers.items()}

    def reader_heard(self) -> set[Key]:
        """The (stream, writer) keys read here that a POSITION or RDATA has
        arrived for since start (from any connection)."""
        return set(self._heard)

    def reader_heard_at(self) -> dict[Key, float]:
        """When the last POSITION or RDATA of each read key arrived (clock
        seconds; a key never heard is absent)."""
        return dict(self._heard)

    def reader_lag(self) -> dict[Key, int]:
        return {key: r.lag for key, r in self._readers.items()}

    def announced_positions(self) -> dict[Key, int]:
        return dict(self.fanout.announced)

    async def drain(self, timeout: float = 10.0) -> bool:
        """Wait until no fan-out or reader work is running or scheduled (at
        shutdown), at most ``timeout`` seconds on the clock; whether it is so."""
        deadline = self._clock.seconds() + timeout
        while not self.idle():
            left = deadline - self._clock.seconds()
            if left <= 0:
                break
            if self.background.running:
                await self.background.wait(self._clock, left)
            else:  # only timers (a fan-out interval, a sequence read): look again soon
                await task.deferLater(self._clock, min(left, 0.01), lambda: None)
        return self.idle()

    def idle(self) -> bool:
        """Nothing queued for any reader, no claim waiting for a check, and
        no fan-out running."""
        return self.fanout.idle() and self.admission.idle() and all(
            r.idle() for r in self._readers.values())

    # ------------------------------------------------------------- shutdown
    def stop(self, reason: str = "server stopping") -> None:
        """Tell every peer we are going: servers send ERROR, clients send
        CLEAR_USER_SYNC, then every connection closes."""
        self._stopping = True
        self.fanout.stop()
        self.admission.stop()
        for reader in self._readers.values():
            reader.stop()
        for conn in list(self.connections):
            if not conn.accepted:
                conn.send_command(ClearUserSyncCommand(self.instance_name))
            conn.stop(reason)


def _wire_line(conn: IReplicationConnection, cmd: Command) -> bytes | None:
    """The line as received (newline included): ``conn.current_line`` while
    the command is dispatched.  Without it, the command re-encoded, or None
    if it cannot be encoded as UTF-8 (a lone surrogate)."""
    line: bytes | None = conn.current_line
    if line is not None:
        return line + b"\n"
    try:
        return (cmd.to_line() + "\n").encode("utf-8")
    except (UnicodeEncodeError, TypeError, ValueError):
        return None

