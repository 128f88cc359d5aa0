"""The consumer interface (see :mod:`replicator.consumers` for its contract)
and the in-memory consumer."""

from collections.abc import Awaitable, Sequence
from typing import Any

from zope.interface import Attribute, Interface, implementer

from ..keys import Key

#: One row of a fact: its columns' values, in the stream's column order.
Row = list[Any]
#: What a consumer's method returns: None, or what to wait for before the
#: key's next fact (a Deferred, a coroutine).
Handled = Awaitable[object] | None
#: The values of a consumer's ``start`` option.
STARTS = ("beginning", "now")


class IConsumer(Interface):
    """What a reader hands facts to (the contract: :mod:`replicator.consumers`).
    Every method may return a Deferred or a coroutine: the reader waits for
    it before the next fact of the same (stream, writer)."""

    streams = Attribute("The streams wanted (a sequence of names), or None: all of them.")

    def positions() -> dict[Key, int]:
        """Positions durably handled, per (stream, writer)."""

    def on_facts(stream: str, writer: str, token: int, rows: list[Row]) -> Handled:
        """One fact: all rows sharing ``token`` (possibly none)."""

    def on_position(stream: str, writer: str, token: int) -> Handled:
        """The writer has nothing more up to ``token`` (no rows)."""

    def close() -> Handled:
        """Flush and release resources at shutdown."""


class IBatchConsumer(IConsumer):
    """A consumer that also takes a page of facts at once (a reader catching
    up): ``on_facts_many`` instead of one ``on_facts`` per fact.  A reader
    hands pages only when every consumer of the stream declares this."""

    def on_facts_many(stream: str, writer: str,
                      facts: Sequence[tuple[int, list[Row]]]) -> Handled:
        """Facts in token order, each ``(token, rows)``, as one call."""


class IAcceptsTrimmed(IConsumer):
    """A consumer whose operator can accept a retention gap in advance
    (``replicator rewind --skip-to boundary``): a reader that meets a gap
    below its position then skips to the boundary for it, instead of
    stopping (:mod:`replicator.replication.core.accepted`)."""

    def accepted_gap(stream: str, writer: str) -> int | None:
        """The key's position if the operator accepted whatever retention
        trims past it and nothing was handed on since, else None."""

    def skip_trimmed(stream: str, writer: str, boundary: int) -> Handled:
        """Move the key (accepted) up to ``boundary``, recording the skip
        as the operator's would be; may return a Deferred to wait on.  It
        stays accepted."""


@implementer(IConsumer)
class Consumer:
    """Base class: override what you need.  A subclass that implements
    ``on_facts_many`` declares :class:`IBatchConsumer` too."""

    #: Streams this consumer wants (None: all streams the reader knows).
    streams: Sequence[str] | None = None
    #: Where a (stream, writer) it has no position for starts: ``"beginning"``
    #: (every fact still in the table, caught up for it alone) or ``"now"``
    #: (the reader's current position).  Either way it is first told that
    #: start with :meth:`on_position`.
    start: str = "now"

    def positions(self) -> dict[Key, int]:
        """Positions durably handled, per (stream, writer).

        A key that is missing means "no history": the consumer starts
        where :attr:`start` says (:func:`replicator.replication.core.delivery.rewire`).
        """
        return {}

    def on_facts(self, stream: str, writer: str, token: int, rows: list[Row]) -> Handled:
        """One fact: all rows sharing ``token`` (possibly none)."""
        return None

    def on_position(self, stream: str, writer: str, token: int) -> Handled:
        """The writer has nothing more up to ``token`` (no rows)."""
        return None

    def close(self) -> Handled:
        """Flush and release resources at shutdown."""
        return None


class MemoryConsumer(Consumer):
    """Keeps every fact in a list, in arrival order (tests, debugging)."""

    def __init__(self, positions: dict[Key, int] | None = None,
                 streams: Sequence[str] | None = None) -> None:
        self.facts: list[tuple[str, str, int, list[Row]]] = []
        self.position_by_key: dict[Key, int] = dict(positions or {})
        self.streams = streams

    def positions(self) -> dict[Key, int]:
        return dict(self.position_by_key)

    def on_facts(self, stream: str, writer: str, token: int, rows: list[Row]) -> None:
        self.facts.append((stream, writer, token, rows))
        self.position_by_key[(stream, writer)] = token

    def on_position(self, stream: str, writer: str, token: int) -> None:
        self.position_by_key[(stream, writer)] = token

