"""YAML → typed, validated configuration of one replicator instance.

Every mistake is reported as one :class:`ConfigError` whose text names the key
(as a dotted path, e.g. ``streams[1].columns[0]``) and the problem; the CLI
prints that line and exits with code 2 before anything listens.

Invariants every parser here keeps (new keys must too):

- a name is checked with ``fullmatch`` (``$`` in ``re.match`` accepts a
  trailing newline, which would split a line on the wire);
- every number has a range: integers through :func:`_int`, other numbers
  through :func:`_number`, both with a ``minimum`` and a ``maximum``
  (NaN and infinities are never in range);
- an error message is one line: values and unknown keys appear as ``repr``.

This module holds the parts every component shares: the database and the
streams.  Sections are parsed by small functions that take a mapping and the
key path it came from.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import yaml

# Always used with fullmatch.
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# Stream and instance names travel as single words on the wire: no space,
# no control character.
WIRE_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,200}")
#: Words PostgreSQL or SQLite refuse as an unquoted table, column or
#: sequence name (checked against both: CREATE, INSERT, SELECT ... GROUP BY).
#: Table and column names are written into SQL unquoted, so these are refused.
SQL_KEYWORDS = frozenset("""
    add all alter analyse analyze and any array as asc asymmetric authorization
    autoincrement between binary both case cast check collate collation column
    commit concurrently constraint create cross current_catalog current_date
    current_role current_schema current_time current_timestamp current_user
    default deferrable delete desc distinct do drop else end escape except
    exists false fetch for foreign freeze from full grant group having if ilike
    in index initially inner insert intersect into is isnull join lateral
    leading left like limit localtime localtimestamp natural not nothing
    notnull null offset on only or order outer overlaps placing primary raise
    references returning right select session_user set similar some symmetric
    table tablesample then to trailing transaction true union unique update
    user using values variadic verbose when where window with
""".split())
#: The table the replicator keeps positions in.
POSITIONS_TABLE = "stream_positions"
COLUMN_TYPES = ("text", "bigint", "boolean", "json")


class ConfigError(ValueError):
    """A configuration mistake: ``key`` names where, ``problem`` says what."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"config: {key}: {problem}")
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class ColumnConfig:
    """One column of a stream's RDATA row, in wire order."""

    name: str
    type: str  # one of COLUMN_TYPES
    nullable: bool = False
    # A json column stored as JSON text in a TEXT column (Synapse's tables;
    # presets only): decoded when read.
    json_text: bool = False


@dataclass(frozen=True)
class StreamConfig:
    """A stream: its backing table and who writes it.

    ``writer_column`` is None for a table without one (then the stream must
    have exactly one writer).  ``sequence`` defaults to ``<table>_seq``.
    """

    name: str
    table: str
    id_column: str
    writer_column: Optional[str]
    columns: Tuple[ColumnConfig, ...]
    sequence: str
    writers: Tuple[str, ...]
    timestamp_column: Optional[str] = None
    create: bool = True
    preset: Optional[str] = None  # e.g. "synapse/caches": a Synapse stream, read-only
    # The stream_name of its rows in stream_positions when it is not ``name``
    # (Synapse's presets: its ID generator's name, e.g. "presence_stream").
    positions_name: Optional[str] = None

    @property
    def positions_key(self) -> str:
        """The ``stream_name`` of this stream's ``stream_positions`` rows."""
        return self.positions_name or self.name

    @property
    def column_names(self) -> List[str]:
        return [c.name for c in self.columns]


@dataclass(frozen=True)
class DatabaseConfig:
    """Where the streams live: ``engine`` is ``sqlite`` or ``postgres``."""

    engine: str
    path: Optional[str] = None  # sqlite
    dsn: Optional[str] = None  # postgres
    pool_min: int = 1
    pool_max: int = 5
    write_group_max: int = 256  # facts per write transaction (group commit)


# ---------------------------------------------------------------- helpers
def _mapping(value: Any, key: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return type(value).__name__


def _key_name(name: Any) -> str:
    """A key as it may appear in a message: itself if it is a plain word,
    else its repr (one line whatever it holds)."""
    if isinstance(name, str) and IDENTIFIER.fullmatch(name):
        return name
    return repr(name)


def no_unknown(section: Mapping, allowed, key: str) -> None:
    """A ConfigError naming the first key of ``section`` not in ``allowed``
    (``key`` is the section's own path, "" at the top)."""
    for name in section:
        if name not in allowed:
            prefix = f"{key}." if key else ""
            raise ConfigError(f"{prefix}{_key_name(name)}", "unknown key")


def _sql_name(value: str, path: str) -> str:
    """An unquoted SQL identifier: valid, and no keyword of either engine."""
    if value.lower() in SQL_KEYWORDS:
        raise ConfigError(path, f"{value!r} is an SQL keyword")
    return value


def get_str(section: Mapping, name: str, key: str, default: Any = ..., pattern=None,
            what: str = "") -> Any:
    """``section[name]``: a non-empty string (matching ``pattern``, which
    ``what`` describes), else ``default``; missing without a default is a
    ConfigError naming ``key.name``."""
    path = f"{key}.{name}" if key else name
    if name not in section or section[name] is None:
        if default is ...:
            raise ConfigError(path, "missing")
        return default
    value = section[name]
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected a non-empty string, got {_kind(value)}")
    if pattern is not None and not pattern.fullmatch(value):
        raise ConfigError(path, f"{value!r} is not {what or 'valid'}")
    return value


def _int(section: Mapping, name: str, key: str, default: Any = ..., *, minimum: int,
         maximum: int) -> int:
    """An integer in ``[minimum, maximum]`` (both required: every number has
    a range)."""
    path = f"{key}.{name}" if key else name
    if name not in section:
        if default is ...:
            raise ConfigError(path, "missing")
        return default
    value = section[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"expected an integer, got {_kind(value)}")
    if not minimum <= value <= maximum:
        raise ConfigError(path, f"must be an integer from {minimum} to {maximum}, "
                                f"got {value}")
    return value


def get_number(section: Mapping, name: str, key: str, default: float, *, minimum: float,
               maximum: float) -> float:
    """A finite number (int or float) in ``[minimum, maximum]``."""
    path = f"{key}.{name}" if key else name
    value = section.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(path, f"expected a number, got {_kind(value)}")
    if not (math.isfinite(value) and minimum <= value <= maximum):
        raise ConfigError(path, f"must be a number from {minimum:g} to {maximum:g}, "
                                f"got {value}")
    return float(value)


def get_bool(section: Mapping, name: str, key: str, default: bool) -> bool:
    """``section[name]`` as a YAML boolean (``default`` if missing)."""
    path = f"{key}.{name}" if key else name
    value = section.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {_kind(value)}")
    return value


def _list(section: Mapping, name: str, key: str, default: Any = ...) -> list:
    path = f"{key}.{name}" if key else name
    if name not in section:
        if default is ...:
            raise ConfigError(path, "missing")
        return default
    value = section[name]
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list, got {_kind(value)}")
    return value


# ---------------------------------------------------------------- sections
#: Database connections (each one a pool thread and a server process).
MAX_POOL = 100
#: Facts in one group-commit transaction (its INSERT's parameters grow with it).
MAX_WRITE_GROUP = 10_000


def parse_database(value: Any, key: str = "database") -> DatabaseConfig:
    section = _mapping(value, key)
    if "sqlite" in section and "postgres" in section:
        raise ConfigError(key, "give either sqlite or postgres, not both")
    no_unknown(section, ("sqlite", "postgres", "pool_min", "pool_max", "write_group_max"), key)
    pool_min = _int(section, "pool_min", key, 1, minimum=1, maximum=MAX_POOL)
    pool_max = _int(section, "pool_max", key, 5, minimum=1, maximum=MAX_POOL)
    group = _int(section, "write_group_max", key, 256, minimum=1, maximum=MAX_WRITE_GROUP)
    if pool_max < pool_min:
        raise ConfigError(f"{key}.pool_max", f"must be at least pool_min ({pool_min})")
    if "sqlite" in section:
        path = get_str(section, "sqlite", key)
        return DatabaseConfig("sqlite", path=path, pool_min=1, pool_max=1,
                              write_group_max=group)
    if "postgres" in section:
        dsn = get_str(section, "postgres", key)
        _check_dsn(dsn, f"{key}.postgres")
        return DatabaseConfig("postgres", dsn=dsn, pool_min=pool_min, pool_max=pool_max,
                              write_group_max=group)
    raise ConfigError(key, "missing: give sqlite: PATH or postgres: DSN")


def _check_dsn(dsn: str, path: str) -> None:
    """A libpq connection string libpq can parse (its text is never quoted
    back: it may hold a password)."""
    try:
        import psycopg2
        from psycopg2.extensions import parse_dsn
    except ImportError:  # checked when connecting instead
        return
    try:
        parse_dsn(dsn)
    except psycopg2.Error:
        raise ConfigError(path, "is not a valid connection string (key=value pairs or a "
                                "postgresql:// URI)") from None


def parse_column(value: Any, key: str) -> ColumnConfig:
    if not isinstance(value, Mapping) or len(value) != 1:
        raise ConfigError(key, "expected one 'name: type' pair")
    (name, type_), = value.items()
    if not isinstance(name, str) or not IDENTIFIER.fullmatch(name):
        raise ConfigError(key, f"{name!r} is not a valid column name")
    _sql_name(name, key)
    if not isinstance(type_, str):
        raise ConfigError(f"{key}.{name}", f"expected a type name, got {_kind(type_)}")
    nullable = type_.endswith("?")
    base = type_[:-1] if nullable else type_
    if base not in COLUMN_TYPES:
        raise ConfigError(
            f"{key}.{name}",
            f"unknown type {type_!r} (one of {', '.join(COLUMN_TYPES)}, '?' for nullable)",
        )
    return ColumnConfig(name, base, nullable)


STREAM_KEYS = (
    "name", "table", "id_column", "writer_column", "columns", "sequence",
    "writers", "timestamp_column", "create", "preset",
)
#: What a preset fills in (and a config with ``preset:`` may not give).
PRESET_KEYS = ("table", "id_column", "writer_column", "columns", "sequence", "create")


def _apply_preset(section: Mapping, key: str) -> Tuple[Mapping, str, frozenset, Optional[str]]:
    """The stream section with its preset's layout filled in; the preset's
    name; the columns stored as JSON text."""
    from . import synapse

    preset = get_str(section, "preset", key)
    path = f"{key}.preset"
    kind, _, name = preset.partition("/")
    if kind != "synapse" or not name:
        raise ConfigError(path, f"unknown preset {preset!r} (presets: "
                                f"{', '.join('synapse/' + n for n in synapse.PRESETS)})")
    if name in synapse.REFUSED:
        raise ConfigError(path, f"Synapse's {name!r} stream {synapse.REFUSED[name]}")
    layout = synapse.PRESETS.get(name)
    if layout is None:
        raise ConfigError(path, f"unknown preset {preset!r} (presets: "
                                f"{', '.join('synapse/' + n for n in synapse.PRESETS)})")
    for given in PRESET_KEYS:
        if given in section:
            raise ConfigError(f"{key}.{given}", f"comes from the preset {preset!r} "
                                                f"(Synapse's own table): remove it")
    if section.get("name", name) != name:
        raise ConfigError(f"{key}.name", f"a {preset!r} stream is named {name!r} on the wire")
    filled = dict(section)
    filled.update({k: v for k, v in layout.items() if k not in ("json_text", "positions_name")})
    filled["name"] = name
    filled.setdefault("writers", [synapse.MAIN_PROCESS])
    return filled, preset, layout["json_text"], layout["positions_name"]


def parse_stream(value: Any, key: str) -> StreamConfig:
    section = _mapping(value, key)
    no_unknown(section, STREAM_KEYS, key)
    preset, json_text, positions_name = None, frozenset(), None
    if "preset" in section:
        section, preset, json_text, positions_name = _apply_preset(section, key)
    name = get_str(section, "name", key, pattern=WIRE_NAME, what="a name without spaces")
    table = get_str(section, "table", key, pattern=IDENTIFIER, what="an SQL identifier")
    _sql_name(table, f"{key}.table")
    if table.lower() == POSITIONS_TABLE:
        raise ConfigError(f"{key}.table", f"{table!r} is the replicator's own table")
    id_column = get_str(section, "id_column", key, "stream_id", IDENTIFIER, "an SQL identifier")
    _sql_name(id_column, f"{key}.id_column")
    writer_column = get_str(section, "writer_column", key, "instance_name", IDENTIFIER,
                         "an SQL identifier")
    if "writer_column" in section and section["writer_column"] is None:
        writer_column = None
    if writer_column is not None:
        _sql_name(writer_column, f"{key}.writer_column")
        if writer_column.lower() == id_column.lower():
            raise ConfigError(f"{key}.writer_column",
                              f"must differ from id_column ({id_column!r})")
    sequence = get_str(section, "sequence", key, f"{table}_seq", IDENTIFIER,
                       "an SQL identifier")
    _sql_name(sequence, f"{key}.sequence")
    columns = tuple(
        parse_column(c, f"{key}.columns[{i}]")
        for i, c in enumerate(_list(section, "columns", key))
    )
    if json_text:
        columns = tuple(ColumnConfig(c.name, c.type, c.nullable, c.name in json_text)
                        for c in columns)
    if not columns:
        raise ConfigError(f"{key}.columns", "a stream needs at least one row column")
    # Unquoted SQL names fold case.
    seen = {id_column.lower(), (writer_column or "").lower()}
    for i, column in enumerate(columns):
        if column.name.lower() in seen:
            raise ConfigError(f"{key}.columns[{i}]", f"column {column.name!r} is declared twice")
        seen.add(column.name.lower())
    writers = _list(section, "writers", key)
    if not writers:
        raise ConfigError(f"{key}.writers", "a stream needs at least one writer")
    for i, writer in enumerate(writers):
        if not isinstance(writer, str) or not WIRE_NAME.fullmatch(writer):
            raise ConfigError(f"{key}.writers[{i}]", f"{writer!r} is not an instance name")
    if len(set(writers)) != len(writers):
        raise ConfigError(f"{key}.writers", "a writer is listed twice")
    if writer_column is None and len(writers) != 1:
        if preset is not None:
            raise ConfigError(f"{key}.writers", f"Synapse's {preset!r} table has no writer "
                                                f"column: give one writer")
        raise ConfigError(f"{key}.writer_column",
                          "a stream with several writers needs a writer column")
    timestamp_column = get_str(section, "timestamp_column", key, None)
    if timestamp_column is not None:
        match = [c for c in columns if c.name == timestamp_column]
        if not match:
            raise ConfigError(f"{key}.timestamp_column",
                              f"unknown column {timestamp_column!r}")
        if match[0].type != "bigint":
            raise ConfigError(f"{key}.timestamp_column",
                              "must name a bigint column (milliseconds since the epoch)")
    return StreamConfig(
        name=name, table=table, id_column=id_column, writer_column=writer_column,
        columns=columns, sequence=sequence, writers=tuple(writers),
        timestamp_column=timestamp_column,
        create=False if preset is not None else get_bool(section, "create", key, True),
        preset=preset, positions_name=positions_name,
    )


def parse_streams(value: Any, key: str = "streams") -> Tuple[StreamConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list, got {_kind(value)}")
    streams = []
    names: Dict[str, int] = {}
    # Tables and sequences share one namespace in PostgreSQL; unquoted
    # names fold case.
    relations: Dict[str, str] = {}
    for i, item in enumerate(value):
        stream = parse_stream(item, f"{key}[{i}]")
        if stream.name in names:
            raise ConfigError(f"{key}[{i}].name",
                              f"duplicate stream {stream.name!r} (also {key}[{names[stream.name]}])")
        table, sequence = stream.table.lower(), stream.sequence.lower()
        if table in relations:
            other = relations[table]
            raise ConfigError(f"{key}[{i}].table",
                              f"table {stream.table!r} already backs {other.rsplit('.', 1)[0]}"
                              if other.endswith(".table") else
                              f"{stream.table!r} is also a sequence ({other})")
        relations[table] = f"{key}[{i}].table"
        if sequence in relations:
            other = relations[sequence]
            raise ConfigError(f"{key}[{i}].sequence",
                              f"{stream.sequence!r} is also a table ({other})"
                              if other.endswith(".table") else
                              f"sequence {stream.sequence!r} is also used by {other}")
        relations[sequence] = f"{key}[{i}].sequence"
        names[stream.name] = i
        streams.append(stream)
    return tuple(streams)


#: A config is a few kilobytes; this bounds what a wrong path could make us read.
MAX_CONFIG_SIZE = 1 << 20


def load_yaml(path: str) -> Any:
    """Read a YAML file; unreadable or malformed files are ConfigErrors."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_SIZE + 1)
    except OSError as e:
        raise ConfigError("file", f"cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_CONFIG_SIZE:
        raise ConfigError("file", f"{path} is larger than {MAX_CONFIG_SIZE} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("file", f"{path} is not UTF-8 text: byte 0x{data[e.start]:02x} at "
                                  f"offset {e.start}") from None
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise ConfigError("file", f"{path} nests too deeply to be a config") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError("file", f"{path} is not valid YAML{where}: {problem}") from None


# ------------------------------------------------------------- instance
LOG_LEVELS = ("debug", "info", "warn", "error", "critical")


@dataclass(frozen=True)
class RedisConfig:
    """Replication through Redis pub/sub instead of (or beside) TCP."""

    endpoint: str
    password: Optional[str] = None
    dbid: Optional[int] = None


@dataclass(frozen=True)
class ReplicationConfig:
    """How this instance joins replication.

    ``listen``: endpoint string the master accepts workers on.
    ``upstream``: endpoint string a worker connects to.
    """

    listen: Optional[str] = None
    upstream: Optional[str] = None
    redis: Optional[RedisConfig] = None
    client_ca: Optional[str] = None  # ssl: listener: require client certs from this CA
    ping_interval: float = 5.0
    ping_timeout: float = 15.0
    max_queued_lines: int = 10_000
    max_queued_bytes: int = 16 * 1024 * 1024
    max_line_length: int = 16_384
    idle_timeout: float = 60.0
    max_connections: int = 256
    reconnect_initial_delay: float = 0.5
    reconnect_max_delay: float = 30.0
    fetch_limit: int = 1000
    fanout_interval: float = 0.003
    max_batch_rows: int = 10_000  # rows of one fact received as a batch
    max_batch_bytes: int = 16 << 20  # bytes of the lines of one partial batch
    # Who may connect (README, "Security model"); None: anyone.
    allowed_peers: Optional[Tuple[str, ...]] = None
    allowed_networks: Optional[Tuple[str, ...]] = None
    # Bounds of the USER_SYNC / USER_IP / FEDERATION_ACK bookkeeping.
    max_user_syncs: int = 50_000
    max_user_ips: int = 20_000
    max_federation_acks: int = 1_000
    bookkeeping_max_age: float = 86_400.0


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP API: write facts, positions, health, metrics."""

    listen: Optional[str] = None
    secret: Optional[str] = field(default=None, repr=False)
    metrics_listen: Optional[str] = None  # host:port served from its own thread
    secret_file: Optional[str] = None  # where the secret was read from, if from a file
    # A request's headers must arrive within header_timeout seconds of its
    # first byte (or of the connection opening), its body within
    # body_timeout of its headers; at most max_connections at once.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 256


@dataclass(frozen=True)
class HealthConfig:
    """What ``/health`` tolerates: a lag, an unreceived committed fact or a
    writer never heard of is a problem once it has lasted ``lag_grace``
    seconds; the database is asked for unreceived facts every
    ``check_interval`` seconds."""

    lag_grace: float = 10.0
    check_interval: float = 5.0


@dataclass(frozen=True)
class ConsumerConfig:
    """One consumer: ``type`` is a built-in name, an entry point name of the
    ``replicator.consumers`` group, or a dotted path ``package.module:Class``."""

    type: str
    streams: Optional[Tuple[str, ...]] = None
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SynapseConfig:
    """A Synapse shares this deployment (README, "Beside Synapse").

    ``server_name``: Synapse's; its Redis channel is ``<server_name>``.
    ``database``/``redis``: its database DSN and Redis endpoint, the
    defaults of ``database.postgres`` and ``replication.redis``.
    """

    server_name: str
    database: Optional[str] = None
    redis: Optional[str] = None


@dataclass(frozen=True)
class InstanceConfig:
    """Everything one instance needs, validated."""

    server_name: str
    instance_name: str
    database: DatabaseConfig
    streams: Tuple[StreamConfig, ...]
    replication: ReplicationConfig
    http: HttpConfig
    consumers: Tuple[ConsumerConfig, ...] = ()
    log_level: str = "info"
    health: HealthConfig = HealthConfig()
    path: Optional[str] = None
    synapse: Optional[SynapseConfig] = None


def _endpoint(section: Mapping, name: str, key: str, kind: str) -> Optional[str]:
    """An endpoint string, checked by Twisted's own parser."""
    value = get_str(section, name, key, None)
    if value is None:
        return None
    from twisted.internet import endpoints, reactor

    path = f"{key}.{name}"
    try:
        if kind == "server":
            parsed = endpoints.serverFromString(reactor, value)
        else:
            parsed = endpoints.clientFromString(reactor, value)
    except Exception as e:  # Twisted raises several types for bad strings
        detail = " ".join((str(e) or type(e).__name__).split())
        raise ConfigError(path, f"cannot parse endpoint {value!r}: {detail}") from None
    _check_endpoint(parsed, path)
    return value


def _check_endpoint(parsed, path: str) -> None:
    """What Twisted's parser lets through but no listen or connect could use:
    a port out of range, an interface that is not an IP address, an absurd
    backlog.  (The endpoint classes keep these as attributes; an endpoint
    type without them is not checked further.)"""
    import ipaddress

    port = getattr(parsed, "_port", None)
    if isinstance(port, int) and not 0 <= port <= 65535:
        raise ConfigError(path, f"port {port} is not from 0 to 65535")
    interface = getattr(parsed, "_interface", None)
    if isinstance(interface, str) and interface:
        try:
            ipaddress.ip_address(interface.strip("[]"))
        except ValueError:
            raise ConfigError(path, f"interface {interface!r} is not an IP address") from None
    backlog = getattr(parsed, "_backlog", None)
    if isinstance(backlog, int) and not 1 <= backlog <= 65535:
        raise ConfigError(path, f"backlog {backlog} is not from 1 to 65535")


def parse_redis(value: Any, key: str) -> Optional[RedisConfig]:
    if value is None:
        return None
    section = _mapping(value, key)
    no_unknown(section, ("endpoint", "password", "dbid"), key)
    endpoint = _endpoint(section, "endpoint", key, "client")
    if endpoint is None:
        raise ConfigError(f"{key}.endpoint", "missing")
    dbid = _int(section, "dbid", key, None, minimum=0, maximum=65535)
    return RedisConfig(endpoint, get_str(section, "password", key, None), dbid)


def _allowed_peers(section: Mapping, key: str) -> Optional[Tuple[str, ...]]:
    if section.get("allowed_peers") is None:
        return None
    names = _list(section, "allowed_peers", key)
    if not names:
        raise ConfigError(f"{key}.allowed_peers", "an empty list would refuse every peer")
    for i, name in enumerate(names):
        if not isinstance(name, str) or not WIRE_NAME.fullmatch(name):
            raise ConfigError(f"{key}.allowed_peers[{i}]", f"{name!r} is not an instance name")
    return tuple(names)


def _allowed_networks(section: Mapping, key: str, listen: Optional[str]
                      ) -> Optional[Tuple[str, ...]]:
    if section.get("allowed_networks") is None:
        return None
    import ipaddress

    networks = _list(section, "allowed_networks", key)
    if not networks:
        raise ConfigError(f"{key}.allowed_networks", "an empty list would refuse every peer")
    for i, network in enumerate(networks):
        path = f"{key}.allowed_networks[{i}]"
        if not isinstance(network, str):
            raise ConfigError(path, f"expected a network like 10.0.0.0/8, got {_kind(network)}")
        try:
            ipaddress.ip_network(network)
        except ValueError as e:
            raise ConfigError(path, str(e).replace("\n", " ")) from None
    if listen is not None and not listen.startswith(("tcp", "ssl")):
        raise ConfigError(f"{key}.allowed_networks", "needs a tcp: or ssl: listener")
    return tuple(networks)


def parse_replication(value: Any, key: str = "replication") -> ReplicationConfig:
    section = _mapping(value if value is not None else {}, key)
    no_unknown(section, ("listen", "upstream", "redis", "client_ca", "ping_interval",
                          "ping_timeout", "max_queued_lines", "max_line_length", "fetch_limit",
                          "fanout_interval", "allowed_peers", "allowed_networks",
                          "max_user_syncs", "max_user_ips", "max_federation_acks",
                          "bookkeeping_max_age", "max_queued_bytes", "idle_timeout",
                          "max_connections", "reconnect_initial_delay",
                          "reconnect_max_delay", "max_batch_rows", "max_batch_bytes"), key)
    ping_interval = get_number(section, "ping_interval", key, 5.0, minimum=0.1, maximum=300)
    ping_timeout = get_number(section, "ping_timeout", key, 15.0, minimum=1, maximum=3600)
    if ping_timeout <= ping_interval:
        raise ConfigError(f"{key}.ping_timeout",
                          f"must be longer than ping_interval ({ping_interval:g}s)")
    listen = _endpoint(section, "listen", key, "server")
    client_ca = get_str(section, "client_ca", key, None)
    if client_ca is not None:
        if listen is None or not listen.startswith("ssl:"):
            raise ConfigError(f"{key}.client_ca", "needs an ssl: listener in replication.listen")
        from .tls import load_ca_certificates, server_endpoint

        try:
            load_ca_certificates(client_ca)
            from twisted.internet import reactor

            server_endpoint(reactor, listen, client_ca)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}.client_ca", str(e)) from None
    max_line_length = _int(section, "max_line_length", key, 16_384, minimum=1024,
                           maximum=16 << 20)
    max_batch_rows = _int(section, "max_batch_rows", key, 10_000, minimum=1,
                          maximum=1_000_000)
    max_batch_bytes = _int(section, "max_batch_bytes", key, 16 << 20, minimum=65536,
                           maximum=1 << 30)
    if max_batch_bytes <= max_line_length:
        raise ConfigError(f"{key}.max_batch_bytes",
                          f"must be larger than max_line_length ({max_line_length})")
    max_queued_bytes = _int(section, "max_queued_bytes", key, 16 << 20, minimum=64 << 10,
                            maximum=2 << 30)
    if max_queued_bytes <= max_line_length:
        raise ConfigError(f"{key}.max_queued_bytes",
                          f"must be more than max_line_length ({max_line_length})")
    initial_delay = get_number(section, "reconnect_initial_delay", key, 0.5, minimum=0.01,
                            maximum=60)
    max_delay = get_number(section, "reconnect_max_delay", key, 30.0, minimum=0.01,
                           maximum=3600)
    if max_delay < initial_delay:
        raise ConfigError(f"{key}.reconnect_max_delay",
                          f"must be at least reconnect_initial_delay ({initial_delay:g}s)")
    return ReplicationConfig(
        listen=listen,
        client_ca=client_ca,
        upstream=_endpoint(section, "upstream", key, "client"),
        redis=parse_redis(section.get("redis"), f"{key}.redis"),
        ping_interval=ping_interval,
        ping_timeout=ping_timeout,
        max_queued_lines=_int(section, "max_queued_lines", key, 10_000, minimum=1,
                              maximum=10_000_000),
        max_line_length=max_line_length,
        max_queued_bytes=max_queued_bytes,
        idle_timeout=get_number(section, "idle_timeout", key, 60.0, minimum=1, maximum=86_400),
        max_connections=_int(section, "max_connections", key, 256, minimum=1, maximum=65_536),
        reconnect_initial_delay=initial_delay,
        reconnect_max_delay=max_delay,
        fetch_limit=_int(section, "fetch_limit", key, 1000, minimum=1, maximum=100_000),
        fanout_interval=get_number(section, "fanout_interval", key, 0.003, minimum=0,
                                maximum=1),
        allowed_peers=_allowed_peers(section, key),
        allowed_networks=_allowed_networks(section, key, listen),
        max_user_syncs=_int(section, "max_user_syncs", key, 50_000, minimum=1,
                            maximum=10_000_000),
        max_user_ips=_int(section, "max_user_ips", key, 20_000, minimum=1, maximum=10_000_000),
        max_federation_acks=_int(section, "max_federation_acks", key, 1_000, minimum=1,
                                 maximum=100_000),
        bookkeeping_max_age=get_number(section, "bookkeeping_max_age", key, 86_400.0,
                                    minimum=60, maximum=31_536_000),
        max_batch_rows=max_batch_rows,
        max_batch_bytes=max_batch_bytes,
    )


def _read_secret(path: str, key: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ConfigError(key, f"cannot read secret file {path}: {e.strerror}") from None
    if not secret:
        raise ConfigError(key, f"secret file {path} is empty")
    return secret


HOST_PORT = re.compile(r"(?P<host>[^\s:]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})")


def parse_http(value: Any, key: str = "http", base_dir: str = ".") -> HttpConfig:
    section = _mapping(value if value is not None else {}, key)
    no_unknown(section, ("listen", "secret", "secret_file", "metrics_listen", "header_timeout",
                          "body_timeout", "max_connections"), key)
    if "secret" in section and "secret_file" in section:
        raise ConfigError(key, "give either secret or secret_file, not both")
    secret = get_str(section, "secret", key, None)
    secret_file = get_str(section, "secret_file", key, None)
    if secret_file is not None:
        import os

        path = secret_file if os.path.isabs(secret_file) else os.path.join(base_dir, secret_file)
        secret = _read_secret(path, f"{key}.secret_file")
        secret_file = path
    if secret is not None and len(secret) < 16:
        raise ConfigError(f"{key}.secret", "must be at least 16 characters")
    listen = _endpoint(section, "listen", key, "server")
    if listen is not None and secret is None:
        raise ConfigError(f"{key}.secret", "missing: the write API always needs a secret "
                                           "(secret or secret_file)")
    metrics_listen = get_str(section, "metrics_listen", key, None)
    if metrics_listen is not None:
        m = HOST_PORT.fullmatch(metrics_listen)
        if not m or not 0 < int(m.group("port")) < 65536:
            raise ConfigError(f"{key}.metrics_listen", f"expected host:port, got {metrics_listen!r}")
    return HttpConfig(
        listen=listen, secret=secret, metrics_listen=metrics_listen, secret_file=secret_file,
        header_timeout=get_number(section, "header_timeout", key, 10.0, minimum=0.1,
                                  maximum=3600),
        body_timeout=get_number(section, "body_timeout", key, 30.0, minimum=0.1, maximum=3600),
        max_connections=_int(section, "max_connections", key, 256, minimum=1,
                             maximum=100_000),
    )


def parse_health(value: Any, key: str = "health") -> HealthConfig:
    section = _mapping(value if value is not None else {}, key)
    no_unknown(section, ("lag_grace", "check_interval"), key)
    return HealthConfig(
        lag_grace=get_number(section, "lag_grace", key, 10.0, minimum=0.0, maximum=3600.0),
        check_interval=get_number(section, "check_interval", key, 5.0, minimum=0.1,
                               maximum=3600.0))


def parse_consumers(value: Any, stream_names, key: str = "consumers") -> Tuple[ConsumerConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list, got {_kind(value)}")
    out = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        section = _mapping(item, where)
        type_ = get_str(section, "type", where)
        streams = None
        if "streams" in section:
            streams = _list(section, "streams", where)
            for j, name in enumerate(streams):
                if not isinstance(name, str) or name not in stream_names:
                    raise ConfigError(f"{where}.streams[{j}]", f"unknown stream {name!r}")
            streams = tuple(streams)
        options = {k: v for k, v in section.items() if k not in ("type", "streams")}
        out.append(ConsumerConfig(type_, streams, options))
    return tuple(out)


INSTANCE_KEYS = ("server_name", "instance_name", "database", "streams", "replication", "http",
                 "consumers", "log_level", "health", "synapse")


def parse_synapse(value: Any, key: str = "synapse") -> Optional[SynapseConfig]:
    if value is None:
        return None
    section = _mapping(value, key)
    no_unknown(section, ("server_name", "database", "redis"), key)
    server_name = get_str(section, "server_name", key, pattern=WIRE_NAME,
                       what="a name without spaces")
    database = get_str(section, "database", key, None)
    if database is not None:
        _check_dsn(database, f"{key}.database")
    redis = _endpoint(section, "redis", key, "client")
    return SynapseConfig(server_name, database, redis)


def _check_synapse_streams(streams, instance_name: str,
                           synapse_config: Optional[SynapseConfig]) -> None:
    """No local writer of a Synapse stream: of a preset stream always, of
    any stream named like one of Synapse's when a Synapse shares the
    deployment (its ID generators and sync tokens would take our IDs)."""
    from . import synapse

    for i, stream in enumerate(streams):
        if instance_name not in stream.writers:
            continue
        if stream.preset is not None or (synapse_config is not None
                                         and stream.name in synapse.STREAM_NAMES):
            raise ConfigError(f"streams[{i}].writers",
                              f"{stream.name!r} is Synapse's stream: replicator may read it, "
                              f"never write it (remove {instance_name!r}, or name the stream "
                              f"otherwise)")


def parse_instance(doc: Any, path: Optional[str] = None) -> InstanceConfig:
    """A whole instance config from its parsed YAML document."""
    # Relative paths (SQLite file, secret file, consumer files) are relative
    # to the working directory, as for the daemon's state directory.
    section = _mapping(doc, "") if doc is not None else {}
    if not section:
        raise ConfigError("file", "is empty")
    no_unknown(section, INSTANCE_KEYS, "")
    server_name = get_str(section, "server_name", "", pattern=WIRE_NAME,
                          what="a name without spaces")
    instance_name = get_str(section, "instance_name", "", pattern=WIRE_NAME,
                         what="a name without spaces")
    synapse_config = parse_synapse(section.get("synapse"))
    database_section = section.get("database")
    if database_section is None and synapse_config is not None and synapse_config.database:
        database_section = {"postgres": synapse_config.database}
    database = parse_database(database_section)
    streams = parse_streams(section.get("streams"))
    _check_synapse_streams(streams, instance_name, synapse_config)
    replication_section = section.get("replication")
    if synapse_config is not None and synapse_config.redis:
        replication_section = dict(_mapping(replication_section or {}, "replication"))
        replication_section.setdefault("redis", {"endpoint": synapse_config.redis})
    replication = parse_replication(replication_section)
    http = parse_http(section.get("http"))
    consumers = parse_consumers(section.get("consumers"), {s.name for s in streams})
    health = parse_health(section.get("health"))
    log_level = section.get("log_level", "info")
    if log_level not in LOG_LEVELS:
        raise ConfigError("log_level", f"{log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    if database.engine == "sqlite":
        for i, stream in enumerate(streams):
            others = [w for w in stream.writers if w != instance_name]
            if others:
                raise ConfigError(f"streams[{i}].writers",
                                  f"{others[0]!r} cannot write an embedded SQLite database of "
                                  f"{instance_name!r}: use PostgreSQL for several writers")
    if replication.upstream and replication.listen:
        raise ConfigError("replication.upstream", "an instance either listens (master) or "
                                                  "connects upstream (worker), not both")
    return InstanceConfig(
        server_name=server_name, instance_name=instance_name, database=database,
        streams=streams, replication=replication, http=http, consumers=consumers,
        log_level=log_level, path=path, health=health, synapse=synapse_config,
    )


def load_config(path: str) -> InstanceConfig:
    """Read and validate one instance's YAML file."""
    return parse_instance(load_yaml(path), path)
