"""Waking read-API readers when a stream's positions move.

Each stream's ID generator calls its listeners on the reactor thread when
a writer's token moves (a fact completed here, or announced by another
writer).  :class:`StreamWatch` adds one listener per generator, the first
time a reader of that stream waits, and wakes every callback waiting on
that stream: long-polls re-read their page, the event streams' live
encoder (:mod:`.live`) reads the new facts once for all its clients.
"""

from collections.abc import Callable

Wake = Callable[[], None]


class StreamWatch:
    """Callbacks waiting for a stream's positions to move (reactor thread)."""

    def __init__(self):
        self._waiting: dict[str, list[Wake]] = {}
        self._always: dict[str, list[Wake]] = {}
        self._watched: set[int] = set()  # id() of the generators listened to
        self._generators: list[object] = []  # kept alive, so their id()s stay theirs

    def _listen(self, stream) -> None:
        gen = stream.id_gen
        if gen is None or id(gen) in self._watched:
            return
        self._watched.add(id(gen))
        self._generators.append(gen)
        name = stream.name
        # First: the event streams' live feed reads a local writer's new
        # facts from memory before the fan-out, done with them, forgets them.
        gen.add_listener(lambda writer, old, new: self._moved(name), first=True)

    def once(self, stream, wake: Wake) -> Callable[[], None]:
        """Call ``wake`` once, at the next move of ``stream``; returns a
        function that cancels it."""
        self._listen(stream)
        waiting = self._waiting.setdefault(stream.name, [])
        waiting.append(wake)

        def cancel() -> None:
            try:
                waiting.remove(wake)
            except ValueError:
                pass

        return cancel

    def always(self, stream, wake: Wake) -> None:
        """Call ``wake`` at every move of ``stream`` (the live encoder)."""
        self._listen(stream)
        self._always.setdefault(stream.name, []).append(wake)

    def _moved(self, name: str) -> None:
        for wake in list(self._always.get(name, ())):
            wake()
        waiting = self._waiting.get(name)
        if waiting:
            woken = list(waiting)
            waiting.clear()
            for wake in woken:
                wake()
