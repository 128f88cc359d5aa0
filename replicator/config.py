"""YAML → typed, validated configuration of one replicator instance.

Every mistake is reported as one :class:`ConfigError` whose text names the key
(as a dotted path, e.g. ``streams[1].columns[0]``) and the problem; the CLI
prints that line and exits with code 2 before anything listens.

This module holds the parts every component shares: the database and the
streams.  Sections are parsed by small functions that take a mapping and the
key path it came from.
"""

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


def _int(section: Mapping, name: str, key: str, default: Any = ..., minimum: int = 0) -> int:
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
