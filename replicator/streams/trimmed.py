"""Telling "trimmed by retention" from "never existed" when reading a table.

Retention (:mod:`.retention`) deletes a stream's oldest facts and records,
in the same transaction, the *trim boundary* ``trimmed_through`` of the
stream's table (``stream_retention``, keyed by :func:`boundary_key`): every
fact at or below it is gone, none above it is ever trimmed.  The boundary
belongs to the table, not to the stream's name: two deployments sharing a
database may both have a stream ``caches`` in tables of their own.  A page read from the table after
``since`` is whole only if
the boundary is at or below ``since``; otherwise facts it should hold may
have been deleted, and the page says nothing about them.

Invariant: :meth:`TrimCheck.check` runs in the page's transaction *after*
the page's SELECT.  Under READ COMMITTED a later statement sees at least
what an earlier one saw: if the SELECT missed rows a trim deleted, the
boundary read after it shows that trim.  So a page that passes the check is
whole, and one that does not raises :class:`FactsTrimmed` before any of it
is handed on: a reader never skips trimmed facts silently.  Reading the
boundary in the page's SELECT itself (a scalar subquery: the same
snapshot) is as good: a trim whose deletions the SELECT misses committed
before its snapshot, boundary included (the read API's pages do so).
"""

from collections.abc import Callable

from ..config.model import StreamConfig
from ..storage import schema
from ..storage.database import Cursor


def boundary_key(config: StreamConfig) -> str:
    """The ``table_name`` of the stream's ``stream_retention`` row: its
    table, in lower case (how both databases fold an unquoted name)."""
    return config.table.lower()


class FactsTrimmed(Exception):
    """Facts a reader needs (after ``since``) were trimmed by retention, up
    to ``boundary`` (``> since``)."""

    def __init__(self, stream: str, writer: str, since: int, boundary: int) -> None:
        self.stream = stream
        self.writer = writer
        self.since = since
        self.boundary = boundary
        super().__init__(f"stream {stream}: facts after {since} are needed but facts up to "
                         f"{boundary} were trimmed by retention")


class TrimCheck:
    """The trim boundary check of one stream's pages (runs in a pool thread).

    Until ``stream_retention`` exists (an instance that writes nothing
    creates no table, and may start before the one that does) each check
    asks whether it does, one catalog lookup; once it exists it is read.
    """

    def __init__(self, stream_name: str, table_key: str, postgres: bool,
                 sql: Callable[[str], str]) -> None:
        self.stream_name = stream_name  # (for the messages)
        self.table_key = table_key  # the row's key: :func:`boundary_key`
        self._postgres = postgres
        self._sql = sql
        self._exists = False

    @property
    def exists(self) -> bool:
        """Whether ``stream_retention`` is known to exist (it is never dropped)."""
        return self._exists

    def boundary(self, txn: Cursor) -> int:
        """The trim boundary of the stream's table now (0: nothing trimmed)."""
        if not self._exists:
            if not schema.retention_table_exists(txn, self._postgres):
                return 0
            self._exists = True
        return schema.trimmed_through(txn, self.table_key, self._sql)

    def check(self, txn: Cursor, writer: str, since: int) -> None:
        """Raise :class:`FactsTrimmed` if facts after ``since`` may be gone."""
        boundary = self.boundary(txn)
        if boundary > since:
            raise FactsTrimmed(self.stream_name, writer, since, boundary)
