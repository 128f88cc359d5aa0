"""The replication commands: parsing and serializing single lines.

Every command of ``docs/protocol.md`` is a small immutable class with

* ``NAME``: the word that starts its line;
* ``from_line(rest)``: build it from the text after ``NAME + " "`` (raises
  :class:`CommandParseError` on anything malformed);
* ``to_line()``: the whole line, without the newline, exactly as Synapse
  writes it: always ``NAME + " " + rest``, so a command without arguments is
  written ``"REPLICATE "`` with a trailing space.

Invariants the encoders rely on and callers must keep: stream, instance and
user names, instance IDs and device IDs contain no space and no newline, and
no text field contains a newline (:mod:`.protocol` refuses to write a line
containing one).  JSON is written by :mod:`replicator.jsontext` (compact,
newline-free) and read by :mod:`.fields` (integers of any size round-trip
exactly); ``NaN``/``Infinity`` are refused both ways, and out-of-range floats
on reading.  The fields of a line are parsed by :mod:`.fields`.

The RDATA fan-out does not go through the classes: it writes the bytes of
:mod:`.wire`, built once per fact for every connection.
"""

import dataclasses
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar

from ...jsontext import encode_json
from .parsing import (
    CommandParseError,
    decode_json,
    excerpt,
    need,
    need_str,
    parse_int,
    split_fields,
)


class Command:
    """Base of every command class."""

    __slots__ = ()
    NAME: ClassVar[str]

    @classmethod
    def from_line(cls, rest: str) -> "Command":
        raise NotImplementedError

    def to_line(self) -> str:
        raise NotImplementedError

    def fields(self) -> dict[str, Any]:
        """The command's arguments by their protocol names (``tail --json``)."""
        return {f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]


# ---------------------------------------------------------------- text only


@dataclass(frozen=True, slots=True)
class TextCommand(Command):
    """A command whose one argument is the rest of the line, kept as is
    (spaces included).  ``WHAT`` names it in parse errors; None means it may
    be empty.  Subclasses give ``text`` its meaningful name as a read-only
    alias (``ServerCommand.server_name``...)."""

    WHAT: ClassVar[str | None] = None
    text: str

    @classmethod
    def from_line(cls, rest: str) -> "TextCommand":
        if cls.WHAT is not None:
            need(rest, cls.WHAT)
        return cls(rest)

    def to_line(self) -> str:
        return self.NAME + " " + self.text

    def fields(self) -> dict[str, Any]:
        # The subclass's alias is the argument's name (server_name, data...).
        for klass in type(self).__mro__:
            for name, value in vars(klass).items():
                if isinstance(value, property) and value.fget is _TEXT:
                    return {name: self.text}
        return {"text": self.text}


_TEXT = attrgetter("text")


def _alias(doc: str) -> property:
    return property(_TEXT, doc=doc)


class ServerCommand(TextCommand):
    """``SERVER <server_name>``: first line the server sends; names the
    deployment so that a client can detect it reached the wrong one."""

    __slots__ = ()
    NAME: ClassVar[str] = "SERVER"
    WHAT: ClassVar[str | None] = "server name"
    server_name = _alias("The deployment's server name.")


class ErrorCommand(TextCommand):
    """``ERROR <free text>``: the sender usually closes right after."""

    __slots__ = ()
    NAME: ClassVar[str] = "ERROR"
    message = _alias("The free text.")


class PingCommand(TextCommand):
    """``PING <free text>`` (usually a millisecond timestamp): keepalive."""

    __slots__ = ()
    NAME: ClassVar[str] = "PING"
    data = _alias("The free text.")


class NameCommand(TextCommand):
    """``NAME <client_name>``: the client's instance name, for logs, metrics
    and the writer check."""

    __slots__ = ()
    NAME: ClassVar[str] = "NAME"
    WHAT: ClassVar[str | None] = "client name"
    client_name = _alias("The client's instance name.")


class ClearUserSyncCommand(TextCommand):
    """``CLEAR_USER_SYNC <instance_id>``: forget that instance's USER_SYNCs."""

    __slots__ = ()
    NAME: ClassVar[str] = "CLEAR_USER_SYNC"
    WHAT: ClassVar[str | None] = "instance id"
    instance_id = _alias("The instance whose USER_SYNCs end.")


class RemoteServerUpCommand(TextCommand):
    """``REMOTE_SERVER_UP <server_name>``: relayed to every other connection."""

    __slots__ = ()
    NAME: ClassVar[str] = "REMOTE_SERVER_UP"
    WHAT: ClassVar[str | None] = "server name"
    server_name = _alias("The remote server that came back.")


class NewActiveTaskCommand(TextCommand):
    """``NEW_ACTIVE_TASK <task_id>``: relayed."""

    __slots__ = ()
    NAME: ClassVar[str] = "NEW_ACTIVE_TASK"
    WHAT: ClassVar[str | None] = "task id"
    task_id = _alias("The task's ID.")


class CancelTaskCommand(TextCommand):
    """``CANCEL_TASK <task_id>``: relayed."""

    __slots__ = ()
    NAME: ClassVar[str] = "CANCEL_TASK"
    WHAT: ClassVar[str | None] = "task id"
    task_id = _alias("The task's ID.")


class AuthChallengeCommand(TextCommand):
    """``AUTH_CHALLENGE <nonce>``: replicator's extension, sent by a
    replicator server only, only to a client whose ``NAME`` is a writer
    with a secret configured there (:mod:`..transport.proof`); never to a
    Synapse peer."""

    __slots__ = ()
    NAME: ClassVar[str] = "AUTH_CHALLENGE"
    WHAT: ClassVar[str | None] = "nonce"
    nonce = _alias("The server's fresh nonce, to be signed with the writer's secret.")


class AuthCommand(TextCommand):
    """``AUTH <proof>``: replicator's extension, the answer to
    ``AUTH_CHALLENGE`` (never sent unasked)."""

    __slots__ = ()
    NAME: ClassVar[str] = "AUTH"
    WHAT: ClassVar[str | None] = "proof"
    proof = _alias("The HMAC of the challenge under the writer's secret (hex).")


@dataclass(frozen=True, slots=True)
class ReplicateCommand(Command):
    """``REPLICATE``: "send me POSITION for every stream".  Written with a
    trailing space like Synapse; parsed with or without it."""

    NAME: ClassVar[str] = "REPLICATE"

    @classmethod
    def from_line(cls, rest: str) -> "ReplicateCommand":
        if rest:
            raise CommandParseError("REPLICATE takes no arguments")
        return cls()

    def to_line(self) -> str:
        return "REPLICATE "


# ---------------------------------------------------------------- streams


@dataclass(frozen=True, slots=True)
class RdataCommand(Command):
    """``RDATA <stream> <instance> <token|batch> <row_json>``: one row.

    ``token`` is None for a ``batch`` line (more rows with the same stream
    ID follow; the last one carries it).  ``row`` is the decoded JSON array.
    """

    NAME: ClassVar[str] = "RDATA"
    stream_name: str
    instance_name: str
    token: int | None
    row: list[Any]

    @classmethod
    def from_line(cls, rest: str) -> "RdataCommand":
        stream_name, instance_name, token_text, row_json = split_fields(
            rest, 4, "<stream_name> <instance_name> <token> <row_json>"
        )
        need(stream_name, "stream name")
        need(instance_name, "instance name")
        token = None if token_text == "batch" else parse_int(token_text, "token")
        row = decode_json(row_json, "row")
        if not isinstance(row, list):
            raise CommandParseError("row is not a JSON array")
        return cls(stream_name, instance_name, token, row)

    def to_line(self) -> str:
        token = "batch" if self.token is None else str(self.token)
        return "RDATA {} {} {} {}".format(
            self.stream_name,
            self.instance_name,
            token,
            encode_json(self.row).decode("utf-8"),
        )


@dataclass(frozen=True, slots=True)
class PositionCommand(Command):
    """``POSITION <stream> <instance> <prev_token> <new_token>``: the writer
    has no unsent rows in ``(prev_token, new_token]``."""

    NAME: ClassVar[str] = "POSITION"
    stream_name: str
    instance_name: str
    prev_token: int
    new_token: int

    @classmethod
    def from_line(cls, rest: str) -> "PositionCommand":
        stream_name, instance_name, prev_text, new_text = split_fields(
            rest, 4, "<stream_name> <instance_name> <prev_token> <new_token>"
        )
        return cls(need(stream_name, "stream name"), need(instance_name, "instance name"),
                   parse_int(prev_text, "prev_token"), parse_int(new_text, "new_token"))

    def to_line(self) -> str:
        return (f"POSITION {self.stream_name} {self.instance_name} {self.prev_token:d} "
                f"{self.new_token:d}")


def rdata_row(line: bytes) -> list[Any]:
    """The row of an RDATA line already parsed once (its wire bytes, with
    or without the newline): a partial batch is kept as its lines and its
    rows decoded only when the fact is handed on."""
    row: list[Any] = decode_json(line.split(b" ", 4)[4].decode("utf-8", "surrogatepass"), "row")
    return row


# ---------------------------------------------------------------- client state


@dataclass(frozen=True, slots=True)
class UserSyncCommand(Command):
    """``USER_SYNC <instance_id> <user_id> <device_id|None> <start|end>
    <last_sync_ms>``: a user started or stopped syncing on a worker.

    ``device_id`` None is written as the literal ``None`` (so a device
    literally named "None" cannot be told apart, as in Synapse).
    """

    NAME: ClassVar[str] = "USER_SYNC"
    instance_id: str
    user_id: str
    device_id: str | None
    is_syncing: bool
    last_sync_ms: int

    @classmethod
    def from_line(cls, rest: str) -> "UserSyncCommand":
        instance_id, user_id, device_id, state, last_sync = split_fields(
            rest, 5, "<instance_id> <user_id> <device_id> <start|end> <last_sync_ms>"
        )
        if state == "start":
            is_syncing = True
        elif state == "end":
            is_syncing = False
        else:
            raise CommandParseError(f"state is neither start nor end: {excerpt(state)}")
        return cls(need(instance_id, "instance id"), need(user_id, "user id"),
                   None if device_id == "None" else device_id, is_syncing,
                   parse_int(last_sync, "last_sync_ms"))

    def to_line(self) -> str:
        device = "None" if self.device_id is None else self.device_id
        state = "start" if self.is_syncing else "end"
        return (f"USER_SYNC {self.instance_id} {self.user_id} {device} {state} "
                f"{self.last_sync_ms:d}")


@dataclass(frozen=True, slots=True)
class FederationAckCommand(Command):
    """``FEDERATION_ACK <instance_name> <token>``: the sender has processed
    the federation stream up to ``token``."""

    NAME: ClassVar[str] = "FEDERATION_ACK"
    instance_name: str
    token: int

    @classmethod
    def from_line(cls, rest: str) -> "FederationAckCommand":
        instance_name, token = split_fields(rest, 2, "<instance_name> <token>")
        return cls(need(instance_name, "instance name"), parse_int(token, "token"))

    def to_line(self) -> str:
        return f"FEDERATION_ACK {self.instance_name} {self.token:d}"


@dataclass(frozen=True, slots=True)
class UserIpCommand(Command):
    """``USER_IP <user_id> <[access_token, ip, user_agent, device_id,
    last_seen]>``: a client IP seen by a worker."""

    NAME: ClassVar[str] = "USER_IP"
    user_id: str
    access_token: str
    ip: str
    user_agent: str
    device_id: str | None
    last_seen: int

    @classmethod
    def from_line(cls, rest: str) -> "UserIpCommand":
        user_id, payload = split_fields(rest, 2, "<user_id> <json>")
        need(user_id, "user id")
        values = decode_json(payload, "USER_IP payload")
        if not isinstance(values, list) or len(values) != 5:
            raise CommandParseError(
                "USER_IP payload is not [access_token, ip, user_agent, device_id, last_seen]")
        access_token, ip, user_agent, device_id, last_seen = values
        if device_id is not None:
            need_str(device_id, "device_id")
        if not isinstance(last_seen, int) or isinstance(last_seen, bool):
            raise CommandParseError("last_seen is not an integer")
        return cls(user_id, need_str(access_token, "access_token"), need_str(ip, "ip"),
                   need_str(user_agent, "user_agent"), device_id, last_seen)

    def to_line(self) -> str:
        payload = encode_json(
            [self.access_token, self.ip, self.user_agent, self.device_id, self.last_seen])
        return "USER_IP " + self.user_id + " " + payload.decode("utf-8")


@dataclass(frozen=True, slots=True)
class LockReleasedCommand(Command):
    """``LOCK_RELEASED <[instance_name, lock_name, lock_key]>``: relayed."""

    NAME: ClassVar[str] = "LOCK_RELEASED"
    instance_name: str
    lock_name: str
    lock_key: str

    @classmethod
    def from_line(cls, rest: str) -> "LockReleasedCommand":
        values = decode_json(rest, "LOCK_RELEASED payload")
        if not isinstance(values, list) or len(values) != 3:
            raise CommandParseError(
                "LOCK_RELEASED payload is not [instance_name, lock_name, lock_key]")
        return cls(*(need_str(v, "lock field") for v in values))

    def to_line(self) -> str:
        payload = encode_json([self.instance_name, self.lock_name, self.lock_key])
        return "LOCK_RELEASED " + payload.decode("utf-8")


# ---------------------------------------------------------------- registry

ALL_COMMANDS: tuple[type[Command], ...] = (
    ServerCommand, RdataCommand, PositionCommand, ErrorCommand, PingCommand, NameCommand,
    ReplicateCommand, UserSyncCommand, ClearUserSyncCommand, FederationAckCommand,
    UserIpCommand, RemoteServerUpCommand, LockReleasedCommand, NewActiveTaskCommand,
    CancelTaskCommand, AuthChallengeCommand, AuthCommand,
)

COMMANDS_BY_NAME: dict[str, type[Command]] = {cls.NAME: cls for cls in ALL_COMMANDS}

#: Names the server may send (docs/protocol.md, "from" column: S).
SERVER_COMMANDS = frozenset({
    "SERVER", "RDATA", "POSITION", "ERROR", "PING", "REMOTE_SERVER_UP", "LOCK_RELEASED",
    "NEW_ACTIVE_TASK", "CANCEL_TASK", "AUTH_CHALLENGE",
})

#: Names a client may send (docs/protocol.md, "from" column: C).
CLIENT_COMMANDS = frozenset({
    "ERROR", "PING", "NAME", "REPLICATE", "USER_SYNC", "CLEAR_USER_SYNC", "FEDERATION_ACK",
    "USER_IP", "REMOTE_SERVER_UP", "LOCK_RELEASED", "NEW_ACTIVE_TASK", "CANCEL_TASK", "AUTH",
})

#: Names a client may send only for streams its instance is a configured
#: writer of (it forwards its own rows to the server, which relays them).
CLIENT_WRITER_COMMANDS = frozenset({"RDATA", "POSITION"})


def parse_line(line: str) -> Command:
    """Parse one line (no newline, no trailing ``\\r``) into a command.

    ``NAME`` is the text before the first space.  Raises
    :class:`CommandParseError` for an unknown name or a malformed rest.
    """
    idx = line.find(" ")
    if idx < 0:
        name, rest = line, ""
    else:
        name, rest = line[:idx], line[idx + 1 :]
    cls = COMMANDS_BY_NAME.get(name)
    if cls is None:
        raise CommandParseError(f"unknown command {excerpt(name)}")
    try:
        return cls.from_line(rest)
    except CommandParseError as e:
        raise CommandParseError(f"{name}: {e}") from None
