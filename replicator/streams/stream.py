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

This module ties the parts together on the reactor thread: who goes into
which transaction (:mod:`.group`), the transaction's statements
(:mod:`.writes`), the ID generator (:mod:`.idgen`), facts kept in memory
for the fan-out (:mod:`.recent`), pages read back from the table
(:mod:`.pages`), and persisting positions in the background.
"""

import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from operator import itemgetter
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from ..config import StreamConfig
from ..net.backoff import Outage
from ..observe import metrics
from ..storage import schema
from ..storage.database import Cursor, Database
from .fence import Fence, Poller
from .group import Group, StatementFailed, Write, WriteGroups
from .idgen import StreamIdGenerator
from .known import KnownIds
from .pages import FactPage, FactRange, Page, PageQuery, group
from .readahead import ReadAhead
from .recent import EncodedPage, RecentFacts
from .rows import RowCodec
from .tally import Tally, TallyQuery
from .writes import PreparedFacts, TxnHook, WriteTransaction

log = Logger()

Update = tuple[int, list[Any]]
#: Facts in one write transaction at most (``database.write_group_max``).
DEFAULT_GROUP_MAX = 256
#: An RDATA line's length is estimated with a token of this many digits.
TOKEN_DIGITS = 20
#: Rows a library write checks and encodes per reactor turn (a larger write
#: takes several turns, the reactor running in between).
PREPARE_SLICE = 2000
_token_of = itemgetter(0)


def _nothing(pages: Any) -> None:
    """What :meth:`Stream.facts_at` runs after its read: nothing."""


class Fact:
    """One fact being written: rows added in the ``async with`` block.

    ``also(fn)`` adds blocking work ``fn(txn, stream_id)`` to the same
    transaction (e.g. the application's own tables).  ``stream_id`` is set
    once the block has committed.  An exception in the block writes nothing
    and reserves nothing; a failure while writing rolls back and completes
    the reserved ID as a fact with no rows.
    """

    def __init__(self, stream: "Stream", writer: str) -> None:
        self._stream = stream
        self.writer = writer
        self.rows: list[list[Any]] = []
        self._hooks: list[TxnHook] = []
        self.stream_id: int | None = None

    def add_row(self, row: Sequence[Any]) -> None:
        self.rows.append(list(row))

    def add_rows(self, rows: Iterable[Sequence[Any]]) -> None:
        self.rows.extend(list(r) for r in rows)

    def also(self, fn: TxnHook) -> None:
        self._hooks.append(fn)

    async def __aenter__(self) -> "Fact":
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
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
        local_writers: Sequence[str] | None = None,
        call_from_thread: Callable[..., Any] | None = None,
        persist_delay: float = 0.2,
        *,
        clock: IReactorTime,
    ) -> None:
        self.config = config
        self.name = config.name
        self.db = db
        self.instance_name = instance_name
        if local_writers is None:
            local_writers = [instance_name] if instance_name in config.writers else []
        self.local_writers = list(local_writers)
        self._id_gen: StreamIdGenerator | None = None
        self._call_from_thread = call_from_thread
        self._txn = WriteTransaction(config, db)
        self._pages = PageQuery(config, db)
        self._tally = TallyQuery(config, db)
        #: IDs whose writer is known here (:mod:`.known`): local writers'
        #: reservations, facts readers handed on.
        self.known_ids = KnownIds()
        # Catch-up pages of other instances' writers read ahead (PostgreSQL:
        # a run holds a pool connection; SQLite has one for everything).
        self._read_ahead = (ReadAhead(db, self._pages.read_facts, call_from_thread)
                            if call_from_thread is not None and db.is_postgres
                            and db.config.pool_max > 1 else None)
        self._codec = RowCodec(config.columns)
        self._persist_delay = persist_delay
        self._persist_outage = Outage(f"stream {config.name}: persisting positions",
                                      max(persist_delay, 0.5))
        self._persist_stopped = False  # (shutdown: no retry after the last flush)
        self._facts_written = metrics.FACTS_WRITTEN.labels(self.name)
        self._facts_rolled_back = metrics.FACTS_ROLLED_BACK.labels(self.name)
        self._write_latency = metrics.WRITE_LATENCY.labels(self.name)
        self._group_size = metrics.WRITE_GROUP_SIZE.labels(self.name)
        self._group_max = getattr(db.config, "write_group_max", DEFAULT_GROUP_MAX)
        self._groups: dict[str, WriteGroups] = {}
        # One writer, and it writes here: every ID of the sequence is ours,
        # so one we never reserved is a fact written behind our back.
        sole_writer = len(config.writers) == 1 and self.local_writers == list(config.writers)
        #: Plain-SQL writers' rows are facts of our writer (:mod:`.fence`):
        #: its token is capped by the fence this instance polls.
        self.fenced = (config.foreign_writers and db.is_postgres
                       and config.writers[0] in self.local_writers)
        self.fence: Fence | None = None
        # Facts completed by local writers, kept until fanned out: the
        # fan-out reads them from here instead of back from the database.
        # (A fenced writer's: an ID it did not write may be a plain-SQL fact.)
        self.recent = RecentFacts(self.local_writers, sole_writer or self.fenced)
        self._persist_call: IDelayedCall | None = None
        self._persisting: defer.Deferred[None] | None = None
        self._loaded: dict[str, int | None] = {}  # local writers' rows at load
        self._foreign_facts = metrics.FOREIGN_FACTS.labels(self.name)
        self._foreign_burst: set[str] = set()  # writers in a burst of foreign facts (logged)
        self._clock = clock  # the instance's reactor, from the registry
        #: The trim boundary when last read (:meth:`load`, :meth:`read_trim_boundary`):
        #: where a consumer with ``start: beginning`` starts (every fact still here).
        self.trimmed_through = 0

    # ------------------------------------------------------------- startup
    @property
    def loaded(self) -> bool:
        """Whether :meth:`load` has run (the ID generator exists)."""
        return self._id_gen is not None

    @property
    def id_gen(self) -> StreamIdGenerator:
        """The stream's ID generator; only once :meth:`load` has run."""
        if self._id_gen is None:
            raise RuntimeError(f"stream {self.name} is not loaded")
        return self._id_gen

    def load(self, txn: Cursor, has_positions: bool = True) -> None:
        """Positions from the database; nothing is in flight (pool thread).

        A local writer starts at the larger of its persisted position and its
        largest ID in the table; a remote writer with neither starts at the
        stream's smallest persisted position (never ahead of facts it may
        still have in flight).  Nothing local is in flight yet, so the ID
        generator then moves every local writer, idle, to the largest of
        these (:mod:`.idgen`).  A sequence behind the table is moved forward,
        with a warning, only by an instance that writes the stream: a stream
        only read here is never written to (nor its sequence moved).
        """
        c = self.config
        # Rows of instances the stream does not name (another deployment
        # sharing the database and the stream's name, a writer removed
        # long ago) are nobody's position here; the table's IDs bound the
        # sequence whoever wrote them.
        persisted = {w: p for w, p in (schema.persisted_positions(
            txn, c.positions_key, self.db.sql) if has_positions else {}).items()
            if w in c.writers}
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
                self._txn.move_sequence(txn, current, top)
                log.warn(
                    "stream {stream}: sequence {seq} was at {current}, behind the "
                    "largest position of its table and its writers' rows in "
                    "stream_positions ({top}); moved it to {top}",
                    stream=self.name, seq=c.sequence, current=current, top=top,
                )
        elif not self.db.is_postgres:
            self._txn.sqlite_last = top
        self.trimmed_through = self._pages.trim_boundary(txn)
        fenced: dict[str, int] | None = None
        if self.fenced:
            # Where the fence stands now (a holder mid-way: what was persisted).
            first = c.writers[0]
            now, _, _ = Poller(c).poll(txn, None, 1 << 63, 0, first, self._txn.upsert)
            fenced = {first: max(persisted.get(first, floor), now or 0)}
        self._id_gen = StreamIdGenerator(
            self.name, positions, self.local_writers, call_from_thread=self._call_from_thread,
            fenced=fenced,
        )
        self._id_gen.add_listener(self._on_advance)
        self._loaded = {w: persisted.get(w) for w in self.local_writers}
        for w in self.local_writers:
            self._groups[w] = WriteGroups(
                partial(self._run_group, w), partial(self._group_done, w), self._group_max)

    # -------------------------------------------------------------- reload
    def new_writer_positions(self, txn: Cursor, writers: Sequence[str]) -> dict[str, int]:
        """Where each of ``writers`` (other instances', joining the stream
        at a reload) starts, as :meth:`load` would start it: its persisted
        position, else the stream's smallest persisted one (pool thread)."""
        has_positions = schema.table_columns(txn, "stream_positions",
                                             self.db.is_postgres) is not None
        persisted = (schema.persisted_positions(txn, self.config.positions_key, self.db.sql)
                     if has_positions else {})
        known = [persisted[w] for w in self.config.writers if w in persisted]
        floor = min(known) if known else 0
        return {w: persisted.get(w, floor) for w in writers}

    async def read_trim_boundary(self) -> int:
        """:attr:`trimmed_through` read again (retention moves it)."""
        self.trimmed_through = int(await self.db.runInteraction(self._pages.trim_boundary))
        return self.trimmed_through

    def change_writers(self, config: StreamConfig, positions: dict[str, int]) -> None:
        """Take ``config``, which differs from the running one only in other
        instances' writers: the ones it adds start at ``positions``, the ones
        it drops no longer hold the linear token back (reactor thread)."""
        for w in self.config.writers:
            if w not in config.writers and w not in self.local_writers:
                self.id_gen.remove_remote(w)
        for w in config.writers:
            if w not in self.config.writers:
                self.id_gen.add_remote(w, positions[w])
        self.config = config

    # ------------------------------------------------------------- writing
    def writer(self, writer: str | None = None) -> Fact:
        """``async with stream.writer() as fact: fact.add_row([...])``."""
        return Fact(self, self._writer(writer))

    def _writer(self, writer: str | None) -> str:
        writer = writer or self.instance_name
        if writer not in self.local_writers:
            raise ValueError(f"stream {self.name}: {writer} is not a writer here")
        return writer

    async def write_fact(self, rows: Sequence[Sequence[Any]], writer: str | None = None) -> int:
        (stream_id,) = await self.write_facts([rows], writer)
        return stream_id

    async def write_facts(
        self, facts: Sequence[Sequence[Any]], writer: str | None = None,
        hooks: Sequence[TxnHook] = (),
    ) -> list[int]:
        """Write several facts in one transaction; IDs reserved in one round trip.

        ``facts`` is a list of facts, each a list of rows (possibly empty).
        Returns the facts' stream IDs in order.  Concurrent writes of the
        same writer that wait for a database connection go together into
        one transaction (group commit, :mod:`.group`); each still succeeds
        or fails alone.  A write of more than ``PREPARE_SLICE`` rows is
        checked and encoded over several reactor turns.
        """
        if sum(map(len, facts)) <= PREPARE_SLICE:
            prepared = self.prepare(facts, writer)
        else:
            prepared = await self._prepare_sliced(facts, writer)
        return await self.write_prepared(prepared, hooks)

    async def _prepare_sliced(self, facts: Sequence[Sequence[Any]],
                              writer: str | None) -> "PreparedFacts":
        """:meth:`prepare` of a large write, ``PREPARE_SLICE`` rows per
        reactor turn (the reactor runs in between); the same result."""
        writer = self._writer(writer)
        prefix = self._line_prefix(writer)
        codec = self._codec
        wire: list[list[list[Any]]] = []
        checked: list[list[list[Any]]] = []
        lines: list[list[bytes]] = []
        done = 0
        for rows in facts:
            fact_wire: list[list[Any]] = []
            fact_checked: list[list[Any]] = []
            fact_lines: list[bytes] = []
            for start in range(0, max(len(rows), 1), PREPARE_SLICE):
                if done >= PREPARE_SLICE:
                    await deferLater(self._clock, 0, lambda: None)
                    done = 0
                part = rows[start:start + PREPARE_SLICE]
                (w,), (c,), (ls,) = codec.prepare([part], prefix, None, first_row=start)
                fact_wire.extend(w)
                fact_checked.extend(c)
                fact_lines.extend(ls)
                done += len(part)
            wire.append(fact_wire)
            checked.append(fact_checked)
            lines.append(fact_lines)
        return PreparedFacts(writer, wire, checked, lines)

    def prepare(self, facts: Sequence[Sequence[Any]], writer: str | None = None,
                max_line_length: int | None = None) -> "PreparedFacts":
        """``facts`` checked (:class:`.RowError` if a row does not fit; with
        ``max_line_length``, also if its RDATA line would be longer) and
        converted for :meth:`write_prepared`.  Pure: may run in a thread."""
        writer = self._writer(writer)
        wire, checked, lines = self._codec.prepare(facts, self._line_prefix(writer),
                                                   max_line_length)
        return PreparedFacts(writer, wire, checked, lines)

    def _line_prefix(self, writer: str) -> int:
        """The length of ``RDATA <stream> <writer> <token> `` with the
        longest token."""
        return (len(b"RDATA ") + len(self.name.encode()) + 1 + len(writer.encode()) + 1
                + TOKEN_DIGITS + 1)

    async def write_prepared(self, prepared: "PreparedFacts",
                             hooks: Sequence[TxnHook] = ()) -> list[int]:
        """Write facts :meth:`prepare` checked, in one transaction (see
        :meth:`write_facts`), or together with other waiting writes."""
        writer, wire, checked, lines = prepared
        write = Write(checked, wire, list(hooks), time.monotonic(), lines)
        return await self._groups[writer].submit(write)

    def writing(self, writer: str) -> bool:
        """Whether another write of local ``writer`` is queued or in a
        transaction (reactor thread): a commit of it is on its way."""
        groups = self._groups.get(writer)
        return groups is not None and groups.busy

    def _run_group(self, writer: str, group: Group) -> "defer.Deferred[None]":
        """Start the transaction that takes ``group``'s writes (reactor thread)."""
        if self.db.is_postgres:
            return self.db.transactions.run(self._write_group, writer, group)
        return self.db.runInteraction(self._write_group, writer, group)

    def _write_group(self, txn: Cursor, writer: str, group: Group) -> None:
        """In a pool thread: take the waiting writes and write them all.

        A failure before the commit is raised as :class:`StatementFailed`
        (nothing of the group committed: its writes may be retried alone).
        """
        writes = self._groups[writer].take(group)
        if not writes:
            return
        self._group_size.observe(sum(len(w.facts) for w in writes))
        try:
            self._txn.write(txn, self.id_gen, writer, writes, group.reserved)
        except BaseException:
            raise StatementFailed(Failure()) from None

    def _group_done(self, writer: str, group: Group, outcome: Any) -> None:
        """Reactor thread: complete the group's IDs and answer its writes."""
        gen = self.id_gen
        if not isinstance(outcome, Failure):
            now = time.monotonic()
            for w in group.writes:
                self.recent.remember(writer, w.ids, w.wire, w.lines)
            if group.reserved:
                self.known_ids.note(group.reserved)
                gen.complete_many(writer, group.reserved)
                self._facts_written.inc(len(group.reserved))
            for w in group.writes:
                self._write_latency.observe(now - w.started)
                w.deferred.callback(w.ids)
            return
        if group.reserved:
            # Rolled back (or, with the connection lost while committing,
            # perhaps committed): only the table knows; readers never wait.
            self.recent.remember(writer, group.reserved, None)
            self.known_ids.note(group.reserved)
            gen.complete_many(writer, group.reserved)
            self._facts_rolled_back.inc(len(group.reserved))
        in_statements = outcome.check(StatementFailed) is not None
        if in_statements and len(group.writes) > 1:
            for w in group.writes:
                self._groups[writer].retry_alone(w)
            return
        cause = cast(StatementFailed, outcome.value).failure if in_statements else outcome
        for w in group.writes:
            w.deferred.errback(cause)

    # ------------------------------------------------------ recent facts
    def keep_recent_facts(self) -> None:
        """Keep completed facts in memory until :meth:`forget` (called by
        whoever fans them out: the replication handler); from now on, so
        memory only ever answers for what it saw complete."""
        self.recent.start({w: self.id_gen.get_current_token(w) for w in self.local_writers})

    def forget(self, writer: str, upto: int) -> None:
        """Facts of ``writer`` up to ``upto`` were fanned out: drop them."""
        self.recent.forget(writer, upto)

    def _recent_updates(self, writer: str, from_token: int, to_token: int,
                        limit: int) -> Page | None:
        """``updates_since`` from memory, or None if memory cannot answer."""
        if writer not in self.local_writers:
            return None
        return self.recent.updates(writer, from_token, to_token, limit,
                                   self.id_gen.get_current_token(writer))

    def encoded_since(self, writer: str, from_token: int, to_token: int,
                      limit: int = 1000) -> EncodedPage | None:
        """What :meth:`updates_since` would return, from memory only, as
        the rows' JSON lines kept from the write (the fan-out's path); None
        when memory cannot answer (then :meth:`updates_since` reads the
        table)."""
        if writer not in self.local_writers:
            return None
        page = self.recent.encoded(writer, from_token, to_token, max(1, limit),
                                   self.id_gen.get_current_token(writer))
        if page is not None:
            self._foreign_burst.discard(writer)
        return page

    # ------------------------------------------------------------- reading
    async def updates_since(
        self, writer: str, from_token: int, to_token: int, limit: int = 1000
    ) -> tuple[list[Update], int, bool]:
        """Rows of ``writer`` with ``from_token < token <= to_token``.

        Returns ``(updates, upto_token, limited)``: ``(token, row)`` pairs in
        ascending token order, every fact whole; ``upto_token`` is the token
        reached (``to_token`` unless ``limited``).  A single fact with more
        rows than ``limit`` is returned whole.
        """
        return cast(Page, await self._page(self._pages.read, writer, from_token, to_token, limit))

    async def first_fact_in(self, writer: str, from_token: int, to_token: int) -> int | None:
        """The smallest ID of ``writer`` in the table in ``(from_token,
        to_token]``, if any (one indexed statement): what a reader asks
        before it takes a POSITION's word that the range holds nothing."""
        found: int | None = await self.db.runReads(
            self._tally.any_fact, writer, from_token, to_token)
        return found

    @property
    def keeps_facts(self) -> bool:
        """Whether every fact stays in the table until retention trims it
        (ours: facts are immutable).  Synapse's tables (a preset) delete
        and replace theirs: presence and receipts keep each user's newest,
        cache invalidations are pruned."""
        return self.config.preset is None

    async def tally(self, writer: str, from_token: int, to_token: int) -> tuple[Tally, int]:
        """``((facts, id_sum, rows), trim boundary)`` of ``writer`` in
        ``(from_token, to_token]`` (:mod:`.tally`)."""
        answer: tuple[Tally, int] = await self.db.runReads(
            self._tally.tally, writer, from_token, to_token)
        return answer

    async def fact_sizes(self, writer: str, from_token: int,
                         to_token: int) -> list[tuple[int, int]]:
        """``(id, rows)`` of each fact of ``writer`` in the range."""
        answer: list[tuple[int, int]] = await self.db.runReads(
            self._tally.facts, writer, from_token, to_token)
        return answer

    async def facts_since(
        self, writer: str, from_token: int, to_token: int, limit: int = 1000
    ) -> FactPage:
        """:meth:`updates_since` as whole facts: ``(facts, upto_token,
        limited)``, ``facts`` being ``(token, rows)`` in token order (a
        reader's catch-up pages)."""
        if self._read_ahead is not None and writer not in self.local_writers \
                and to_token > from_token:
            # Memory answers for local writers only: the table it is.
            return cast(FactPage, await self._read_ahead.page(
                writer, from_token, to_token, max(1, limit)))
        return cast(FactPage, await self._page(
            self._pages.read_facts, writer, from_token, to_token, limit))

    async def fact_page(
        self, writer: str, from_token: int, to_token: int, limit: int = 1000
    ) -> FactPage:
        """:meth:`facts_since` for readers other than this instance's
        catch-up (the read API): the same page, from memory or one read,
        never through the catch-up's read-ahead run."""
        return cast(FactPage, await self._page(
            self._pages.read_facts, writer, from_token, to_token, limit))

    async def facts_at(self, writer: str, tokens: Sequence[int]) -> dict[int, list[Any]]:
        """The rows of the facts of ``writer`` with these IDs (the audit's
        sample): ``{token: rows}``, an ID with no fact left out.  Memory
        answers what it can; the rest is read from the table in one trip
        to a pool thread (:meth:`table_fact_pages`: one statement per ID,
        no transaction around them), not one trip each.  Raises
        :class:`.trimmed.FactsTrimmed` if retention took one of them."""
        found: dict[int, list[Any]] = {}
        ranges: list[FactRange] = []
        for token in tokens:
            page = self.memory_fact_page(writer, token - 1, token, 1)
            if page is None:
                ranges.append((writer, token - 1, token, 1))
            elif page[0] and page[0][0][0] == token:
                found[token] = page[0][0][1]
        if ranges:
            pages, _ = await self.table_fact_pages(ranges, _nothing)
            for (_, _, token, _), (facts, _, _) in zip(ranges, pages):
                if facts and facts[0][0] == token:
                    found[token] = facts[0][1]
        return found

    def memory_fact_page(self, writer: str, from_token: int, to_token: int,
                         limit: int) -> FactPage | None:
        """:meth:`fact_page` if memory can answer it (at once), else None."""
        if to_token <= from_token:
            return [], to_token, False
        answer = self._recent_updates(writer, from_token, to_token, max(1, limit))
        if answer is None:
            return None
        self._foreign_burst.discard(writer)
        return group(answer[0]), answer[1], answer[2]

    @property
    def json_rows(self) -> bool:
        """Whether :meth:`table_fact_pages` can give rows as JSON text."""
        return self._pages.json_rows

    async def table_fact_pages(self, ranges: Sequence[FactRange],
                               then: Callable[[list[FactPage]], Any],
                               json_rows: bool = False) -> tuple[list[FactPage], Any]:
        """Several writers' pages counted in facts, read from the table in
        one trip to a pool thread (:meth:`.pages.PageQuery.read_fact_pages`,
        one statement per writer, each consistent by itself: no
        transaction around them; rows as JSON text with ``json_rows``),
        and ``then(pages)`` run in the same pool thread (e.g. encoding
        them): ``(pages, then(pages))``."""
        def read(txn: Cursor) -> tuple[list[FactPage], Any]:
            pages = self._pages.read_fact_pages(txn, ranges, json_rows)
            return pages, then(pages)

        answer: tuple[list[FactPage], Any] = await self.db.runReads(read)
        for (writer, from_token, _, _), page in zip(ranges, answer[0]):
            self._check_foreign(writer, from_token, map(_token_of, page[0]))
        return answer

    async def _page(self, read: Callable[..., Any], writer: str, from_token: int,
                    to_token: int, limit: int) -> Any:
        """One page from memory if it can answer, else by ``read`` in a pool thread."""
        if to_token <= from_token:
            return [], to_token, False
        limit = max(1, limit)
        answer = self._recent_updates(writer, from_token, to_token, limit)
        if answer is not None:
            self._foreign_burst.discard(writer)
            if read == self._pages.read_facts:
                answer = group(answer[0]), answer[1], answer[2]
            return answer
        answer = await self.db.runInteraction(read, writer, from_token, to_token, limit)
        self._check_foreign(writer, from_token, map(_token_of, answer[0]))
        return answer

    def _check_foreign(self, writer: str, from_token: int, tokens: Iterable[int]) -> None:
        """Report facts of the sole (local) writer under IDs this instance
        never reserved: written behind its back (e.g. by SQL).  They are
        delivered like any other; one log line per burst, and a metric.
        (``tokens`` is read only when memory can tell: a reader of another
        instance's writer does not walk its catch-up pages.)"""
        foreign = self.recent.foreign(writer, from_token, tokens)
        if foreign is None:
            return
        if not foreign:
            self._foreign_burst.discard(writer)
            return
        self._foreign_facts.inc(len(foreign))
        if self.fenced:
            return  # plain-SQL writers are taken here, behind the fence
        if writer not in self._foreign_burst:
            self._foreign_burst.add(writer)
            log.warn("stream {stream}: facts written without going through replicator "
                     "(IDs from {first}, {n} so far); delivered from the table. Writes must "
                     "go through the library or the HTTP API: others can be passed over "
                     "while uncommitted", stream=self.name, first=foreign[0], n=len(foreign))

    # ---------------------------------------------------------- persisting
    def started(self) -> None:
        """After :meth:`load`, on the reactor thread: a local writer that
        starts ahead of its row in ``stream_positions`` (an idle writer
        moved to the largest position, or a writer with no row yet) has it
        persisted, as after any advance; otherwise the row would wait for
        the writer's next advance, holding the export's bound back."""
        if any(p is None or self.id_gen.get_current_token(w) > p
               for w, p in self._loaded.items()):
            self._on_advance(self.local_writers[0], 0, 0)
        if self.fenced and self.fence is None:
            self.fence = Fence(self, self._clock)
            self.fence.start()

    @property
    def upsert_sql(self) -> str:
        """The statement that persists a writer's position (a lower bound)."""
        return self._txn.upsert

    def _on_advance(self, writer: str, old: int, new: int) -> None:
        if writer in self.local_writers and self._persist_call is None:
            self._persist_call = self._clock.callLater(self._persist_delay, self._persist_now)

    def _persist_now(self) -> "defer.Deferred[None]":
        self._persist_call = None
        positions = [(self.name, w, self.id_gen.get_current_token(w)) for w in self.local_writers]

        def txn_fn(txn: Cursor) -> None:
            for p in positions:
                txn.execute(self._txn.upsert, p)

        d = self.db.runInteraction(txn_fn)
        d.addCallbacks(self._persisted, self._persist_failed)
        self._persisting = d
        return d

    def _persisted(self, _: object) -> None:
        self._persist_outage.succeeded()

    def _persist_failed(self, failure: Failure) -> None:
        """Tried again with backoff, not only at the writer's next advance:
        an idle writer's row would stay behind its last fact until then."""
        delay = self._persist_outage.failed(failure.value)
        if self._persist_call is None and not self._persist_stopped:
            self._persist_call = self._clock.callLater(delay, self._persist_now)

    async def flush_positions(self) -> None:
        """Persist local writers' current tokens now (at shutdown)."""
        self._persist_stopped = True
        if self.fence is not None:
            self.fence.stop()
        if self._persist_call is not None and self._persist_call.active():
            self._persist_call.cancel()
        self._persist_call = None
        if self.loaded and self.local_writers:
            await self._persist_now()

    # ------------------------------------------------------------ sequence
    async def sequence_value(self) -> int:
        """The largest ID the stream's sequence has handed out, read now.

        No fact of any writer, in this process or another sharing the
        database, can have a larger ID: a peer claiming a larger token is
        lying.  PostgreSQL: one statement on the database's reactor-driven
        connection (:mod:`..storage.reactor_reads`: no trip to a pool
        thread, never blocking the reactor), or in a pool thread where there
        is none; SQLite: the in-process counter (every writer is in this
        process).
        """
        if not self.db.is_postgres:
            return self._txn.sqlite_last
        reads = self.db.reactor_reads(self._clock)
        if reads is None:
            value: int = await self.db.runReads(schema.sequence_value, self.config.sequence)
            return value
        rows = await reads.fetchall(schema.sequence_value_sql(self.config.sequence))
        return schema.sequence_value_of(rows[0])
