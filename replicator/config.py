"""YAML → typed, validated configuration of one replicator instance.

Every mistake is reported as one :class:`ConfigError` whose text names the key
(as a dotted path, e.g. ``streams[1].columns[0]``) and the problem; the CLI
prints that line and exits with code 2 before anything listens.

This module holds the parts every component shares: the database and the
streams.  Sections are parsed by small functions that take a mapping and the
key path it came from.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import yaml

IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# Stream and instance names travel as single words on the wire.
WIRE_NAME = re.compile(r"^[^\s]{1,200}$")
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


# ---------------------------------------------------------------- helpers
def _mapping(value: Any, key: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return type(value).__name__


def _no_unknown(section: Mapping, allowed, key: str) -> None:
    for name in section:
        if name not in allowed:
            prefix = f"{key}." if key else ""
            raise ConfigError(f"{prefix}{name}", "unknown key")


def _str(section: Mapping, name: str, key: str, default: Any = ..., pattern=None,
         what: str = "") -> Any:
    path = f"{key}.{name}" if key else name
    if name not in section or section[name] is None:
        if default is ...:
            raise ConfigError(path, "missing")
        return default
    value = section[name]
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected a non-empty string, got {_kind(value)}")
    if pattern is not None and not pattern.match(value):
        raise ConfigError(path, f"{value!r} is not {what or 'valid'}")
    return value


def _int(section: Mapping, name: str, key: str, default: Any = ..., minimum: int = 0,
         maximum: Optional[int] = None) -> int:
    path = f"{key}.{name}" if key else name
    if name not in section:
        if default is ...:
            raise ConfigError(path, "missing")
        return default
    value = section[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"expected an integer, got {_kind(value)}")
    if value < minimum:
        raise ConfigError(path, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(path, f"must be at most {maximum}, got {value}")
    return value


def _bool(section: Mapping, name: str, key: str, default: bool) -> bool:
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
def parse_database(value: Any, key: str = "database") -> DatabaseConfig:
    section = _mapping(value, key)
    if "sqlite" in section and "postgres" in section:
        raise ConfigError(key, "give either sqlite or postgres, not both")
    _no_unknown(section, ("sqlite", "postgres", "pool_min", "pool_max"), key)
    pool_min = _int(section, "pool_min", key, 1, minimum=1)
    pool_max = _int(section, "pool_max", key, 5, minimum=1)
    if pool_max < pool_min:
        raise ConfigError(f"{key}.pool_max", f"must be at least pool_min ({pool_min})")
    if "sqlite" in section:
        path = _str(section, "sqlite", key)
        return DatabaseConfig("sqlite", path=path, pool_min=1, pool_max=1)
    if "postgres" in section:
        dsn = _str(section, "postgres", key)
        return DatabaseConfig("postgres", dsn=dsn, pool_min=pool_min, pool_max=pool_max)
    raise ConfigError(key, "missing: give sqlite: PATH or postgres: DSN")


def parse_column(value: Any, key: str) -> ColumnConfig:
    if not isinstance(value, Mapping) or len(value) != 1:
        raise ConfigError(key, "expected one 'name: type' pair")
    (name, type_), = value.items()
    if not isinstance(name, str) or not IDENTIFIER.match(name):
        raise ConfigError(key, f"{name!r} is not a valid column name")
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
    "writers", "timestamp_column", "create",
)


def parse_stream(value: Any, key: str) -> StreamConfig:
    section = _mapping(value, key)
    _no_unknown(section, STREAM_KEYS, key)
    name = _str(section, "name", key, pattern=WIRE_NAME, what="a name without spaces")
    table = _str(section, "table", key, pattern=IDENTIFIER, what="an SQL identifier")
    id_column = _str(section, "id_column", key, "stream_id", IDENTIFIER, "an SQL identifier")
    writer_column = _str(section, "writer_column", key, "instance_name", IDENTIFIER,
                         "an SQL identifier")
    if "writer_column" in section and section["writer_column"] is None:
        writer_column = None
    sequence = _str(section, "sequence", key, f"{table}_seq", IDENTIFIER, "an SQL identifier")
    columns = tuple(
        parse_column(c, f"{key}.columns[{i}]")
        for i, c in enumerate(_list(section, "columns", key))
    )
    if not columns:
        raise ConfigError(f"{key}.columns", "a stream needs at least one row column")
    seen = {id_column, writer_column}
    for i, column in enumerate(columns):
        if column.name in seen:
            raise ConfigError(f"{key}.columns[{i}]", f"column {column.name!r} is declared twice")
        seen.add(column.name)
    writers = _list(section, "writers", key)
    if not writers:
        raise ConfigError(f"{key}.writers", "a stream needs at least one writer")
    for i, writer in enumerate(writers):
        if not isinstance(writer, str) or not WIRE_NAME.match(writer):
            raise ConfigError(f"{key}.writers[{i}]", f"{writer!r} is not an instance name")
    if len(set(writers)) != len(writers):
        raise ConfigError(f"{key}.writers", "a writer is listed twice")
    if writer_column is None and len(writers) != 1:
        raise ConfigError(f"{key}.writer_column",
                          "a stream with several writers needs a writer column")
    timestamp_column = _str(section, "timestamp_column", key, None)
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
        timestamp_column=timestamp_column, create=_bool(section, "create", key, True),
    )


def parse_streams(value: Any, key: str = "streams") -> Tuple[StreamConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list, got {_kind(value)}")
    streams = []
    names: Dict[str, int] = {}
    tables: Dict[str, int] = {}
    for i, item in enumerate(value):
        stream = parse_stream(item, f"{key}[{i}]")
        if stream.name in names:
            raise ConfigError(f"{key}[{i}].name",
                              f"duplicate stream {stream.name!r} (also {key}[{names[stream.name]}])")
        if stream.table in tables:
            raise ConfigError(f"{key}[{i}].table",
                              f"table {stream.table!r} already backs {key}[{tables[stream.table]}]")
        names[stream.name] = i
        tables[stream.table] = i
        streams.append(stream)
    return tuple(streams)


def load_yaml(path: str) -> Any:
    """Read a YAML file; unreadable or malformed files are ConfigErrors."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise ConfigError("file", f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError("file", f"{path} is not valid YAML{where}: {problem}") from None


# ------------------------------------------------------------- instance
LOG_LEVELS = ("debug", "info", "warn", "error", "critical")
LOOPBACK = ("127.", "::1", "localhost")


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


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP API: write facts, positions, health, metrics."""

    listen: Optional[str] = None
    secret: Optional[str] = field(default=None, repr=False)
    metrics_listen: Optional[str] = None  # host:port served from its own thread
    secret_file: Optional[str] = None  # where the secret was read from, if from a file


@dataclass(frozen=True)
class ConsumerConfig:
    """One consumer: ``type`` is a built-in name, an entry point name of the
    ``replicator.consumers`` group, or a dotted path ``package.module:Class``."""

    type: str
    streams: Optional[Tuple[str, ...]] = None
    options: Dict[str, Any] = field(default_factory=dict)


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
    path: Optional[str] = None

    def writes(self, stream: StreamConfig) -> bool:
        return self.instance_name in stream.writers


def _number(section: Mapping, name: str, key: str, default: float, minimum: float,
            maximum: Optional[float] = None) -> float:
    path = f"{key}.{name}"
    value = section.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(path, f"expected a number, got {_kind(value)}")
    if not math.isfinite(value):
        raise ConfigError(path, f"expected a finite number, got {value}")
    if value < minimum:
        raise ConfigError(path, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(path, f"must be at most {maximum}, got {value}")
    return float(value)


def _endpoint(section: Mapping, name: str, key: str, kind: str) -> Optional[str]:
    """An endpoint string, checked by Twisted's own parser."""
    value = _str(section, name, key, None)
    if value is None:
        return None
    from twisted.internet import endpoints, reactor

    try:
        if kind == "server":
            endpoints.serverFromString(reactor, value)
        else:
            endpoints.clientFromString(reactor, value)
    except Exception as e:  # Twisted raises several types for bad strings
        detail = str(e) or type(e).__name__
        raise ConfigError(f"{key}.{name}", f"cannot parse endpoint {value!r}: {detail}") from None
    return value


def parse_redis(value: Any, key: str) -> Optional[RedisConfig]:
    if value is None:
        return None
    section = _mapping(value, key)
    _no_unknown(section, ("endpoint", "password", "dbid"), key)
    endpoint = _endpoint(section, "endpoint", key, "client")
    if endpoint is None:
        raise ConfigError(f"{key}.endpoint", "missing")
    dbid = _int(section, "dbid", key, None) if "dbid" in section else None
    return RedisConfig(endpoint, _str(section, "password", key, None), dbid)


def parse_replication(value: Any, key: str = "replication") -> ReplicationConfig:
    section = _mapping(value if value is not None else {}, key)
    _no_unknown(section, ("listen", "upstream", "redis", "client_ca", "ping_interval",
                          "ping_timeout", "max_queued_lines", "max_line_length", "fetch_limit",
                          "fanout_interval", "max_queued_bytes", "idle_timeout",
                          "max_connections", "reconnect_initial_delay",
                          "reconnect_max_delay"), key)
    ping_interval = _number(section, "ping_interval", key, 5.0, 0.1)
    ping_timeout = _number(section, "ping_timeout", key, 15.0, 1.0)
    if ping_timeout <= ping_interval:
        raise ConfigError(f"{key}.ping_timeout",
                          f"must be longer than ping_interval ({ping_interval:g}s)")
    listen = _endpoint(section, "listen", key, "server")
    client_ca = _str(section, "client_ca", key, None)
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
    max_line_length = _int(section, "max_line_length", key, 16_384, minimum=1024)
    max_queued_bytes = _int(section, "max_queued_bytes", key, 16 * 1024 * 1024,
                            minimum=64 * 1024, maximum=2**31)
    if max_queued_bytes <= max_line_length:
        raise ConfigError(f"{key}.max_queued_bytes",
                          f"must be more than max_line_length ({max_line_length})")
    initial_delay = _number(section, "reconnect_initial_delay", key, 0.5, 0.01, 60.0)
    max_delay = _number(section, "reconnect_max_delay", key, 30.0, 0.01, 3600.0)
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
        max_queued_lines=_int(section, "max_queued_lines", key, 10_000, minimum=1),
        max_line_length=max_line_length,
        max_queued_bytes=max_queued_bytes,
        idle_timeout=_number(section, "idle_timeout", key, 60.0, 1.0, 86400.0),
        max_connections=_int(section, "max_connections", key, 256, minimum=1, maximum=65536),
        reconnect_initial_delay=initial_delay,
        reconnect_max_delay=max_delay,
        fetch_limit=_int(section, "fetch_limit", key, 1000, minimum=1),
        fanout_interval=_number(section, "fanout_interval", key, 0.003, 0.0),
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


HOST_PORT = re.compile(r"^(?P<host>[^\s:]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")


def parse_http(value: Any, key: str = "http", base_dir: str = ".") -> HttpConfig:
    section = _mapping(value if value is not None else {}, key)
    _no_unknown(section, ("listen", "secret", "secret_file", "metrics_listen"), key)
    if "secret" in section and "secret_file" in section:
        raise ConfigError(key, "give either secret or secret_file, not both")
    secret = _str(section, "secret", key, None)
    secret_file = _str(section, "secret_file", key, None)
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
    metrics_listen = _str(section, "metrics_listen", key, None)
    if metrics_listen is not None:
        m = HOST_PORT.match(metrics_listen)
        if not m or not 0 < int(m.group("port")) < 65536:
            raise ConfigError(f"{key}.metrics_listen", f"expected host:port, got {metrics_listen!r}")
    return HttpConfig(listen=listen, secret=secret, metrics_listen=metrics_listen,
                      secret_file=secret_file)


def parse_consumers(value: Any, stream_names, key: str = "consumers") -> Tuple[ConsumerConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list, got {_kind(value)}")
    out = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        section = _mapping(item, where)
        type_ = _str(section, "type", where)
        streams = None
        if "streams" in section:
            streams = _list(section, "streams", where)
            for j, name in enumerate(streams):
                if name not in stream_names:
                    raise ConfigError(f"{where}.streams[{j}]", f"unknown stream {name!r}")
            streams = tuple(streams)
        options = {k: v for k, v in section.items() if k not in ("type", "streams")}
        out.append(ConsumerConfig(type_, streams, options))
    return tuple(out)


INSTANCE_KEYS = ("server_name", "instance_name", "database", "streams", "replication", "http",
                 "consumers", "log_level")


def parse_instance(doc: Any, path: Optional[str] = None) -> InstanceConfig:
    """A whole instance config from its parsed YAML document."""
    # Relative paths (SQLite file, secret file, consumer files) are relative
    # to the working directory, as for the daemon's state directory.
    base_dir = "."
    section = _mapping(doc, "") if doc is not None else {}
    if not section:
        raise ConfigError("file", "is empty")
    _no_unknown(section, INSTANCE_KEYS, "")
    server_name = _str(section, "server_name", "", pattern=WIRE_NAME, what="a name without spaces")
    instance_name = _str(section, "instance_name", "", pattern=WIRE_NAME,
                         what="a name without spaces")
    database = parse_database(section.get("database"))
    streams = parse_streams(section.get("streams"))
    replication = parse_replication(section.get("replication"))
    http = parse_http(section.get("http"), base_dir=base_dir)
    consumers = parse_consumers(section.get("consumers"), {s.name for s in streams})
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
        log_level=log_level, path=path,
    )


def load_config(path: str) -> InstanceConfig:
    """Read and validate one instance's YAML file."""
    return parse_instance(load_yaml(path), path)


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether a server endpoint string binds only to a loopback address."""
    for part in endpoint.split(":"):
        if part.startswith("interface="):
            host = part[len("interface="):].strip("[]").replace("\\", "")
            return host.startswith(LOOPBACK) or host == "::1"
    return endpoint.startswith("unix:")
