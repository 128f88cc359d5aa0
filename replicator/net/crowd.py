"""The connections of one listener, by source address and by whether they
have identified themselves: what the listeners' caps are decided on.

A connection arrives *unidentified* (a replication peer that has sent no
``NAME``, an HTTP connection without a complete request).  The listener
says when it becomes *identified* (and may make it *exempt*: a known peer,
counted nowhere) and, for HTTP, when it is idle again.  :class:`Crowd` only
keeps the books; the listeners (:mod:`.transport.tcp`,
:mod:`.http.slots`) decide whom to refuse and whom to close to make room:
an unidentified connection, so that idle sockets can never keep a
newcomer out.

Invariants: every connection is in exactly one of unidentified,
identified or exempt until it leaves; ``count(host)`` and ``len`` count the
unidentified and identified connections (not the exempt); unidentified
connections are kept in arrival order.
"""

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any


class Crowd:
    """The books of one listener's connections."""

    def __init__(self) -> None:
        self._unidentified: OrderedDict[Any, str | None] = OrderedDict()
        self._identified: dict[Any, str | None] = {}
        self._exempt: dict[Any, str | None] = {}
        self._per_host: Counter[str | None] = Counter()
        self._identified_per_host: Counter[str | None] = Counter()

    def __len__(self) -> int:
        """Connections counted: unidentified and identified, not exempt."""
        return len(self._unidentified) + len(self._identified)

    @property
    def unidentified(self) -> int:
        return len(self._unidentified)

    @property
    def identified(self) -> int:
        """Identified connections counted (not exempt)."""
        return len(self._identified)

    def count(self, host: str | None) -> int:
        """Connections counted from ``host``."""
        return self._per_host[host]

    def identified_count(self, host: str | None) -> int:
        """Identified connections counted from ``host``."""
        return self._identified_per_host[host]

    def host(self, conn: Any) -> str | None:
        """The address ``conn`` came from (None: not an IP peer, or gone)."""
        for table in (self._unidentified, self._identified, self._exempt):
            if conn in table:
                return table[conn]
        return None

    def __contains__(self, conn: Any) -> bool:
        return conn in self._unidentified or conn in self._identified or conn in self._exempt

    def arrive(self, conn: Any, host: str | None) -> None:
        """``conn`` from ``host`` (None: not an IP peer) was accepted."""
        self._unidentified[conn] = host
        self._per_host[host] += 1

    def oldest_unidentified(self, host: Any = ...,
                            where: Callable[[Any], bool] | None = None) -> Any | None:
        """The unidentified connection that arrived (or became idle) first,
        from ``host`` if given and for which ``where`` holds if given; or
        None."""
        for conn, h in self._unidentified.items():
            if (host is ... or h == host) and (where is None or where(conn)):
                return conn
        return None

    def identify(self, conn: Any, exempt: bool = False) -> None:
        """``conn`` identified itself; an ``exempt`` one is counted no more."""
        host = self._take(conn)
        if host is _MISSING:
            return
        if exempt:
            self._exempt[conn] = host
        else:
            self._identified[conn] = host
            self._per_host[host] += 1
            self._identified_per_host[host] += 1

    def unidentify(self, conn: Any) -> None:
        """``conn`` is idle again (HTTP: its requests were answered): it
        counts as unidentified, the newest."""
        host = self._take(conn)
        if host is _MISSING:
            return
        self._unidentified[conn] = host
        self._per_host[host] += 1

    def leave(self, conn: Any) -> None:
        """``conn`` is gone (or being closed): it counts no more."""
        self._take(conn)

    def _take(self, conn: Any) -> Any:
        for table, counted in ((self._unidentified, True), (self._identified, True),
                               (self._exempt, False)):
            if conn in table:
                host = table.pop(conn)
                if counted:
                    _decrement(self._per_host, host)
                if table is self._identified:
                    _decrement(self._identified_per_host, host)
                return host
        return _MISSING


_MISSING = object()


def _decrement(counter: "Counter[Any]", key: Any) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
