"""The status page's problem history, kept in the database across restarts.

One row of ``replicator_problems`` per problem an instance's status page
listed (:class:`replicator.observe.status.StatusRecorder`): what it was
(``kind``, ``stream_name``, ``writer``: ``''`` for none), its latest line
(``text``), whether it failed ``/health``, when it began and ended
(``started_ms``, ``ended_ms``; NULL: not ended).  A row still open when
its instance stopped says so: ``stopped_ms`` is the stop, written by an
orderly stop; ``restarted_ms`` is the next start, written when that start
found it open with no stop recorded (the instance was killed, or the
database was down at the stop).  A row is written when its problem starts
and when it ends, never in between (:mod:`replicator.observe.problem_log`).

Bounded: every write keeps the last :data:`KEEP` rows of its instance (by
``started_ms``) and deletes the older ones in the same transaction.

The table is created when a problem is first written and it does not
exist (``CREATE TABLE IF NOT EXISTS``, as ``stream_audit``: any instance
may be the first; so a role without ``CREATE`` on the schema works on a
table made for it) and read only if it exists.  Statements run in a pool
thread.
"""

from typing import Any, NamedTuple

from ..config.model import PROBLEMS_TABLE
from .database import Cursor, Database
from .schema import table_exists

TABLE = PROBLEMS_TABLE
#: Rows kept per instance.
KEEP = 200

DDL = (f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    instance_name TEXT NOT NULL,
    kind TEXT NOT NULL,
    stream_name TEXT NOT NULL,
    writer TEXT NOT NULL,
    text TEXT NOT NULL,
    fails_health INTEGER NOT NULL,
    started_ms BIGINT NOT NULL,
    ended_ms BIGINT,
    stopped_ms BIGINT,
    restarted_ms BIGINT
)
""", f"CREATE INDEX IF NOT EXISTS {TABLE}_started ON {TABLE} (instance_name, started_ms)")

#: A row of this run still open (neither ended nor marked at a stop).
_OPEN = "ended_ms IS NULL AND stopped_ms IS NULL AND restarted_ms IS NULL"


class Record(NamedTuple):
    """One write: a problem's row as of now.  ``new``: it has no row yet
    (an INSERT); else its open row gets ``text`` and ``ended_ms``."""

    kind: str
    stream: str | None
    writer: str | None
    text: str
    fails_health: bool
    started_ms: int
    ended_ms: int | None
    new: bool


def exists(txn: Cursor, db: Database) -> bool:
    return table_exists(txn, db.is_postgres, TABLE)


def write(txn: Cursor, db: Database, instance: str, records: list[Record],
          stopped_ms: int | None = None, keep: int = KEEP) -> None:
    """``records`` in order; then, with ``stopped_ms``, this run's rows still
    open are marked as open at that stop; then the instance's rows past the
    last ``keep`` are deleted."""
    if not exists(txn, db):
        for statement in DDL:
            txn.execute(statement)
    for r in records:
        if r.new:
            txn.execute(db.sql(
                f"INSERT INTO {TABLE} (instance_name, kind, stream_name, writer, text, "
                "fails_health, started_ms, ended_ms) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"),
                (instance, r.kind, r.stream or "", r.writer or "", r.text, int(r.fails_health),
                 r.started_ms, r.ended_ms))
        else:
            txn.execute(db.sql(
                f"UPDATE {TABLE} SET text = %s, ended_ms = %s WHERE instance_name = %s "
                "AND kind = %s AND stream_name = %s AND writer = %s AND started_ms = %s "
                f"AND {_OPEN}"),
                (r.text, r.ended_ms, instance, r.kind, r.stream or "", r.writer or "",
                 r.started_ms))
    if stopped_ms is not None:
        txn.execute(db.sql(f"UPDATE {TABLE} SET stopped_ms = %s WHERE instance_name = %s "
                           f"AND {_OPEN}"), (stopped_ms, instance))
    txn.execute(db.sql(
        f"DELETE FROM {TABLE} WHERE instance_name = %s AND started_ms < (SELECT started_ms "
        f"FROM {TABLE} WHERE instance_name = %s ORDER BY started_ms DESC LIMIT 1 OFFSET %s)"),
        (instance, instance, keep - 1))


def load(txn: Cursor, db: Database, instance: str, restarted_ms: int,
         limit: int) -> list[dict[str, Any]]:
    """At a start: this instance's last ``limit`` rows, oldest first, as
    dicts of the columns (``stream``, ``writer``: None for ``''``) (none if
    the table does not exist).  Rows open with no stop recorded are marked
    first as open at this restart (``restarted_ms``)."""
    if not exists(txn, db):
        return []
    txn.execute(db.sql(f"UPDATE {TABLE} SET restarted_ms = %s WHERE instance_name = %s "
                       f"AND {_OPEN}"), (restarted_ms, instance))
    txn.execute(db.sql(
        f"SELECT kind, stream_name, writer, text, fails_health, started_ms, ended_ms, "
        f"stopped_ms, restarted_ms FROM {TABLE} WHERE instance_name = %s "
        "ORDER BY started_ms DESC LIMIT %s"), (instance, limit))
    rows = [{"kind": k, "stream": s or None, "writer": w or None, "text": t,
             "fails_health": bool(f), "started_ms": int(start),
             "ended_ms": None if end is None else int(end),
             "stopped_ms": None if stop is None else int(stop),
             "restarted_ms": None if restart is None else int(restart)}
            for k, s, w, t, f, start, end, stop, restart in txn.fetchall()]
    return rows[::-1]
