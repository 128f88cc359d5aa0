"""The open replication connections of one instance.

:class:`Connections` is the handler's table of connections: which of them
receive fan-out, the metrics label of each, the last disconnects (for the
status page), and writing the same lines to many of them.

Invariants:

* ``replicator_connections{peer}`` counts the connections in the table per
  label: a connection adds one under its label when it is added, moves it
  when relabelled, and removes it when removed.
* Labels are bounded: a peer's own name is a label only if the
  configuration knows it
  (:func:`replicator.replication.interfaces.metrics_label`), never an address.
* One connection failing to take lines never holds up the others.
"""

from collections import deque
from collections.abc import ItemsView, Iterator, Sequence
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from ...addresses import peer_address
from ...observe import metrics
from ..interfaces import ConnectionSeen, Disconnect, IReplicationConnection

log = Logger()

#: Disconnects remembered for the status page.
MAX_RECENT_DISCONNECTS = 20
#: Peer names whose last disconnect time is kept (the oldest go first).
MAX_LOST_NAMES = 1024


class ConnState:
    """What is kept per connection."""

    __slots__ = ("replicating", "label", "counters", "since")

    def __init__(self, replicating: bool, label: str, since: float = 0.0) -> None:
        self.replicating = replicating  # receives fan-out
        self.label = label  # metrics label: the peer's NAME, "unnamed", "upstream", "redis"
        self.counters: dict[tuple[Any, str], Any] = {}  # (metric, command) -> metric child
        self.since = since  # when the connection was made (clock seconds)


def peer_name(conn: IReplicationConnection, label: str) -> str:
    """The one name the status page gives a connection's peer, the same
    from its connect to its disconnect: the name it gave itself, or, for
    our upstream before its ``SERVER``, the name it must give
    (``server_name``); else the metrics ``label``."""
    name = conn.instance_name
    if name is None and not conn.accepted:
        name = getattr(conn, "server_name", None)  # the one our upstream must give
    return str(name or label)[:200]


class Connections:
    """Connections (protocols with ``send_lines``) and their :class:`ConnState`.

    Reads like a mapping of connection to state (``in``, iteration, ``len``,
    ``get``, ``items``)."""

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._states: dict[IReplicationConnection, ConnState] = {}
        #: The last disconnects, newest last: ``(time, peer, address, reason)``.
        self.recent_disconnects: deque[tuple[float, str, str | None, str]] = deque(
            maxlen=MAX_RECENT_DISCONNECTS)
        #: When the last connection of each named peer closed (newest last).
        self.last_lost: dict[str, float] = {}

    def __contains__(self, conn: IReplicationConnection) -> bool:
        return conn in self._states

    def __iter__(self) -> Iterator[IReplicationConnection]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def get(self, conn: IReplicationConnection) -> ConnState | None:
        return self._states.get(conn)

    def items(self) -> ItemsView[IReplicationConnection, ConnState]:
        return self._states.items()

    def seen(self) -> list[ConnectionSeen]:
        """The open connections as observers see them, in the order they came."""
        return [ConnectionSeen(conn, peer_name(conn, state.label), state.label, state.since)
                for conn, state in list(self._states.items())]

    def disconnects(self) -> list[Disconnect]:
        """The last disconnects, newest last."""
        return [Disconnect(*d) for d in list(self.recent_disconnects)]

    def add(self, conn: IReplicationConnection, replicating: bool, label: str) -> ConnState:
        """Start tracking ``conn``."""
        state = self._states[conn] = ConnState(replicating, label, self._clock.seconds())
        metrics.CONNECTIONS.labels(label).inc()
        return state

    def remove(self, conn: IReplicationConnection, reason: str) -> ConnState | None:
        """Stop tracking ``conn``, lost for ``reason``; its state, None if
        it was not tracked."""
        state = self._states.pop(conn, None)
        metrics.DISCONNECTS.labels(reason).inc()
        if state is None:
            return None
        name = conn.instance_name
        peer = peer_name(conn, state.label)
        if name is not None and conn.accepted:
            self.last_lost.pop(name, None)
            self.last_lost[name] = self._clock.seconds()
            if len(self.last_lost) > MAX_LOST_NAMES:
                del self.last_lost[next(iter(self.last_lost))]
        self.recent_disconnects.append(
            (self._clock.seconds(), peer, peer_address(conn), str(reason)[:200]))
        metrics.CONNECTIONS.labels(state.label).dec()
        return state

    def label(self, conn: IReplicationConnection) -> str:
        """The connection's metrics label (bounded: names, not addresses)."""
        state = self._states.get(conn)
        return state.label if state is not None else "unnamed"

    def relabel(self, conn: IReplicationConnection, label: str) -> None:
        """Count ``conn`` under ``label`` from now on."""
        state = self._states.get(conn)
        if state is None or state.label == label:
            return
        metrics.CONNECTIONS.labels(state.label).dec()
        state.label = label
        state.counters.clear()
        metrics.CONNECTIONS.labels(label).inc()

    def counter(self, conn: IReplicationConnection, metric: Any, name: str) -> Any:
        """The child of ``metric`` for command ``name`` on ``conn`` (cached
        per connection while its label holds)."""
        state = self._states.get(conn)
        if state is None:
            return metric.labels(name, "unnamed")
        key = (metric, name)
        child = state.counters.get(key)
        if child is None:
            child = state.counters[key] = metric.labels(name, state.label)
        return child

    def broadcast(self, lines: Sequence[bytes], name: str,
                  exclude: IReplicationConnection | None = None,
                  replicating_only: bool = True) -> None:
        """Write ``lines`` (of command ``name``) to every connection but
        ``exclude``; only to those receiving fan-out if ``replicating_only``."""
        for conn, state in list(self._states.items()):
            if conn is not exclude and (state.replicating or not replicating_only):
                try:
                    conn.send_lines(lines, name)
                except Exception:
                    # One broken connection must not hold up the others.
                    log.failure("Sending {name} to {conn} failed", name=name, conn=conn)
