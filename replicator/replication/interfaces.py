"""What the parts of replication require of each other, declared.

The handler drives two transports: a TCP protocol of either side
(:mod:`.protocol`) and the one logical connection of a Redis subscription
(:class:`.redis.RedisConnection`).  Both provide
:class:`IReplicationConnection`, and the handler relies on nothing else of
a connection; what only one of them can do is a separate interface checked
with ``providedBy`` (:class:`IPeerConnection`: refusing one peer), never
told from the methods an object happens to have.  The protocols call into
a :class:`IReplicationHandler`; a Redis connection publishes through its
owner, a :class:`IRedisBus`.  Whatever observes the core (``observe/``,
``http/``, the CLI) sees it through :class:`IReplicationView` alone, read-only.

Core and transports meet only here: the reasons a connection ends
(:data:`CLOSE_REASONS`) and the bounded metrics label of a peer's name
(:func:`metrics_label`) are declared in this module, for both.

Tests check every implementation, and every test double standing in for
one, with :func:`zope.interface.verify.verifyObject` (``tests/test_interfaces.py``).
"""

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import (
    TYPE_CHECKING,
    Any,
    NamedTuple,
)

from zope.interface import Attribute, Interface

from ..keys import Key

if TYPE_CHECKING:
    from ..observe.health import Finding
    from ..observe.metrics import Sample
    from .wire.commands import Command

#: Seconds a peer's silence is judged again after a timeout that may have
#: run before the reactor read what waits in the socket (this process was
#: stopped, or its reactor held): the reactor reads in between.
LATE_CHECK = 0.1

# Why a connection ended (``close_reason``, ``lost_connection``'s reason,
# the ``replicator_disconnects_total{reason}`` label).
CONGESTION = "congestion"
PING_TIMEOUT_REASON = "ping_timeout"
IDLE_TIMEOUT_REASON = "idle_timeout"
#: Server side: no NAME (nor REPLICATE) within ``identify_timeout``.
IDENTIFY_TIMEOUT_REASON = "identify_timeout"
PARSE_ERROR = "parse_error"
WRONG_REMOTE = "wrong_remote"
INVALID_COMMAND = "invalid_command"
LINE_TOO_LONG = "line_too_long"
SHUTDOWN = "shutdown"
REMOTE_ERROR = "remote_error"
CONNECTION_LOST = "connection_lost"
#: The peer's address or NAME is not allowed (:mod:`.transport.peers`).
REFUSED = "refused"

CLOSE_REASONS = frozenset({
    CONGESTION, PING_TIMEOUT_REASON, IDLE_TIMEOUT_REASON, IDENTIFY_TIMEOUT_REASON, PARSE_ERROR,
    WRONG_REMOTE, INVALID_COMMAND, LINE_TOO_LONG, SHUTDOWN, REMOTE_ERROR, CONNECTION_LOST,
    REFUSED,
})

#: The metrics label of every name the configuration does not know.
OTHER = "other"


def metrics_label(name: str | None, known: AbstractSet[str]) -> str:
    """``name`` if the configuration knows it, else :data:`OTHER`: labels
    stay bounded, a peer-supplied name is never one by itself."""
    return name if name is not None and name in known else OTHER




class IReplicationConnection(Interface):
    """One connection as the handler sees it: where fan-out goes, where
    commands come from, and who they come from."""

    name = Attribute("How log lines name the peer (str): its name, or its address before "
                     "it named itself; a bus names its channel.")
    role = Attribute('"client" (a peer connected to us over TCP), "upstream" (we connected '
                     'to it over TCP) or "redis" (a bus): the metrics label until the peer '
                     "names itself, and the role on the status page.")
    instance_name = Attribute("The name the peer gave itself (NAME or SERVER), as received; "
                              "None until it did, and always on a bus (no one peer).")
    accepted = Attribute(
        "True if the peer connected to us (TCP server side): this instance is its hub. "
        "What it sends is relayed to the other connections, a REPLICATE from it is "
        "answered for every writer known here, the instance IDs of its USER_SYNCs are "
        "checked and die with it, and its disconnect counts for the writer watch. "
        "False for an upstream and for a bus: nobody there asks for our positions, so "
        "the handler announces them as the connection comes, sends fan-out from the "
        "start, and says CLEAR_USER_SYNC before stopping; REPLICATE is answered only "
        "for this instance's own writers (the others answer themselves).")
    current_line = Attribute("The inbound line being dispatched (bytes, without the newline), "
                             "None between lines: what a relay passes on, byte for byte.")
    queued = Attribute("Lines written but waiting for the transport (int; the status page).")
    queued_bytes = Attribute("Bytes of those lines (int).")
    transport = Attribute("The byte transport underneath (its peer address and write buffer "
                          "are shown and measured), or None where there is not one "
                          "(a bus: its links are its owner's).")

    def send_lines(lines: Sequence[bytes], command_name: str = "RDATA") -> bool:
        """Write pre-encoded lines (each ending in ``\\n``, built by
        :mod:`.wire`) together, nothing between them; ``command_name``
        counts them.  Returns whether they were written (or kept to be):
        False once the connection stops, or when dropped."""

    def send_command(cmd: "Command") -> bool:
        """Write one command; whether it was written (see :meth:`send_lines`)."""

    def pause_reading() -> None:
        """Stop taking inbound lines until :meth:`resume_reading` (while a
        claim the connection made is checked against the database); a
        connection that is going away ignores it."""

    def resume_reading() -> None:
        """Take inbound lines again."""

    def stop(reason_text: str = "server stopping") -> None:
        """Orderly shutdown: nothing is sent after it (a TCP connection
        first says ``ERROR <reason_text>``, then closes)."""


class IPeerConnection(IReplicationConnection):
    """A connection to one peer (TCP, either side): one that sent what
    cannot be true is refused with ``ERROR`` and closed.

    The handler checks this interface (``IPeerConnection.providedBy``); a
    connection without it (a bus: every instance is on the other end) is
    never closed for one line: the line is dropped and counted."""

    close_reason = Attribute("None while up; why it ended, one of :data:`CLOSE_REASONS`, "
                             "from the moment it starts closing.")

    def close(reason: str, error_text: str | None = None,
              log_text: str | None = None) -> None:
        """Close, first writing ``ERROR <error_text>`` if given; one log line
        (``log_text`` at warn level when the peer is at fault).  Idempotent."""


class IRedisBus(Interface):
    """What a :class:`.redis.RedisConnection` needs of its owner
    (:class:`.redis.RedisReplication`): the links are the owner's."""

    channel = Attribute("The channel our lines go to (str; log lines name it).")

    def hold(lines: Sequence[bytes], command_name: str) -> bool:
        """Whether the owner keeps ``lines`` back for now (registering beside
        a possible Synapse, see :mod:`.synapse_watch`): then they are not
        published now."""

    def publish_lines(lines: Sequence[bytes], channel: bytes | None = None) -> None:
        """PUBLISH the lines, all in one write (one MULTI/EXEC when several)."""

    def pause_reading() -> None:
        """Stop reading the subscription."""

    def resume_reading() -> None:
        """Read the subscription again."""


class IReplicationHandler(Interface):
    """What the transports call: one per instance, shared by all its
    connections (:class:`.handler.ReplicationHandler`).

    Besides these, one ``on_<NAME>(conn, cmd)`` per command handled (a
    command without one is ignored; ``PING``, ``NAME``, ``SERVER`` and
    ``ERROR`` reach it after the protocol's own handling).  ``conn``
    provides :class:`IReplicationConnection`.  An exception raised here is
    logged by the caller and does not end the connection.  The transports
    call every method below unconditionally: a handler that is not the core
    subclasses :class:`.transport.base_handler.BaseHandler` (all no-ops)."""

    instance_name = Attribute("This instance's name (str).")
    registry = Attribute("The streams (a :class:`~replicator.streams.registry.StreamRegistry`).")
    known_names = Attribute("Instance names the configuration knows (frozenset of str).")

    def new_connection(conn: IReplicationConnection) -> None:
        """``conn`` is up: after the handshake lines were sent (a TCP client:
        after its ``REPLICATE``), a bus once subscribed and publishing."""

    def writes_released(conn: IReplicationConnection) -> None:
        """A TCP client that held this instance's writes back (its
        ``writes_held``: waiting to learn whether the server asks for a proof
        of our NAME) lets them go: from now on the handler sends them there,
        its positions first."""

    def lost_connection(conn: IReplicationConnection, reason: str) -> None:
        """``conn`` is gone, once; ``reason`` one of :data:`CLOSE_REASONS`."""

    def client_may_write(stream_name: str, instance_name: str) -> bool:
        """Server side: may client ``instance_name`` send RDATA/POSITION of
        that stream (is it one of its writers, not local here)?"""

    def count_inbound(conn: IReplicationConnection, name: str) -> None:
        """One inbound ``name`` command was accepted (before dispatch)."""

    def count_outbound(conn: IReplicationConnection, name: str, n: int) -> None:
        """``n`` lines of command ``name`` were written or queued: once per
        ``send_command`` and once per ``send_lines`` call."""

    def count_dropped(conn: IReplicationConnection, name: str, n: int) -> None:
        """``n`` outbound lines were never written: over-long, or a newline
        inside (a bug of whoever built them)."""


class ConnectionSeen(NamedTuple):
    """One open connection as observers see it (:meth:`IReplicationView.open_connections`)."""

    conn: Any  # provides IReplicationConnection
    #: The one name the status page gives the peer (see ``core.connections.peer_name``).
    peer: str
    #: Its metrics label (bounded: a name the configuration knows, or a role).
    label: str
    #: When it was made (clock seconds).
    since: float


class Disconnect(NamedTuple):
    """One of the last disconnects (:meth:`IReplicationView.recent_disconnects`)."""

    at: float
    peer: str
    address: str | None
    reason: str


class IReplicationView(Interface):
    """What observers (``observe/``, ``http/``, the CLI) may see of the
    replication core of one instance, and nothing else: connections,
    readers, positions and findings.  Read-only: every method returns a
    copy (or a snapshot) that the caller may keep; nothing here changes
    the core.  Implemented by :class:`.core.handler.ReplicationHandler`."""

    instance_name = Attribute("This instance's name (str).")
    user_syncs = Attribute("USER_SYNC table: instance -> {(user, device): time ms}; read "
                           "only (the bookkeeping pages copy it at C level, off the reactor).")
    federation_acks = Attribute("FEDERATION_ACK table: instance -> token; read only.")
    user_ips = Attribute("USER_IP table: (user, device) -> fields; read only.")

    def open_connections() -> list[ConnectionSeen]:
        """The open connections, in the order they came."""

    def last_lost(name: str) -> float | None:
        """When the last accepted connection of the peer ``name`` closed
        (clock seconds), None if none did (or long forgotten)."""

    def recent_disconnects() -> list[Disconnect]:
        """The last disconnects, newest last (bounded)."""

    def reader_positions() -> dict[Key, int | None]:
        """Each remote (stream, writer) read here: the position delivered
        to the consumers, None before the first."""

    def reader_lag() -> dict[Key, int]:
        """Each reader's lag: tokens announced but not yet delivered."""

    def reader_heard() -> set[Key]:
        """The keys read here that a POSITION or RDATA arrived for since start."""

    def reader_heard_at() -> dict[Key, float]:
        """When the last POSITION or RDATA of each read key arrived (clock
        seconds); a key never heard is absent."""

    def announced_positions() -> dict[Key, int]:
        """This instance's writers: the last position announced of each."""

    def idle() -> bool:
        """Nothing queued for any reader, no claim waiting for a check, no
        fan-out running."""

    def findings() -> list["Finding"]:
        """What the core itself found wrong and holds until it is mended
        (a reader stopped at trimmed facts, an audit mismatch)."""

    def bookkeeping_samples() -> list["Sample"]:
        """The USER_SYNC / FEDERATION_ACK gauges' samples (safe off the
        reactor: a metrics scrape thread reads them)."""
