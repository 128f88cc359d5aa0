"""Reading a writer's facts back from a stream's table, a page at a time.

This is what a reader's catch-up and the fan-out (when memory cannot
answer) read.  One page is the rows of one writer with ``from_token <
token <= to_token`` in ascending token order (rows of one fact in insertion
order), at most ``limit`` rows, and never part of a fact: a page that would
cut a fact ends before it, and a single fact with more rows than ``limit``
is returned whole.  Pages are keyset-paginated (``token > last``), so each
costs the same however far behind the reader is.
"""

from typing import List, Tuple

from ..config import StreamConfig
from ..storage.database import Database
from .rows import reader

Update = Tuple[int, list]
Page = Tuple[List[Update], int, bool]


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

    def read(self, txn, writer: str, from_token: int, to_token: int, limit: int) -> Page:
        """One page: ``(updates, upto_token, limited)``; ``upto_token`` is
        ``to_token`` unless ``limited``, else the last fact's token."""
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
