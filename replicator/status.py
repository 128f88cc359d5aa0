"""The status page: what an operator on call looks at first.

``GET /`` on the HTTP listener is a server-rendered HTML page; ``/status.js``
refreshes it every few seconds from ``GET /status.json``, which returns
exactly what the page shows (and nothing else).  Neither needs the HTTP
secret, so neither shows anything secret: stream and writer names,
positions, lag, connection peers (names and addresses) and the reasons
``/health`` gives.  No row content, no bookkeeping tables, no secret.

Parts:

* :class:`StatusRecorder` — a service that samples every reader's lag each
  ``interval`` seconds on the injected clock into a bounded ring per
  (stream, writer) covering ``window`` seconds, and remembers the health
  problems seen (a bounded ring of ``(since, latest reason)``: a problem
  that goes on with other figures updates its entry).
* :func:`snapshot` — the page's content as a JSON-able dict.
* :mod:`.status_page` — the page rendered from it, its stylesheet and its
  script.

Invariants: memory is bounded (``window / interval`` samples per configured
key, :data:`MAX_PROBLEMS` problems; the handler keeps its own bounded ring
of disconnects); nothing here blocks or touches the database.
"""

import re
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from twisted.application.internet import TimerService
from twisted.logger import Logger

from . import __version__
from .replication.handler import peer_address

log = Logger(namespace="replicator.status")

#: Sampling interval and the sparkline's window, in seconds.
SAMPLE_INTERVAL = 5.0
WINDOW = 15 * 60.0
#: Health problems remembered.
MAX_PROBLEMS = 20
#: In-flight IDs listed per writer (the count is always given).
MAX_IN_FLIGHT_SHOWN = 10

Key = Tuple[str, str]


class StatusRecorder(TimerService):
    """Samples reader lag and health problems for the status page, every
    ``interval`` seconds while running (from its start on).

    ``problem()`` returns the current health problem (a line) or None.
    """

    def __init__(self, *, handler, problem: Callable[[], Optional[str]], clock,
                 interval: float = SAMPLE_INTERVAL, window: float = WINDOW):
        self._clock = clock
        self.handler = handler
        self._problem = problem
        self.interval = interval
        self.window = window
        self._size = max(1, int(window // interval) + 1)
        self.lag: Dict[Key, Deque[Tuple[float, int]]] = {}
        self.problems: Deque[Tuple[float, str]] = deque(maxlen=MAX_PROBLEMS)
        self.current_problem: Optional[str] = None
        super().__init__(interval, self.sample)
        self.clock = clock

    def sample(self) -> None:
        """One sample of every reader's lag and of the health verdict."""
        now = self._clock.seconds()
        for key, lag in self.handler.reader_lag().items():
            ring = self.lag.get(key)
            if ring is None:
                ring = self.lag[key] = deque(maxlen=self._size)
            ring.append((now, lag))
        try:
            problem = self._problem()
        except Exception:
            log.failure("Computing the health verdict failed")
            problem = "health verdict unavailable"
        if problem is not None:
            last = self.problems[-1] if self.problems else None
            if last is not None and self.current_problem is not None \
                    and _kind(last[1]) == _kind(problem):
                self.problems[-1] = (last[0], problem)  # the same problem, still going
            else:
                self.problems.append((now, problem))
        self.current_problem = problem

    def history(self, key: Key) -> List[List[float]]:
        """``[[time, lag], ...]`` of the last ``window`` seconds, oldest first."""
        ring = self.lag.get(key, ())
        since = self._clock.seconds() - self.window
        return [[t, lag] for t, lag in ring if t >= since]


def _kind(problem: str) -> str:
    """A problem without its figures: "lagging by 3 for 10s" and "lagging
    by 4 for 15s" are one problem going on."""
    return re.sub(r"\d+", "N", problem).replace(" facts ", " fact ")




def snapshot(*, instance: str, role: str, registry, handler, recorder: StatusRecorder,
             problem: Optional[str], clock, redact: Callable[[str], str]) -> Dict[str, Any]:
    """What the page shows, as a JSON-able dict (see the README).
    ``problem`` is the current health problem (None: healthy)."""
    announced = handler.announced_positions()
    readers = handler.reader_positions()
    lags = handler.reader_lag()
    streams = []
    for stream in registry:
        gen = stream.id_gen
        writers = []
        for writer in stream.config.writers:
            key = (stream.name, writer)
            local = writer in stream.local_writers
            entry: Dict[str, Any] = {
                "writer": writer, "local": local,
                "position": gen.get_positions().get(writer) if gen is not None else None,
            }
            if local:
                ids = gen.in_flight_ids(writer, MAX_IN_FLIGHT_SHOWN) if gen is not None else []
                entry["in_flight"] = gen.in_flight(writer) if gen is not None else 0
                entry["in_flight_ids"] = ids
                entry["announced"] = announced.get(key)
                entry["verdict"] = "loading" if gen is None else "ok"
            else:
                lag = lags.get(key, 0)
                entry["reader_position"] = readers.get(key)
                entry["lag"] = lag
                entry["lag_history"] = recorder.history(key)
                mentioned = problem is not None and (
                    f"stream {stream.name}/{writer} " in problem
                    or f"stream {stream.name}: writer {writer} " in problem)
                if gen is None:
                    verdict = "loading"
                elif readers.get(key) is None:
                    verdict = "not heard yet"
                elif lag:
                    verdict = f"behind by {lag}"
                else:
                    verdict = "ok"
                entry["verdict"] = f"unhealthy: {verdict}" if mentioned else verdict
            writers.append(entry)
        streams.append({"name": stream.name,
                        "linear": gen.get_linear_token() if gen is not None else None,
                        "writers": writers})
    connections = []
    for conn, state in list(handler.connections.items()):
        connections.append({
            "peer": redact(str(getattr(conn, "instance_name", None) or state.label)),
            "address": peer_address(conn),
            "role": conn.role,
            "queued_lines": int(getattr(conn, "queued", 0) or 0),
            "queued_bytes": int(getattr(conn, "queued_bytes", 0) or 0),
            "connected_since": state.since,
        })
    connections.sort(key=lambda c: (c["role"], c["peer"], c["address"] or ""))
    return {
        "instance": instance,
        "role": role,
        "version": __version__,
        "now": clock.seconds(),
        "healthy": problem is None,
        "problem": redact(problem) if problem is not None else None,
        "problems": [{"at": t, "reason": redact(r)} for t, r in reversed(recorder.problems)],
        "streams": streams,
        "connections": connections,
        "disconnects": [{"at": d[0], "peer": redact(d[1]), "address": d[2], "reason": d[3]}
                        for d in reversed(handler.recent_disconnects)],
        "window": recorder.window,
    }
