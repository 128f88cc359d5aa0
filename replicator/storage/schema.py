"""Tables and sequences the streams live in, and the checks made at startup.

``stream_positions`` holds, per (stream, writer instance), a persisted
position: every fact of that writer at or below it is committed and final.
A stream's backing table holds its ID column, its writer column (if any) and
its row columns; several rows may share one ID (a multi-row fact).  A table
the replicator owns (:attr:`~replicator.config.model.StreamConfig.owns_table`)
also holds ``row_index``: each row's place in its fact, written by the
writer, so that every read gives a fact's rows in the order they were
written (the heap order, ``ctid``, is not that order once retention's
deletions and VACUUM have freed space the writer fills again, or a row was
updated).  A table made by an older release gets the column at the next
start of a writer of it (:func:`add_row_index`): its rows so far hold 0,
and keep being read in heap order among themselves, as before.

All functions here take a DB-API cursor and run in a pool thread.
"""

from collections.abc import Callable, Sequence
from typing import Any

from ..config import ConfigError, StreamConfig
from ..config.model import ROW_INDEX_COLUMN
from .column_types import TableType, mismatch, postgres_kind, sqlite_kind
from .database import Cursor

#: The engine's SQL of a statement written with ``%s`` (:meth:`.Database.sql`).
Sql = Callable[[str], str]

POSITIONS_DDL = """
CREATE TABLE IF NOT EXISTS stream_positions (
    stream_name TEXT NOT NULL,
    instance_name TEXT NOT NULL,
    stream_id BIGINT NOT NULL,
    PRIMARY KEY (stream_name, instance_name)
)
"""

#: Per stream table, the trim boundary of retention: every fact with an ID at
#: or below ``trimmed_through`` was deleted (or never existed); no fact above
#: it is ever trimmed.  Readers compare it with the position they read from.
#: Keyed by the table (its name in lower case,
#: :func:`replicator.streams.trimmed.boundary_key`), not the stream's name:
#: two deployments sharing a database may each have a stream ``caches``,
#: in tables of their own, and a boundary says what left one table.
#: (A table of its own, created like ``stream_positions``: it must become a
#: step of the schema migrations.)
RETENTION_DDL = """
CREATE TABLE IF NOT EXISTS stream_retention (
    table_name TEXT NOT NULL PRIMARY KEY,
    trimmed_through BIGINT NOT NULL
)
"""

#: Idempotency keys of writes (:mod:`replicator.streams.idempotency`): per
#: stream table (:func:`replicator.streams.trimmed.boundary_key`, as
#: ``stream_retention``) and key, what the write was (``fingerprint``), the
#: ID its fact got and when (``created_ms``, milliseconds since the epoch).
#: A row is written in the transaction of its fact: neither is ever without
#: the other.  Rows older than ``http.idempotency_window`` are pruned
#: (``created_ms`` indexed for it).  A step of the schema migrations.
IDEMPOTENCY_DDL = (
    """
CREATE TABLE IF NOT EXISTS stream_idempotency (
    table_name TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    stream_id BIGINT NOT NULL,
    created_ms BIGINT NOT NULL,
    PRIMARY KEY (table_name, idem_key)
)
""",
    "CREATE INDEX IF NOT EXISTS stream_idempotency_created "
    "ON stream_idempotency (created_ms)",
)

#: The column every row of an owned table gets; 0 for the rows written
#: before it existed (by an older release), which keep their heap order.
ROW_INDEX_DDL = f"{ROW_INDEX_COLUMN} INTEGER NOT NULL DEFAULT 0"

PG_TYPES = {"text": "TEXT", "bigint": "BIGINT", "boolean": "BOOLEAN", "json": "JSONB"}
SQLITE_TYPES = {"text": "TEXT", "bigint": "INTEGER", "boolean": "INTEGER", "json": "TEXT"}


def table_ddl(stream: StreamConfig, postgres: bool) -> list[str]:
    """Statements creating the stream's table, indexes and sequence if missing."""
    types = PG_TYPES if postgres else SQLITE_TYPES
    cols = [f"{stream.id_column} BIGINT NOT NULL"]
    if stream.writer_column:
        cols.append(f"{stream.writer_column} TEXT NOT NULL")
    for c in stream.columns:
        cols.append(f"{c.name} {types[c.type]}{'' if c.nullable else ' NOT NULL'}")
    if stream.owns_table:
        cols.append(ROW_INDEX_DDL)
    statements = []
    if postgres:
        statements.append(f"CREATE SEQUENCE IF NOT EXISTS {stream.sequence}")
    statements.append(f"CREATE TABLE IF NOT EXISTS {stream.table} ({', '.join(cols)})")
    if stream.writer_column:
        statements.append(
            f"CREATE INDEX IF NOT EXISTS {stream.table}_writer_id "
            f"ON {stream.table} ({stream.writer_column}, {stream.id_column})"
        )
    statements.append(
        f"CREATE INDEX IF NOT EXISTS {stream.table}_id ON {stream.table} ({stream.id_column})"
    )
    if stream.durable_streams:  # one Durable Stream's operations, in order
        statements.append(f"CREATE INDEX IF NOT EXISTS {stream.table}_path "
                          f"ON {stream.table} (ds_path, {stream.id_column})")
    return statements


def _index_exists(txn: Cursor, statement: str) -> bool:
    """Whether ``statement`` is a ``CREATE INDEX IF NOT EXISTS`` of an index
    that exists (PostgreSQL): skipped, since it would take a SHARE lock on
    the table first, waiting for every open transaction that wrote it (a
    plain-SQL writer's) and holding up every write after it."""
    words = statement.split()
    if words[:5] != ["CREATE", "INDEX", "IF", "NOT", "EXISTS"]:
        return False
    txn.execute("SELECT to_regclass(%s)", (words[5],))
    return txn.fetchone()[0] is not None


def add_row_index(txn: Cursor, stream: StreamConfig, postgres: bool) -> bool:
    """Give an owned table that lacks it (made by an older release) the
    ``row_index`` column; whether it was added.  Idempotent: a table that
    has it, or none, is left alone.  PostgreSQL (11 and later) adds a
    column with a constant default without rewriting the table; the rows
    already there read 0."""
    existing = table_columns(txn, stream.table, postgres)
    if (not stream.owns_table or existing is None
            or ROW_INDEX_COLUMN in (name.lower() for name in existing)):
        return False
    # IF NOT EXISTS: another writer of the stream starting at once may
    # have added it between the check and here.
    guard = "IF NOT EXISTS " if postgres else ""
    txn.execute(f"ALTER TABLE {stream.table} ADD COLUMN {guard}{ROW_INDEX_DDL}")
    return True


def has_row_index(txn: Cursor, stream: StreamConfig, postgres: bool) -> bool:
    """Whether reads order the table's facts' rows by ``row_index``: an
    owned table that has it (a stream only read here may be written by
    an instance of an older release that did not add it yet)."""
    if not stream.owns_table:
        return False
    existing = table_columns(txn, stream.table, postgres) or []
    return ROW_INDEX_COLUMN in (name.lower() for name in existing)


def table_columns(txn: Cursor, table: str, postgres: bool) -> list[str] | None:
    """Column names of ``table``, or None if it does not exist."""
    types = column_types(txn, table, postgres)
    return None if types is None else list(types)


def column_types(txn: Cursor, table: str, postgres: bool) -> dict[str, TableType] | None:
    """Each column of ``table`` with its type, or None if it does not exist."""
    if postgres:
        txn.execute(
            "SELECT column_name, data_type, udt_name, character_maximum_length "
            "FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = %s",
            (table,),
        )
        types = {r[0]: postgres_kind(r[1], r[2], r[3]) for r in txn.fetchall()}
    else:
        txn.execute(f"PRAGMA table_info({table})")
        types = {r[1]: sqlite_kind(r[2] or "") for r in txn.fetchall()}
    return types or None


def check_stream_table(txn: Cursor, stream: StreamConfig, key: str, postgres: bool,
                       written: bool = True) -> None:
    """Every configured column exists with a type that fits its declared
    one (:mod:`.column_types`; the ID column ``bigint``, the writer column
    ``text``); otherwise a ConfigError naming the first that does not.
    ``written``: the stream is written here."""
    existing = column_types(txn, stream.table, postgres)
    if existing is None:
        why = ("create: false" if written else
               "this instance only reads the stream; its writer creates the table")
        raise ConfigError(f"{key}.table", f"table {stream.table!r} does not exist ({why})")
    wanted = [(f"{key}.id_column", "needs id_column", stream.id_column, "bigint", False)]
    if stream.writer_column:
        wanted.append((f"{key}.writer_column", "needs writer_column", stream.writer_column,
                       "text", False))
    wanted += [(f"{key}.columns[{i}]", "declares column", c.name, c.type, c.json_text)
               for i, c in enumerate(stream.columns)]
    for where, says, name, declared, json_text in wanted:
        found = existing.get(name)
        if found is None:
            raise ConfigError(where, f"unknown column {name!r} in table {stream.table!r}")
        fits = mismatch(declared, json_text, found, postgres, written)
        if fits is not None:
            raise ConfigError(where, f"stream {stream.name!r} {says} {name!r} {declared}, but "
                                     f"table {stream.table!r} has it as {found.shown} ({fits})")


def ensure_schema(txn: Cursor, streams: Sequence[StreamConfig], postgres: bool,
                  keys: dict[str, str], written: set[str] | None = None, dry_run: bool = False,
                  added_row_index: list[str] | None = None,
                  awaiting_writer: list[str] | None = None) -> bool:
    """Create what is missing and check what exists.

    ``written``: names of the streams with a local writer (default: all).
    Only those are ever created (``create``); a stream this instance only
    reads gets no DDL at all, not even ``stream_positions`` when no stream
    is written here: its tables may be another program's (Synapse's).
    Returns whether ``stream_positions`` exists.

    ``dry_run`` (``replicator check``) runs no DDL and changes nothing: it
    checks what exists, and takes what would be created as fine: by this
    instance, or, for a stream only read here whose table is missing (with
    ``create``, as every file declares it alike), by its writer at its first
    start; the names of those streams are appended to ``awaiting_writer``
    (a start still refuses them: the writer must have started first).

    A created table that lacks ``row_index`` gets it (:func:`add_row_index`);
    the names of those streams are appended to ``added_row_index``.
    """
    if written is None:
        written = {s.name for s in streams}
    if any(s.name in written for s in streams):
        if not dry_run:
            txn.execute(POSITIONS_DDL)
            txn.execute(RETENTION_DDL)
            for statement in IDEMPOTENCY_DDL:
                txn.execute(statement)
        has_positions = True
    else:
        has_positions = table_columns(txn, "stream_positions", postgres) is not None
    for stream in streams:
        ours = stream.name in written
        created = ours and stream.create
        if dry_run and stream.create and table_columns(txn, stream.table, postgres) is None:
            if created:
                continue  # start would create it
            if awaiting_writer is not None:
                awaiting_writer.append(stream.name)  # its writer's first start creates it
                continue
        if created and not dry_run:
            for statement in table_ddl(stream, postgres):
                if postgres and _index_exists(txn, statement):
                    continue
                txn.execute(statement)
            if add_row_index(txn, stream, postgres) and added_row_index is not None:
                added_row_index.append(stream.name)
        check_stream_table(txn, stream, keys[stream.name], postgres, ours)
        if postgres and not created:
            txn.execute("SELECT to_regclass(%s)", (stream.sequence,))
            if txn.fetchone()[0] is None:
                raise ConfigError(f"{keys[stream.name]}.sequence",
                                  f"sequence {stream.sequence!r} does not exist")
    return has_positions


def persisted_positions(txn: Cursor, stream_name: str, sql: Sql) -> dict[str, int]:
    txn.execute(
        sql("SELECT instance_name, stream_id FROM stream_positions WHERE stream_name = %s"),
        (stream_name,),
    )
    return {name: int(pos) for name, pos in txn.fetchall()}


def table_exists(txn: Cursor, postgres: bool, table: str) -> bool:
    """Whether the replicator's own ``table`` exists (one created when first
    needed, or by an instance that writes a stream: another instance may
    start first)."""
    if postgres:
        txn.execute("SELECT to_regclass(%s)", (table,))
        return txn.fetchone()[0] is not None
    txn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,))
    return txn.fetchone() is not None


def retention_table_exists(txn: Cursor, postgres: bool) -> bool:
    """Whether ``stream_retention`` exists (an instance that writes no
    stream creates no table, and may start before the one that does)."""
    return table_exists(txn, postgres, "stream_retention")


def trimmed_through(txn: Cursor, table_key: str, sql: Sql) -> int:
    """The trim boundary of the stream table ``table_key`` (0: nothing
    trimmed); ``stream_retention`` exists."""
    txn.execute(sql("SELECT trimmed_through FROM stream_retention WHERE table_name = %s"),
                (table_key,))
    row = txn.fetchone()
    return int(row[0]) if row is not None else 0


def table_max_per_writer(txn: Cursor, stream: StreamConfig) -> dict[str, int]:
    if stream.writer_column:
        txn.execute(
            f"SELECT {stream.writer_column}, MAX({stream.id_column}) FROM {stream.table} "
            f"GROUP BY {stream.writer_column}"
        )
        return {w: int(m) for w, m in txn.fetchall()}
    txn.execute(f"SELECT MAX({stream.id_column}) FROM {stream.table}")
    (m,) = txn.fetchone()
    return {stream.writers[0]: int(m)} if m is not None else {}


def upsert_position_sql(greatest: str) -> str:
    return (
        "INSERT INTO stream_positions (stream_name, instance_name, stream_id) "
        "VALUES (%s, %s, %s) ON CONFLICT (stream_name, instance_name) DO UPDATE "
        f"SET stream_id = {greatest}(stream_positions.stream_id, excluded.stream_id)"
    )


def sequence_value_sql(sequence: str) -> str:
    """The statement :func:`sequence_value` runs (its row:
    :func:`sequence_value_of`)."""
    return f"SELECT last_value, is_called FROM {sequence}"


def sequence_value_of(row: Sequence[Any]) -> int:
    """The last value ``nextval`` handed out, from the row of
    :func:`sequence_value_sql`."""
    last, called = row
    return int(last) if called else int(last) - 1


def sequence_value(txn: Cursor, sequence: str) -> int:
    """The last value ``nextval`` handed out (PostgreSQL)."""
    txn.execute(sequence_value_sql(sequence))
    return sequence_value_of(txn.fetchone())
