"""A stream as one instance sees it: its table, its writers, its positions.

Writing a fact (:meth:`Stream.writer`, :meth:`Stream.write_facts`) reserves
its ID from the sequence inside the writing transaction, inserts the fact's
rows (any number, all sharing the ID), persists the writer's position in
``stream_positions`` in the same transaction (unless other writes of that
writer are in flight: then right after, in the background), commits or rolls
back, and then marks the ID complete either way.  The ID generator is told about the
reservation before the transaction can commit, so no position ever passes an
ID whose rows could still appear.

Reading (:meth:`Stream.updates_since`) returns the rows of one writer between
two tokens in ascending token order; it is what both the RDATA fan-out and a
reader's catch-up use.
"""

import time
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from .. import metrics
from ..config import StreamConfig
from ..storage import schema
from ..storage.database import Database
from .group import Group, StatementFailed, Write, WriteGroups
from .idgen import StreamIdGenerator
from .rows import RowCodec, reader

log = Logger()

Update = Tuple[int, list]
#: Facts in one write transaction at most (``database.write_group_max``).
DEFAULT_GROUP_MAX = 256
TxnHook = Callable[[Any, int], None]
#: An RDATA line's length is estimated with a token of this many digits.
TOKEN_DIGITS = 20


class PreparedFacts(NamedTuple):
    """Facts checked by :meth:`Stream.prepare`, ready to write."""

    writer: str
    wire: List[List[list]]
    params: List[List[list]]


class Fact:
    """One fact being written: rows added in the ``async with`` block.

    ``also(fn)`` adds blocking work ``fn(txn, stream_id)`` to the same
    transaction (e.g. the application's own tables).  ``stream_id`` is set
    once the block has committed.  An exception in the block writes nothing
    and reserves nothing; a failure while writing rolls back and completes
    the reserved ID as a fact with no rows.
    """

    def __init__(self, stream: "Stream", writer: str):
        self._stream = stream
        self.writer = writer
        self.rows: List[list] = []
        self._hooks: List[TxnHook] = []
        self.stream_id: Optional[int] = None

    def add_row(self, row: Sequence[Any]) -> None:
        self.rows.append(list(row))

    def add_rows(self, rows) -> None:
        self.rows.extend(list(r) for r in rows)

    def also(self, fn: TxnHook) -> None:
        self._hooks.append(fn)

    async def __aenter__(self) -> "Fact":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            return False
        (self.stream_id,) = await self._stream.write_facts(
            [self.rows], writer=self.writer, hooks=self._hooks
        )
        return False


class Stream:
    """One stream: config, database, ID generator, and the local writer(s).

    Call :meth:`load` (in a DB thread, via the registry) before use.
    """

    def __init__(
        self,
        config: StreamConfig,
        db: Database,
        instance_name: str,
        local_writers: Optional[Sequence[str]] = None,
        call_from_thread: Optional[Callable] = None,
        persist_delay: float = 0.2,
        *,
        clock,
    ):
        self.config = config
        self.name = config.name
        self.db = db
        self.instance_name = instance_name
        if local_writers is None:
            local_writers = [instance_name] if instance_name in config.writers else []
        self.local_writers = list(local_writers)
        self.id_gen: Optional[StreamIdGenerator] = None
        self._call_from_thread = call_from_thread
        self._sqlite_last = 0  # SQLite: the in-process sequence's last value
        self._shape = reader(config.columns, db.is_postgres)
        self._codec = RowCodec(config.columns)
        self._persist_delay = persist_delay
        self._facts_written = metrics.FACTS_WRITTEN.labels(self.name)
        self._facts_rolled_back = metrics.FACTS_ROLLED_BACK.labels(self.name)
        self._write_latency = metrics.WRITE_LATENCY.labels(self.name)
        self._group_size = metrics.WRITE_GROUP_SIZE.labels(self.name)
        self._group_max = getattr(db.config, "write_group_max", DEFAULT_GROUP_MAX)
        self._groups: Dict[str, WriteGroups] = {}
        # Facts completed by local writers, kept until fanned out: the
        # fan-out reads them from here instead of back from the database.
        self._recent: Dict[str, Dict[int, List[list]]] = {}
        self._recent_floor: Dict[str, int] = {}
        self._recent_unknown: Dict[str, set] = {}  # failed writes: ask the table
        self._persist_call = None
        self._persisting: Optional[defer.Deferred] = None
        # One writer, and it writes here: every ID of the sequence is ours,
        # so one we never reserved is a fact written behind our back.
        self._sole_writer = len(config.writers) == 1 and self.local_writers == list(config.writers)
        self._foreign_facts = metrics.FOREIGN_FACTS.labels(self.name)
        self._foreign_burst: set = set()  # writers in a burst of foreign facts (logged)
        # Database connections whose sequence check ran (see
        # _sequence_past_positions); a reconnect makes a new connection.
        self._sequence_checked: "weakref.WeakSet" = weakref.WeakSet()
        self._clock = clock  # the instance's reactor, from the registry
        self._build_sql()

    # ------------------------------------------------------------- startup
    def _build_sql(self) -> None:
        c = self.config
        sql = self.db.sql
        cols = [c.id_column] + ([c.writer_column] if c.writer_column else []) + c.column_names
        self._insert_cols = ", ".join(cols)
        marks = ["%s"] * (2 if c.writer_column else 1)
        for column in c.columns:
            marks.append("%s::jsonb" if column.type == "json" and self.db.is_postgres else "%s")
        self._row_marks = "(" + ", ".join(marks) + ")"
        self._insert_one = sql(f"INSERT INTO {c.table} ({self._insert_cols}) VALUES {self._row_marks}")
        self._upsert = sql(schema.upsert_position_sql(self.db.greatest))
        order = "ctid" if self.db.is_postgres else "rowid"
        where = f"{c.writer_column} = %s AND " if c.writer_column else ""
        select = f"SELECT {c.id_column}, {', '.join(c.column_names)} FROM {c.table}"
        self._select_range = sql(
            f"{select} WHERE {where}{c.id_column} > %s AND {c.id_column} <= %s "
            f"ORDER BY {c.id_column}, {order} LIMIT %s"
        )
        self._select_one = sql(
            f"{select} WHERE {where}{c.id_column} = %s ORDER BY {order}"
        )
        self._insert_head = f"INSERT INTO {c.table} ({self._insert_cols}) VALUES "
        self._nextval = f"SELECT nextval('{c.sequence}')"
        self._nextval_many = f"SELECT nextval('{c.sequence}') FROM generate_series(1, %s)"

    def load(self, txn, has_positions: bool = True) -> None:
        """Positions from the database; nothing is in flight (pool thread).

        A local writer starts at the larger of its persisted position and its
        largest ID in the table; a writer with neither starts at the stream's
        smallest persisted position (never ahead of facts other writers may
        still have in flight).  A sequence behind the table is moved forward,
        with a warning, only by an instance that writes the stream: a stream
        only read here is never written to (nor its sequence moved).
        """
        c = self.config
        persisted = (schema.persisted_positions(txn, c.positions_key, self.db.sql)
                     if has_positions else {})
        table_max = schema.table_max_per_writer(txn, c)
        known = [persisted[w] for w in c.writers if w in persisted]
        floor = min(known) if known else 0
        positions = {}
        for w in c.writers:
            if w in self.local_writers:
                candidates = [p for p in (persisted.get(w), table_max.get(w)) if p is not None]
                positions[w] = max(candidates) if candidates else floor
            else:
                positions[w] = persisted.get(w, floor)
        top = max([0, *table_max.values(), *persisted.values()])
        if self.db.is_postgres and self.local_writers:
            current = schema.sequence_value(txn, c.sequence)
            if current < top:
                self._move_sequence(txn, current, top)
                log.warn(
                    "stream {stream}: sequence {seq} was at {current}, behind the "
                    "table's {top}; moved it to {top}",
                    stream=self.name, seq=c.sequence, current=current, top=top,
                )
        elif not self.db.is_postgres:
            self._sqlite_last = top
        self.id_gen = StreamIdGenerator(
            self.name, positions, self.local_writers, call_from_thread=self._call_from_thread
        )
        self.id_gen.add_listener(self._on_advance)
        for w in self.local_writers:
            self._groups[w] = WriteGroups(
                lambda group, w=w: self._run_group(w, group),
                lambda group, outcome, w=w: self._group_done(w, group, outcome),
                self._group_max)
            self._recent[w] = {}
            self._recent_floor[w] = positions[w]
            self._recent_unknown[w] = set()

    # ------------------------------------------------------------- writing
    def writer(self, writer: Optional[str] = None) -> Fact:
        """``async with stream.writer() as fact: fact.add_row([...])``."""
        return Fact(self, self._writer(writer))

    def _writer(self, writer: Optional[str]) -> str:
        writer = writer or self.instance_name
        if writer not in self.local_writers:
            raise ValueError(f"stream {self.name}: {writer} is not a writer here")
        return writer

    async def write_fact(self, rows, writer: Optional[str] = None) -> int:
        (stream_id,) = await self.write_facts([rows], writer)
        return stream_id

    async def write_facts(
        self, facts: Sequence[Sequence[Any]], writer: Optional[str] = None,
        hooks: Sequence[TxnHook] = (),
    ) -> List[int]:
        """Write several facts in one transaction; IDs reserved in one round trip.

        ``facts`` is a list of facts, each a list of rows (possibly empty).
        Returns the facts' stream IDs in order.  Concurrent writes of the
        same writer that wait for a database connection go together into
        one transaction (group commit, :mod:`.group`); each still succeeds
        or fails alone.
        """
        return await self.write_prepared(self.prepare(facts, writer), hooks)

    def prepare(self, facts: Sequence[Sequence[Any]], writer: Optional[str] = None,
                max_line_length: Optional[int] = None) -> "PreparedFacts":
        """``facts`` checked (:class:`RowError` if a row does not fit; with
        ``max_line_length``, also if its RDATA line would be longer) and
        converted for :meth:`write_prepared`.  Pure: may run in a thread."""
        writer = self._writer(writer)
        prefix = (len(b"RDATA ") + len(self.name.encode()) + 1 + len(writer.encode()) + 1
                  + TOKEN_DIGITS + 1)
        wire, checked = self._codec.prepare(facts, prefix, max_line_length)
        return PreparedFacts(writer, wire, checked)

    async def write_prepared(self, prepared: "PreparedFacts",
                             hooks: Sequence[TxnHook] = ()) -> List[int]:
        """Write facts :meth:`prepare` checked, in one transaction (see
        :meth:`write_facts`), or together with other waiting writes."""
        writer, wire, checked = prepared
        write = Write(checked, wire, list(hooks), time.monotonic())
        return await self._groups[writer].submit(write)

    def _run_group(self, writer: str, group: Group) -> defer.Deferred:
        """Start the transaction that takes ``group``'s writes (reactor thread)."""
        if self.db.is_postgres:
            return self.db.transactions.run(self._write_group, writer, group)
        return self.db.runInteraction(self._write_group, writer, group)

    def _write_group(self, txn, writer: str, group: Group) -> None:
        """In a pool thread: take the waiting writes and write them all.

        A failure before the commit is raised as :class:`StatementFailed`
        (nothing of the group committed: its writes may be retried alone).
        """
        writes = self._groups[writer].take(group)
        if not writes:
            return
        self._group_size.observe(sum(len(w.facts) for w in writes))
        try:
            if self.db.is_postgres:
                self._write_postgres(txn, writer, writes, group.reserved)
            else:
                self._write_sqlite(txn, writer, writes, group.reserved)
        except BaseException:
            raise StatementFailed(Failure())

    def _group_done(self, writer: str, group: Group, outcome) -> None:
        """Reactor thread: complete the group's IDs and answer its writes."""
        gen = self.id_gen
        if not isinstance(outcome, Failure):
            now = time.monotonic()
            for w in group.writes:
                self._remember(writer, w.ids, w.wire)
            if group.reserved:
                gen.complete_many(writer, group.reserved)
                self._facts_written.inc(len(group.reserved))
            for w in group.writes:
                self._write_latency.observe(now - w.started)
                w.deferred.callback(w.ids)
            return
        if group.reserved:
            # Rolled back (or, with the connection lost while committing,
            # perhaps committed): only the table knows; readers never wait.
            self._remember(writer, group.reserved, None)
            gen.complete_many(writer, group.reserved)
            self._facts_rolled_back.inc(len(group.reserved))
        in_statements = outcome.check(StatementFailed) is not None
        if in_statements and len(group.writes) > 1:
            for w in group.writes:
                self._groups[writer].retry_alone(w)
            return
        cause = outcome.value.failure if in_statements else outcome
        for w in group.writes:
            w.deferred.errback(cause)

    def _write_postgres(self, txn, writer, writes, reserved) -> List[int]:
        """``nextval`` (n of them, in order) in one round trip, then the rows
        and the writer's position in one batch of statements; the pool commits.
        """
        gen = self.id_gen
        connection = txn.connection
        if connection not in self._sequence_checked:
            self._sequence_past_positions(txn)
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
        params: List[Any] = []
        count = 0
        for w in writes:
            for stream_id, rows in zip(w.ids, w.facts):
                for row in rows:
                    params.append(stream_id)
                    if with_writer:
                        params.append(writer)
                    params.extend(row)
                    count += 1
        statements = []
        if count:
            statements.append(self._insert_head + ", ".join([self._row_marks] * count))
        if self._persist_in_transaction(writer, ids):
            statements.append(self._upsert)
            params += [self.name, writer, gen.prospective_token(writer, ids)]
        if statements:
            txn.execute("; ".join(statements), params)
        return ids

    @staticmethod
    def _hand_out(txn, writes, ids) -> None:
        """Give each write its IDs (in arrival order) and run its hooks."""
        i = 0
        for w in writes:
            w.ids = ids[i:i + len(w.facts)]
            i += len(w.facts)
            for hook in w.hooks:
                for stream_id in w.ids:
                    hook(txn, stream_id)

    #: Above this many values behind, the sequence is moved with ``setval``
    #: instead of by taking values (which never moves it backwards).
    SEQUENCE_CATCH_UP_MAX = 100_000

    def _sequence_past_positions(self, txn) -> None:
        """Before the first ``nextval`` on a database connection: move the
        sequence past every ID this instance knows (its writers' positions
        included), never backwards.

        PostgreSQL can hand out again, after a crash restart, a value that
        went to a transaction which never committed; our writer may already
        have announced a position past it.  Every connection after a
        reconnect is a new one, so this runs before any write after a
        crash (as the check at startup does).
        """
        floor = self.id_gen.get_max_known()
        current = schema.sequence_value(txn, self.config.sequence)
        if current >= floor:
            return
        self._move_sequence(txn, current, floor)
        metrics.SEQUENCE_MOVED.labels(self.name).inc()
        log.warn("stream {stream}: sequence {seq} was at {current}, behind the "
                 "positions (up to {floor}) on a new database connection; moved it past",
                 stream=self.name, seq=self.config.sequence, current=current, floor=floor)

    def _move_sequence(self, txn, current: int, floor: int) -> None:
        """Move the sequence from ``current`` to at least ``floor`` by taking
        values, which never moves it backwards even if other connections
        take values meanwhile (``setval`` could); ``setval`` only for a gap
        above ``SEQUENCE_CATCH_UP_MAX``."""
        if floor - current <= self.SEQUENCE_CATCH_UP_MAX:
            txn.execute(f"SELECT max(nextval('{self.config.sequence}')) "
                        "FROM generate_series(1, %s)", (floor - current,))
        else:
            txn.execute("SELECT setval(%s, %s)", (self.config.sequence, floor))

    def _persist_in_transaction(self, writer: str, ids: List[int]) -> bool:
        """Persist the position with the fact unless other writes of this
        writer are in flight: they would queue on the position row's lock
        until each commit.  Then the background persist, which follows every
        advance, writes it (the table only ever holds a lower bound)."""
        return self.id_gen.in_flight(writer) == len(ids)

    def _write_sqlite(self, txn, writer, writes, reserved) -> List[int]:
        n = sum(len(w.facts) for w in writes)
        first = self._sqlite_last + 1
        ids = list(range(first, first + n))
        self._sqlite_last = first + n - 1  # consumed even if this rolls back
        self.id_gen.reserved(writer, ids, pending=False)
        reserved.extend(ids)
        with_writer = self.config.writer_column is not None
        rows = []
        i = 0
        for w in writes:
            for fact_rows in w.facts:
                stream_id = ids[i]
                i += 1
                for row in fact_rows:
                    rows.append([stream_id, writer, *row] if with_writer else [stream_id, *row])
        if rows:
            txn.executemany(self._insert_one, rows)
        self._hand_out(txn, writes, ids)
        position = self.id_gen.prospective_token(writer, ids)
        txn.execute(self._upsert, (self.name, writer, position))
        return ids

    # ------------------------------------------------------ recent facts
    RECENT_MAX = 50_000
    keep_recent = False

    def keep_recent_facts(self) -> None:
        """Keep completed facts in memory until :meth:`forget` (called by
        whoever fans them out: the replication handler); from now on, so
        memory only ever answers for what it saw complete."""
        for w in self.local_writers:
            self._recent[w].clear()
            self._recent_unknown[w].clear()
            self._recent_floor[w] = self.id_gen.get_current_token(w)
        self.keep_recent = True

    def _remember(self, writer: str, ids: List[int], wire: Optional[List[List[list]]]) -> None:
        if not self.keep_recent:
            return
        recent = self._recent[writer]
        if wire is None:
            # A failed write: rolled back, or (connection lost during COMMIT)
            # perhaps committed after all. Only the table knows.
            self._recent_unknown[writer].update(ids)
        else:
            for stream_id, rows in zip(ids, wire):
                recent[stream_id] = rows
        if len(recent) > self.RECENT_MAX:
            keep = sorted(recent)[len(recent) // 2:]
            self.forget(writer, keep[0] - 1)

    def forget(self, writer: str, upto: int) -> None:
        """Facts of ``writer`` up to ``upto`` were fanned out: drop them."""
        recent = self._recent.get(writer)
        if recent is None or upto <= self._recent_floor[writer]:
            return
        for stream_id in [i for i in recent if i <= upto]:
            del recent[stream_id]
        unknown = self._recent_unknown[writer]
        if unknown:
            unknown.difference_update([i for i in unknown if i <= upto])
        self._recent_floor[writer] = upto

    def _recent_updates(self, writer, from_token, to_token, limit):
        """``updates_since`` from memory, or None if memory cannot answer."""
        recent = self._recent.get(writer)
        if recent is None or not self.keep_recent or from_token < self._recent_floor[writer] \
                or to_token > self.id_gen.get_current_token(writer) \
                or any(from_token < i <= to_token for i in self._recent_unknown[writer]):
            return None
        ids = sorted(i for i in recent if from_token < i <= to_token)
        if self._sole_writer and len(ids) < to_token - from_token:
            return None  # an ID we never reserved: foreign, only the table knows
        updates: List[Update] = []
        upto = to_token
        limited = False
        for stream_id in ids:
            rows = recent[stream_id]
            if updates and len(updates) + len(rows) > limit:
                upto, limited = updates[-1][0], True
                break
            updates.extend((stream_id, row) for row in rows)
        return updates, upto, limited

    # ------------------------------------------------------------- reading
    async def updates_since(
        self, writer: str, from_token: int, to_token: int, limit: int = 1000
    ) -> Tuple[List[Update], int, bool]:
        """Rows of ``writer`` with ``from_token < token <= to_token``.

        Returns ``(updates, upto_token, limited)``: ``(token, row)`` pairs in
        ascending token order, every fact whole; ``upto_token`` is the token
        reached (``to_token`` unless ``limited``).  A single fact with more
        rows than ``limit`` is returned whole.
        """
        if to_token <= from_token:
            return [], to_token, False
        answer = self._recent_updates(writer, from_token, to_token, max(1, limit))
        if answer is not None:
            if writer in self._foreign_burst:
                self._foreign_burst.discard(writer)
            return answer
        answer = await self.db.runInteraction(
            self._updates_txn, writer, from_token, to_token, max(1, limit)
        )
        self._check_foreign(writer, from_token, answer[0])
        return answer

    def _check_foreign(self, writer: str, from_token: int, updates: List[Update]) -> None:
        """Report facts of the sole (local) writer under IDs this instance
        never reserved: written behind its back (e.g. by SQL).  They are
        delivered like any other; one log line per burst, and a metric."""
        recent = self._recent.get(writer)
        if not self._sole_writer or recent is None or not self.keep_recent \
                or from_token < self._recent_floor[writer]:
            return
        unknown = self._recent_unknown[writer]
        foreign = sorted({t for t, _ in updates if t not in recent and t not in unknown})
        if not foreign:
            self._foreign_burst.discard(writer)
            return
        self._foreign_facts.inc(len(foreign))
        if writer not in self._foreign_burst:
            self._foreign_burst.add(writer)
            log.warn("stream {stream}: facts written without going through replicator "
                     "(IDs from {first}, {n} so far); delivered from the table. Writes must "
                     "go through the library or the HTTP API: others can be passed over "
                     "while uncommitted", stream=self.name, first=foreign[0], n=len(foreign))

    def _updates_txn(self, txn, writer, from_token, to_token, limit):
        prefix = (writer,) if self.config.writer_column else ()
        txn.execute(self._select_range, prefix + (from_token, to_token, limit + 1))
        rows = txn.fetchall()
        limited = len(rows) > limit
        if limited:
            last = rows[limit - 1][0]
            if rows[limit][0] == last:
                kept = [r for r in rows[:limit] if r[0] != last]
                if not kept:
                    txn.execute(self._select_one, prefix + (last,))
                    kept = txn.fetchall()
                rows = kept
            else:
                rows = rows[:limit]
            upto = rows[-1][0]
        else:
            upto = to_token
        shape = self._shape
        if shape is None:
            updates = [(r[0], list(r[1:])) for r in rows]
        else:
            updates = [(r[0], shape(r[1:])) for r in rows]
        return updates, upto, limited

    # ---------------------------------------------------------- persisting
    def _on_advance(self, writer: str, old: int, new: int) -> None:
        if writer in self.local_writers and self._persist_call is None:
            self._persist_call = self._clock.callLater(self._persist_delay, self._persist_now)

    def _persist_now(self) -> defer.Deferred:
        self._persist_call = None
        positions = [(self.name, w, self.id_gen.get_current_token(w)) for w in self.local_writers]

        def txn_fn(txn):
            for p in positions:
                txn.execute(self._upsert, p)

        d = self.db.runInteraction(txn_fn)
        d.addErrback(lambda f: log.failure("stream {stream}: persisting positions failed",
                                           f, stream=self.name))
        self._persisting = d
        return d

    async def flush_positions(self) -> None:
        """Persist local writers' current tokens now (at shutdown)."""
        if self._persist_call is not None and self._persist_call.active():
            self._persist_call.cancel()
        if self.id_gen is not None and self.local_writers:
            await self._persist_now()

    # ------------------------------------------------------------ sequence
    async def sequence_value(self) -> int:
        """The largest ID the stream's sequence has handed out, read now.

        No fact of any writer, in this process or another sharing the
        database, can have a larger ID: a peer claiming a larger token is
        lying.  PostgreSQL: read in a pool thread (never on the reactor);
        SQLite: the in-process counter (every writer is in this process).
        """
        if not self.db.is_postgres:
            return self._sqlite_last
        return await self.db.runInteraction(schema.sequence_value, self.config.sequence)
