"""The delivery audit's findings, kept in the database across restarts.

A reader the audit stopped (:mod:`replicator.replication.core.audit`) has
handed its consumers facts past the ones it missed: after a restart their
positions are past them too, so nothing would find the loss again.  So
each finding is a row of ``stream_audit``, one per (instance, stream,
writer), written when it is found and read at the next start, before any
reader runs: the stream is stopped again, with the same finding, until
every consumer that keeps a position for that writer is below the finding's
first ID (the operator ran the ``replicator rewind --to`` it names), when
the row is deleted.

The table is created when a finding is first written (``CREATE TABLE IF
NOT EXISTS``, as ``stream_positions``; an instance that only reads may be
the first to need it) and read only if it exists.  Statements run in a
pool thread.
"""

import json
from typing import Any

from ..config.model import AUDIT_TABLE
from .database import Cursor, Database
from .schema import table_exists

TABLE = AUDIT_TABLE

DDL = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    instance_name TEXT NOT NULL,
    stream_name TEXT NOT NULL,
    writer TEXT NOT NULL,
    first_id BIGINT NOT NULL,
    detail TEXT NOT NULL,
    found_ms BIGINT NOT NULL,
    PRIMARY KEY (instance_name, stream_name, writer)
)
"""


def exists(txn: Cursor, db: Database) -> bool:
    return table_exists(txn, db.is_postgres, TABLE)


def save(txn: Cursor, db: Database, instance: str, stream: str, writer: str, first_id: int,
         detail: dict[str, Any], found_ms: int) -> None:
    """Keep a finding (the first one of its (stream, writer) stays)."""
    txn.execute(DDL)
    txn.execute(db.sql(
        f"INSERT INTO {TABLE} (instance_name, stream_name, writer, first_id, detail, found_ms) "
        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (instance_name, stream_name, writer) "
        "DO NOTHING"), (instance, stream, writer, first_id, json.dumps(detail), found_ms))


def load(txn: Cursor, db: Database, instance: str) -> list[dict[str, Any]]:
    """This instance's findings: ``{"stream", "writer", "first_id", "detail",
    "found_ms"}`` each (none if the table does not exist)."""
    if not exists(txn, db):
        return []
    txn.execute(db.sql(f"SELECT stream_name, writer, first_id, detail, found_ms FROM {TABLE} "
                       "WHERE instance_name = %s ORDER BY stream_name, writer"), (instance,))
    return [{"stream": s, "writer": w, "first_id": int(f), "detail": json.loads(d),
             "found_ms": int(ms)} for s, w, f, d, ms in txn.fetchall()]


def delete(txn: Cursor, db: Database, instance: str, stream: str, writer: str) -> None:
    txn.execute(db.sql(f"DELETE FROM {TABLE} WHERE instance_name = %s AND stream_name = %s "
                       "AND writer = %s"), (instance, stream, writer))
