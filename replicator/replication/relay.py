"""Relay (TCP server): facts of writer clients passed on to everyone else.

A writer that is a client of this server sends its RDATA/POSITION here; the
server passes them to every other replicating connection.

Invariants:

* Only whole facts are relayed: ``batch`` rows wait, per (connection,
  stream, writer), for the row that carries the token, then the fact's
  lines go out in one call.  A partial batch dies with its connection, and
  with a POSITION of the same writer on that connection (sent only between
  facts: the rest of the batch was lost on the writer's side).
* ``relayed`` per (stream, writer) is the largest token passed on; the
  server's REPLICATE answer for such a writer is never below it.
"""

from typing import Any, Callable, Dict, List, Tuple

Key = Tuple[str, str]


class Relay:
    """``broadcast(lines, name, exclude)`` writes to the other connections."""

    def __init__(self, broadcast: Callable[..., None]):
        self._broadcast = broadcast
        self.relayed: Dict[Key, int] = {}
        self._batches: Dict[Any, Dict[Key, List[bytes]]] = {}  # conn -> key -> lines

    def rdata(self, conn, key: Key, cmd) -> None:
        """An RDATA line of a writer client on ``conn``."""
        pending = self._batches.setdefault(conn, {}).setdefault(key, [])
        pending.append((cmd.to_line() + "\n").encode("utf-8"))
        if cmd.token is not None:
            del self._batches[conn][key]
            self.relayed[key] = max(self.relayed.get(key, 0), cmd.token)
            self._broadcast(pending, "RDATA", exclude=conn)

    def position(self, conn, key: Key, cmd) -> None:
        """A POSITION line of a writer client on ``conn``."""
        self._batches.get(conn, {}).pop(key, None)
        self.relayed[key] = max(self.relayed.get(key, 0), cmd.new_token)
        self._broadcast([(cmd.to_line() + "\n").encode("utf-8")], "POSITION", exclude=conn)

    def connection_lost(self, conn) -> None:
        self._batches.pop(conn, None)
