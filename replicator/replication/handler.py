"""The command handler: the replication logic shared by every connection.

One handler per instance.  It is the *writer* side for the streams this
instance writes (fan-out of new facts as RDATA/POSITION to every connection)
and the *reader* side for facts written elsewhere (per (stream, writer)
positions, batches, catch-up from the database, consumers), plus the
bookkeeping of the other commands.

Invariants:

* Fan-out: for each local (stream, writer) the rows between the last token
  announced and the writer's current token are read with ``updates_since``,
  encoded once, and the same bytes are written to every connection; rows
  sharing a token form one ``batch`` run written in one call.  An advance
  without rows is a POSITION.  ``announced`` only moves after the lines are
  written, and REPLICATE is answered with ``announced``: a new connection
  never misses a fact and never gets half of one.
* Reader: per (stream, writer) commands are processed one at a time, in
  arrival order; a gap behind a POSITION is fetched from the stream's table
  before anything later; a fact at or below the position is dropped.  So
  consumers see every fact exactly once, in token order per writer, whole.
* Relay (server): RDATA/POSITION from a writer client go to every other
  connection, whole facts only; REPLICATE answers for such writers are never
  below what was already relayed.
"""

import time
from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Optional, Set, Tuple

from twisted.internet import defer, task
from twisted.logger import Logger

from .. import metrics
from ..consumers import Consumer
from ..streams.registry import StreamRegistry
from ..streams.stream import Stream
from .commands import (
    MAX_LINE_LENGTH,
    ClearUserSyncCommand,
    PositionCommand,
    encode_position_line,
    encode_rdata_lines,
)

log = Logger()

Key = Tuple[str, str]
RELAYED_COMMANDS = ("REMOTE_SERVER_UP", "LOCK_RELEASED", "NEW_ACTIVE_TASK", "CANCEL_TASK")


class _ConnState:
    """What the handler keeps per connection."""

    __slots__ = ("replicating", "connected", "batches", "relay_batches", "user_sync_instances",
                 "label", "counters")

    def __init__(self, replicating: bool, label: str):
        self.replicating = replicating  # receives fan-out
        self.label = label  # metrics label: the peer's NAME, "unnamed", "upstream", "redis"
        self.counters: Dict[tuple, Any] = {}  # (direction, command) -> metric child
        self.connected: Set[Key] = set()  # keys with a POSITION seen here
        self.batches: Dict[Key, List[list]] = {}
        self.relay_batches: Dict[Key, List[bytes]] = {}
        self.user_sync_instances: Set[str] = set()


class _Reader:
    """Reader state of one (stream, writer)."""

    __slots__ = ("position", "queue", "busy", "seen")

    def __init__(self, position: Optional[int]):
        self.position = position
        self.queue: Deque[tuple] = deque()
        self.busy = False
        self.seen = position or 0  # largest token the writer announced


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
        clock=None,
        retry_delay: float = 1.0,
        fanout_interval: float = 0.003,
    ):
        self.registry = registry
        self.instance_name = instance_name
        self.server_name = server_name
        self.consumers = list(consumers)
        self.fetch_limit = fetch_limit
        self.max_line_length = max_line_length
        self.retry_delay = retry_delay
        self.fanout_interval = fanout_interval
        if clock is None:
            from twisted.internet import reactor as clock
        self._clock = clock
        self.connections: Dict[Any, _ConnState] = {}
        self._announced: Dict[Key, int] = {}
        self._relayed: Dict[Key, int] = {}
        self._fanout_running: Set[Key] = set()
        self._retries: Dict[tuple, Any] = {}  # pending retry calls, one per job
        self._fanout_timers: Dict[Key, Any] = {}
        self._last_fanout: Dict[Key, float] = {}
        self._readers: Dict[Key, _Reader] = {}
        self._heard: Set[Key] = set()  # read keys a POSITION or RDATA arrived for
        self._started = False
        self._stopping = False
        # USER_SYNC / FEDERATION_ACK / USER_IP bookkeeping (master side).
        self.user_syncs: Dict[str, Dict[Tuple[str, Optional[str]], int]] = {}
        self.federation_acks: Dict[str, int] = {}
        self.user_ips: Dict[Tuple[str, Optional[str]], dict] = {}
        self.listeners: List[Any] = []  # objects with optional on_<NAME>(conn, cmd)

    # ------------------------------------------------------------- startup
    def start(self) -> None:
        """Hook into the streams' generators; call after the registry loaded."""
        if self._started:
            return
        self._started = True
        consumer_positions = [c.positions() for c in self.consumers]
        for stream in self.registry:
            gen = stream.id_gen
            for writer in stream.config.writers:
                key = (stream.name, writer)
                if writer in stream.local_writers:
                    self._announced[key] = gen.get_current_token(writer)
                    stream.keep_recent_facts()
                else:
                    known = [p[key] for p in consumer_positions if key in p]
                    self._readers[key] = _Reader(min(known) if known else None)
            gen.add_listener(self._make_advance_listener(stream))

    def _make_advance_listener(self, stream: Stream):
        def advanced(writer: str, old: int, new: int) -> None:
            if writer in stream.local_writers:
                self._schedule_fanout(stream, writer)
        return advanced

    # ---------------------------------------------------------- connections
    def new_connection(self, conn) -> None:
        client_side = conn.is_client_side
        label = getattr(conn, "metrics_name", None) or ("upstream" if client_side else "unnamed")
        self.connections[conn] = _ConnState(replicating=client_side, label=label)
        metrics.CONNECTIONS.labels(label).inc()
        if client_side:
            # Nobody asks a client for its positions: announce them.
            lines = [
                encode_position_line(s, w, token, token)
                for (s, w), token in self._announced.items()
            ]
            if lines:
                conn.send_lines(lines, "POSITION")

    def lost_connection(self, conn, reason: str) -> None:
        state = self.connections.pop(conn, None)
        metrics.DISCONNECTS.labels(reason).inc()
        if state is None:
            return
        metrics.CONNECTIONS.labels(state.label).dec()
        for instance in state.user_sync_instances:
            self.user_syncs.pop(instance, None)
        # A partial batch dies with its connection.
        state.batches.clear()
        state.relay_batches.clear()

    def conn_label(self, conn) -> str:
        """The connection's metrics label (bounded: names, not addresses)."""
        state = self.connections.get(conn)
        return state.label if state is not None else "unnamed"

    def on_NAME(self, conn, cmd) -> None:
        state = self.connections.get(conn)
        if state is None or state.label == cmd.client_name:
            return
        metrics.CONNECTIONS.labels(state.label).dec()
        state.label = cmd.client_name
        state.counters.clear()
        metrics.CONNECTIONS.labels(state.label).inc()

    def _counter(self, conn, metric, name: str):
        state = self.connections.get(conn)
        if state is None:
            return metric.labels(name, "unnamed")
        key = (metric, name)
        child = state.counters.get(key)
        if child is None:
            child = state.counters[key] = metric.labels(name, state.label)
        return child

    def count_inbound(self, conn, name: str) -> None:
        self._counter(conn, metrics.COMMANDS_IN, name).inc()

    def count_outbound(self, conn, name: str, n: int) -> None:
        self._counter(conn, metrics.COMMANDS_OUT, name).inc(n)

    def count_dropped(self, conn, name: str, n: int) -> None:
        metrics.COMMANDS_DROPPED.labels(name, "too_long").inc(n)

    def client_may_write(self, stream_name: str, instance_name: str) -> bool:
        stream = self.registry.find(stream_name)
        return stream is not None and instance_name in stream.config.writers \
            and instance_name not in stream.local_writers

    def _broadcast(self, lines: List[bytes], name: str, exclude=None,
                   replicating_only: bool = True) -> None:
        for conn, state in list(self.connections.items()):
            if conn is not exclude and (state.replicating or not replicating_only):
                try:
                    conn.send_lines(lines, name)
                except Exception:
                    # One broken connection must not hold up the others.
                    log.failure("Sending {name} to {conn} failed", name=name, conn=conn)

    # ------------------------------------------------------------- fan-out
    def _schedule_fanout(self, stream: Stream, writer: str) -> None:
        """Fan out now, or, if this writer fanned out less than
        ``fanout_interval`` ago, at the end of that interval: under load,
        advances coalesce into fewer, larger writes (fewer syscalls per
        fact); when idle, a fact goes out at once."""
        key = (stream.name, writer)
        if key in self._fanout_running or key in self._fanout_timers or self._stopping:
            return
        wait = self._last_fanout.get(key, -1e9) + self.fanout_interval - self._clock.seconds()
        if wait > 0:
            self._fanout_timers[key] = self._clock.callLater(
                wait, self._start_fanout, stream, writer, key)
        else:
            self._start_fanout(stream, writer, key)

    def _start_fanout(self, stream: Stream, writer: str, key: Key) -> None:
        self._fanout_timers.pop(key, None)
        if key in self._fanout_running or self._stopping:
            return
        self._fanout_running.add(key)
        self._last_fanout[key] = self._clock.seconds()
        defer.ensureDeferred(self._fanout(stream, writer, key))

    async def _fanout(self, stream: Stream, writer: str, key: Key) -> None:
        try:
            while not self._stopping:
                target = stream.id_gen.get_current_token(writer)
                announced = self._announced[key]
                if target <= announced:
                    return
                started = time.monotonic()
                updates, upto, _ = await stream.updates_since(
                    writer, announced, target, self.fetch_limit)
                self.send_updates(stream.name, writer, announced, updates, upto)
                stream.forget(writer, upto)
                metrics.FANOUT_LATENCY.observe(time.monotonic() - started)
        except Exception:
            log.failure("Fan-out of {stream}/{writer} failed; retrying in {delay}s",
                        stream=stream.name, writer=writer, delay=self.retry_delay)
            if key not in self._retries:
                self._retries[key] = self._clock.callLater(
                    self.retry_delay, self._retry_fanout, stream, writer)
        finally:
            self._fanout_running.discard(key)

    def _retry_fanout(self, stream: Stream, writer: str) -> None:
        self._retries.pop((stream.name, writer), None)
        self._schedule_fanout(stream, writer)

    def send_updates(self, stream_name: str, writer: str, prev: int,
                     updates: List[Tuple[int, list]], upto: int) -> None:
        """Write rows ``(prev, upto]`` of a local writer to every connection.

        ``updates`` are ``(token, row)`` pairs in ascending token order.
        """
        key = (stream_name, writer)
        if updates:
            lines = encode_rdata_lines(stream_name, writer, updates, self.max_line_length)
            if lines.dropped:
                metrics.COMMANDS_DROPPED.labels("RDATA", "too_long").inc(lines.dropped)
                log.error("{n} rows of {stream}/{writer} exceed the line length; not sent",
                          n=lines.dropped, stream=stream_name, writer=writer)
            if lines:
                self._broadcast(lines, "RDATA")
            last = updates[-1][0]
        else:
            last = prev
        if upto > last:
            self._broadcast([encode_position_line(stream_name, writer, last, upto)], "POSITION")
        self._announced[key] = upto

    # ----------------------------------------------------------- commands
    def on_REPLICATE(self, conn, cmd) -> None:
        state = self.connections.get(conn)
        if state is None:
            return
        lines = []
        # A hub (TCP server) answers for every writer it knows; a peer on a
        # bus (Redis) only for its own writers: the others answer themselves.
        hub = not conn.is_client_side
        for stream in self.registry:
            for writer in stream.config.writers:
                key = (stream.name, writer)
                if key in self._announced:
                    token = self._announced[key]
                elif not hub:
                    continue
                else:
                    token = max(self._relayed.get(key, 0),
                                stream.id_gen.get_current_token(writer))
                lines.append(encode_position_line(stream.name, writer, token, token))
        state.replicating = True
        if lines:
            conn.send_lines(lines, "POSITION")

    def on_RDATA(self, conn, cmd) -> None:
        state = self.connections.get(conn)
        if state is None:
            return
        key = (cmd.stream_name, cmd.instance_name)
        if key not in self._readers:
            metrics.COMMANDS_DROPPED.labels("RDATA", "unknown_stream").inc()
            log.debug("Ignoring RDATA for {key} (not a stream writer we read)", key=key)
            return
        self._heard.add(key)
        if not conn.is_client_side:
            # From a writer client: relay whole facts to everyone else.
            pending = state.relay_batches.setdefault(key, [])
            pending.append((cmd.to_line() + "\n").encode("utf-8"))
            if cmd.token is not None:
                del state.relay_batches[key]
                self._relayed[key] = max(self._relayed.get(key, 0), cmd.token)
                self._broadcast(pending, "RDATA", exclude=conn)
        if cmd.token is None:
            state.batches.setdefault(key, []).append(cmd.row)
            return
        rows = state.batches.pop(key, [])
        rows.append(cmd.row)
        reader = self._readers[key]
        if cmd.token > reader.seen:
            reader.seen = cmd.token
        if key not in state.connected:
            return  # the POSITION that follows makes us catch up
        self._enqueue(key, ("rdata", cmd.token, rows))

    def on_POSITION(self, conn, cmd: PositionCommand) -> None:
        state = self.connections.get(conn)
        if state is None:
            return
        key = (cmd.stream_name, cmd.instance_name)
        if key not in self._readers:
            if key not in self._announced:
                metrics.COMMANDS_DROPPED.labels("POSITION", "unknown_stream").inc()
            return
        self._heard.add(key)
        if not conn.is_client_side:
            self._relayed[key] = max(self._relayed.get(key, 0), cmd.new_token)
            self._broadcast([(cmd.to_line() + "\n").encode("utf-8")], "POSITION", exclude=conn)
        state.connected.add(key)
        reader = self._readers[key]
        if cmd.new_token > reader.seen:
            reader.seen = cmd.new_token
        self._enqueue(key, ("position", cmd.prev_token, cmd.new_token))

    def on_USER_SYNC(self, conn, cmd) -> None:
        syncing = self.user_syncs.setdefault(cmd.instance_id, {})
        user = (cmd.user_id, cmd.device_id)
        if cmd.is_syncing:
            syncing[user] = cmd.last_sync_ms
        else:
            syncing.pop(user, None)
        state = self.connections.get(conn)
        if state is not None:
            state.user_sync_instances.add(cmd.instance_id)
        self._notify(conn, cmd)

    def on_CLEAR_USER_SYNC(self, conn, cmd) -> None:
        self.user_syncs.pop(cmd.instance_id, None)
        self._notify(conn, cmd)

    def on_FEDERATION_ACK(self, conn, cmd) -> None:
        self.federation_acks[cmd.instance_name] = cmd.token
        self._notify(conn, cmd)

    def on_USER_IP(self, conn, cmd) -> None:
        self.user_ips[(cmd.user_id, cmd.device_id)] = {
            "access_token_seen": True, "ip": cmd.ip, "user_agent": cmd.user_agent,
            "last_seen": cmd.last_seen,
        }
        self._notify(conn, cmd)

    def _relay(self, conn, cmd) -> None:
        if not conn.is_client_side:
            self._broadcast([(cmd.to_line() + "\n").encode("utf-8")], cmd.NAME, exclude=conn,
                            replicating_only=False)
        self._notify(conn, cmd)

    on_REMOTE_SERVER_UP = on_LOCK_RELEASED = on_NEW_ACTIVE_TASK = on_CANCEL_TASK = _relay

    def _notify(self, conn, cmd) -> None:
        for listener in self.listeners:
            method = getattr(listener, "on_" + cmd.NAME, None)
            if method is not None:
                method(conn, cmd)

    # --------------------------------------------------------------- reader
    def _enqueue(self, key: Key, item: tuple) -> None:
        reader = self._readers[key]
        reader.queue.append(item)
        if not reader.busy:
            reader.busy = True
            defer.ensureDeferred(self._drain(key, reader))

    async def _drain(self, key: Key, reader: _Reader) -> None:
        stream = self.registry.get(key[0])
        writer = key[1]
        try:
            while reader.queue and not self._stopping:
                item = reader.queue[0]
                try:
                    await self._apply(stream, writer, reader, item)
                except _Stopping:
                    return
                except Exception:
                    log.failure("Processing {kind} of {stream}/{writer} failed; retrying in "
                                "{delay}s", kind=item[0], stream=key[0], writer=writer,
                                delay=self.retry_delay)
                    self._retries[key + ("reader",)] = self._clock.callLater(
                        self.retry_delay, self._resume, key)
                    return
                reader.queue.popleft()
        finally:
            if not reader.queue or self._stopping:
                reader.busy = False
            metrics.READER_LAG.labels(*key).set(max(0, reader.seen - (reader.position or 0)))

    def _resume(self, key: Key) -> None:
        self._retries.pop(key + ("reader",), None)
        reader = self._readers[key]
        reader.busy = False
        if reader.queue:
            reader.busy = True
            defer.ensureDeferred(self._drain(key, reader))

    async def _apply(self, stream: Stream, writer: str, reader: _Reader, item: tuple) -> None:
        kind = item[0]
        if kind == "rdata":
            _, token, rows = item
            if reader.position is not None and token <= reader.position:
                return  # already handled
            await self._deliver(stream.name, writer, token, rows)
            self._advance(stream, writer, reader, token)
            return
        _, prev, new = item
        position = reader.position
        if position is None or prev <= position <= new:
            pass
        elif position > new:
            return  # stale
        else:
            await self._catch_up(stream, writer, reader, position, new)
        if reader.position is None or new > reader.position:
            self._advance(stream, writer, reader, new)
            for consumer in self._consumers_for(stream.name):
                await _maybe_await(consumer.on_position(stream.name, writer, new))

    async def _catch_up(self, stream: Stream, writer: str, reader: _Reader,
                        since: int, until: int) -> None:
        metrics.CATCHUP_FETCHES.labels(stream.name).inc()
        log.info("Catching up {stream}/{writer} from {since} to {until}",
                 stream=stream.name, writer=writer, since=since, until=until)
        while since < until:
            updates, upto, _ = await stream.updates_since(writer, since, until, self.fetch_limit)
            metrics.CATCHUP_ROWS.labels(stream.name).inc(len(updates))
            for token, rows in _group(updates):
                await self._deliver(stream.name, writer, token, rows)
                self._advance(stream, writer, reader, token)
            since = upto

    def _advance(self, stream: Stream, writer: str, reader: _Reader, token: int) -> None:
        reader.position = token
        gen = stream.id_gen
        if writer not in stream.local_writers:
            gen.advance(writer, token)

    def _consumers_for(self, stream_name: str):
        return [c for c in self.consumers if c.streams is None or stream_name in c.streams]

    async def _deliver(self, stream_name: str, writer: str, token: int, rows: List[list]) -> None:
        if self._stopping:
            raise _Stopping()
        for consumer in self._consumers_for(stream_name):
            await _maybe_await(consumer.on_facts(stream_name, writer, token, rows))

    def reader_positions(self) -> Dict[Key, Optional[int]]:
        return {key: r.position for key, r in self._readers.items()}

    def reader_heard(self) -> Set[Key]:
        """The (stream, writer) keys read here that a POSITION or RDATA has
        arrived for since start (from any connection)."""
        return set(self._heard)

    def reader_lag(self) -> Dict[Key, int]:
        return {key: max(0, r.seen - (r.position or 0)) for key, r in self._readers.items()}

    def announced_positions(self) -> Dict[Key, int]:
        return dict(self._announced)

    async def drain(self, timeout: float = 10.0) -> bool:
        """Wait until no fan-out or reader work is running (at shutdown)."""
        waited = 0.0
        while not self.idle() and waited < timeout:
            await task.deferLater(self._clock, 0.01, lambda: None)
            waited += 0.01
        return self.idle()

    def idle(self) -> bool:
        """Nothing queued for any reader and no fan-out running."""
        return not self._fanout_running and not self._fanout_timers and not any(
            r.busy or r.queue for r in self._readers.values())

    # ------------------------------------------------------------- shutdown
    def stop(self, reason: str = "server stopping") -> None:
        """Tell every peer we are going: servers send ERROR, clients send
        CLEAR_USER_SYNC, then every connection closes."""
        self._stopping = True
        for call in list(self._retries.values()) + list(self._fanout_timers.values()):
            if call.active():
                call.cancel()
        self._retries.clear()
        self._fanout_timers.clear()
        for conn in list(self.connections):
            if conn.is_client_side:
                conn.send_command(ClearUserSyncCommand(self.instance_name))
            conn.stop(reason)


class _Stopping(Exception):
    """Raised inside reader work once the handler is stopping."""


def _group(updates: List[Tuple[int, list]]):
    """``(token, rows)`` per fact from ``(token, row)`` pairs."""
    current = None
    rows: List[list] = []
    for token, row in updates:
        if token != current and rows:
            yield current, rows
            rows = []
        current = token
        rows.append(row)
    if rows:
        yield current, rows


async def _maybe_await(result):
    if isinstance(result, defer.Deferred) or hasattr(result, "__await__"):
        return await result
    return result
