"""Retention gaps the operator accepted in advance.

``replicator rewind --skip-to boundary`` moves a consumer's position to the
stream's trim boundary as it is when the command runs.  Under aggressive
retention the trimmer may pass that position again before the next start
catches up, and the pasted command would never converge.  So such a skip
records that the operator accepted the loss of *whatever retention has
trimmed by the time the reader reads* (:class:`.IAcceptsTrimmed`:
``accepted_gap``), until something is handed on after it.

:func:`accepting` wraps a reader's ``source``.  When a page raises
:class:`.FactsTrimmed` and every consumer of the stream whose position is
below the boundary accepted it (at least one such consumer), each of them
records a skip to the boundary (a skip line: none of those facts is in the
table any more, all are at or below the boundary), one log line says so,
and the page is read again from the boundary: the reader goes on instead of
stopping.  Otherwise the gap is raised as before and the stream stops
(:mod:`.gaps`).  Nothing in the table is skipped: every fact at or below a
boundary is gone, and every consumer that needed one of them had accepted.
"""

from collections.abc import Callable, Sequence
from typing import Any, cast

from twisted.logger import Logger

from ...consumers import Consumer
from ...consumers.base import IAcceptsTrimmed
from ...streams.trimmed import FactsTrimmed
from .gaps import consumer_label
from .reader import Source, maybe_await

log = Logger(namespace="replicator.retention")


def _behind(consumers: Sequence[Consumer], key: tuple[str, str], boundary: int
            ) -> list[Consumer] | None:
    """The consumers below ``boundary`` for ``key`` if every one of them
    accepted the gap (and there is one), else None."""
    behind: list[Consumer] = []
    for consumer in consumers:
        accepted = (cast(Any, consumer).accepted_gap(*key)
                    if IAcceptsTrimmed.providedBy(consumer) else None)
        if accepted is not None:
            if accepted < boundary:
                behind.append(consumer)
            continue
        try:
            position = consumer.positions().get(key)
        except Exception:
            return None  # a broken consumer: stop as for any gap
        if position is not None and position < boundary:
            return None  # behind, and no loss accepted for it
    return behind or None


def accepting(source: Source, stream: str, writer: str,
              consumers: Callable[[], Sequence[Consumer]]) -> Source:
    """``source`` of the reader of ``(stream, writer)``, a gap accepted by
    the consumers taking the stream now (``consumers()``) skipped (see the
    module docstring)."""
    key = (stream, writer)

    async def read(writer_: str, since: int, until: int, limit: int) -> Any:
        while True:
            try:
                return await maybe_await(source(writer_, since, until, limit))
            except FactsTrimmed as gap:
                behind = _behind(consumers(), key, gap.boundary) \
                    if gap.boundary < until else None
                if behind is None:
                    raise
                for consumer in behind:
                    await maybe_await(cast(Any, consumer).skip_trimmed(stream, writer,
                                                                       gap.boundary))
                log.warn("stream {stream}: facts of writer {writer} after {since} up to "
                         "{boundary} were trimmed by retention; {who} had accepted that loss "
                         "(replicator rewind --skip-to boundary, nothing delivered since): "
                         "skipped to {boundary} (0 of them in the table), reading on",
                         stream=stream, writer=writer, since=gap.since, boundary=gap.boundary,
                         who=", ".join(consumer_label(c) for c in behind))
                since = gap.boundary
    return read
