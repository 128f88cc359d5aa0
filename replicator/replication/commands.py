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
containing one).  JSON is compact and newline-free (orjson; integers outside
the 64-bit range and lone surrogates fall back to the standard library with
ASCII escapes), decoded by the standard library so that integers of any size
round-trip exactly; ``NaN``/``Infinity`` and out-of-range floats are rejected.

The RDATA fan-out does not go through the classes: :func:`encode_rdata_lines`
and :func:`encode_position_line` build the wire bytes directly, once per fact,
for writing to every connection.
"""

import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple, Type

import orjson

#: Default maximum length of one line in bytes, without the ``\n``.
MAX_LINE_LENGTH = 16384

_EXCERPT = 80


class CommandParseError(Exception):
    """A line that is not a valid command.

    ``str()`` is a short, single-line description (values quoted and cut to
    a few dozen characters) meant to follow ``ERROR failed to parse line: ``.
    """


def _excerpt(text: str) -> str:
    if len(text) > _EXCERPT:
        return repr(text[:_EXCERPT]) + "..."
    return repr(text)


#: The largest stream token or other integer field: a 63-bit integer, as
#: in a PostgreSQL ``bigint`` sequence.
MAX_INTEGER = 2**63 - 1
_MAX_DIGITS = len(str(MAX_INTEGER))


def _parse_int(text: str, what: str) -> int:
    """A decimal integer from 0 to :data:`MAX_INTEGER`, ASCII digits only
    (no sign).  The length is checked before conversion, so a number of any
    size is a :class:`CommandParseError`, never Python's ``ValueError`` for
    over-long integer strings."""
    if not (text.isascii() and text.isdigit()):
        raise CommandParseError(f"{what} is not an integer: {_excerpt(text)}")
    if len(text) > _MAX_DIGITS or int(text) > MAX_INTEGER:
        raise CommandParseError(f"{what} is out of range (0 to 2**63-1): {_excerpt(text)}")
    return int(text)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:_EXCERPT]}")
    return value


_decoder = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_parse_float)


def decode_json(text: str, what: str) -> Any:
    """Decode one JSON value of a command, or raise :class:`CommandParseError`."""
    try:
        return _decoder.decode(text)
    except (ValueError, RecursionError) as e:
        # JSONDecodeError is a ValueError; its message is short and one line.
        raise CommandParseError(f"invalid JSON in {what}: {_excerpt(str(e))}") from None


def encode_json(value: Any) -> bytes:
    """Compact, newline-free JSON bytes for ``value``.

    orjson for speed; values orjson refuses (integers beyond 64 bits, lone
    surrogates, tuple subclasses) are encoded by the standard library with
    ASCII escapes.  Raises ``TypeError``/``ValueError`` for what is not JSON.
    """
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("ascii")


def _split(rest: str, count: int, fields: str) -> List[str]:
    """Split ``rest`` into exactly ``count`` space-separated fields; the last
    one keeps any further spaces."""
    parts = rest.split(" ", count - 1)
    if len(parts) != count:
        raise CommandParseError(f"expected {fields}, got {len(parts)} field(s)")
    return parts


def _need(value: str, what: str) -> str:
    if not value:
        raise CommandParseError(f"empty {what}")
    return value


def _need_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise CommandParseError(f"{what} is not a string")
    return value


class Command:
    """Base of every command class."""

    __slots__ = ()
    NAME: ClassVar[str]

    @classmethod
    def from_line(cls, rest: str) -> "Command":
        raise NotImplementedError

    def to_line(self) -> str:
        raise NotImplementedError


# ---------------------------------------------------------------- text only


@dataclass(frozen=True, slots=True)
class ServerCommand(Command):
    """``SERVER <server_name>``: first line the server sends; names the
    deployment so that a client can detect it reached the wrong one."""

    NAME: ClassVar[str] = "SERVER"
    server_name: str

    @classmethod
    def from_line(cls, rest: str) -> "ServerCommand":
        return cls(_need(rest, "server name"))

    def to_line(self) -> str:
        return "SERVER " + self.server_name


@dataclass(frozen=True, slots=True)
class ErrorCommand(Command):
    """``ERROR <free text>``: the sender usually closes right after."""

    NAME: ClassVar[str] = "ERROR"
    message: str

    @classmethod
    def from_line(cls, rest: str) -> "ErrorCommand":
        return cls(rest)

    def to_line(self) -> str:
        return "ERROR " + self.message


@dataclass(frozen=True, slots=True)
class PingCommand(Command):
    """``PING <free text>`` (usually a millisecond timestamp): keepalive."""

    NAME: ClassVar[str] = "PING"
    data: str

    @classmethod
    def from_line(cls, rest: str) -> "PingCommand":
        return cls(rest)

    def to_line(self) -> str:
        return "PING " + self.data


@dataclass(frozen=True, slots=True)
class NameCommand(Command):
    """``NAME <client_name>``: the client's instance name, for logs, metrics
    and the writer check."""

    NAME: ClassVar[str] = "NAME"
    client_name: str

    @classmethod
    def from_line(cls, rest: str) -> "NameCommand":
        return cls(_need(rest, "client name"))

    def to_line(self) -> str:
        return "NAME " + self.client_name


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


@dataclass(frozen=True, slots=True)
class ClearUserSyncCommand(Command):
    """``CLEAR_USER_SYNC <instance_id>``: forget that instance's USER_SYNCs."""

    NAME: ClassVar[str] = "CLEAR_USER_SYNC"
    instance_id: str

    @classmethod
    def from_line(cls, rest: str) -> "ClearUserSyncCommand":
        return cls(_need(rest, "instance id"))

    def to_line(self) -> str:
        return "CLEAR_USER_SYNC " + self.instance_id


@dataclass(frozen=True, slots=True)
class RemoteServerUpCommand(Command):
    """``REMOTE_SERVER_UP <server_name>``: relayed to every other connection."""

    NAME: ClassVar[str] = "REMOTE_SERVER_UP"
    server_name: str

    @classmethod
    def from_line(cls, rest: str) -> "RemoteServerUpCommand":
        return cls(_need(rest, "server name"))

    def to_line(self) -> str:
        return "REMOTE_SERVER_UP " + self.server_name


@dataclass(frozen=True, slots=True)
class NewActiveTaskCommand(Command):
    """``NEW_ACTIVE_TASK <task_id>``: relayed."""

    NAME: ClassVar[str] = "NEW_ACTIVE_TASK"
    task_id: str

    @classmethod
    def from_line(cls, rest: str) -> "NewActiveTaskCommand":
        return cls(_need(rest, "task id"))

    def to_line(self) -> str:
        return "NEW_ACTIVE_TASK " + self.task_id


@dataclass(frozen=True, slots=True)
class CancelTaskCommand(Command):
    """``CANCEL_TASK <task_id>``: relayed."""

    NAME: ClassVar[str] = "CANCEL_TASK"
    task_id: str

    @classmethod
    def from_line(cls, rest: str) -> "CancelTaskCommand":
        return cls(_need(rest, "task id"))

    def to_line(self) -> str:
        return "CANCEL_TASK " + self.task_id


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
    token: Optional[int]
    row: list

    @classmethod
    def from_line(cls, rest: str) -> "RdataCommand":
        stream_name, instance_name, token_text, row_json = _split(
            rest, 4, "<stream_name> <instance_name> <token> <row_json>"
        )
        _need(stream_name, "stream name")
        _need(instance_name, "instance name")
        token = None if token_text == "batch" else _parse_int(token_text, "token")
        row = decode_json(row_json, "row")
        if not isinstance(row, list):
            raise CommandParseError("row is not a JSON array")
        return cls(stream_name, instance_name, token, row)

    def to_line(self) -> str:
        token = "batch" if self.token is None else str(self.token)
        return "RDATA %s %s %s %s" % (
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
        stream_name, instance_name, prev_text, new_text = _split(
            rest, 4, "<stream_name> <instance_name> <prev_token> <new_token>"
        )
        return cls(
            _need(stream_name, "stream name"),
            _need(instance_name, "instance name"),
            _parse_int(prev_text, "prev_token"),
            _parse_int(new_text, "new_token"),
        )

    def to_line(self) -> str:
        return "POSITION %s %s %d %d" % (
            self.stream_name,
            self.instance_name,
            self.prev_token,
            self.new_token,
        )


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
    device_id: Optional[str]
    is_syncing: bool
    last_sync_ms: int

    @classmethod
    def from_line(cls, rest: str) -> "UserSyncCommand":
        instance_id, user_id, device_id, state, last_sync = _split(
            rest, 5, "<instance_id> <user_id> <device_id> <start|end> <last_sync_ms>"
        )
        if state == "start":
            is_syncing = True
        elif state == "end":
            is_syncing = False
        else:
            raise CommandParseError(f"state is neither start nor end: {_excerpt(state)}")
        return cls(
            _need(instance_id, "instance id"),
            _need(user_id, "user id"),
            None if device_id == "None" else device_id,
            is_syncing,
            _parse_int(last_sync, "last_sync_ms"),
        )

    def to_line(self) -> str:
        return "USER_SYNC %s %s %s %s %d" % (
            self.instance_id,
            self.user_id,
            "None" if self.device_id is None else self.device_id,
            "start" if self.is_syncing else "end",
            self.last_sync_ms,
        )


@dataclass(frozen=True, slots=True)
class FederationAckCommand(Command):
    """``FEDERATION_ACK <instance_name> <token>``: the sender has processed
    the federation stream up to ``token``."""

    NAME: ClassVar[str] = "FEDERATION_ACK"
    instance_name: str
    token: int

    @classmethod
    def from_line(cls, rest: str) -> "FederationAckCommand":
        instance_name, token = _split(rest, 2, "<instance_name> <token>")
        return cls(_need(instance_name, "instance name"), _parse_int(token, "token"))

    def to_line(self) -> str:
        return "FEDERATION_ACK %s %d" % (self.instance_name, self.token)


@dataclass(frozen=True, slots=True)
class UserIpCommand(Command):
    """``USER_IP <user_id> <[access_token, ip, user_agent, device_id,
    last_seen]>``: a client IP seen by a worker."""

    NAME: ClassVar[str] = "USER_IP"
    user_id: str
    access_token: str
    ip: str
    user_agent: str
    device_id: Optional[str]
    last_seen: int

    @classmethod
    def from_line(cls, rest: str) -> "UserIpCommand":
        user_id, payload = _split(rest, 2, "<user_id> <json>")
        _need(user_id, "user id")
        values = decode_json(payload, "USER_IP payload")
        if not isinstance(values, list) or len(values) != 5:
            raise CommandParseError(
                "USER_IP payload is not [access_token, ip, user_agent, device_id, last_seen]"
            )
        access_token, ip, user_agent, device_id, last_seen = values
        if device_id is not None:
            _need_str(device_id, "device_id")
        if not isinstance(last_seen, int) or isinstance(last_seen, bool):
            raise CommandParseError("last_seen is not an integer")
        return cls(
            user_id,
            _need_str(access_token, "access_token"),
            _need_str(ip, "ip"),
            _need_str(user_agent, "user_agent"),
            device_id,
            last_seen,
        )

    def to_line(self) -> str:
        payload = encode_json(
            [self.access_token, self.ip, self.user_agent, self.device_id, self.last_seen]
        )
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
            raise CommandParseError("LOCK_RELEASED payload is not [instance_name, lock_name, lock_key]")
        return cls(*(_need_str(v, "lock field") for v in values))

    def to_line(self) -> str:
        payload = encode_json([self.instance_name, self.lock_name, self.lock_key])
        return "LOCK_RELEASED " + payload.decode("utf-8")


# ---------------------------------------------------------------- registry

ALL_COMMANDS: Tuple[Type[Command], ...] = (
    ServerCommand,
    RdataCommand,
    PositionCommand,
    ErrorCommand,
    PingCommand,
    NameCommand,
    ReplicateCommand,
    UserSyncCommand,
    ClearUserSyncCommand,
    FederationAckCommand,
    UserIpCommand,
    RemoteServerUpCommand,
    LockReleasedCommand,
    NewActiveTaskCommand,
    CancelTaskCommand,
)

COMMANDS_BY_NAME: Dict[str, Type[Command]] = {cls.NAME: cls for cls in ALL_COMMANDS}

#: Names the server may send (docs/protocol.md, "from" column: S).
SERVER_COMMANDS = frozenset(
    {
        "SERVER",
        "RDATA",
        "POSITION",
        "ERROR",
        "PING",
        "REMOTE_SERVER_UP",
        "LOCK_RELEASED",
        "NEW_ACTIVE_TASK",
        "CANCEL_TASK",
    }
)

#: Names a client may send (docs/protocol.md, "from" column: C).
CLIENT_COMMANDS = frozenset(
    {
        "ERROR",
        "PING",
        "NAME",
        "REPLICATE",
        "USER_SYNC",
        "CLEAR_USER_SYNC",
        "FEDERATION_ACK",
        "USER_IP",
        "REMOTE_SERVER_UP",
        "LOCK_RELEASED",
        "NEW_ACTIVE_TASK",
        "CANCEL_TASK",
    }
)

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
        raise CommandParseError(f"unknown command {_excerpt(name)}")
    try:
        return cls.from_line(rest)
    except CommandParseError as e:
        raise CommandParseError(f"{name}: {e}") from None


# ---------------------------------------------------------------- fan-out encoding


class EncodedLines(list):
    """Wire lines (each ending in ``b"\\n"``) plus ``dropped``: how many rows
    were left out because their line would exceed the maximum length or they
    are not JSON-serializable.  The caller logs and counts those.

    :func:`joined` concatenates the lines once and keeps the result, so a
    fan-out hands the same bytes object to every connection.  Invariant:
    the list is not changed once it was joined (it is built, then only
    read)."""

    __slots__ = ("dropped", "_joined")

    def __init__(self, lines: Iterable[bytes] = ()) -> None:
        super().__init__(lines)
        self.dropped = 0
        self._joined: Optional[bytes] = None


def joined(lines: Sequence[bytes]) -> bytes:
    """The concatenation of ``lines``: what one ``transport.write`` sends
    instead of a ``writeSequence`` of them (whose cost grows with the number
    of lines, per connection).  Computed once per :class:`EncodedLines`."""
    if type(lines) is EncodedLines:
        data = lines._joined
        if data is None:
            data = lines._joined = b"".join(lines)
        return data
    if len(lines) == 1:
        return lines[0]
    return b"".join(lines)


def encode_rdata_lines(
    stream_name: str,
    instance_name: str,
    updates: Sequence[Tuple[int, Sequence[Any]]],
    max_line_length: int = MAX_LINE_LENGTH,
) -> EncodedLines:
    """Encode ``(token, row)`` pairs as RDATA wire lines, once for all
    connections.

    ``updates`` is in ascending token order; consecutive pairs with the same
    token form a batch: every line of it but the last carries ``batch``, the
    last one the token.  Each row is encoded once (orjson) and concatenated
    with a prefix.

    A row whose line would be longer than ``max_line_length`` bytes (newline
    excluded) is dropped and counted in the result's ``dropped``; the batch
    it belonged to still ends with a numeric line if any of its rows remain.
    The bound is checked against the longer of ``batch`` and the token, so a
    row within a few bytes of the limit may be dropped even as a batch line.

    Fast path: every line built in one comprehension, and the bound checked
    on the longest line, conservatively (with the widest difference between
    the token's and ``batch``'s prefix added).  If a row might be dropped or
    orjson refuses a row, the rows are encoded one by one instead
    (:func:`_encode_rdata_lines_each`): the same bytes either way.
    """
    if not isinstance(updates, (list, tuple)):
        updates = list(updates)
    if not updates:
        return EncodedLines()
    prefix = b"RDATA " + stream_name.encode() + b" " + instance_name.encode() + b" "
    batch_prefix = prefix + b"batch "
    dumps = orjson.dumps
    newline = orjson.OPT_APPEND_NEWLINE
    following = [t for t, _ in updates]
    following.append(None)
    try:
        lines = EncodedLines([
            (batch_prefix if token == following[i] else b"%s%d " % (prefix, token))
            + dumps(row, option=newline)
            for i, (token, row) in enumerate(updates, 1)
        ])
    except TypeError:
        return _encode_rdata_lines_each(stream_name, instance_name, updates, max_line_length)
    # A line's prefix is the token's or "batch"'s; the row-by-row bound uses
    # the longer of the two, which differ by at most this much.
    slack = max(len(b"batch "), len(b"%d " % max(abs(following[0]), abs(updates[-1][0]))) + 1)
    if max(map(len, lines)) + slack > max_line_length + 1:
        return _encode_rdata_lines_each(stream_name, instance_name, updates, max_line_length)
    return lines


def _encode_rdata_lines_each(
    stream_name: str,
    instance_name: str,
    updates: Iterable[Tuple[int, Sequence[Any]]],
    max_line_length: int = MAX_LINE_LENGTH,
) -> EncodedLines:
    """:func:`encode_rdata_lines` row by row: drops the rows whose line
    would be too long and the rows orjson and the JSON fallback refuse."""
    prefix = b"RDATA " + stream_name.encode() + b" " + instance_name.encode() + b" "
    batch_prefix = prefix + b"batch "
    out = EncodedLines()
    append = out.append
    dumps = orjson.dumps
    newline = orjson.OPT_APPEND_NEWLINE
    dropped = 0
    # The previous kept row of the current token: written as a batch line if
    # another kept row of the same token follows, else with the token.
    pending: Optional[bytes] = None
    token_prefix = b""
    current: Optional[int] = None
    room = 0
    for token, row in updates:
        if token != current:
            if pending is not None:
                append(token_prefix + pending)
                pending = None
            current = token
            token_prefix = prefix + b"%d " % token
            # Room for the JSON plus its newline.
            room = max_line_length + 1 - max(len(token_prefix), len(batch_prefix))
        try:
            data = dumps(row, option=newline)
        except TypeError:
            try:
                data = encode_json(row) + b"\n"
            except (TypeError, ValueError):
                dropped += 1
                continue
        if len(data) > room:
            dropped += 1
            continue
        if pending is not None:
            append(batch_prefix + pending)
        pending = data
    if pending is not None:
        append(token_prefix + pending)
    out.dropped = dropped
    return out


def encode_position_line(stream_name: str, instance_name: str, prev_token: int, new_token: int) -> bytes:
    """The POSITION wire line, ending in ``b"\\n"``."""
    return b"POSITION %s %s %d %d\n" % (
        stream_name.encode(),
        instance_name.encode(),
        prev_token,
        new_token,
    )
