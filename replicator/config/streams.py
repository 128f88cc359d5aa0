"""The ``database`` and ``streams`` sections (and Synapse presets): what every
component shares."""

import re
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from .fields import (
    IDENTIFIER,
    WIRE_NAME,
    ConfigError,
    as_mapping,
    get_bool,
    get_int,
    get_list,
    get_names,
    get_number,
    get_path,
    get_str,
    kind_of,
    no_unknown,
    sql_name,
)
from .model import (
    AUDIT_TABLE,
    COLUMN_TYPES,
    DS_COLUMNS,
    IDEMPOTENCY_TABLE,
    POSITIONS_TABLE,
    PROBLEMS_TABLE,
    RETENTION_TABLE,
    ROW_INDEX_COLUMN,
    SCHEMA_TABLE,
    ColumnConfig,
    DatabaseConfig,
    RetentionConfig,
    StreamConfig,
)

#: Database connections (each one a pool thread and a server process).
MAX_POOL = 100
#: Facts in one group-commit transaction (its INSERT's parameters grow with it).
MAX_WRITE_GROUP = 10_000


def parse_database(value: Any, key: str = "database") -> DatabaseConfig:
    section = as_mapping(value, key)
    if "sqlite" in section and "postgres" in section:
        raise ConfigError(key, "give either sqlite or postgres, not both")
    no_unknown(section, ("sqlite", "postgres", "pool_min", "pool_max", "write_group_max",
                         "auto_migrate"), key)
    pool_min = get_int(section, "pool_min", key, 1, minimum=1, maximum=MAX_POOL)
    pool_max = get_int(section, "pool_max", key, 5, minimum=1, maximum=MAX_POOL)
    group = get_int(section, "write_group_max", key, 256, minimum=1, maximum=MAX_WRITE_GROUP)
    auto_migrate = get_bool(section, "auto_migrate", key, True)
    if pool_max < pool_min:
        raise ConfigError(f"{key}.pool_max", f"must be at least pool_min ({pool_min})")
    if "sqlite" in section:
        path = get_path(section, "sqlite", key)
        return DatabaseConfig("sqlite", path=path, pool_min=1, pool_max=1,
                              write_group_max=group, auto_migrate=auto_migrate)
    if "postgres" in section:
        dsn = get_str(section, "postgres", key)
        _check_dsn(dsn, f"{key}.postgres")
        return DatabaseConfig("postgres", dsn=dsn, pool_min=pool_min, pool_max=pool_max,
                              write_group_max=group, auto_migrate=auto_migrate)
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
    sql_name(name, key)
    if not isinstance(type_, str):
        raise ConfigError(f"{key}.{name}", f"expected a type name, got {kind_of(type_)}")
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
    "writers", "timestamp_column", "create", "preset", "retention", "durable_streams",
    "foreign_writers",
)
RETENTION_KEYS = ("max_age", "max_facts", "interval", "batch")
#: ``retention.max_age``: a whole number and a unit ("7d", "12h", "90m").
DURATION = re.compile(r"([0-9]{1,9})(s|m|h|d|w)")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
#: The longest ``max_age`` (100 years): beyond it, a typo.
MAX_AGE = 100 * 365 * 86_400
#: The most facts ``max_facts`` keeps (IDs are 63-bit).
MAX_FACTS = 1 << 62
#: Facts deleted per transaction at most.
MAX_TRIM_BATCH = 100_000
#: What a preset fills in (and a config with ``preset:`` may not give).
PRESET_KEYS = ("table", "id_column", "writer_column", "columns", "sequence", "create")


def _apply_preset(section: Mapping[str, Any], key: str,
                  ) -> tuple[Mapping[str, Any], str, "frozenset[str]", str | None]:
    """The stream section with its preset's layout filled in; the preset's
    name; the columns stored as JSON text."""
    from .. import synapse

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


def parse_duration(value: Any, path: str) -> float:
    """Seconds of a duration such as ``"7d"``, ``"12h"``, ``"90m"``, ``"30s"``
    or ``"2w"`` (a plain number is seconds), more than 0 and at most
    ``MAX_AGE``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(path, f"expected a duration like '7d' or '12h', got {kind_of(value)}")
    if isinstance(value, int):
        seconds = value
    else:
        match = DURATION.fullmatch(value.strip())
        if match is None:
            raise ConfigError(path, f"{value!r} is not a duration (a whole number and one of "
                                    f"s, m, h, d, w: '7d', '12h')")
        seconds = int(match.group(1)) * UNIT_SECONDS[match.group(2)]
    if not 0 < seconds <= MAX_AGE:
        raise ConfigError(path, f"must be more than 0 and at most {MAX_AGE // 86_400}d, "
                                f"got {value!r}")
    return float(seconds)


def parse_retention(value: Any, key: str, timestamp_column: str | None,
                    columns: Sequence[ColumnConfig]) -> RetentionConfig:
    """A stream's ``retention``: ``max_age`` needs the stream's
    ``timestamp_column`` (NOT NULL): a fact's age is read from it."""
    section = as_mapping(value, key)
    no_unknown(section, RETENTION_KEYS, key)
    if "max_age" not in section and "max_facts" not in section:
        raise ConfigError(key, "give max_age (e.g. '7d') and/or max_facts (e.g. 1000000)")
    max_age = None
    if "max_age" in section:
        max_age = parse_duration(section["max_age"], f"{key}.max_age")
        if timestamp_column is None:
            raise ConfigError(f"{key}.max_age", "needs the stream's timestamp_column (a bigint "
                                                "column of milliseconds since the epoch): a "
                                                "fact's age is read from it")
        if any(c.name == timestamp_column and c.nullable for c in columns):
            raise ConfigError(f"{key}.max_age", f"needs a NOT NULL timestamp_column "
                                                f"({timestamp_column!r} is nullable: a fact "
                                                f"without a time has no age)")
    max_facts = get_int(section, "max_facts", key, None, minimum=1, maximum=MAX_FACTS)
    interval = get_number(section, "interval", key, 60.0, minimum=1, maximum=86_400)
    batch = get_int(section, "batch", key, 1000, minimum=1, maximum=MAX_TRIM_BATCH)
    return RetentionConfig(max_age=max_age, max_facts=max_facts, interval=interval,
                           batch=batch)


def parse_stream(value: Any, key: str) -> StreamConfig:
    section = as_mapping(value, key)
    no_unknown(section, STREAM_KEYS, key)
    preset, positions_name = None, None
    json_text: AbstractSet[str] = frozenset()
    if "preset" in section:
        section, preset, json_text, positions_name = _apply_preset(section, key)
    name = get_str(section, "name", key, pattern=WIRE_NAME, what="a name without spaces")
    table = get_str(section, "table", key, pattern=IDENTIFIER, what="an SQL identifier")
    sql_name(table, f"{key}.table")
    if table.lower() in (POSITIONS_TABLE, SCHEMA_TABLE, RETENTION_TABLE,
                         IDEMPOTENCY_TABLE, PROBLEMS_TABLE, AUDIT_TABLE):
        raise ConfigError(f"{key}.table", f"{table!r} is the replicator's own table")
    id_column = get_str(section, "id_column", key, "stream_id", IDENTIFIER, "an SQL identifier")
    sql_name(id_column, f"{key}.id_column")
    writer_column = get_str(section, "writer_column", key, "instance_name", IDENTIFIER,
                         "an SQL identifier")
    if "writer_column" in section and section["writer_column"] is None:
        writer_column = None
    if writer_column is not None:
        sql_name(writer_column, f"{key}.writer_column")
        if writer_column.lower() == id_column.lower():
            raise ConfigError(f"{key}.writer_column",
                              f"must differ from id_column ({id_column!r})")
    sequence = get_str(section, "sequence", key, f"{table}_seq", IDENTIFIER,
                       "an SQL identifier")
    sql_name(sequence, f"{key}.sequence")
    durable = get_bool(section, "durable_streams", key, False)
    if durable:
        # Streams created over HTTP (docs/read-api.md, "Streams created
        # over HTTP"): the replicator's table, its columns fixed.
        for given in ("columns", "preset", "retention", "timestamp_column"):
            if section.get(given) is not None:
                raise ConfigError(f"{key}.{given}", "not given for a stream with "
                                                    "durable_streams: true (its columns "
                                                    "are fixed, its retention is the TTL)")
        if "create" in section and section["create"] is not True:
            raise ConfigError(f"{key}.create", "a stream with durable_streams: true is "
                                               "in a table the replicator creates")
        columns: tuple[ColumnConfig, ...] = DS_COLUMNS
    else:
        columns = tuple(
            parse_column(c, f"{key}.columns[{i}]")
            for i, c in enumerate(get_list(section, "columns", key))
        )
    if json_text:
        columns = tuple(ColumnConfig(c.name, c.type, c.nullable, c.name in json_text)
                        for c in columns)
    if not columns:
        raise ConfigError(f"{key}.columns", "a stream needs at least one row column")
    create = False if preset is not None else get_bool(section, "create", key, True)
    if create:
        for where, given in ((f"{key}.id_column", id_column),
                             (f"{key}.writer_column", writer_column or ""),
                             *((f"{key}.columns[{i}]", c.name) for i, c in enumerate(columns))):
            if given.lower() == ROW_INDEX_COLUMN:
                raise ConfigError(where, f"{given!r} is the replicator's own column (the "
                                         "order of a fact's rows) in a table it creates")
    # Unquoted SQL names fold case.
    seen = {id_column.lower(), (writer_column or "").lower()}
    for i, column in enumerate(columns):
        if column.name.lower() in seen:
            raise ConfigError(f"{key}.columns[{i}]", f"column {column.name!r} is declared twice")
        seen.add(column.name.lower())
    writers = get_names(section, "writers", key, "a stream needs at least one writer")
    if len(set(writers)) != len(writers):
        raise ConfigError(f"{key}.writers", "a writer is listed twice")
    if durable and len(writers) != 1:
        raise ConfigError(f"{key}.writers", "a stream with durable_streams: true has one "
                                            "writer: the instance that creates and appends")
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
    retention = None
    if section.get("retention") is not None:
        if preset is not None:
            raise ConfigError(f"{key}.retention", f"{preset!r} is Synapse's table: Synapse "
                                                  f"decides what it keeps")
        retention = parse_retention(section["retention"], f"{key}.retention",
                                    timestamp_column, columns)
    foreign_writers = get_bool(section, "foreign_writers", key, False)
    if foreign_writers and durable:
        raise ConfigError(f"{key}.foreign_writers", "a stream with durable_streams: true is "
                                                    "written over HTTP only (its writes of a "
                                                    "path are checked and ordered there)")
    if foreign_writers and preset is not None:
        raise ConfigError(f"{key}.foreign_writers", f"{preset!r} is Synapse's table: its "
                                                    f"writers are Synapse's")
    return StreamConfig(
        name=name, table=table, id_column=id_column, writer_column=writer_column,
        columns=columns, sequence=sequence, writers=tuple(writers),
        timestamp_column=timestamp_column,
        create=create, preset=preset, positions_name=positions_name, retention=retention,
        durable_streams=durable,
        foreign_writers=foreign_writers,
    )


def parse_streams(value: Any, key: str = "streams") -> tuple[StreamConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list, got {kind_of(value)}")
    streams = []
    names: dict[str, int] = {}
    # Tables and sequences share one namespace in PostgreSQL; unquoted
    # names fold case.
    relations: dict[str, str] = {}
    for i, item in enumerate(value):
        stream = parse_stream(item, f"{key}[{i}]")
        if stream.name in names:
            raise ConfigError(f"{key}[{i}].name", f"duplicate stream {stream.name!r} "
                                                  f"(also {key}[{names[stream.name]}])")
        _claim(relations, stream.table, f"{key}[{i}].table")
        _claim(relations, stream.sequence, f"{key}[{i}].sequence")
        names[stream.name] = i
        streams.append(stream)
    return tuple(streams)


def _claim(relations: dict[str, str], name: str, path: str) -> None:
    """Record that the table or sequence ``name`` is the one at ``path``
    (``streams[i].table`` or ``.sequence``); a ConfigError if another
    stream's table or sequence has that name already."""
    other = relations.get(name.lower())
    if other is not None:
        other_is_table = other.endswith(".table")
        if path.endswith(".table"):
            problem = (f"table {name!r} already backs {other.rsplit('.', 1)[0]}"
                       if other_is_table else f"{name!r} is also a sequence ({other})")
        else:
            problem = (f"{name!r} is also a table ({other})" if other_is_table
                       else f"sequence {name!r} is also used by {other}")
        raise ConfigError(path, problem)
    relations[name.lower()] = path
