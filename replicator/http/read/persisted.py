"""The persisted linear position of a stream: the smallest of its writers'
positions in ``stream_positions`` (a writer without a row: 0).

Every fact at or below it is committed and final for good: each writer's
row is a lower bound written only once its facts up to it are complete
(docs/streams.md, "Persisted positions"), and a restart resumes above it,
so no ID at or below it is ever handed out again.  The linear token in
memory is final only while this instance runs: rolled-back IDs above the
persisted positions could be handed out again after a crash of the
database and a restart of the instance.  So a page is served as immutable
only at or below this position (:mod:`.routes`).

Read in the database pool, at most once per ``max_age`` seconds per stream
(requests meanwhile share the value or the read under way); a failed read
counts as 0 (nothing is final), and is not logged: the page read next to
it says what is wrong.
"""

from typing import Any

from twisted.internet import defer

from ...storage import schema


class PersistedLinear:
    """Persisted linear positions, cached (reactor thread)."""

    def __init__(self, clock, max_age: float = 1.0):
        self._clock = clock
        self.max_age = max_age
        self._known: dict[str, tuple[float, int]] = {}  # stream -> (read at, position)
        self._reading: dict[str, defer.Deferred] = {}

    async def get(self, stream) -> int:
        known = self._known.get(stream.name)
        if known is not None and self._clock.seconds() - known[0] < self.max_age:
            return known[1]
        reading = self._reading.get(stream.name)
        if reading is None:
            reading = self._reading[stream.name] = defer.ensureDeferred(self._read(stream))
        waiting: defer.Deferred[int] = defer.Deferred()

        def answer(result: Any) -> Any:
            waiting.callback(result)
            return result
        reading.addBoth(answer)
        return await waiting

    async def _read(self, stream) -> int:
        started = self._clock.seconds()
        try:
            db = stream.db
            persisted = await db.runInteraction(schema.persisted_positions,
                                                stream.config.positions_key, db.sql)
            position = min([persisted.get(w, 0) for w in stream.config.writers] or [0])
        except Exception:
            position = 0
        else:
            self._known[stream.name] = (started, position)
        finally:
            self._reading.pop(stream.name, None)
        return position
