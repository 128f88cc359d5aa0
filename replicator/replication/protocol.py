"""The replication line protocol over TCP: framing, handshake, keepalive,
direction checks and congestion control.

One protocol instance is one connection.  It knows nothing about streams or
positions; it parses lines into commands (:mod:`.commands`), checks that the
peer may send them, and hands them to a *handler*, which is shared by all
connections of an instance and does the real work.

Handler interface
-----------------

Every method is optional except where noted; a missing ``on_<NAME>`` means
the command is ignored.  ``conn`` is the protocol instance.

``new_connection(conn)``
    After the handshake lines were sent (client: after ``REPLICATE``).
``lost_connection(conn, reason: str)``
    Once, when the connection is gone; ``reason`` is one of
    :data:`CLOSE_REASONS` (also in ``conn.close_reason``).
``on_<NAME>(conn, cmd)``
    For every valid inbound command, e.g. ``on_REPLICATE``, ``on_RDATA``,
    ``on_POSITION``, ``on_USER_SYNC``.  ``PING``, ``NAME``, ``SERVER`` and
    ``ERROR`` are handled by the protocol first and then passed on too.
    Meanwhile ``conn.current_line`` holds the line's bytes as received
    (without ``\n`` and a trailing ``\r``): what a relay passes on.
``client_may_write(stream_name, instance_name) -> bool``
    Server side: may the client instance send RDATA/POSITION for that
    stream (is it a configured writer)?  Missing means no.
``count_inbound(conn, name)``
    One inbound command was accepted (before dispatch).
``count_outbound(conn, name, n)``
    ``n`` lines of command ``name`` were written or queued: once per
    :meth:`send_command` and once per :meth:`send_lines` batch.
``count_dropped(conn, name, n)``
    ``n`` outbound lines were never written because they are over-long or
    contain a newline (a bug of whoever built them).

An exception raised by a handler method is logged with its traceback and
otherwise ignored: the connection stays up, since a bug in processing one
command is no reason to punish the peer (a handler that must not go on after
its own failure calls :meth:`ReplicationProtocol.close`).

Invariants: nothing the peer sends raises out of :meth:`lineReceived`; a
line longer than ``max_line_length`` is never written; outbound order is
the order of the ``send_*`` calls; once the connection is closing nothing
more is written or dispatched.
"""

from collections import deque
from typing import Any, Callable, Deque, Dict, FrozenSet, List, Optional

from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure
from zope.interface import implementer

from ..logs import printable
from .commands import (
    CLIENT_COMMANDS,
    CLIENT_WRITER_COMMANDS,
    MAX_LINE_LENGTH,
    SERVER_COMMANDS,
    Command,
    CommandParseError,
    ErrorCommand,
    NameCommand,
    PingCommand,
    ReplicateCommand,
    ServerCommand,
    joined,
    parse_line,
)
from ..tls import certificate_names
from .peers import PeerPolicy

#: Send a PING when nothing else was written for this long (seconds).
PING_INTERVAL = 5.0
#: Close a peer silent this long (seconds): an upstream server from connect
#: on (it sends SERVER and PING at once), a client once it has PINGed.
PING_TIMEOUT = 15.0
#: Server side: close a client that never PINGs (netcat) once it has sent no
#: command for this long (seconds).
IDLE_TIMEOUT = 60.0
#: Lines queued while the transport is paused before giving up on the peer.
MAX_QUEUED_LINES = 10_000
#: Bytes queued while the transport is paused before giving up on the peer.
MAX_QUEUED_BYTES = 16 * 1024 * 1024
#: How long a connection closed for congestion may take to drain before it
#: is aborted (seconds).
CONGESTION_GRACE = 1.0

# Why a connection ended, for metrics.
CONGESTION = "congestion"
PING_TIMEOUT_REASON = "ping_timeout"
IDLE_TIMEOUT_REASON = "idle_timeout"
PARSE_ERROR = "parse_error"
WRONG_REMOTE = "wrong_remote"
INVALID_COMMAND = "invalid_command"
LINE_TOO_LONG = "line_too_long"
SHUTDOWN = "shutdown"
REMOTE_ERROR = "remote_error"
CONNECTION_LOST = "connection_lost"
#: The peer's address or NAME is not allowed (:mod:`.peers`).
REFUSED = "refused"

CLOSE_REASONS = frozenset(
    {
        CONGESTION,
        PING_TIMEOUT_REASON,
        IDLE_TIMEOUT_REASON,
        PARSE_ERROR,
        WRONG_REMOTE,
        INVALID_COMMAND,
        LINE_TOO_LONG,
        SHUTDOWN,
        REMOTE_ERROR,
        CONNECTION_LOST,
        REFUSED,
    }
)

# Handler methods resolved once per connection.
_HOOKS = ("new_connection", "lost_connection", "count_inbound", "count_outbound", "count_dropped")

# How many queued lines resumeProducing hands to one write call, so
# that a transport pausing us again mid-drain is noticed.
_DRAIN_CHUNK = 512

_EPSILON = 1e-6


def _default_clock() -> IReactorTime:
    from twisted.internet import reactor

    return reactor  # type: ignore[return-value]


@implementer(IPushProducer)
class ReplicationProtocol(LineOnlyReceiver):
    """Common part of both sides; use a subclass.

    ``close_reason`` is None while the connection is up and becomes one of
    :data:`CLOSE_REASONS` when we start closing it or it is lost (the first
    reason wins).
    """

    delimiter = b"\n"
    is_client_side = False
    #: Called with the protocol once the connection is gone.
    on_lost: Optional[Callable[[Any], None]] = None
    #: Command names the peer may send.
    VALID_INBOUND: FrozenSet[str] = frozenset()
    #: Commands accepted from a peer that must name itself before anything else.
    BEFORE_NAME: FrozenSet[str] = frozenset({"PING", "NAME", "ERROR"})
    #: Whether the peer must send NAME before any other command.
    name_required = False

    log = Logger()

    def __init__(
        self,
        handler: Any,
        *,
        clock: Optional[IReactorTime] = None,
        max_line_length: int = MAX_LINE_LENGTH,
        ping_interval: float = PING_INTERVAL,
        ping_timeout: float = PING_TIMEOUT,
        max_queued_lines: int = MAX_QUEUED_LINES,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        idle_timeout: float = IDLE_TIMEOUT,
    ):
        self.handler = handler
        self._clock = clock if clock is not None else _default_clock()
        self.MAX_LENGTH = max_line_length
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._max_queued = max_queued_lines
        self._max_queued_bytes = max_queued_bytes
        self._idle_timeout = idle_timeout

        self.name = "unconnected"
        #: The inbound line being dispatched (bytes, no newline).
        self.current_line: Optional[bytes] = None
        self.close_reason: Optional[str] = None
        self._peer_instance: Optional[str] = None
        self._remote_error = False
        self._closing = False
        self._connected = False
        self._registered = False  # we are the transport's producer
        self._paused = False
        self._queue: Deque[bytes] = deque()
        self._queued_bytes = 0
        self._peer_pinged = False
        self._established = False
        self._last_sent = 0.0
        self._last_received = 0.0
        self._last_command = 0.0
        self._ping_call: Optional[IDelayedCall] = None
        self._timeout_call: Optional[IDelayedCall] = None
        self._abort_call: Optional[IDelayedCall] = None

        self._hooks: Dict[str, Optional[Callable[..., Any]]] = {
            hook: getattr(handler, hook, None) for hook in _HOOKS
        }
        self._count_inbound = self._hooks["count_inbound"]
        self._count_outbound = self._hooks["count_outbound"]
        names = self.VALID_INBOUND | CLIENT_WRITER_COMMANDS
        self._dispatch: Dict[str, Optional[Callable[..., Any]]] = {
            name: getattr(handler, "on_" + name, None) for name in names
        }
        # The protocol's own handling, run before the handler's.
        self._own: Dict[str, Callable[[Any], None]] = {
            name: getattr(self, "_on_" + name) for name in names if hasattr(self, "_on_" + name)
        }

    # ------------------------------------------------------------ identity

    @property
    def instance_name(self) -> Optional[str]:
        """The name the peer gave itself: a client's ``NAME`` (server side)
        or the server's ``SERVER`` name (client side); None until received."""
        return self._peer_instance

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
    def established(self) -> bool:
        """Whether the handshake is done and the connection not closing: on
        a client, the right server named itself (``SERVER``)."""
        return self._established and not self._closing

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    # ------------------------------------------------------------ connection

    def connectionMade(self) -> None:
        self._connected = True
        now = self._clock.seconds()
        self._last_sent = self._last_received = self._last_command = now
        peer = self.transport.getPeer()
        host, port = getattr(peer, "host", None), getattr(peer, "port", None)
        self.name = f"{host}:{port}" if host is not None else str(peer)
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            try:
                set_no_delay(True)
            except Exception:
                self.log.failure("Could not set TCP_NODELAY on {conn}", conn=self)
        refusal = self._refusal(host)
        if refusal is not None:
            self.close(REFUSED, refusal, log_text=refusal)
            return
        self.transport.registerProducer(self, True)
        self._registered = True
        self.log.info("Replication connection {conn} made", conn=self)
        self._send_handshake()
        self._ping_call = self._clock.callLater(self._ping_interval, self._ping_due)
        self._timeout_call = self._clock.callLater(self._silence_limit(), self._timeout_due)
        self._call_hook("new_connection", self)

    def connectionLost(self, reason: Optional[Failure] = None) -> None:
        self._connected = False
        self._closing = True
        self._clear_queue()
        for call in self._timers():
            if call is not None and call.active():
                call.cancel()
        self._ping_call = self._timeout_call = self._abort_call = None
        self._connection_ended()
        if self.close_reason is None:
            self.close_reason = REMOTE_ERROR if self._remote_error else CONNECTION_LOST
        self.log.info(
            "Replication connection {conn} lost ({why}): {reason}",
            conn=self,
            why=self.close_reason,
            reason=reason.getErrorMessage() if reason is not None else "",
        )
        self._call_hook("lost_connection", self, self.close_reason)

    def _send_handshake(self) -> None:
        raise NotImplementedError

    def _timers(self) -> List[Optional[IDelayedCall]]:
        return [self._ping_call, self._timeout_call, self._abort_call]

    def _connection_ended(self) -> None:
        """Once, from :meth:`connectionLost`: tells ``on_lost`` (set by a
        factory that counts its connections)."""
        on_lost = self.on_lost
        if on_lost is not None:
            self.on_lost = None
            self._call(on_lost, self)

    def _clear_queue(self) -> None:
        self._queue.clear()
        self._queued_bytes = 0

    def _refusal(self, host: Optional[str]) -> Optional[str]:
        """Why a peer at ``host`` may not connect at all (None: it may)."""
        return None

    def _ping_line(self) -> PingCommand:
        return PingCommand(str(int(self._clock.seconds() * 1000)))

    # ------------------------------------------------------------ closing

    def close(self, reason: str, error_text: Optional[str] = None,
              log_text: Optional[str] = None) -> None:
        """Close the connection, first writing ``ERROR <error_text>`` if
        given (straight to the transport, past any queue).

        One log line says so: at info level, or, when the peer is at fault
        and ``log_text`` says how, that text at warn level.

        ``reason`` is one of :data:`CLOSE_REASONS`.  Queued lines are
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
            self._call_hook("count_outbound", self, "ERROR", 1)
        if log_text is None:
            self.log.info(
                "Closing replication connection {conn} ({why}): {text}",
                conn=self,
                why=reason,
                text=printable(error_text or ""),
            )
        else:
            self.log.warn(
                "Closing replication connection {conn} ({why}): {text}",
                conn=self,
                why=reason,
                text=printable(log_text),
            )
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

    def lineReceived(self, line: bytes) -> None:
        """Handle one line (no ``\\n``; one trailing ``\\r`` is stripped)."""
        if self._closing:
            return
        if line[-1:] == b"\r":
            line = line[:-1]
        if not line or line.isspace():
            return
        try:
            cmd = parse_line(line.decode("utf-8"))
        except Exception as e:
            # CommandParseError and UnicodeDecodeError are expected; anything
            # else is a parser bug, and still the peer's line that caused it:
            # the same ERROR and close, one log line, no traceback.
            if isinstance(e, (CommandParseError, UnicodeDecodeError)):
                text = "failed to parse line: " + _one_line(e)
            else:
                text = "failed to parse line: " + type(e).__name__
            self.close(PARSE_ERROR, text, log_text=text + " ({0} bytes)".format(len(line)))
            return
        name = cmd.NAME
        if name not in self.VALID_INBOUND and not self._may_write(cmd):
            self.close(INVALID_COMMAND, "invalid command: " + name,
                       log_text="invalid command " + name)
            return
        if self.name_required and self._peer_instance is None and name not in self.BEFORE_NAME:
            self.close(REFUSED, "NAME required", log_text=f"{name} before NAME")
            return
        self._last_command = self._clock.seconds()
        if self._count_inbound is not None:
            self._call(self._count_inbound, self, name)
        own = self._own.get(name)
        if own is not None:
            own(cmd)
            if self._closing:
                return
        method = self._dispatch.get(name)
        if method is not None:
            self.current_line = line
            try:
                self._call(method, self, cmd)
            finally:
                self.current_line = None

    def _may_write(self, cmd: Command) -> bool:
        """Whether the peer may send this otherwise invalid command (only
        servers accept RDATA/POSITION from writer clients)."""
        return False

    def _on_PING(self, cmd: PingCommand) -> None:
        if not self._peer_pinged:
            # From now on the ping timeout applies: move the timer to it.
            self._peer_pinged = True
            if self._timeout_call is not None and self._timeout_call.active():
                self._timeout_call.cancel()
            self._timeout_call = self._clock.callLater(self._silence_limit(), self._timeout_due)

    def _on_ERROR(self, cmd: ErrorCommand) -> None:
        self._remote_error = True
        self.log.warn("Remote {conn} reported an error: {text}", conn=self,
                      text=printable(cmd.message))

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
            self.log.error(
                "Dropping {name} of {n} bytes for {conn}: over-long or contains a newline",
                name=cmd.NAME,
                n=len(data),
                conn=self,
            )
            self._call_hook("count_dropped", self, cmd.NAME, 1)
            return False
        return self._write([data + b"\n"], cmd.NAME)

    def send_lines(self, lines: List[bytes], command_name: str = "RDATA") -> bool:
        """Write pre-encoded lines (each ending in ``b"\\n"``, built by
        :func:`.commands.encode_rdata_lines` / ``encode_position_line`` with
        this connection's maximum line length) in one ``transport.write`` of
        their concatenation (see :func:`.commands.joined`; nothing else can
        come between them); queued while paused, each line counting toward
        the bound.

        The lines are trusted: no length or newline check is made here.
        Counted as one ``count_outbound(conn, command_name, len(lines))``.
        Returns False if nothing was written (closing, or congestion).
        """
        if self._closing or not lines:
            return False
        return self._write(lines, command_name)

    def sendLine(self, line: bytes) -> bool:  # type: ignore[override]
        """LineOnlyReceiver's API, routed through the queue and the checks
        of :meth:`send_command` (``line`` without its newline)."""
        name = line.split(b" ", 1)[0].decode("ascii", "replace")
        if self._closing:
            return False
        if len(line) > self.MAX_LENGTH or b"\n" in line:
            self._call_hook("count_dropped", self, name, 1)
            return False
        return self._write([line + b"\n"], name)

    def _write(self, lines: List[bytes], name: str) -> bool:
        if self._paused:
            queue = self._queue
            size = sum(map(len, lines))
            if (len(queue) + len(lines) > self._max_queued
                    or self._queued_bytes + size > self._max_queued_bytes):
                self.close(
                    CONGESTION, "Failed to keep up",
                    log_text=f"failed to keep up: {len(queue)} lines, {self._queued_bytes} "
                             f"bytes queued",
                )
                return False
            queue.extend(lines)
            self._queued_bytes += size
        else:
            # One write of the joined lines: writeSequence would check and
            # measure every line in Python, per connection; an EncodedLines
            # is joined once for all connections.
            self.transport.write(joined(lines))
        self._last_sent = self._clock.seconds()
        if self._count_outbound is not None:
            self._call(self._count_outbound, self, name, len(lines))
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
            n = min(len(queue), _DRAIN_CHUNK)
            chunk = [queue.popleft() for _ in range(n)]
            data = b"".join(chunk)
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

    def _deadline(self):
        """When the peer counts as gone, and the close reason then.

        The ping timeout (any bytes count as a sign of life) applies on the
        client side from connect, and on the server side once the client
        has PINGed.  Until then a server-side connection must bring a whole
        command every ``idle_timeout`` seconds: netcat-safe, but an idle or
        byte-dribbling socket does not stay forever."""
        if self.is_client_side or self._peer_pinged:
            return self._last_received + self._ping_timeout, PING_TIMEOUT_REASON
        return self._last_command + self._idle_timeout, IDLE_TIMEOUT_REASON

    def _timeout_due(self) -> None:
        self._timeout_call = None
        if self._closing:
            return
        now = self._clock.seconds()
        due, why = self._deadline()
        if now + _EPSILON >= due:
            if why == PING_TIMEOUT_REASON:
                silent = now - self._last_received
                self.close(why, "ping timeout", log_text=f"silent for {silent:.1f}s")
            else:
                silent = now - self._last_command
                self.close(why, "idle timeout", log_text=f"no command for {silent:.1f}s")
        else:
            self._timeout_call = self._clock.callLater(due - now, self._timeout_due)

    # ------------------------------------------------------------ handler calls

    def _call_hook(self, hook: str, *args: Any) -> None:
        method = self._hooks[hook]
        if method is not None:
            self._call(method, *args)

    def _call(self, method: Callable[..., Any], *args: Any) -> None:
        try:
            method(*args)
        except Exception:
            self.log.failure(
                "Replication handler {method} failed on {conn}",
                method=getattr(method, "__name__", repr(method)),
                conn=self,
            )


def _one_line(error: Exception) -> str:
    return str(error).replace("\n", " ").replace("\r", " ")


class ServerReplicationProtocol(ReplicationProtocol):
    """The accepting side: sends ``SERVER <server_name>`` and ``PING`` on
    connect, accepts client commands, and RDATA/POSITION from a client only
    for streams ``handler.client_may_write`` allows for the instance the
    client named itself (``NAME``) — and only rows of that instance.

    ``policy`` (:class:`.peers.PeerPolicy`) decides which addresses may
    connect and which names a client may take; a refusal is ``ERROR`` and a
    close (reason ``refused``).  A client's name is set once."""

    VALID_INBOUND = CLIENT_COMMANDS
    is_client_side = False

    def __init__(self, handler: Any, server_name: str, policy: Optional[PeerPolicy] = None,
                 **kwargs: Any):
        super().__init__(handler, **kwargs)
        self.server_name = server_name
        self.policy = policy if policy is not None else PeerPolicy()
        self.name_required = self.policy.name_required
        self._client_may_write = getattr(handler, "client_may_write", None)

    def _refusal(self, host: Optional[str]) -> Optional[str]:
        return self.policy.check_address(host)

    def _send_handshake(self) -> None:
        self.send_command(ServerCommand(self.server_name))
        self.send_command(self._ping_line())

    def _on_NAME(self, cmd: NameCommand) -> None:
        cert_names = certificate_names(self.transport) if self.policy.certificate_names else None
        refusal = self.policy.check_name(cmd.client_name, self._peer_instance, cert_names)
        if refusal is not None:
            self.close(REFUSED, refusal,
                       log_text=f"NAME {printable(cmd.client_name, 64)} refused: {refusal}")
            return
        self._peer_instance = cmd.client_name
        name = printable(cmd.client_name, 64)
        self.log.info("Replication connection {peer} is {name}", peer=self.name, name=name)
        # For logs only (metrics and checks use instance_name).
        self.name = name

    def _may_write(self, cmd: Command) -> bool:
        if cmd.NAME not in CLIENT_WRITER_COMMANDS or self._client_may_write is None:
            return False
        instance = self._peer_instance
        if instance is None or cmd.instance_name != instance:  # type: ignore[attr-defined]
            return False
        try:
            return bool(self._client_may_write(cmd.stream_name, instance))  # type: ignore[attr-defined]
        except Exception:
            self.log.failure("client_may_write failed on {conn}", conn=self)
            return False


class ClientReplicationProtocol(ReplicationProtocol):
    """The connecting side: sends ``NAME`` (if ``client_name`` is set),
    ``PING`` and ``REPLICATE`` on connect; closes with ``ERROR Wrong remote``
    if the server's ``SERVER`` name is not ``server_name``.

    The ping timeout runs from connect (a server sends SERVER and PING at
    once, so a silent one is dead).  ``on_healthy()`` is called once, when
    the handshake is done and the connection has stayed up for
    ``ping_interval`` seconds since: the reconnect backoff resets only then.
    """

    VALID_INBOUND = SERVER_COMMANDS
    is_client_side = True

    def __init__(self, handler: Any, client_name: Optional[str], server_name: Optional[str],
                 on_healthy: Optional[Callable[[], None]] = None, **kwargs: Any):
        super().__init__(handler, **kwargs)
        self.client_name = client_name
        self.server_name = server_name
        self._on_healthy = on_healthy
        self._healthy_call: Optional[IDelayedCall] = None

    def _timers(self) -> List[Optional[IDelayedCall]]:
        return super()._timers() + [self._healthy_call]

    def _connection_ended(self) -> None:
        self._healthy_call = None
        super()._connection_ended()

    def _healthy_due(self) -> None:
        """Handshake done and alive for ``ping_interval``: the connection
        has proven healthy (the reconnect backoff may start over)."""
        self._healthy_call = None
        if self.established and self._on_healthy is not None:
            self._call(self._on_healthy)

    def _send_handshake(self) -> None:
        if self.client_name:
            self.send_command(NameCommand(self.client_name))
        self.send_command(self._ping_line())
        self.send_command(ReplicateCommand())

    def _on_SERVER(self, cmd: ServerCommand) -> None:
        if self.server_name is not None and cmd.server_name != self.server_name:
            self.log.error(
                "Connected to {got} instead of {expected} at {conn}",
                got=printable(cmd.server_name),
                expected=printable(self.server_name),
                conn=self,
            )
            self.close(WRONG_REMOTE, "Wrong remote")
            return
        self._peer_instance = cmd.server_name
        self.name = printable(cmd.server_name, 64)
        if not self._established:
            self._established = True
            self._healthy_call = self._clock.callLater(self._ping_interval, self._healthy_due)
