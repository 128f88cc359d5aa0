"""The replication line protocol over TCP: handshake, identity, direction
checks and dispatch of commands to the handler.

One protocol instance is one connection.  It knows nothing about streams or
positions; it parses lines into commands (:mod:`.commands`), checks that the
peer may send them, and hands them to a *handler*, which is shared by all
connections of an instance and does the real work.  Framing, the outbound
queue, keepalive and closing are :class:`.link.LineConnection`'s.

The handler is a :class:`.interfaces.IReplicationHandler`: every hook is
optional here (a missing ``on_<NAME>`` means the command is ignored, a
missing ``client_may_write`` means no); ``conn`` is the protocol instance.
While ``on_<NAME>`` runs, ``conn.current_line`` holds the line's bytes as
received (without ``\n`` and a trailing ``\r``): what a relay passes on.

An exception raised by a handler method is logged with its traceback and
otherwise ignored: the connection stays up, since a bug in processing one
command is no reason to punish the peer (a handler that must not go on after
its own failure calls :meth:`ReplicationProtocol.close`).

Invariants: nothing the peer sends raises out of :meth:`lineReceived`; a
command the peer may not send (direction, writer, NAME first) is never
dispatched: ``ERROR`` and close.  (Those of :mod:`.link` hold too.)
"""

from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure
from zope.interface import implementer

from ...logs.printable import printable
from ...net.tls import certificate_names
from ...observe import metrics
from ..interfaces import (
    CONNECTION_LOST,
    IDENTIFY_TIMEOUT_REASON,
    INVALID_COMMAND,
    PARSE_ERROR,
    REFUSED,
    REMOTE_ERROR,
    WRONG_REMOTE,
    IPeerConnection,
    IReplicationHandler,
)
from ..wire.commands import (
    CLIENT_COMMANDS,
    CLIENT_WRITER_COMMANDS,
    SERVER_COMMANDS,
    AuthChallengeCommand,
    AuthCommand,
    Command,
    ErrorCommand,
    NameCommand,
    PingCommand,
    ReplicateCommand,
    ServerCommand,
    parse_line,
)
from ..wire.parsing import CommandParseError
from . import proof
from .link import LineConnection
from .peers import PeerPolicy


@implementer(IPeerConnection)
class ReplicationProtocol(LineConnection):
    """Common part of both sides; use a subclass.  One peer's connection
    (:class:`.interfaces.IPeerConnection`)."""

    #: Called with the protocol once the connection is gone.
    on_lost: Callable[[Any], None] | None = None
    #: Command names the peer may send.
    VALID_INBOUND: frozenset[str] = frozenset()
    #: Commands accepted from a peer that must name itself before anything else.
    BEFORE_NAME: frozenset[str] = frozenset({"PING", "NAME", "ERROR"})
    #: Whether the peer must send NAME before any other command.
    name_required = False

    def __init__(self, handler: IReplicationHandler, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        #: The inbound line being dispatched (bytes, no newline).
        self.current_line: bytes | None = None
        self._peer_instance: str | None = None
        self._remote_error = False
        #: The text of the peer's ``ERROR``, and why the connection ended
        #: (for the reconnect line: :mod:`replicator.net.reconnect`).
        self.remote_error_text: str | None = None
        self.lost_failure: Failure | None = None
        self._established = False
        names = self.VALID_INBOUND | CLIENT_WRITER_COMMANDS
        self._dispatch: dict[str, Callable[..., Any] | None] = {
            name: getattr(handler, "on_" + name, None) for name in names
        }
        # The protocol's own handling, run before the handler's.
        self._own: dict[str, Callable[[Any], None]] = {
            name: getattr(self, "_on_" + name) for name in names if hasattr(self, "_on_" + name)
        }

    # ------------------------------------------------------------ identity

    @property
    def instance_name(self) -> str | None:
        """The peer's one name: the name it gave itself, a client's ``NAME``
        (server side) or the server's ``SERVER`` name (client side); None
        until received.  Checks use it as received; :attr:`name` is its
        printable form for logs, and the metrics label is derived from it
        (:func:`replicator.replication.interfaces.metrics_label`, bounded)."""
        return self._peer_instance

    @property
    def name(self) -> str:
        """The peer for logs: :attr:`instance_name` made printable, or its
        address before it named itself."""
        if self._peer_instance is None:
            return self.address
        return printable(self._peer_instance, 64)

    @property
    def role(self) -> str:
        """``"upstream"`` (we connected to it) or ``"client"`` (it connected
        to us)."""
        return "client" if self.accepted else "upstream"

    @property
    def answered(self) -> bool:
        """Whether the handshake was done on this connection, closing or not."""
        return self._established

    @property
    def established(self) -> bool:
        """Whether the handshake is done and the connection not closing: on
        a client, the right server named itself (``SERVER``)."""
        return self._established and not self._closing

    # ------------------------------------------------------------ connection

    def connectionMade(self) -> None:
        self._connected = True
        now = self._clock.seconds()
        self._last_sent = self._last_received = self._last_command = now
        peer = self.transport.getPeer()
        host, port = getattr(peer, "host", None), getattr(peer, "port", None)
        self.address = f"{host}:{port}" if host is not None else str(peer)
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
        self._start_timers()
        self._call(self.handler.new_connection, self)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._connected = False
        self.lost_failure = reason
        self._closing = True
        self._clear_queue()
        self._stop_timers()
        self._connection_ended()
        if self.close_reason is None:
            self.close_reason = REMOTE_ERROR if self._remote_error else CONNECTION_LOST
        self.log.info(
            "Replication connection {conn} lost ({why}): {reason}",
            conn=self,
            why=self.close_reason,
            reason=reason.getErrorMessage() if reason is not None else "",
        )
        self._call(self.handler.lost_connection, self, self.close_reason)

    def _send_handshake(self) -> None:
        raise NotImplementedError

    def _connection_ended(self) -> None:
        """Once, from :meth:`connectionLost`: tells ``on_lost`` (set by a
        factory that counts its connections)."""
        on_lost = self.on_lost
        if on_lost is not None:
            self.on_lost = None
            self._call(on_lost, self)

    def _refusal(self, host: str | None) -> str | None:
        """Why a peer at ``host`` may not connect at all (None: it may)."""
        return None

    # ------------------------------------------------------------ inbound

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
            self.close(PARSE_ERROR, text, log_text=text + f" ({len(line)} bytes)")
            return
        name = cmd.NAME
        if name not in self.VALID_INBOUND:
            refusal = self._write_refusal(cmd)
            if refusal is not None:
                self.close(INVALID_COMMAND, refusal, log_text=refusal)
                return
        if self.name_required and self._peer_instance is None and name not in self.BEFORE_NAME:
            self.close(REFUSED, "NAME required", log_text=f"{name} before NAME")
            return
        self._last_command = self._clock.seconds()
        self._call(self.handler.count_inbound, self, name)
        own = self._own.get(name)
        if own is not None:
            # True: the protocol keeps the command (the handler gets it later, or never).
            if own(cmd) or self._closing:
                return
        method = self._dispatch.get(name)
        if method is not None:
            self.current_line = line
            try:
                self._call(method, self, cmd)
            finally:
                self.current_line = None

    def _write_refusal(self, cmd: Command) -> str | None:
        """Why the peer may not send this otherwise invalid command (the
        ``ERROR`` text), or None if it may (only servers accept
        RDATA/POSITION from writer clients)."""
        return "invalid command: " + cmd.NAME

    def _on_PING(self, cmd: PingCommand) -> None:
        if not self._peer_pinged:
            self._peer_pinged_first()

    def _on_ERROR(self, cmd: ErrorCommand) -> None:
        self._remote_error = True
        self.remote_error_text = cmd.message
        self.log.warn("Remote {conn} reported an error: {text}", conn=self,
                      text=printable(cmd.message))

def _one_line(error: Exception) -> str:
    return str(error).replace("\n", " ").replace("\r", " ")


class ServerReplicationProtocol(ReplicationProtocol):
    """The accepting side: sends ``SERVER <server_name>`` and ``PING`` on
    connect, accepts client commands, and RDATA/POSITION from a client only
    for streams ``handler.client_may_write`` allows for the instance the
    client named itself (``NAME``) — and only rows of that instance.

    ``policy`` (:class:`.peers.PeerPolicy`) decides which addresses may
    connect and which names a client may take; a refusal is ``ERROR`` and a
    close (reason ``refused``).  A client's name is set once.

    A client *identifies* itself with ``NAME`` (or, an anonymous reader,
    with ``REPLICATE`` before any ``NAME``).  ``identify(conn, name)``
    (given by the listener: one live connection per known name, caps per
    address) is asked then, ``name`` None for an anonymous reader; a text
    it returns is the refusal.  With ``identify_timeout``, a client that
    has not identified itself within that many seconds of connecting is
    closed (``identify_timeout``).

    A ``NAME`` the policy gives a secret (``writer_secrets``) identifies
    the client only once it has proven it (:mod:`.proof`): the ``NAME`` is
    answered with ``AUTH_CHALLENGE``, and until a right ``AUTH`` comes the
    connection is still unidentified (it holds no name, ``identify_timeout``
    runs, the handler has heard neither its ``NAME`` nor its ``REPLICATE``,
    which reach it once the proof came) and its RDATA/POSITION is
    refused (``ERROR``, close, counted as ``unproven``); a wrong ``AUTH`` is
    refused too (``bad_proof``).  Nothing is sent to a client whose name has
    no secret: a Synapse peer sees Synapse's wire."""

    VALID_INBOUND = CLIENT_COMMANDS
    accepted = True

    def __init__(self, handler: IReplicationHandler, server_name: str,
                 policy: PeerPolicy | None = None,
                 identify: Callable[[Any, str | None], str | None] | None = None,
                 identify_timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.server_name = server_name
        self.policy = policy if policy is not None else PeerPolicy()
        self.name_required = self.policy.name_required
        self._identify = identify
        self._identify_timeout = identify_timeout
        self._identify_call: IDelayedCall | None = None
        #: Whether the client identified itself (NAME, or REPLICATE first).
        self.identified = False
        #: While a bound NAME waits for its proof: (the nonce sent, the NAME).
        self._challenge: tuple[str, NameCommand] | None = None
        #: Whether the client proved its NAME (:mod:`.proof`).
        self.proven = False
        self._replicate_held = False  # a REPLICATE came before the proof

    def _timers(self) -> list[IDelayedCall | None]:
        return super()._timers() + [self._identify_call]

    def _start_timers(self) -> None:
        super()._start_timers()
        if self._identify_timeout is not None:
            self._identify_call = self._clock.callLater(self._identify_timeout,
                                                        self._identify_due)

    def _connection_ended(self) -> None:
        self._identify_call = None
        super()._connection_ended()

    def _identify_due(self) -> None:
        self._identify_call = None
        if not self.identified:
            what = "AUTH" if self._challenge is not None else "NAME"
            text = f"{what} not received within {self._identify_timeout:g}s"
            self.close(IDENTIFY_TIMEOUT_REASON, text)

    def _identified(self, name: str | None) -> str | None:
        """The client identified itself as ``name`` (None: anonymous); the
        listener's refusal, if any."""
        self.identified = True
        if self._identify_call is not None:
            if self._identify_call.active():
                self._identify_call.cancel()
            self._identify_call = None
        if self._identify is None:
            return None
        try:
            return self._identify(self, name)
        except Exception:
            self.log.failure("identify failed on {conn}", conn=self)
            return None

    def _refusal(self, host: str | None) -> str | None:
        return self.policy.check_address(host)

    def refusal_under(self, policy: PeerPolicy) -> str | None:
        """Why ``policy`` would refuse this open connection (its address, or
        the NAME it gave), or None; later checks use ``policy``."""
        self.policy = policy
        peer = self.transport.getPeer() if self.transport is not None else None
        refusal = policy.check_address(getattr(peer, "host", None))
        if refusal is None and self._peer_instance is not None:
            cert_names = (certificate_names(self.transport) if policy.certificate_names
                          else None)
            refusal = policy.check_name(self._peer_instance, None, cert_names)
            if refusal is None and self.identified and not self.proven \
                    and policy.secret_for(self._peer_instance) is not None:
                refusal = f"NAME {printable(self._peer_instance, 64)} must now prove itself (AUTH)"
        return refusal

    def _send_handshake(self) -> None:
        self.send_command(ServerCommand(self.server_name))
        self.send_command(self._ping_line())

    def _on_NAME(self, cmd: NameCommand) -> bool:
        """True while the NAME waits for its proof (the handler hears it then)."""
        cert_names = certificate_names(self.transport) if self.policy.certificate_names else None
        refusal = self.policy.check_name(cmd.client_name, self._peer_instance, cert_names)
        if refusal is None and self._peer_instance is None:
            if self.policy.secret_for(cmd.client_name) is not None:
                self._peer_instance = cmd.client_name
                nonce = proof.new_nonce()
                self._challenge = (nonce, cmd)
                self.send_command(AuthChallengeCommand(nonce))
                return True
            refusal = self._identified(cmd.client_name)
        if refusal is None and self._challenge is not None:
            return True  # the same NAME again, still unproven
        if refusal is not None:
            self.close(REFUSED, refusal,
                       log_text=f"NAME {printable(cmd.client_name, 64)} refused: {refusal}")
            return True
        self._peer_instance = cmd.client_name
        self.log.info("Replication connection {peer} is {name}", peer=self.address, name=self.name)
        return False

    def _on_AUTH(self, cmd: AuthCommand) -> bool:
        """The proof of the NAME challenged: right, the client is identified
        as that name (and the handler hears its NAME); else ``ERROR``."""
        challenge = self._challenge
        if challenge is None:
            self.close(REFUSED, "AUTH not asked for", log_text="AUTH not asked for")
            return True
        nonce, name_cmd = challenge
        name = name_cmd.client_name
        secret = self.policy.secret_for(name)
        if secret is None or not proof.verify(secret, self.server_name, name, nonce,
                                              cmd.proof):
            metrics.CONNECTIONS_REFUSED.labels("bad_proof").inc()
            text = f"AUTH for {printable(name, 64)} refused: wrong proof"
            self.close(REFUSED, text, log_text=text)
            return True
        self._challenge = None
        refusal = self._identified(name)
        if refusal is not None:
            self.close(REFUSED, refusal, log_text=f"NAME {printable(name, 64)} refused: {refusal}")
            return True
        self.proven = True
        self.log.info("Replication connection {peer} is {name} (proven)", peer=self.address,
                      name=self.name)
        for command_name, held in (("NAME", name_cmd),
                                   ("REPLICATE", ReplicateCommand() if self._replicate_held
                                    else None)):
            method = self._dispatch.get(command_name)
            if held is not None and method is not None and not self._closing:
                self._call(method, self, held)
        self._replicate_held = False
        return True

    def _on_REPLICATE(self, cmd: ReplicateCommand) -> bool:
        """True while the NAME before it waits for its proof: the handler
        hears the REPLICATE once the proof came (an unproven connection is
        sent nothing but the challenge)."""
        if self._challenge is not None:
            self._replicate_held = True
            return True
        if self.identified:
            return False
        refusal = self._identified(None)
        if refusal is not None:
            self.close(REFUSED, refusal, log_text=f"anonymous reader refused: {refusal}")
            return True
        return False

    def _write_refusal(self, cmd: Command) -> str | None:
        """None for RDATA/POSITION of the client's own writer of a stream
        ``client_may_write`` allows; else the reason, naming the stream and
        writer (a worker the config no longer names as a writer of a
        stream says so in its retry lines)."""
        name = cmd.NAME
        if name not in CLIENT_WRITER_COMMANDS:
            return "invalid command: " + name
        stream, writer = cmd.stream_name, cmd.instance_name  # type: ignore[attr-defined]
        what = f"{name} of {printable(stream, 64)}/{printable(writer, 64)} refused"
        instance = self._peer_instance
        if instance is None:
            return f"{what}: no NAME sent"
        if writer != instance:
            return f"{what}: this connection is {printable(instance, 64)}"
        if self._challenge is not None:
            metrics.CONNECTIONS_REFUSED.labels("unproven").inc()
            return f"{what}: {printable(instance, 64)} has not proven its NAME (AUTH)"
        try:
            allowed = bool(self.handler.client_may_write(stream, instance))
        except Exception:
            self.log.failure("client_may_write failed on {conn}", conn=self)
            allowed = False
        if allowed:
            return None
        return f"{what}: {printable(instance, 64)} is not a writer of {printable(stream, 64)} here"


class ClientReplicationProtocol(ReplicationProtocol):
    """The connecting side: sends ``NAME`` (if ``client_name`` is set),
    ``PING`` and ``REPLICATE`` on connect; closes with ``ERROR Wrong remote``
    if the server's ``SERVER`` name is not ``server_name``.

    The ping timeout runs from connect (a server sends SERVER and PING at
    once, so a silent one is dead).  ``on_healthy()`` is called once, when
    the handshake is done and the connection has stayed up for
    ``ping_interval`` seconds since: the reconnect backoff resets only then.

    With a ``secret`` (this writer's, :mod:`.proof`) the client holds its
    own RDATA/POSITION back (:attr:`writes_held`: the handler sends none
    here) until it knows whether the server asks for a proof: an
    ``AUTH_CHALLENGE`` is answered with ``AUTH`` and the writes go after it;
    a POSITION or RDATA from the server, which answers REPLICATE only after
    it handled our NAME, or ``ping_interval`` after its ``SERVER``, says it
    will not ask (a Synapse server, or one that gives us no secret): the
    writes go as they always did.  The handler is told then
    (``writes_released(conn)``).  Nothing new is ever sent unasked.
    """

    VALID_INBOUND = SERVER_COMMANDS
    accepted = False

    def __init__(self, handler: IReplicationHandler, client_name: str | None,
                 server_name: str | None,
                 on_healthy: Callable[[], None] | None = None, secret: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.client_name = client_name
        self.server_name = server_name
        self._on_healthy = on_healthy
        self._healthy_call: IDelayedCall | None = None
        self._secret = secret
        #: Whether our own RDATA/POSITION wait to learn if a proof is asked for.
        self.writes_held = secret is not None and bool(client_name)
        self._challenged = False
        if not self.writes_held:
            self._own.pop("POSITION", None)
            self._own.pop("RDATA", None)

    def _timers(self) -> list[IDelayedCall | None]:
        return super()._timers() + [self._healthy_call]

    def _connection_ended(self) -> None:
        self._healthy_call = None
        super()._connection_ended()

    def _healthy_due(self) -> None:
        """Handshake done and alive for ``ping_interval``: the connection
        has proven healthy (the reconnect backoff may start over)."""
        self._healthy_call = None
        if self.established:
            self._release_writes()
        if self.established and self._on_healthy is not None:
            self._call(self._on_healthy)

    def _release_writes(self) -> None:
        """Our writes may go (proved, or no proof is asked for): the handler
        sends them from now on."""
        if not self.writes_held or self._closing:
            return
        self.writes_held = False
        self._own.pop("POSITION", None)
        self._own.pop("RDATA", None)
        self._call(self.handler.writes_released, self)

    def _on_POSITION(self, cmd: Command) -> None:
        self._release_writes()

    _on_RDATA = _on_POSITION

    def _on_AUTH_CHALLENGE(self, cmd: AuthChallengeCommand) -> bool:
        """Prove our NAME once, if we hold a secret; without one the server
        will refuse our writes (its ERROR says why)."""
        if self._challenged:
            self.close(REFUSED, "AUTH_CHALLENGE twice", log_text="AUTH_CHALLENGE twice")
            return True
        self._challenged = True
        if self._secret is None or not self.client_name:
            self.log.error("Upstream {conn} asks {name} to prove its NAME, but this instance "
                           "has no replication.secret_file: its writes will be refused",
                           conn=self, name=printable(self.client_name or "", 64))
            return True
        if not proof.NONCE.fullmatch(cmd.nonce):
            self.close(PARSE_ERROR, "AUTH_CHALLENGE: not a nonce",
                       log_text="AUTH_CHALLENGE: not a nonce")
            return True
        self.send_command(AuthCommand(proof.proof(self._secret, self._peer_instance or "",
                                                  self.client_name, cmd.nonce)))
        self._release_writes()
        return True

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
        if not self._established:
            self._established = True
            self._healthy_call = self._clock.callLater(self._ping_interval, self._healthy_due)
