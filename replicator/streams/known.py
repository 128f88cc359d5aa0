"""IDs of a stream whose writer this instance knows, lately.

Every ID of a stream comes from its one sequence, so an ID a local writer
reserved (committed or rolled back), or a fact a reader handed on, belongs
to that writer and to no other.  A reader told by ``POSITION s W p n`` that
writer W has nothing in ``(p, n]`` needs to ask the table only about the IDs
in there it cannot account for: in a stream of several writers an idle
writer's POSITION usually spans just the other writers' facts.

Invariant: an ID is in :class:`KnownIds` only if this instance saw it
reserved by a local writer or handed on from a writer's RDATA or catch-up,
so :meth:`KnownIds.covers` is never true of an ID that might be W's fact.
Bounded: the newest ``capacity`` IDs are kept (forgetting one only costs a
query).
"""

from collections import deque
from collections.abc import Iterable


class KnownIds:
    """The newest IDs of one stream whose writer is known here."""

    #: A POSITION spanning more IDs than this is checked against the table
    #: without looking here.
    SPAN = 256

    def __init__(self, capacity: int = 65_536) -> None:
        self.capacity = capacity
        self._ids: set[int] = set()
        self._order: deque[int] = deque()

    def note(self, ids: Iterable[int]) -> None:
        """``ids`` belong to a writer this instance knows (reactor thread)."""
        known, order = self._ids, self._order
        for stream_id in ids:
            if stream_id not in known:
                known.add(stream_id)
                order.append(stream_id)
        while len(order) > self.capacity:
            known.discard(order.popleft())

    def covers(self, from_token: int, to_token: int) -> bool:
        """Whether every ID in ``(from_token, to_token]`` is known to be
        some writer's (so none of them can be a fact of the writer asked
        about, which is not the one that had them)."""
        if to_token - from_token > self.SPAN:
            return False
        known = self._ids
        return all(i in known for i in range(from_token + 1, to_token + 1))

    def __len__(self) -> int:
        return len(self._ids)
