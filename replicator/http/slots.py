"""Who may hold the HTTP API's connections: the ordinary slots, the slots
reserved for health probes and writers, and whom a newcomer closes to make
room.

* **Ordinary slots**: at most ``max_connections`` connections,
  ``max_connections_per_address`` from one address, for any request.
* **Reserved slots**: beyond those, ``reserved_for_health`` connections for
  ``GET``/``HEAD /health`` and ``reserved_for_writers`` for requests that
  carry the write secret (``Authorization: Bearer <http.secret>``), from any
  address.  A newcomer that finds no ordinary slot takes a reserved one; its
  request must be one of these (else ``503``, before its body is read).  A
  health probe's connection closes after its answer (pipelined requests
  behind it are dropped); a writer's stays open, and every request on it
  must carry the secret (or be ``/health``, which closes it).  So clients
  that keep every ordinary slot busy (long requests, pipelines, any number
  of addresses) never keep a health probe or a write out, and cannot hold
  a reserved slot themselves without the secret for longer than one
  ``/health`` answer.
* **Making room**: a newcomer over a cap closes a connection with no request
  being answered, in the same pool (of its own address, for the per-address
  cap).  Of the ordinary slots, the oldest *idle* one (answered, waiting
  for its next request: closed quietly, clients retry on a closed
  keep-alive connection) first, then the oldest *fresh* one (no complete
  request yet: ``503``): idle first, so that a newcomer that has not sent
  its request yet is not the one closed while busy clients go idle and
  busy again between requests.  Of the reserved slots, the oldest fresh
  one first (an idle one there is a writer's, a fresh one anybody's), then
  the oldest idle one.
  A connection whose request is being answered, or whose last answer is
  out and still being flushed before its close (``Connection: close``), is
  never closed to make room: it is in neither list.  Only when no
  connection of either pool can be closed is a newcomer answered ``503``
  and closed before anything of it is parsed.

Invariants: every connection admitted is in exactly one pool until it
leaves; at most ``max_connections`` + ``reserved_for_health`` +
``reserved_for_writers`` are held; at most ``reserved_for_health`` reserved
connections are a health probe's and ``reserved_for_writers`` a writer's.
"""

from typing import Any

from ..net.crowd import Crowd
from .answers import HttpError, authorize

HEALTH = "health"
WRITER = "writer"


class Slots:
    """The books of one site's connections (the channels call the hooks:
    :meth:`started`, :meth:`answered`, :meth:`leave`, :meth:`check`)."""

    def __init__(self, *, max_connections: int, max_connections_per_address: int,
                 reserved_for_health: int = 0, reserved_for_writers: int = 0,
                 secret: bytes | None = None):
        self.max_connections = max_connections
        self.max_connections_per_address = max_connections_per_address
        self.limits = {HEALTH: reserved_for_health, WRITER: reserved_for_writers if secret else 0}
        self.secret = secret
        self.ordinary = Crowd()
        self.reserved = Crowd()
        self._kind: dict[Any, str] = {}  # reserved connections: whose they are
        self._idle: set[Any] = set()  # answered, waiting for the next request

    def __len__(self) -> int:
        return len(self.ordinary) + len(self.reserved)

    def __contains__(self, conn: Any) -> bool:
        return conn in self.ordinary or conn in self.reserved

    def holding(self, kind: str) -> int:
        """Reserved connections that are a health probe's or a writer's."""
        return sum(1 for k in self._kind.values() if k == kind)

    # --------------------------------------------------------- admission
    def admit(self, conn: Any, host: str | None) -> str | None:
        """Give ``conn`` (from ``host``; None: not an IP peer) a slot, closing
        another to make room if need be; None, or why there is none."""
        ordinary = self.ordinary
        per_address = self.max_connections_per_address
        if host is not None and ordinary.count(host) >= per_address:
            placed = self._make_room(ordinary, host, idle_first=True)
            why = f"too many HTTP connections from {host} ({per_address})"
        elif len(ordinary) >= self.max_connections:
            placed = self._make_room(ordinary, ..., idle_first=True)
            why = f"too many HTTP connections ({self.max_connections})"
        else:
            placed = True
            why = ""
        if placed:
            ordinary.arrive(conn, host)
            return None
        reserved = sum(self.limits.values())
        if reserved and (len(self.reserved) < reserved
                         or self._make_room(self.reserved, ..., idle_first=False)):
            self.reserved.arrive(conn, host)
            return None
        if reserved:
            why += f" and the {reserved} reserved for /health and writers busy"
        return why + ": try again later"

    def _make_room(self, crowd: Crowd, host: Any, idle_first: bool) -> bool:
        """Close the oldest idle connection of ``crowd`` (from ``host`` unless
        ``...``), else the oldest fresh one (fresh first unless
        ``idle_first``); whether there was one."""
        idle = self._idle.__contains__
        victim = crowd.oldest_unidentified(host, idle if idle_first else lambda c: not idle(c)) \
            or crowd.oldest_unidentified(host)
        if victim is None:
            return False
        self.leave(victim)
        victim.evict("too many HTTP connections: closing the oldest idle one")
        return True

    # ------------------------------------------------------------- hooks
    def check(self, conn: Any, request, method: bytes, path: bytes) -> tuple[str | None, bool]:
        """Whether ``request`` (its headers complete) may go on over ``conn``:
        ``(None, close_after)`` or ``(why not, True)``.  Only a reserved
        slot restricts its requests."""
        if conn not in self.reserved:
            return None, False
        health = method in (b"GET", b"HEAD") and path.split(b"?", 1)[0] == b"/health"
        kind = WRITER if self._carries_secret(request) else HEALTH if health else None
        if kind is None:
            return ("too many HTTP connections: the spare ones are for /health and "
                    "requests with the write secret"), True
        held = self._kind.get(conn)
        if held is None:
            if self.holding(kind) >= self.limits[kind]:
                return (f"too many HTTP connections: the {self.limits[kind]} reserved for "
                        f"{'/health' if kind == HEALTH else 'writers'} are busy"), True
            self._kind[conn] = held = kind
        return None, kind == HEALTH or held == HEALTH

    def _carries_secret(self, request) -> bool:
        if self.secret is None:
            return False
        try:
            authorize(request, self.secret)
        except HttpError:
            return False
        return True

    def started(self, conn: Any) -> None:
        """``conn`` has a whole request to answer: it is not closed to make room."""
        self._idle.discard(conn)
        self._crowd(conn).identify(conn)

    def answered(self, conn: Any, persistent: bool) -> None:
        """``conn``'s request was answered: idle if the connection stays open
        (or its next pipelined request makes it busy again at once); if it
        closes after this answer, still counted, and never closed to make
        room (it is flushing the answer)."""
        if persistent:
            self._crowd(conn).unidentify(conn)
            self._idle.add(conn)

    def leave(self, conn: Any) -> None:
        """``conn`` is gone (or being closed): it counts no more."""
        self._crowd(conn).leave(conn)
        self._idle.discard(conn)
        self._kind.pop(conn, None)

    def _crowd(self, conn: Any) -> Crowd:
        return self.reserved if conn in self.reserved else self.ordinary
