"""What the read API's readers are doing: per (reader, stream), how many
requests or event streams are open, the position each last reached, and its
lag; for the metrics, the status page and ``/status.json``.  And the cap on
reads that stay open (long-polls waiting, event streams)."""

from typing import Any

from ..answers import HttpError
from .tokens import Positions

Key = tuple[str, str]


class ReaderBook:
    """Per (reader name, stream): open reads, last position, when last seen."""

    def __init__(self, clock):
        self._clock = clock
        self.connected: dict[Key, int] = {}
        self.positions: dict[Key, Positions] = {}
        self.seen: dict[Key, float] = {}
        self.streams: dict[Key, set] = {}  # open event streams (their .position)

    def attach(self, reader: str, stream: str, client) -> None:
        self.streams.setdefault((reader, stream), set()).add(client)

    def detach(self, reader: str, stream: str, client) -> None:
        key = (reader, stream)
        clients = self.streams.get(key)
        if clients is not None:
            clients.discard(client)
            self.positions[key] = dict(client.position)
            if not clients:
                del self.streams[key]

    def opened(self, reader: str, stream: str) -> None:
        key = (reader, stream)
        self.connected[key] = self.connected.get(key, 0) + 1
        self.seen[key] = self._clock.seconds()

    def closed(self, reader: str, stream: str) -> None:
        key = (reader, stream)
        self.connected[key] = max(0, self.connected.get(key, 0) - 1)
        self.seen[key] = self._clock.seconds()

    def reached(self, reader: str, stream: str, positions: Positions) -> None:
        key = (reader, stream)
        self.positions[key] = dict(positions)
        self.seen[key] = self._clock.seconds()

    def rows(self, registry) -> list[dict[str, Any]]:
        """One entry per (reader, stream) seen: ``reader``, ``stream``,
        ``connected``, ``position`` (the smallest of its writers'), ``lag``
        (IDs behind the stream's current tokens, the largest over its
        writers), ``seen_age`` (seconds)."""
        now = self._clock.seconds()
        out = []
        for key in sorted(set(self.connected) | set(self.positions) | set(self.streams)):
            reader, name = key
            positions = self.positions.get(key)
            clients = self.streams.get(key)
            if clients:  # the most behind of its open event streams
                positions = min((c.position for c in list(clients)),
                                key=lambda p: min(p.values(), default=0))
            stream = registry.find(name)
            gen = getattr(stream, "id_gen", None)
            lag: int | None = None
            if positions and gen is not None:
                current = gen.get_positions()
                lag = max([0] + [current[w] - p for w, p in positions.items() if w in current])
            out.append({"reader": reader, "stream": name,
                        "connected": self.connected.get(key, 0),
                        "position": min(positions.values()) if positions else None,
                        "lag": lag, "seen_age": round(now - self.seen.get(key, now), 1)})
        return out


class Slots:
    """How many reads stay open at once (all, and per address): one more is
    503, the others keep theirs."""

    def __init__(self, limit: int, per_address: int):
        self.limit = limit
        self.per_address = per_address
        self.open = 0
        self._per_host: dict[str | None, int] = {}

    def take(self, host: str | None) -> None:
        if self.open >= self.limit:
            raise HttpError(503, f"too many long-polls and event streams ({self.limit}): "
                                 "try again later", {b"retry-after": b"1"})
        if self._per_host.get(host, 0) >= self.per_address:
            raise HttpError(503, f"too many long-polls and event streams from {host} "
                                 f"({self.per_address}): try again later",
                            {b"retry-after": b"1"})
        self.open += 1
        self._per_host[host] = self._per_host.get(host, 0) + 1

    def give(self, host: str | None) -> None:
        self.open -= 1
        n = self._per_host.get(host, 0) - 1
        if n > 0:
            self._per_host[host] = n
        else:
            self._per_host.pop(host, None)


def client_host(request) -> str | None:
    try:
        return getattr(request.getClientAddress(), "host", None)
    except Exception:
        return None
