"""What both Redis transports (:mod:`.redis`, one server; :mod:`.redis_cluster`,
a cluster) give the handler: the one logical connection of a bus
(:class:`RedisConnection`), and a message's way out (:func:`routed`: to its
channel, signed) and in (:func:`parse_message`, :func:`deliver`: our own
echo dropped, the rest handed to the handler as coming from that
connection).

Invariants: a message reaches the handler at most once, as the line heard
(``conn.current_line`` while it is dispatched); one that is not a command,
or names a command the handler lacks, is counted and dropped, never an
error; a handler's failure is logged and does not stop the bus.
"""

from collections.abc import Sequence
from typing import Any

from twisted.logger import Logger
from zope.interface import implementer

from ...logs.printable import printable
from ...observe import metrics
from ..interfaces import IRedisBus, IReplicationConnection, IReplicationHandler
from ..wire.commands import Command, parse_line
from .redis_channels import ChannelLayout

log = Logger(namespace="replicator.replication.transport.redis")

NAME = "redis"
OWN_INSTANCE_FIELDS = {"RDATA": "instance_name", "POSITION": "instance_name",
                       "USER_SYNC": "instance_id", "CLEAR_USER_SYNC": "instance_id",
                       "FEDERATION_ACK": "instance_name"}


@implementer(IReplicationConnection)
class RedisConnection:
    """What the handler sees as one connection: a bus, where every instance
    hears every line.  Not an :class:`.interfaces.IPeerConnection`: there is
    no one peer to refuse.  Its owner (an :class:`.interfaces.IRedisBus`)
    has the links."""

    #: Nobody connected to us: no relaying (every instance hears every
    #: line), our positions announced as it comes, our own writers only.
    accepted = False
    name = NAME  # for logs
    role = NAME  # the metrics label and the status page's role
    instance_name = None  # no one peer: every instance on the channel
    #: Lines go to the publisher at once (dropped while it is away).
    queued = 0
    queued_bytes = 0
    #: No one transport: the subscriber and the publisher are the owner's.
    transport = None

    def __init__(self, owner: IRedisBus) -> None:
        self._owner = owner
        self.closed = False
        #: The message being dispatched (bytes, no newline).
        self.current_line: bytes | None = None

    def __str__(self) -> str:
        """How log lines name it: ``redis channel <channel>``."""
        return f"redis channel {printable(self._owner.channel, 100)}"

    def pause_reading(self) -> None:
        """Stop reading the subscription (while a claim is checked)."""
        self._owner.pause_reading()

    def resume_reading(self) -> None:
        self._owner.resume_reading()

    def send_lines(self, lines: Sequence[bytes], command_name: str = "RDATA") -> bool:
        if self.closed:
            return False
        if self._owner.hold(lines, command_name):
            return True
        self._owner.publish_lines(lines)
        metrics.COMMANDS_OUT.labels(command_name, NAME).inc(len(lines))
        return True

    def send_command(self, cmd: Command) -> bool:
        return self.send_lines([(cmd.to_line() + "\n").encode("utf-8")], cmd.NAME)

    def stop(self, reason_text: str = "server stopping") -> None:
        self.closed = True


def text_of(message: Any) -> str:
    return message.decode("utf-8", "replace") if isinstance(message, bytes) else message


def routed(layout: ChannelLayout, lines: Sequence[bytes], channel: bytes | None,
           signer: Any) -> tuple[list[bytes], list[bytes]]:
    """The payloads of ``lines`` (no newline) and the channel of each:
    ``channel`` if given (Synapse's: nothing there is signed), else the
    layout's; signed by ``signer`` (a :class:`.redis_signing.Signer`) if any."""
    payloads = [line[:-1] if line.endswith(b"\n") else line for line in lines]
    if channel is not None:
        return payloads, [channel] * len(payloads)
    route = layout.route
    channels = [route(payload) for payload in payloads]
    if signer is not None:
        payloads = signer.sign(payloads, channels)
    return payloads, channels


def parse_message(message: str, own_prefixes: tuple[str, ...]) -> Command | None:
    """The command of one message heard on a channel; None for our own
    RDATA/POSITION echoed (not even parsed) and for a line we cannot parse
    (counted, a debug log)."""
    if message.startswith(own_prefixes):
        return None
    try:
        return parse_line(message.rstrip("\r\n"))
    except Exception as e:  # CommandParseError; anything else is a parser bug
        metrics.COMMANDS_DROPPED.labels("unknown", "unparsable").inc()
        log.debug("redis: ignoring line {line}: {error}", line=printable(message, 80),
                  error=printable(str(e) or type(e).__name__))
        return None


def deliver(handler: IReplicationHandler, conn: RedisConnection, cmd: Command, message: str,
            instance_name: str) -> None:
    """Hand ``cmd`` (of the line ``message``) to the handler as coming from
    ``conn``, unless it is our own echo or a command the handler lacks."""
    field = OWN_INSTANCE_FIELDS.get(cmd.NAME)
    if field is not None and getattr(cmd, field) == instance_name:
        return  # our own echo
    method = getattr(handler, "on_" + cmd.NAME, None)
    if method is None:
        metrics.COMMANDS_DROPPED.labels(cmd.NAME, "ignored").inc()
        return
    metrics.COMMANDS_IN.labels(cmd.NAME, NAME).inc()
    conn.current_line = message.rstrip("\r\n").encode("utf-8", "surrogatepass")
    try:
        method(conn, cmd)
    except Exception:
        log.failure("redis: handling {name} failed", name=cmd.NAME)
    finally:
        conn.current_line = None
