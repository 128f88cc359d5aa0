"""Reading a writer's facts back from a stream's table, a page at a time.

This is what a reader's catch-up and the fan-out (when memory cannot
answer) read.  One page is the rows of one writer with ``from_token <
token <= to_token`` in ascending token order (rows of one fact in insertion
order), at most ``limit`` rows, and never part of a fact: a page that would
cut a fact ends before it, and a single fact with more rows than ``limit``
is returned whole.  Pages are keyset-paginated (``token > last``), so each
costs the same however far behind the reader is.

A page is grouped into facts in the pool thread, in the same pass that
shapes its rows, so the reactor gets whole facts.  (Having PostgreSQL build
each fact as one JSON array, ``json_agg`` per fact, was measured: the
server spends about three times longer per page than the plain SELECT, and
the catch-up got slower.)
"""

from typing import Any, Iterable, List, Tuple

from ..config import StreamConfig
from ..storage.database import Cursor, Database
from .rows import reader

Update = Tuple[int, List[Any]]
Fact = Tuple[int, List[List[Any]]]
Page = Tuple[List[Update], int, bool]
FactPage = Tuple[List[Fact], int, bool]


def group(updates: Iterable[Update]) -> List[Fact]:
    """``(token, rows)`` per fact from ``(token, row)`` pairs in token order."""
    facts: List[Fact] = []
    current = None
    rows: List[List[Any]] = []
    for token, row in updates:
        if token != current:
            rows = []
            facts.append((token, rows))
            current = token
        rows.append(row)
    return facts


class PageQuery:
    """The page SELECTs of one stream's table (run in a pool thread)."""

    def __init__(self, config: StreamConfig, db: Database) -> None:
        c = config
        self._by_writer = c.writer_column is not None
        self._shape = reader(c.columns, db.is_postgres)
        order = "ctid" if db.is_postgres else "rowid"
        where = f"{c.writer_column} = %s AND " if c.writer_column else ""
        select = f"SELECT {c.id_column}, {', '.join(c.column_names)} FROM {c.table}"
        self._select_range = db.sql(
            f"{select} WHERE {where}{c.id_column} > %s AND {c.id_column} <= %s "
            f"ORDER BY {c.id_column}, {order} LIMIT %s"
        )
        self._select_one = db.sql(
            f"{select} WHERE {where}{c.id_column} = %s ORDER BY {order}"
        )

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
        shape = self._shape
        facts: List[Fact] = []
        append = facts.append
        current = None
        fact_rows: List[List[Any]] = []
        if shape is None:
            shape = list
        for r in rows:
            token = r[0]
            if token != current:
                fact_rows = [shape(r[1:])]
                append((token, fact_rows))
                current = token
            else:
                fact_rows.append(shape(r[1:]))
        return facts, upto, limited

    def _select(self, txn: Cursor, writer: str, from_token: int, to_token: int,
                limit: int) -> Tuple[List[Any], int, bool]:
        """The rows of one page (as the database gives them), ``upto``, ``limited``."""
        prefix = (writer,) if self._by_writer else ()
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
        return rows, upto, limited
