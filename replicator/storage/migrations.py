"""The schema version of the replicator's own tables, and the steps between
versions.

The version lives in ``replicator_schema``, one row: ``version``, and when
(``migrated_at``, UTC) and by which replicator and instance it was reached.
Versions:

* 0: none of the replicator's tables (a new database);
* 1: ``stream_positions`` and no ``replicator_schema``: what release 0.2.0
  and earlier make (they recorded no version);
* 2: ``replicator_schema`` recorded;
* 3: ``stream_retention`` (the trim boundaries of retention);
* 4: ``stream_idempotency`` (the idempotency keys of writes).

A stream's own table (and PostgreSQL sequence) is made by
:func:`.schema.ensure_schema` from the config; the steps here change what
every database of a version holds.  So is the ``row_index`` column a table
made by an older release lacks (:func:`.schema.add_row_index`): which
tables exist is the config's to say, not the version's (a stream added at
a reload, or again after years, may find an old table), and an older
release still works on a table that has it, so no version shuts it out.

:data:`STEPS` is the ordered list: ``STEPS[n]`` takes a database from
version ``n`` to ``n + 1``.  Each step is one transaction with the version
row written in it, so a step either happened whole, version included, or
not at all.  Whoever runs a step holds the migration lock for that
transaction (PostgreSQL: a transaction-level advisory lock; SQLite: ``BEGIN
IMMEDIATE``) and reads the version again under it: two instances starting
at once on one database never run the same step twice; the second finds
the work done.  A new database gets every step in one transaction.

Only an instance that writes a stream here keeps tables here (as
:func:`.schema.ensure_schema` decides): only it creates or migrates.  Any
instance refuses a schema newer than it knows.
"""

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from .. import __version__
from ..config.model import POSITIONS_TABLE, SCHEMA_TABLE
from . import schema
from .database import Cursor, Database

log = Logger()

#: PostgreSQL advisory lock key held (per transaction) by whoever creates or
#: migrates the schema: "repl" "sche" as two 32-bit words.
LOCK_KEY = 0x7265706C_73636865

SCHEMA_DDL = f"""
CREATE TABLE {SCHEMA_TABLE} (
    one_row CHAR(1) NOT NULL DEFAULT 'X' UNIQUE CHECK (one_row = 'X'),
    version INTEGER NOT NULL,
    migrated_at TEXT NOT NULL,
    replicator_version TEXT NOT NULL,
    instance_name TEXT NOT NULL
)
"""

#: A step's work: ``apply(txn, postgres)`` in the step's transaction.
Apply = Callable[[Any, bool], None]


@dataclass(frozen=True)
class Step:
    """Takes a database from version ``to - 1`` to ``to``; ``what`` says how,
    in the one line logged for it."""

    to: int
    what: str
    apply: Apply


def _create_positions(txn: Cursor, postgres: bool) -> None:
    txn.execute(schema.POSITIONS_DDL)


def _create_schema_table(txn: Cursor, postgres: bool) -> None:
    txn.execute(SCHEMA_DDL)


def _create_retention_table(txn: Cursor, postgres: bool) -> None:
    txn.execute(schema.RETENTION_DDL)


def _create_idempotency_table(txn: Cursor, postgres: bool) -> None:
    for statement in schema.IDEMPOTENCY_DDL:
        txn.execute(statement)


STEPS: tuple[Step, ...] = (
    Step(1, "create stream_positions", _create_positions),
    Step(2, f"record the schema version in {SCHEMA_TABLE}", _create_schema_table),
    Step(3, "create stream_retention (the trim boundaries of retention)",
         _create_retention_table),
    Step(4, "create stream_idempotency (the Idempotency-Keys of writes)",
         _create_idempotency_table),
)


def _check_steps(steps: Sequence[Step]) -> None:
    for n, step in enumerate(steps):
        if step.to != n + 1:
            raise ValueError(f"step {n} goes to version {step.to}, not {n + 1}")


_check_steps(STEPS)
#: The version this replicator makes and needs: its last step's.
CURRENT_VERSION = len(STEPS)


class SchemaProblem(Exception):
    """The database's schema stops a start (one line).  ``code`` 2: an
    operator must act, a restart does not help."""

    code = 2


class StepFailed(SchemaProblem):
    """A step failed and was rolled back (the database is as before it);
    ``code`` 1: a runtime failure, which a later start may not meet."""

    code = 1


def too_new(version: int) -> SchemaProblem:
    return SchemaProblem(
        f"database schema version {version} is newer than this replicator ({__version__}) "
        f"supports ({CURRENT_VERSION}); upgrade replicator")


# ------------------------------------------------------ in a pool thread
def read_version(txn: Cursor, postgres: bool) -> int:
    """The database's version (module docstring): its ``replicator_schema``
    row, else 1 if ``stream_positions`` exists, else 0."""
    if schema.table_columns(txn, SCHEMA_TABLE, postgres) is not None:
        txn.execute(f"SELECT version FROM {SCHEMA_TABLE}")
        row = txn.fetchone()
        if row is None:
            raise SchemaProblem(f"table {SCHEMA_TABLE} has no row: it is not the replicator's, "
                                "or was emptied by hand")
        return int(row[0])
    if schema.table_columns(txn, POSITIONS_TABLE, postgres) is not None:
        return 1
    return 0


def _lock(txn: Cursor, postgres: bool) -> None:
    if postgres:
        txn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
    else:
        # Python's sqlite3 opens no transaction before DDL on its own: this
        # one makes the step's CREATE/ALTER roll back with the rest.
        txn.execute("BEGIN IMMEDIATE")


def _record(txn: Cursor, db: Database, version: int, now: float, instance_name: str) -> None:
    when = datetime.datetime.fromtimestamp(now, datetime.UTC)
    txn.execute(db.sql(
        f"INSERT INTO {SCHEMA_TABLE} (version, migrated_at, replicator_version, instance_name) "
        "VALUES (%s, %s, %s, %s) ON CONFLICT (one_row) DO UPDATE SET "
        "version = excluded.version, migrated_at = excluded.migrated_at, "
        "replicator_version = excluded.replicator_version, "
        "instance_name = excluded.instance_name"),
        (version, when.isoformat(timespec="seconds"), __version__, instance_name))


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _next_step(txn: Cursor, db: Database, steps: Sequence[Step], announce: Callable[[str], None],
               now: float, instance_name: str) -> int | None:
    """One transaction: the next step, if any is due (None: none is); the
    version reached.  A new database gets all of them."""
    _lock(txn, db.is_postgres)
    version = read_version(txn, db.is_postgres)
    target = len(steps)
    if version > target:
        raise too_new(version)
    if version == target:
        return None
    todo = steps[version:] if version == 0 else steps[version:version + 1]
    if version == 0:
        announce(f"schema: creating version {target} (new database)")
    else:
        announce(f"schema: migrating {version} -> {version + 1}: {todo[0].what}")
    try:
        for step in todo:
            step.apply(txn, db.is_postgres)
        _record(txn, db, todo[-1].to, now, instance_name)
    except Exception as e:
        raise StepFailed(f"schema: migrating {version} -> {todo[-1].to} failed and was "
                            f"rolled back: {_one_line(e)}") from e
    return todo[-1].to


# ---------------------------------------------------------- from the reactor
async def migrate(db: Database, announce: Callable[[str], None], clock: IReactorTime,
                  instance_name: str,
                  steps: Sequence[Step] = STEPS) -> int:
    """Run every step due, each in its own transaction; returns the version
    reached.  ``announce(line)`` is called (in a pool thread) once per step,
    before it runs.  A failed step raises :class:`SchemaProblem` with the
    database at the version before it."""
    _check_steps(steps)
    while True:
        reached = await db.runInteraction(_next_step, db, steps, announce, clock.seconds(),
                                          instance_name)
        if reached is None:
            version: int = await db.runInteraction(read_version, db.is_postgres)
            return version


async def current_version(db: Database) -> int:
    """The database's version (:func:`read_version`), without the lock."""
    version: int = await db.runInteraction(read_version, db.is_postgres)
    return version


def pending(version: int, steps: Sequence[Step] = STEPS) -> Sequence[Step]:
    """The steps a database at ``version`` is due (all of them if new)."""
    return steps[version:]


def assess(version: int, owns_tables: bool, auto_migrate: bool) -> str:
    """What a start does with a database at ``version``, in a few words
    (``replicator check``); :class:`SchemaProblem` if it would refuse."""
    if version > CURRENT_VERSION:
        raise too_new(version)
    if not owns_tables:
        return (f"schema version {version}" if version else "no replicator tables") + \
            " (this instance writes no stream here: it creates and migrates nothing)"
    if version == CURRENT_VERSION:
        return f"schema version {version} (current)"
    if version == 0:
        return f"no replicator tables yet (start creates schema version {CURRENT_VERSION})"
    if not auto_migrate:
        raise SchemaProblem(
            f"database schema version {version} is older than this replicator's "
            f"({CURRENT_VERSION}) and auto_migrate is false: back the database up and run "
            "'replicator migrate -c' with this file")
    return f"schema version {version}, start migrates it to {CURRENT_VERSION}"


async def prepare(db: Database, owns_tables: bool, auto_migrate: bool, reactor: Any,
                  instance_name: str) -> None:
    """At start, before the streams load: the schema made current (new or
    older, when allowed), or :class:`SchemaProblem` saying why it cannot be
    (the daemon names ``database.<engine>`` with it)."""
    version = await current_version(db)
    assess(version, owns_tables, auto_migrate)
    if owns_tables and version < CURRENT_VERSION:
        await migrate(db, lambda line: reactor.callFromThread(log.info, "{line}", line=line),
                      reactor, instance_name)
