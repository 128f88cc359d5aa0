"""Facts completed by a stream's local writers, kept until fanned out.

The RDATA fan-out of a writer's new facts reads them from here instead of
back from the database.  Memory answers a range only when it is sure to
hold every fact of it:

* it was switched on (:meth:`RecentFacts.start`) before the range's first
  ID, and nothing below the range was forgotten yet;
* no ID of the range belongs to a failed write (rolled back, or perhaps
  committed after a lost COMMIT: only the table knows);
* for a stream whose only writer is local, no ID of the range is missing
  (an ID this instance never reserved is a fact written behind its back).

Otherwise :meth:`RecentFacts.updates` says ``None`` and the caller reads
the table.  Memory is bounded: past ``MAX`` facts of a writer, the older
half is forgotten.

Each fact is kept twice: its rows (for :meth:`RecentFacts.updates`), and
each row's JSON line as the write path encoded it (for
:meth:`RecentFacts.encoded`: the fan-out only has to put the prefix and
token in front).  The lines take about the JSON's size, less than the rows
themselves, under the same bound.
"""

from collections.abc import Iterable
from typing import Any, NamedTuple

Update = tuple[int, list[Any]]


class EncodedPage(NamedTuple):
    """Rows of whole facts as the JSON lines the write path encoded
    (:func:`~replicator.jsontext.encode_json_line`), in token order:
    ``lines[i]`` is a row of fact ``tokens[i]``; ``facts`` distinct facts
    (fewer than rows: a fact has several).  ``upto`` and ``limited`` as
    for ``updates_since``."""

    tokens: list[int]
    lines: list[bytes]
    facts: int
    upto: int
    limited: bool


class RecentFacts:
    """Per local writer: completed facts (ID → wire rows, and their JSON
    lines) above a floor."""

    #: Facts kept per writer at most; past it the older half is dropped.
    MAX = 50_000

    def __init__(self, writers: Iterable[str], sole_writer: bool) -> None:
        self.active = False
        self._sole_writer = sole_writer
        self.facts: dict[str, dict[int, list[list[Any]]]] = {w: {} for w in writers}
        self.lines: dict[str, dict[int, list[bytes]]] = {w: {} for w in self.facts}
        self._floor: dict[str, int] = {w: 0 for w in self.facts}
        self._unknown: dict[str, set[Any]] = {w: set() for w in self.facts}

    def start(self, floors: dict[str, int]) -> None:
        """Keep facts from now on, above each writer's current token
        ``floors[w]``: memory only answers for what it saw complete."""
        for w in self.facts:
            self.facts[w].clear()
            self.lines[w].clear()
            self._unknown[w].clear()
            self._floor[w] = floors[w]
        self.active = True

    def remember(self, writer: str, ids: list[int], wire: list[list[list[Any]]] | None,
                 lines: list[list[bytes]] | None = None) -> None:
        """Facts ``ids`` completed (``wire``: their rows, ``lines``: their
        rows' JSON lines) or failed (None)."""
        if not self.active:
            return
        recent = self.facts[writer]
        if wire is None or lines is None:
            self._unknown[writer].update(ids)
        else:
            recent.update(zip(ids, wire))
            self.lines[writer].update(zip(ids, lines))
        if len(recent) > self.MAX:
            keep = sorted(recent)[len(recent) // 2:]
            self.forget(writer, keep[0] - 1)

    def forget(self, writer: str, upto: int) -> None:
        """Facts of ``writer`` up to ``upto`` were fanned out: drop them."""
        recent = self.facts.get(writer)
        if recent is None or upto <= self._floor[writer]:
            return
        lines = self.lines[writer]
        for stream_id in [i for i in recent if i <= upto]:
            del recent[stream_id]
            del lines[stream_id]
        unknown = self._unknown[writer]
        if unknown:
            unknown.difference_update([i for i in unknown if i <= upto])
        self._floor[writer] = upto

    def _ids(self, writer: str, from_token: int, to_token: int,
             current_token: int) -> list[int] | None:
        """The IDs kept in ``(from_token, to_token]``, sorted, or None if
        memory cannot answer for that range."""
        recent = self.facts.get(writer)
        if recent is None or not self.active or from_token < self._floor[writer] \
                or to_token > current_token \
                or any(from_token < i <= to_token for i in self._unknown[writer]):
            return None
        ids = sorted(i for i in recent if from_token < i <= to_token)
        if self._sole_writer and len(ids) < to_token - from_token:
            return None  # an ID we never reserved: foreign, only the table knows
        return ids

    def updates(self, writer: str, from_token: int, to_token: int, limit: int,
                current_token: int) -> tuple[list[Update], int, bool] | None:
        """``updates_since`` from memory, or None if memory cannot answer."""
        ids = self._ids(writer, from_token, to_token, current_token)
        if ids is None:
            return None
        recent = self.facts[writer]
        updates: list[Update] = []
        upto = to_token
        limited = False
        for stream_id in ids:
            rows = recent[stream_id]
            if updates and len(updates) + len(rows) > limit:
                upto, limited = updates[-1][0], True
                break
            updates.extend((stream_id, row) for row in rows)
        return updates, upto, limited

    def encoded(self, writer: str, from_token: int, to_token: int, limit: int,
                current_token: int) -> EncodedPage | None:
        """What :meth:`updates` answers, as the rows' JSON lines; None if
        memory cannot answer."""
        ids = self._ids(writer, from_token, to_token, current_token)
        if ids is None:
            return None
        kept = self.lines[writer]
        tokens: list[int] = []
        lines: list[bytes] = []
        facts = 0
        upto = to_token
        limited = False
        for stream_id in ids:
            rows = kept[stream_id]
            if not rows:
                continue
            if lines and len(lines) + len(rows) > limit:
                upto, limited = tokens[-1], True
                break
            facts += 1
            if len(rows) == 1:
                tokens.append(stream_id)
                lines.append(rows[0])
            else:
                tokens.extend([stream_id] * len(rows))
                lines.extend(rows)
        return EncodedPage(tokens, lines, facts, upto, limited)

    def foreign(self, writer: str, from_token: int, tokens: Iterable[int]) -> list[int] | None:
        """Of ``tokens`` read from the table above ``from_token``, those of
        the sole local writer that this instance never wrote (sorted); None
        when memory cannot tell."""
        recent = self.facts.get(writer)
        if not self._sole_writer or recent is None or not self.active \
                or from_token < self._floor[writer]:
            return None
        unknown = self._unknown[writer]
        return sorted({t for t in tokens if t not in recent and t not in unknown})
