"""Reading a writer's facts back from a stream's table, a page at a time.

This is what a reader's catch-up and the fan-out (when memory cannot
answer) read.  One page is the rows of one writer with ``from_token <
token <= to_token`` in ascending token order (rows of one fact in insertion
order), at most ``limit`` rows, and never part of a fact: a page that would
cut a fact ends before it, and a single fact with more rows than ``limit``
is returned whole.  Pages are keyset-paginated (``token > last``), so each
costs the same however far behind the reader is.

On PostgreSQL a page is read as one row per fact: the server builds each
fact's rows as one JSON array (``json_agg``), and the pool thread decodes
it in one call, instead of building a Python tuple per row and grouping the
rows again.  Values come out as they do from the row query: JSON is decoded
by the standard library as psycopg2 decodes JSONB (integers exact at any
size); a stream without ``json`` columns is decoded with orjson (its
integers are 64-bit, its text exact).  SQLite reads rows and groups them.
"""

import json
from typing import Iterable, List, Tuple

import orjson

from ..config import StreamConfig
from ..storage.database import Database
from .rows import reader

Update = Tuple[int, list]
Fact = Tuple[int, List[list]]
Page = Tuple[List[Update], int, bool]
FactPage = Tuple[List[Fact], int, bool]

#: PostgreSQL functions take at most 100 arguments: wider streams read rows.
MAX_JSON_COLUMNS = 90


def group(updates: Iterable[Update]) -> List[Fact]:
    """``(token, rows)`` per fact from ``(token, row)`` pairs in token order."""
    facts: List[Fact] = []
    current = None
    rows: List[list] = []
    for token, row in updates:
        if token != current:
            rows = []
            facts.append((token, rows))
            current = token
        rows.append(row)
    return facts


def flatten(facts: Iterable[Fact]) -> List[Update]:
    """``(token, row)`` pairs from ``(token, rows)`` facts."""
    return [(token, row) for token, rows in facts for row in rows]


class PageQuery:
    """The page SELECTs of one stream's table (run in a pool thread)."""

    def __init__(self, config: StreamConfig, db: Database):
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
        self._grouped = db.is_postgres and len(c.columns) <= MAX_JSON_COLUMNS
        if self._grouped:
            values = ", ".join(f"{col.name}::json" if col.json_text else col.name
                               for col in c.columns)
            fact = f"json_agg(json_build_array({values}) ORDER BY _row_order)::text"
            inner = (f"SELECT {c.id_column}, ctid AS _row_order, {', '.join(c.column_names)} "
                     f"FROM {c.table}")
            self._select_facts = (
                f"SELECT {c.id_column}, count(*), {fact} FROM ({inner} "
                f"WHERE {where}{c.id_column} > %s AND {c.id_column} <= %s "
                f"ORDER BY {c.id_column}, ctid LIMIT %s) page "
                f"GROUP BY {c.id_column} ORDER BY {c.id_column}")
            self._select_fact = (
                f"SELECT {c.id_column}, count(*), {fact} FROM ({inner} "
                f"WHERE {where}{c.id_column} = %s) page GROUP BY {c.id_column}")
            has_json = any(col.type == "json" for col in c.columns)
            self._decode = json.loads if has_json else orjson.loads

    def read(self, txn, writer: str, from_token: int, to_token: int, limit: int) -> Page:
        """One page: ``(updates, upto_token, limited)``; ``upto_token`` is
        ``to_token`` unless ``limited``, else the last fact's token."""
        if self._grouped:
            facts, upto, limited = self.read_facts(txn, writer, from_token, to_token, limit)
            return flatten(facts), upto, limited
        return self._read_rows(txn, writer, from_token, to_token, limit)

    def read_facts(self, txn, writer: str, from_token: int, to_token: int,
                   limit: int) -> FactPage:
        """One page as ``(facts, upto_token, limited)``, ``facts`` being
        ``(token, rows)`` in token order (the same page as :meth:`read`)."""
        if not self._grouped:
            updates, upto, limited = self._read_rows(txn, writer, from_token, to_token, limit)
            return group(updates), upto, limited
        prefix = (writer,) if self._by_writer else ()
        txn.execute(self._select_facts, prefix + (from_token, to_token, limit + 1))
        found = txn.fetchall()
        limited = sum(n for _, n, _ in found) > limit
        if limited:
            # The last fact holds the row past the limit: it may be cut.
            cut = found.pop()
            if not found:
                # A single fact with more rows than the limit: whole.
                txn.execute(self._select_fact, prefix + (cut[0],))
                found = txn.fetchall()
            upto = found[-1][0]
        else:
            upto = to_token
        decode = self._decode
        return [(token, decode(rows)) for token, _, rows in found], upto, limited

    def _read_rows(self, txn, writer: str, from_token: int, to_token: int, limit: int) -> Page:
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
        shape = self._shape
        if shape is None:
            updates = [(r[0], list(r[1:])) for r in rows]
        else:
            updates = [(r[0], shape(r[1:])) for r in rows]
        return updates, upto, limited
