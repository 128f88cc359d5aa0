"""What a stream's table holds of one writer in an ID range, in one row.

Readers do not take a writer's word for what it wrote: a POSITION that
moves a reader over an ID range is checked against the table
(:meth:`TallyQuery.any_fact`), and the delivery audit
(:mod:`replicator.replication.core.audit`) compares what a reader handed on
with :meth:`TallyQuery.tally` of the same range.  Both are single indexed
statements over ``(writer, id)`` (or ``id``), run in a pool thread; neither
reads a row's values.

A tally is ``(facts, id_sum, rows, boundary)``: the number of distinct IDs
in ``(from_token, to_token]``, the sum of those IDs modulo
:data:`ID_MODULUS` (so it fits every engine's integers however long the
range), the number of rows, and the trim boundary read in the same
statement (facts at or below it may be gone: not comparable).
"""

from collections.abc import Iterable, Sequence

from ..config import StreamConfig
from ..storage.database import Cursor, Database
from .trimmed import TrimCheck, boundary_key

#: IDs are summed modulo this prime (a missing and an extra fact of the
#: same count cancel only if their IDs agree modulo it).
ID_MODULUS = 1_000_000_007

Tally = tuple[int, int, int]  # (facts, id sum mod ID_MODULUS, rows)


def tally_of(facts: Iterable[tuple[int, int]]) -> Tally:
    """The tally of ``(id, rows)`` pairs, as :meth:`TallyQuery.tally` counts."""
    count = id_sum = rows = 0
    for stream_id, n in facts:
        count += 1
        id_sum += stream_id % ID_MODULUS
        rows += n
    return count, id_sum % ID_MODULUS, rows


class TallyQuery:
    """The tally statements of one stream's table."""

    def __init__(self, config: StreamConfig, db: Database) -> None:
        c = config
        self._trim: TrimCheck | None = (
            None if c.preset is not None
            else TrimCheck(c.name, boundary_key(c), db.is_postgres, db.sql))
        self._by_writer = c.writer_column is not None
        where = f"{c.writer_column} = %s AND " if c.writer_column else ""
        span = f"{where}{c.id_column} > %s AND {c.id_column} <= %s"
        self._any = db.sql(f"SELECT {c.id_column} FROM {c.table} WHERE {span} "
                           f"ORDER BY {c.id_column} LIMIT 1")
        modulo = "%%" if db.is_postgres else "%"  # (psycopg2 reads "%" as a placeholder)
        self._tally = db.sql(
            f"SELECT COUNT(*), COALESCE(SUM(i {modulo} {ID_MODULUS}), 0), COALESCE(SUM(n), 0) "
            f"FROM (SELECT {c.id_column} AS i, COUNT(*) AS n FROM {c.table} "
            f"WHERE {span} GROUP BY {c.id_column}) AS f")
        self._facts = db.sql(
            f"SELECT {c.id_column}, COUNT(*) FROM {c.table} WHERE {span} "
            f"GROUP BY {c.id_column} ORDER BY {c.id_column}")

    def _args(self, writer: str, from_token: int, to_token: int) -> Sequence[object]:
        return (writer, from_token, to_token) if self._by_writer else (from_token, to_token)

    def any_fact(self, txn: Cursor, writer: str, from_token: int,
                 to_token: int) -> int | None:
        """The smallest ID of ``writer`` in ``(from_token, to_token]``, if any."""
        txn.execute(self._any, self._args(writer, from_token, to_token))
        row = txn.fetchone()
        return None if row is None else int(row[0])

    def tally(self, txn: Cursor, writer: str, from_token: int,
              to_token: int) -> tuple[Tally, int]:
        """``(tally, boundary)`` of ``(from_token, to_token]``: the boundary
        is read after the tally's statement (facts at or below it may have
        been deleted by retention before or during it)."""
        txn.execute(self._tally, self._args(writer, from_token, to_token))
        count, id_sum, rows = txn.fetchone()
        boundary = self._trim.boundary(txn) if self._trim is not None else 0
        return (int(count), int(id_sum) % ID_MODULUS, int(rows)), boundary

    def facts(self, txn: Cursor, writer: str, from_token: int,
              to_token: int) -> list[tuple[int, int]]:
        """``(id, rows)`` of every fact of ``writer`` in the range (what an
        audit that found a difference lists, to name it)."""
        txn.execute(self._facts, self._args(writer, from_token, to_token))
        return [(int(i), int(n)) for i, n in txn.fetchall()]

