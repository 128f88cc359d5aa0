"""One replication connection below the commands: framing, the outbound
queue and congestion, keepalive, and closing.

:class:`LineConnection` is the base of :class:`.protocol.ReplicationProtocol`.
It splits inbound bytes into lines (``lineReceived`` is the subclass's),
writes outbound lines in order (queued while the transport is paused, up to
a bound), PINGs when nothing else was written for ``ping_interval``, closes
a silent or idle peer (or one dribbling bytes of a line it never
finishes), and closes with ``ERROR`` first.

Invariants: a line longer than ``max_line_length`` (not counting one
trailing ``\\r``) is never dispatched, nor written by :meth:`send_command`;
outbound order is the order of the ``send_*`` calls; once the connection is
closing nothing more is written or dispatched; the queue never holds more
than ``max_queued_lines`` lines or ``max_queued_bytes`` bytes (past that the
peer is closed for congestion); every byte from the peer counts as a sign
of life against the ping timeout, but only a whole command against the idle
timeout; every timeout that closes a peer tells it why (``ERROR``) and logs
one line naming it.
"""

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from zope.interface import implementer

from ...logs.printable import printable
from ..interfaces import (
    CONGESTION,
    IDLE_TIMEOUT_REASON,
    LATE_CHECK,
    LINE_TOO_LONG,
    PING_TIMEOUT_REASON,
    SHUTDOWN,
    IReplicationHandler,
)
from ..wire.commands import Command, ErrorCommand, PingCommand
from ..wire.encoding import MAX_LINE_LENGTH, joined

#: Send a PING when nothing else was written for this long (seconds).
PING_INTERVAL = 5.0
#: Close a peer silent this long (seconds): an upstream server from connect
#: on (it sends SERVER and PING at once), a client once it has PINGed.
PING_TIMEOUT = 15.0
#: Close a peer that has sent no whole command for this long (seconds): on
#: the server side a client that never PINGs (netcat); on either side, with
#: at least ``ping_timeout``, a peer that dribbles bytes of a line.
IDLE_TIMEOUT = 60.0
#: Lines queued while the transport is paused before giving up on the peer.
MAX_QUEUED_LINES = 10_000
#: Bytes queued while the transport is paused before giving up on the peer.
MAX_QUEUED_BYTES = 16 * 1024 * 1024
#: How long a connection closed for congestion may take to drain before it
#: is aborted (seconds).
CONGESTION_GRACE = 1.0

# How many queued lines resumeProducing hands to one write call, so
# that a transport pausing us again mid-drain is noticed.
_DRAIN_CHUNK = 512

_EPSILON = 1e-6


@implementer(IPushProducer)
class LineConnection(Protocol):
    """Framing, outbound queue, keepalive and closing of one connection.

    A subclass provides ``lineReceived(line)``, sets ``accepted`` False on
    the connecting side (the ping timeout applies from connect) and calls
    :meth:`_peer_pinged_first` when the peer first PINGs (it applies from
    then on).  ``handler`` is a whole
    :class:`~replicator.replication.interfaces.IReplicationHandler`.

    ``close_reason`` is None while the connection is up and becomes one of
    :data:`replicator.replication.interfaces.CLOSE_REASONS` when we start
    closing it or it is lost (the first reason wins).
    """

    #: Whether the peer connected to us (see
    #: :attr:`.interfaces.IReplicationConnection.accepted`).
    accepted = True

    log = Logger()

    #: A TCP transport and push-producer consumer once connected (Twisted
    #: declares only ``Optional[ITransport]``; ``dataReceived`` and every
    #: write run connected).
    transport: Any

    def lineReceived(self, line: bytes) -> None:
        raise NotImplementedError

    def __init__(self, handler: IReplicationHandler, *, clock: IReactorTime,
                 max_line_length: int = MAX_LINE_LENGTH, ping_interval: float = PING_INTERVAL,
                 ping_timeout: float = PING_TIMEOUT, max_queued_lines: int = MAX_QUEUED_LINES,
                 max_queued_bytes: int = MAX_QUEUED_BYTES,
                 idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.handler = handler
        self._clock = clock
        self.MAX_LENGTH = max_line_length
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._max_queued = max_queued_lines
        self._max_queued_bytes = max_queued_bytes
        self._idle_timeout = idle_timeout

        #: The peer's address ("host:port"), once connected.
        self.address = "unconnected"
        self.close_reason: str | None = None
        self._buffer = b""  # inbound bytes after the last newline
        self._closing = False
        self._connected = False
        self._registered = False  # we are the transport's producer
        self._paused = False
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        self._peer_pinged = False
        self._last_sent = 0.0
        self._last_received = 0.0
        self._last_command = 0.0
        self._ping_call: IDelayedCall | None = None
        self._timeout_call: IDelayedCall | None = None
        self._abort_call: IDelayedCall | None = None
        #: (On the hot path: bound once; a LineConnection is the connection.)
        self._count_outbound: Callable[..., None] = handler.count_outbound

    @property
    def paused(self) -> bool:
        """Whether the transport asked us to stop writing."""
        return self._paused

    @property
    def queued(self) -> int:
        """Lines waiting for the transport to resume."""
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        """Bytes of the lines waiting for the transport to resume."""
        return self._queued_bytes

    @property
    def last_received(self) -> float:
        """When the peer last sent a byte (clock seconds; from the connect)."""
        return self._last_received

    @property
    def ping_interval(self) -> float:
        """Seconds between keepalives: a live peer is heard at least this often."""
        return self._ping_interval

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def __str__(self) -> str:
        """How a log line names the connection: the peer's name and address
        (``worker1 (127.0.0.1:56162)``), or its address alone."""
        name, address = self.name, self.address
        return address if name == address else f"{name} ({address})"

    @property
    def name(self) -> str:
        """How logs show the peer: its address (a protocol that learns the
        peer's name shows that instead)."""
        return self.address

    def _start_timers(self) -> None:
        """Keepalive and timeout, from the connection on."""
        self._ping_call = self._clock.callLater(self._ping_interval, self._ping_due)
        self._timeout_call = self._clock.callLater(self._silence_limit(), self._timeout_due)

    def _timers(self) -> list[IDelayedCall | None]:
        return [self._ping_call, self._timeout_call, self._abort_call]

    def _stop_timers(self) -> None:
        for call in self._timers():
            if call is not None and call.active():
                call.cancel()
        self._ping_call = self._timeout_call = self._abort_call = None

    def _clear_queue(self) -> None:
        self._queue.clear()
        self._queued_bytes = 0

    def _ping_line(self) -> PingCommand:
        return PingCommand(str(int(self._clock.seconds() * 1000)))

    def _peer_pinged_first(self) -> None:
        """The peer PINGed for the first time: from now on the ping timeout
        applies; move the timer to it."""
        self._peer_pinged = True
        if self._timeout_call is not None and self._timeout_call.active():
            self._timeout_call.cancel()
        self._timeout_call = self._clock.callLater(self._silence_limit(), self._timeout_due)

    # ------------------------------------------------------------ closing

    def close(self, reason: str, error_text: str | None = None,
              log_text: str | None = None) -> None:
        """Close the connection, first writing ``ERROR <error_text>`` if
        given (straight to the transport, past any queue).

        One log line says so: at info level, or, when the peer is at fault
        and ``log_text`` says how, that text at warn level.

        ``reason`` is one of
        :data:`replicator.replication.interfaces.CLOSE_REASONS`.  Queued lines are
        discarded.  If the transport has not closed ``ping_timeout`` seconds
        later, it is aborted.  Idempotent: later calls do nothing.
        """
        if self._closing:
            return
        self._closing = True
        self.close_reason = reason
        self._clear_queue()
        transport = self.transport
        if transport is None or not self._connected:
            return
        if error_text is not None:
            data = ErrorCommand(error_text).to_line().encode("utf-8", "replace")
            data = data[: self.MAX_LENGTH].replace(b"\n", b" ") + b"\n"
            transport.write(data)
            self._last_sent = self._clock.seconds()
            self._call(self.handler.count_outbound, self, "ERROR", 1)
        emit = self.log.info if log_text is None else self.log.warn
        emit("Closing replication connection {conn} ({why}): {text}", conn=self, why=reason,
             text=printable((error_text or "") if log_text is None else log_text))
        # With a streaming producer registered, a paused transport that has
        # drained would resume us instead of finishing the close; TLS does
        # not even start its shutdown while a producer is registered.
        if self._registered:
            self._registered = False
            try:
                transport.unregisterProducer()
            except Exception:
                pass
        transport.loseConnection()
        if self._connected and self._abort_call is None:
            # A congested peer is not reading: give it a short grace to take
            # what is buffered (ending with the ERROR), then drop it.
            grace = CONGESTION_GRACE if reason == CONGESTION else self._ping_timeout
            self._abort_call = self._clock.callLater(grace, self._abort)

    def poke(self) -> None:
        """Write a PING now (unless closing or paused): if the peer's host
        has forgotten the connection (it restarted), it answers with a
        reset, and the connection ends without waiting for the ping
        timeout."""
        if not self._closing and not self._paused and self._connected:
            self.send_command(self._ping_line())

    def pause_reading(self) -> None:
        """Stop reading from the transport (unless it is going away)."""
        transport = self.transport
        if transport is not None and not transport.disconnecting:
            transport.pauseProducing()

    def resume_reading(self) -> None:
        """Read from the transport again (unless it is going away)."""
        transport = self.transport
        if transport is not None and not transport.disconnecting:
            transport.resumeProducing()

    def stop(self, reason_text: str = "server stopping") -> None:
        """Orderly shutdown: ``ERROR <reason_text>`` then close (``shutdown``)."""
        self.close(SHUTDOWN, reason_text)

    def _abort(self) -> None:
        self._abort_call = None
        if self._connected:
            self.log.warn("Replication connection {conn} did not close; aborting", conn=self)
            self.transport.abortConnection()

    # ------------------------------------------------------------ inbound

    def dataReceived(self, data: bytes) -> None:
        """Split into lines like LineOnlyReceiver, but measure a line without
        its trailing ``\\r`` against the maximum, and note the time: any
        bytes from the peer count as a sign of life."""
        self._last_received = self._clock.seconds()
        if self._buffer:
            data = self._buffer + data
        lines = data.split(b"\n")
        self._buffer = lines.pop()
        limit = self.MAX_LENGTH
        for line in lines:
            if self._closing or self.transport.disconnecting:
                return
            if len(line) > limit and (len(line) > limit + 1 or line[-1:] != b"\r"):
                self.lineLengthExceeded(line)
                return
            self.lineReceived(line)
        if len(self._buffer) > limit + 1 and not self._closing:
            self.lineLengthExceeded(self._buffer)

    def lineLengthExceeded(self, line: bytes) -> None:
        self._buffer = b""
        self.close(LINE_TOO_LONG, "Line length exceeded",
                   log_text=f"line of {len(line)} bytes exceeds {self.MAX_LENGTH}")

    # ------------------------------------------------------------ outbound

    def send_command(self, cmd: Command) -> bool:
        """Write (or queue, while paused) one command.

        Returns False if it was not written: the connection is closing, or
        the line is over-long or contains a newline (logged and counted as
        dropped).
        """
        if self._closing:
            return False
        data = cmd.to_line().encode("utf-8")
        if len(data) > self.MAX_LENGTH or b"\n" in data:
            self.log.error("Dropping {name} of {n} bytes for {conn}: over-long or contains a "
                           "newline", name=cmd.NAME, n=len(data), conn=self)
            self._call(self.handler.count_dropped, self, cmd.NAME, 1)
            return False
        return self._write([data + b"\n"], cmd.NAME)

    def send_lines(self, lines: Sequence[bytes], command_name: str = "RDATA") -> bool:
        """Write pre-encoded lines (each ending in ``b"\\n"``, built by
        :func:`.encoding.encode_rdata_lines` / ``encode_position_line`` with
        this connection's maximum line length) in one ``transport.write`` of
        their concatenation (see :func:`.encoding.joined`; nothing else can
        come between them); queued while paused, each line counting toward
        the bound.

        The lines are trusted: no length or newline check is made here.
        Counted as one ``count_outbound(conn, command_name, len(lines))``.
        Returns False if nothing was written (closing, or congestion).
        """
        if self._closing or not lines:
            return False
        return self._write(lines, command_name)

    def _write(self, lines: Sequence[bytes], name: str) -> bool:
        if self._paused:
            queue = self._queue
            size = sum(map(len, lines))
            if (len(queue) + len(lines) > self._max_queued
                    or self._queued_bytes + size > self._max_queued_bytes):
                self.close(CONGESTION, "Failed to keep up", log_text=f"failed to keep up: "
                           f"{len(queue)} lines, {self._queued_bytes} bytes queued")
                return False
            queue.extend(lines)
            self._queued_bytes += size
        else:
            # One write of the joined lines: writeSequence would check and
            # measure every line in Python, per connection; an EncodedLines
            # is joined once for all connections.
            self.transport.write(joined(lines))
        self._last_sent = self._clock.seconds()
        try:
            self._count_outbound(self, name, len(lines))
        except Exception:
            self.log.failure("Replication handler {method} failed on {conn}",
                             method="count_outbound", conn=self)
        return True

    # ------------------------------------------------------------ IPushProducer

    def pauseProducing(self) -> None:
        """The transport's buffer is full: queue from now on."""
        if not self._closing:
            self._paused = True

    def resumeProducing(self) -> None:
        """Drain the queue in order, in chunks, until it is empty or the
        transport pauses us again."""
        if self._closing:
            return
        self._paused = False
        queue = self._queue
        while queue and not self._paused and not self._closing:
            data = b"".join([queue.popleft() for _ in range(min(len(queue), _DRAIN_CHUNK))])
            self._queued_bytes -= len(data)
            self.transport.write(data)
            self._last_sent = self._clock.seconds()

    def stopProducing(self) -> None:
        """The transport is going away: drop what is queued."""
        self._clear_queue()
        self._closing = True

    # ------------------------------------------------------------ keepalive

    def _ping_due(self) -> None:
        self._ping_call = None
        if self._closing:
            return
        now = self._clock.seconds()
        due = self._last_sent + self._ping_interval
        if now + _EPSILON >= due:
            if not self._paused:
                # A paused peer is not reading; a PING would only queue.
                self.send_command(self._ping_line())
            due = now + self._ping_interval
        if not self._closing:
            self._ping_call = self._clock.callLater(due - now, self._ping_due)

    def _silence_limit(self) -> float:
        """Seconds from now until the peer counts as gone."""
        return self._deadline()[0] - self._clock.seconds()

    def _deadline(self) -> tuple[float, str]:
        """When the peer counts as gone, and the close reason then.

        The ping timeout (any bytes count as a sign of life) applies on the
        client side from connect, and on the server side once the client
        has PINGed.  Until then a server-side connection must bring a whole
        command every ``idle_timeout`` seconds: netcat-safe, but an idle or
        byte-dribbling socket does not stay forever.  Under the ping
        timeout a whole command must still come every ``idle_timeout``
        seconds (at least ``ping_timeout``): a peer that keeps the ping
        timeout away with a byte now and then but never finishes a line is
        closed too (a live peer PINGs every few seconds)."""
        idle = self._last_command + self._command_limit()
        if not self.accepted or self._peer_pinged:
            silent = self._last_received + self._ping_timeout
            if silent <= idle:
                return silent, PING_TIMEOUT_REASON
        return idle, IDLE_TIMEOUT_REASON

    def _command_limit(self) -> float:
        """Seconds a whole command may take to come: ``idle_timeout``, and
        under the ping timeout at least that."""
        if not self.accepted or self._peer_pinged:
            return max(self._idle_timeout, self._ping_timeout)
        return self._idle_timeout

    def _timeout_due(self) -> None:
        call, self._timeout_call = self._timeout_call, None
        if self._closing:
            return
        now = self._clock.seconds()
        due, why = self._deadline()
        if now + _EPSILON >= due and call is not None and now - call.getTime() > LATE_CHECK:
            # This process did not run when the check was due (it was
            # stopped, or its reactor held): what the peer sent meanwhile
            # may be waiting unread in the socket, and a timer can run
            # before the reads.  Let the reactor read first.
            self._timeout_call = self._clock.callLater(LATE_CHECK, self._timeout_due)
            return
        if now + _EPSILON >= due:
            if why == PING_TIMEOUT_REASON:
                silent = now - self._last_received
                self.close(why, "ping timeout", log_text=f"silent for {silent:.1f}s")
            else:
                self._idle_due(now)
        else:
            self._timeout_call = self._clock.callLater(due - now, self._timeout_due)

    def _idle_due(self, now: float) -> None:
        """Close for no whole command within the idle deadline, saying so to
        the peer and in one log line; a peer that sent bytes of a line it
        never finished (it dribbles) is told that, with how many."""
        limit = self._command_limit()
        silent = now - self._last_command
        unfinished = len(self._buffer)
        if unfinished:
            self.close(IDLE_TIMEOUT_REASON,
                       f"idle timeout: no whole command for {limit:g}s, only {unfinished} "
                       "bytes of an unfinished line",
                       log_text=f"no whole command for {silent:.1f}s; {unfinished} bytes of "
                                f"an unfinished line, the last {now - self._last_received:.1f}s "
                                "ago (a peer dribbling bytes)")
            return
        self.close(IDLE_TIMEOUT_REASON,
                   f"idle timeout: no command for {limit:g}s "
                   "(send PING now and then to keep a quiet connection open)",
                   log_text=f"no command for {silent:.1f}s")

    # ------------------------------------------------------------ handler calls

    def _call(self, method: Callable[..., Any], *args: Any) -> None:
        try:
            method(*args)
        except Exception:
            self.log.failure("Replication handler {method} failed on {conn}",
                             method=getattr(method, "__name__", repr(method)), conn=self)
