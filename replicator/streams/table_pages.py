"""Reading a writer's facts back from a stream's table, a page at a time.

This is what a reader's catch-up, the fan-out (when memory cannot answer),
the read API and ``replicator verify`` read.  One page is the rows of one
writer with ``from_token < token <= to_token`` in ascending token order,
at most ``limit`` rows, and never part of a fact: a page that would
cut a fact ends before it, and a single fact with more rows than ``limit``
is returned whole.  Pages are keyset-paginated (``token > last``), so each
costs the same however far behind the reader is.

The rows of one fact come in the order they were written in a table the
replicator owns: by its ``row_index`` (:mod:`..storage.schema`), then heap
order (``ctid``, SQLite's ``rowid``) among rows of equal index (those
written before the column existed, all 0).  Another's table (``create:
false``, Synapse's) has no such column: its rows come in heap order, which
is the order they were inserted in until rows are updated or deleted space
is filled again (docs/streams.md, "The order of a fact's rows").

Each page's statements cover a window of IDs at a time
(:func:`windows`): the first spans :data:`WINDOW_ROWS` IDs per row (or
fact) asked for, each next one four times the last, until the page is
full or the range ends.  The result is the one statement's over the whole
range, but what the worst plan costs is bounded by the window, not by how
far behind the reader is: on a table PostgreSQL has no statistics for
(never analyzed: a new table filled fast, or autovacuum kept from running
by restarts), the planner takes the writer's whole range in a bitmap scan
and sorts it for every page of 100 facts (measured: 0.5–0.65 s a page
1.5 million rows behind, against 0.1 ms once analyzed).

A page is grouped into facts in the pool thread, in the same pass that
shapes its rows, so the reactor gets whole facts.  (Having PostgreSQL build
each fact as one JSON array, ``json_agg`` per fact, was measured: the
server spends about three times longer per page than the plain SELECT, and
the catch-up got slower.)  The read API's pages (:meth:`PageQuery.read_fact_pages`)
are counted in facts, and for streams of scalar columns PostgreSQL writes
each *row* as JSON text, which the answer uses as it is.
"""

from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter
from typing import Any

import orjson

from ..config import StreamConfig
from ..config.model import ROW_INDEX_COLUMN
from ..storage import schema
from ..storage.database import Cursor, Database
from .rows import reader
from .trimmed import FactsTrimmed, TrimCheck, boundary_key

Update = tuple[int, list[Any]]
Fact = tuple[int, list[list[Any]]]
Page = tuple[list[Update], int, bool]
FactPage = tuple[list[Fact], int, bool]
#: One writer's range of a :meth:`PageQuery.read_fact_pages`:
#: ``(writer, from_token, to_token, facts)``.
FactRange = tuple[str, int, int, int]


#: IDs the first window of a page's statements spans, per row (or fact)
#: the page asks for (:func:`windows`).
WINDOW_ROWS = 16
#: Each next window spans this many times the one before.
WINDOW_GROWTH = 4


def windows(from_token: int, to_token: int, wanted: int) -> Iterable[tuple[int, int]]:
    """``(lo, hi]`` ranges that cover ``(from_token, to_token]`` in order,
    each one :data:`WINDOW_GROWTH` times as wide as the one before, the
    first :data:`WINDOW_ROWS` IDs per ``wanted`` row: a caller takes them
    until it has what it wanted.  An empty range is one empty window (its
    statement still carries the trim boundary)."""
    if from_token >= to_token:
        yield from_token, to_token
        return
    span = max(1, WINDOW_ROWS * wanted)
    lo = from_token
    while lo < to_token:
        hi = to_token if to_token - lo <= span else lo + span
        yield lo, hi
        lo = hi
        span *= WINDOW_GROWTH


#: Column types whose values PostgreSQL writes as JSON exactly as orjson
#: writes what psycopg2 gives for them (``to_json``: the same string
#: escapes, digits, true/false).  ``json`` columns are not: ``jsonb`` text
#: has spaces and its own number forms.
JSON_SCALARS = ("text", "bigint", "boolean")


def row_json_sql(columns: Sequence[str]) -> str:
    """A PostgreSQL expression: the JSON text of a row as an object of
    ``columns`` (keys in this order, compact, ``null`` for NULL), equal to
    ``orjson.dumps(dict(zip(columns, values)))`` for columns of
    :data:`JSON_SCALARS` (tests/test_read_api_json.py compares them)."""
    parts = []
    for i, name in enumerate(columns):
        key = ("{" if i == 0 else ",") + orjson.dumps(name).decode() + ":"
        literal = "'" + key.replace("'", "''").replace("%", "%%") + "'"
        parts.append(f"{literal} || COALESCE(to_json({name})::text, 'null')")
    return "(" + " || ".join(parts) + " || '}')"


def group(updates: Iterable[Update]) -> list[Fact]:
    """``(token, rows)`` per fact from ``(token, row)`` pairs in token order."""
    facts: list[Fact] = []
    current = None
    rows: list[list[Any]] = []
    for token, row in updates:
        if token != current:
            rows = []
            facts.append((token, rows))
            current = token
        rows.append(row)
    return facts



#: Rows taken from the driver per call: psycopg2 converts the rows a fetch
#: takes holding the GIL (one ``fetchall`` of a 100,000-row fact held it
#: for 120 ms, the reactor thread waiting); between two calls it can switch.
FETCH_SLICE = 1000


def fetch_rows(txn: Cursor) -> list[Any]:
    """Every row of the statement just executed, ``FETCH_SLICE`` at a time."""
    rows: list[Any] = txn.fetchmany(FETCH_SLICE)
    if len(rows) < FETCH_SLICE:
        return rows
    while True:
        part = txn.fetchmany(FETCH_SLICE)
        if not part:
            return rows
        rows.extend(part)


class PageQuery:
    """The page SELECTs of one stream's table (run in a pool thread).

    Every page is checked against the stream's trim boundary after its
    SELECT (:mod:`.trimmed`): a page that may lack facts retention deleted
    raises :class:`.trimmed.FactsTrimmed` instead (Synapse's tables, which
    the replicator never trims, are not checked)."""

    def __init__(self, config: StreamConfig, db: Database) -> None:
        c = config
        self._config = config
        self._db = db
        self._trim: TrimCheck | None = (
            None if c.preset is not None
            else TrimCheck(c.name, boundary_key(c), db.is_postgres, db.sql))
        self._by_writer = c.writer_column is not None
        self._shape = reader(c.columns, db.is_postgres)
        #: Whether :meth:`read_fact_pages` can give rows as JSON text built
        #: by PostgreSQL (:func:`row_json_sql`): the stream's own table,
        #: columns of scalar types only.
        self.json_rows = (db.is_postgres and c.preset is None
                          and all(col.type in JSON_SCALARS for col in c.columns))
        self._heap = "ctid" if db.is_postgres else "rowid"
        #: The ORDER BY within a fact the SELECTs were built with; None
        #: until the first read of an owned table looked for its row_index.
        self.order: str | None = None
        if not c.owns_table:
            self._build(self._heap)

    def _ready(self, txn: Cursor) -> None:
        """The SELECTs built, on the first read of an owned table: ordered
        by its row_index if it has one (a stream only read here may be
        written by an older release that did not add it; looked at once)."""
        if self.order is None:
            indexed = schema.has_row_index(txn, self._config, self._db.is_postgres)
            self._build(f"{ROW_INDEX_COLUMN}, {self._heap}" if indexed else self._heap)

    def _build(self, order: str) -> None:
        c, db = self._config, self._db
        where = f"{c.writer_column} = %s AND " if c.writer_column else ""
        select = f"SELECT {c.id_column}, {', '.join(c.column_names)} FROM {c.table}"
        self._select_range = db.sql(
            f"{select} WHERE {where}{c.id_column} > %s AND {c.id_column} <= %s "
            f"ORDER BY {c.id_column}, {order} LIMIT %s"
        )
        self._select_one = db.sql(
            f"{select} WHERE {where}{c.id_column} = %s ORDER BY {order}"
        )
        # The rows of the first N facts of a range: up to the Nth distinct
        # ID (the writer's (writer, id) index), in one statement, so one
        # snapshot for both scans.  No fact: the bound is NULL, no row.
        first_facts = (
            f" FROM {c.table} WHERE {where}{c.id_column} > %s AND {c.id_column} <= %s "
            f"AND {c.id_column} <= (SELECT MAX(i) FROM (SELECT DISTINCT {c.id_column} AS i "
            f"FROM {c.table} WHERE {where}{c.id_column} > %s AND {c.id_column} <= %s "
            f"ORDER BY {c.id_column} LIMIT %s) AS ids) "
            f"ORDER BY {c.id_column}, {order}"
        )
        # (json rows, with the trim boundary) -> the SELECT.  The boundary
        # as a last column is read in the page's own snapshot: a trim
        # whose deletions the page misses committed before that snapshot,
        # so its boundary is in it (as :mod:`.trimmed` asks of a check).
        boundary = ", (SELECT trimmed_through FROM stream_retention WHERE table_name = %s)"
        select_facts = {}
        for json_rows in (False, True) if self.json_rows else (False,):
            values = row_json_sql(c.column_names) if json_rows else ", ".join(c.column_names)
            for with_boundary in (False, True):
                select_facts[json_rows, with_boundary] = db.sql(
                    f"SELECT {c.id_column}, {values}{boundary if with_boundary else ''}"
                    f"{first_facts}")
        self._select_facts = select_facts
        self.order = order  # last: another pool thread may read it meanwhile

    def read(self, txn: Cursor, writer: str, from_token: int, to_token: int, limit: int) -> Page:
        """One page: ``(updates, upto_token, limited)``; ``upto_token`` is
        ``to_token`` unless ``limited``, else the last fact's token."""
        rows, upto, limited = self._select(txn, writer, from_token, to_token, limit)
        shape = self._shape
        if shape is None:
            updates = [(r[0], list(r[1:])) for r in rows]
        else:
            updates = [(r[0], shape(r[1:])) for r in rows]
        return updates, upto, limited

    def read_facts(self, txn: Cursor, writer: str, from_token: int, to_token: int,
                   limit: int) -> FactPage:
        """One page as ``(facts, upto_token, limited)``, ``facts`` being
        ``(token, rows)`` in token order (the same page as :meth:`read`)."""
        rows, upto, limited = self._select(txn, writer, from_token, to_token, limit)
        return self._grouped(rows), upto, limited

    def read_fact_pages(self, txn: Cursor, ranges: Sequence[FactRange],
                        json_rows: bool = False) -> list[FactPage]:
        """Pages of several writers in one transaction, each counted in
        *facts*: ``(writer, from_token, to_token, facts)`` gives the first
        ``facts`` facts of ``writer`` with ``from_token < token <=
        to_token`` (each whole, one SELECT), as ``(facts, upto_token,
        limited)``: ``limited`` when it holds ``facts`` facts (``upto`` is
        then its last ID, else ``to_token``).  Every page is checked
        against the trim boundary (:mod:`.trimmed`): read by each SELECT
        itself once ``stream_retention`` exists, else once after them.

        With ``json_rows`` (only where :attr:`json_rows`), each row is the
        JSON text of an object of the stream's columns, in their order, as
        ``orjson`` encodes the values the plain SELECT gives."""
        self._ready(txn)
        trim = self._trim
        # Once stream_retention is known to exist, each SELECT carries the
        # boundary (no statement more); else one check after them all.
        carried = trim is not None and trim.exists
        select = self._select_facts[json_rows, carried]
        head = (trim.table_key,) if carried and trim is not None else ()
        pages: list[FactPage] = []
        unchecked = False
        for writer, from_token, to_token, count in ranges:
            prefix = (writer,) if self._by_writer else ()
            count = max(1, count)
            facts: list[Fact] = []
            boundary: int | None = None  # the largest any window's rows carried
            for lo, hi in windows(from_token, to_token, count):
                txn.execute(select, head + prefix + (lo, hi) + prefix + (lo, hi,
                                                                        count - len(facts)))
                rows = fetch_rows(txn)
                if carried and rows:
                    boundary = max(boundary or 0, rows[0][-1] or 0)
                else:
                    unchecked = True  # (no row: no boundary came with it)
                facts.extend(self._grouped(rows, json_rows, -1 if carried else None))
                if len(facts) >= count:
                    break
            limited = len(facts) >= count
            pages.append((facts, facts[-1][0] if limited else to_token, limited))
            if boundary is not None:
                self._check_trim(writer, from_token, boundary)
        if trim is not None and unchecked:
            boundary = trim.boundary(txn)
            for writer, from_token, _, _ in ranges:
                self._check_trim(writer, from_token, boundary)
        return pages

    def trim_boundary(self, txn: Cursor) -> int:
        """The stream's trim boundary now (0: nothing trimmed, or a preset
        stream, which retention never trims)."""
        return self._trim.boundary(txn) if self._trim is not None else 0

    def _check_trim(self, writer: str, from_token: int, boundary: int) -> None:
        if boundary > from_token:
            assert self._trim is not None
            raise FactsTrimmed(self._trim.stream_name, writer, from_token, boundary)

    def _grouped(self, rows: list[Any], json_rows: bool = False,
                 end: int | None = None) -> list[Fact]:
        """``(token, rows)`` per fact of database rows in token order, shaped
        (``json_rows``: each row is its one JSON text); the row's values
        are ``r[1:end]``."""
        shape: Callable[[Any], Any] | None = self._shape
        if json_rows:
            shape = itemgetter(0)
        facts: list[Fact] = []
        append = facts.append
        current = None
        fact_rows: list[list[Any]] = []
        if shape is None:
            shape = list
        for r in rows:
            token = r[0]
            if token != current:
                fact_rows = [shape(r[1:end])]
                append((token, fact_rows))
                current = token
            else:
                fact_rows.append(shape(r[1:end]))
        return facts

    def _select(self, txn: Cursor, writer: str, from_token: int, to_token: int,
                limit: int) -> tuple[list[Any], int, bool]:
        """The rows of one page (as the database gives them), ``upto``, ``limited``."""
        self._ready(txn)
        prefix = (writer,) if self._by_writer else ()
        rows: list[Any] = []
        for lo, hi in windows(from_token, to_token, limit + 1):
            txn.execute(self._select_range, prefix + (lo, hi, limit + 1 - len(rows)))
            rows.extend(fetch_rows(txn))
            if len(rows) > limit:
                break
        limited = len(rows) > limit
        if limited:
            last = rows[limit - 1][0]
            if rows[limit][0] == last:
                kept = [r for r in rows[:limit] if r[0] != last]
                if not kept:
                    txn.execute(self._select_one, prefix + (last,))
                    kept = fetch_rows(txn)
                rows = kept
            else:
                rows = rows[:limit]
            upto = rows[-1][0] if rows else last  # none: trimmed meanwhile (checked below)
        else:
            upto = to_token
        if self._trim is not None:  # after every SELECT of the page
            self._trim.check(txn, writer, from_token)
        return rows, upto, limited
