"""A handler that does nothing: the base of handlers that are not the core.

:class:`BaseHandler` provides every method of
:class:`~replicator.replication.interfaces.IReplicationHandler` (it is
checked with ``verifyObject``), each doing nothing: a handler of its own
(``replicator tail``'s printer, a test's recorder) subclasses it and
overrides what it needs, and adds ``on_<NAME>(conn, cmd)`` for the
commands it takes.  The transports call every method of the interface
unconditionally, so a handler is always complete.
"""

from typing import Any

from zope.interface import implementer

from ..interfaces import IReplicationConnection, IReplicationHandler


@implementer(IReplicationHandler)
class BaseHandler:
    """Every hook a no-op; no streams, no known names; no client may write."""

    #: No streams (an iterable of :class:`replicator.streams.stream.Stream`).
    registry: Any = ()

    def __init__(self, instance_name: str = "replicator",
                 known_names: frozenset[str] = frozenset()) -> None:
        self.instance_name = instance_name
        self.known_names = known_names

    def new_connection(self, conn: IReplicationConnection) -> None:
        pass

    def writes_released(self, conn: IReplicationConnection) -> None:
        pass

    def lost_connection(self, conn: IReplicationConnection, reason: str) -> None:
        pass

    def client_may_write(self, stream_name: str, instance_name: str) -> bool:
        return False

    def count_inbound(self, conn: IReplicationConnection, name: str) -> None:
        pass

    def count_outbound(self, conn: IReplicationConnection, name: str, n: int) -> None:
        pass

    def count_dropped(self, conn: IReplicationConnection, name: str, n: int) -> None:
        pass
