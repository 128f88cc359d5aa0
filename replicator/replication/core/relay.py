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
* What is relayed is the bytes received, never a re-encoding (a re-encoded
  line may be longer than the receivers accept); lines come here only once
  :mod:`.admission` admitted them, and RDATA only from a connection that
  announced the writer's position (what this instance's reader takes).
"""

from collections.abc import Callable
from typing import Any

from ...keys import Key
from ..interfaces import IReplicationConnection


class Relay:
    """``broadcast(lines, name, exclude)`` writes to the other connections."""

    def __init__(self, broadcast: Callable[..., None]) -> None:
        self._broadcast = broadcast
        self.relayed: dict[Key, int] = {}
        self._batches: dict[Any, dict[Key, list[bytes]]] = {}  # conn -> key -> lines

    def rdata(self, conn: IReplicationConnection, key: Key, token: int | None, line: bytes) -> None:
        """An RDATA line (its wire bytes, newline included) of a writer
        client on ``conn``; ``token`` None for a ``batch`` row."""
        pending = self._batches.setdefault(conn, {}).setdefault(key, [])
        pending.append(line)
        if token is not None:
            del self._batches[conn][key]
            self.relayed[key] = max(self.relayed.get(key, 0), token)
            self._broadcast(pending, "RDATA", exclude=conn)

    def position(self, conn: IReplicationConnection, key: Key, new_token: int, line: bytes) -> None:
        """A POSITION line (wire bytes) of a writer client on ``conn``."""
        self._batches.get(conn, {}).pop(key, None)
        self.relayed[key] = max(self.relayed.get(key, 0), new_token)
        self._broadcast([line], "POSITION", exclude=conn)

    def drop_batch(self, conn: IReplicationConnection, key: Key) -> None:
        """Forget the partial batch of ``key`` on ``conn`` (refused)."""
        self._batches.get(conn, {}).pop(key, None)

    def connection_lost(self, conn: IReplicationConnection) -> None:
        self._batches.pop(conn, None)
