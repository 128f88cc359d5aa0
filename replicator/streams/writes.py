"""A stream's write transaction: IDs, rows and position in one commit.

:class:`WriteTransaction` is what runs in a database thread for a group of
writes (:mod:`.group`): it reserves the group's IDs from the stream's
sequence (PostgreSQL: ``nextval``, n of them in one round trip; SQLite: an
in-process counter), tells the ID generator about them *before* the commit
can happen (so no position ever passes an ID whose rows could still
appear), inserts every row of every fact (in one statement, or one per
``INSERT_ROWS`` rows; in a table the replicator owns, each row with its
``row_index``: its place in its fact, in the order the writer gave the
rows, which every read orders by), runs the writes' hooks, and persists
the writer's position in the same transaction when no other write of that
writer is in flight.  The pool commits.

Completing the IDs and answering the writers is the stream's business
(:class:`~replicator.streams.stream.Stream`), on the reactor thread.
"""

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from twisted.logger import Logger

from ..config import StreamConfig
from ..config.model import ROW_INDEX_COLUMN
from ..observe import metrics
from ..storage import schema
from ..storage.database import Cursor, Database
from .idgen import StreamIdGenerator

log = Logger()

TxnHook = Callable[[Any, int], None]

#: Rows in one INSERT statement at most (PostgreSQL): the driver formats a
#: statement holding the GIL, which would hold the reactor thread for as
#: long (0.4 s for 100,000 rows); between two statements it is released
#: while the server works.
INSERT_ROWS = 1000


class PreparedFacts(NamedTuple):
    """Facts checked by :meth:`.Stream.prepare`, ready to write."""

    writer: str
    wire: list[list[list[Any]]]
    params: list[list[list[Any]]]
    #: Per fact, each row's JSON line as RDATA carries it (the fan-out's).
    lines: list[list[bytes]]


class WriteTransaction:
    """The statements of one stream's write transaction (pool threads).

    ``sqlite_last`` is SQLite's in-process sequence: the last ID handed out
    (consumed even if its transaction rolls back).
    """

    #: Above this many values behind, the sequence is moved with ``setval``
    #: instead of by taking values (which never moves it backwards).
    SEQUENCE_CATCH_UP_MAX = 100_000

    def __init__(self, config: StreamConfig, db: Database) -> None:
        self.config = config
        self.name = config.name
        self.db = db
        self.sqlite_last = 0
        # Database connections whose sequence check ran (see
        # sequence_past_positions); a reconnect makes a new connection.
        self._sequence_checked: weakref.WeakSet[Any] = weakref.WeakSet()
        c = config
        sql = db.sql
        #: Whether each row is written with its row_index (ensure_schema
        #: gave an owned table the column before any write).
        self._indexed = c.owns_table
        cols = [c.id_column] + ([c.writer_column] if c.writer_column else []) + c.column_names
        cols += [ROW_INDEX_COLUMN] if self._indexed else []
        insert_cols = ", ".join(cols)
        marks = ["%s"] * (2 if c.writer_column else 1)
        for column in c.columns:
            marks.append("%s::jsonb" if column.type == "json" and db.is_postgres else "%s")
        marks += ["%s"] if self._indexed else []
        self._row_marks = "(" + ", ".join(marks) + ")"
        self._insert_one = sql(f"INSERT INTO {c.table} ({insert_cols}) VALUES {self._row_marks}")
        self._insert_head = f"INSERT INTO {c.table} ({insert_cols}) VALUES "
        self.upsert = sql(schema.upsert_position_sql(db.greatest))
        self._nextval = f"SELECT nextval('{c.sequence}')"
        self._nextval_many = f"SELECT nextval('{c.sequence}') FROM generate_series(1, %s)"

    def write(self, txn: Cursor, gen: StreamIdGenerator, writer: str, writes: Any,
              reserved: Any) -> list[int]:
        """Write ``writes`` (each given its IDs); IDs the generator accepted
        are appended to ``reserved`` as soon as it has them."""
        if self.db.is_postgres:
            return self._write_postgres(txn, gen, writer, writes, reserved)
        return self._write_sqlite(txn, gen, writer, writes, reserved)

    def _write_postgres(self, txn: Cursor, gen: StreamIdGenerator, writer: str, writes: Any,
                        reserved: Any) -> list[int]:
        """``nextval`` (n of them, in order) in one round trip, then the rows
        and the writer's position in one batch of statements; the pool commits.
        """
        connection = txn.connection
        if connection not in self._sequence_checked:
            self.sequence_past_positions(txn, gen)
            self._sequence_checked.add(connection)
        n = sum(len(w.facts) for w in writes)
        gen.begin_reservation()
        try:
            if n == 1:
                txn.execute(self._nextval)
                ids = [txn.fetchone()[0]]
            else:
                txn.execute(self._nextval_many, (n,))
                ids = sorted(r[0] for r in txn.fetchall())
        except BaseException:
            gen.abort_reservation()
            raise
        # Only IDs the generator accepted are ours to complete if this fails.
        gen.reserved(writer, ids)
        reserved.extend(ids)
        self._hand_out(txn, writes, ids)
        with_writer = self.config.writer_column is not None
        indexed = self._indexed
        params: list[Any] = []
        count = 0
        for w in writes:
            for stream_id, rows in zip(w.ids, w.facts):
                for index, row in enumerate(rows):
                    params.append(stream_id)
                    if with_writer:
                        params.append(writer)
                    params.extend(row)
                    if indexed:
                        params.append(index)
                    count += 1
                    if count == INSERT_ROWS:
                        # psycopg2 formats a statement holding the GIL: a
                        # statement per slice lets the reactor run between.
                        txn.execute(self._insert_head + self._marks_of(count), params)
                        params, count = [], 0
        statements = []
        if count:
            statements.append(self._insert_head + self._marks_of(count))
        if self._persist_in_transaction(gen, writer, ids):
            statements.append(self.upsert)
            params += [self.name, writer, gen.prospective_token(writer, ids)]
        if statements:
            txn.execute("; ".join(statements), params)
        return ids

    def _write_sqlite(self, txn: Cursor, gen: StreamIdGenerator, writer: str, writes: Any,
                      reserved: Any) -> list[int]:
        n = sum(len(w.facts) for w in writes)
        # As for nextval: no token moves (an idle writer's included) while
        # an ID is taken and not yet registered.
        gen.begin_reservation()
        first = self.sqlite_last + 1
        ids = list(range(first, first + n))
        self.sqlite_last = first + n - 1  # consumed even if this rolls back
        gen.reserved(writer, ids)
        reserved.extend(ids)
        with_writer = self.config.writer_column is not None
        indexed = self._indexed
        rows = []
        i = 0
        for w in writes:
            for fact_rows in w.facts:
                stream_id = ids[i]
                i += 1
                for index, row in enumerate(fact_rows):
                    values = [stream_id, writer, *row] if with_writer else [stream_id, *row]
                    if indexed:
                        values.append(index)
                    rows.append(values)
        if rows:
            txn.executemany(self._insert_one, rows)
        self._hand_out(txn, writes, ids)
        position = gen.prospective_token(writer, ids)
        txn.execute(self.upsert, (self.name, writer, position))
        return ids

    def _marks_of(self, rows: int) -> str:
        """The ``VALUES`` placeholders of ``rows`` rows."""
        return ", ".join([self._row_marks] * rows)

    @staticmethod
    def _hand_out(txn: Cursor, writes: Any, ids: Sequence[int]) -> None:
        """Give each write its IDs (in arrival order) and run its hooks."""
        i = 0
        for w in writes:
            w.ids = ids[i:i + len(w.facts)]
            i += len(w.facts)
            for hook in w.hooks:
                for stream_id in w.ids:
                    hook(txn, stream_id)

    @staticmethod
    def _persist_in_transaction(gen: StreamIdGenerator, writer: str, ids: list[int]) -> bool:
        """Persist the position with the fact unless other writes of this
        writer are in flight: they would queue on the position row's lock
        until each commit.  Then the background persist, which follows every
        advance, writes it (the table only ever holds a lower bound)."""
        return gen.in_flight(writer) == len(ids)

    def sequence_past_positions(self, txn: Cursor, gen: StreamIdGenerator) -> None:
        """Before the first ``nextval`` on a database connection: move the
        sequence past every ID this instance knows (its writers' positions
        included), never backwards.

        PostgreSQL can hand out again, after a crash restart, a value that
        went to a transaction which never committed; our writer may already
        have announced a position past it.  Every connection after a
        reconnect is a new one, so this runs before any write after a
        crash (as the check at startup does).
        """
        floor = gen.get_max_known()
        current = schema.sequence_value(txn, self.config.sequence)
        if current >= floor:
            return
        self.move_sequence(txn, current, floor)
        metrics.SEQUENCE_MOVED.labels(self.name).inc()
        log.warn("stream {stream}: sequence {seq} was at {current}, behind the "
                 "positions (up to {floor}) on a new database connection; moved it past",
                 stream=self.name, seq=self.config.sequence, current=current, floor=floor)

    def move_sequence(self, txn: Cursor, current: int, floor: int) -> None:
        """Move the sequence from ``current`` to at least ``floor`` by taking
        values, which never moves it backwards even if other connections
        take values meanwhile (``setval`` could); ``setval`` only for a gap
        above ``SEQUENCE_CATCH_UP_MAX``."""
        if floor - current <= self.SEQUENCE_CATCH_UP_MAX:
            txn.execute(f"SELECT max(nextval('{self.config.sequence}')) "
                        "FROM generate_series(1, %s)", (floor - current,))
        else:
            txn.execute("SELECT setval(%s, %s)", (self.config.sequence, floor))
