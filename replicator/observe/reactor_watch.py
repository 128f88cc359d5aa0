"""A watch on the reactor thread: how long it went without a turn, and
where it was meanwhile.

Everything the daemon does runs on one reactor thread.  A call that holds
it (a long computation, a statement run on the reactor, a full collection
of a big heap) stops every connection, timer and answer at once: peers
time the links out, ``/health`` does not answer, and nothing says why.  So
a beat on the reactor stamps the time every :data:`BEAT` seconds, and a
thread of its own looks as often.  Once the reactor is :data:`BLOCKED`
seconds late, the thread takes the reactor thread's stack (once per
stall).  When the reactor beats again, one warning says for how long it
was held and where it was, and the metrics count the stall.

Invariants:

* The thread never calls into the reactor or the logger.  It writes one
  attribute (a tuple, swapped whole) that the beat reads on the reactor.
* A process stopped or starved as a whole (SIGSTOP, a host that paused the
  machine) is not a stall: the thread's own sleep then overran as much,
  and it measures again from the moment it woke.
* ``replicator_reactor_blocked_seconds`` is read by the metrics thread
  (``http.metrics_listen``), so it is true while the reactor is held.
* Its cost: two short calls every :data:`BEAT` seconds.
"""

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

from twisted.application.service import Service
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from . import metrics

log = Logger(namespace="replicator.observe.reactor_watch")

#: Seconds between beats, and between the thread's looks.
BEAT = 0.25

#: Seconds without a beat that count as a stall.
BLOCKED = 1.0

#: Frames of the held stack that the warning names (innermost first).
FRAMES = 12

class ReactorWatch(Service):
    """The beat (on the reactor) and the watching thread, as one service.

    ``now`` is the monotonic clock both sides read; ``frames`` gives every
    thread's current frame (``sys._current_frames``).  Tests drive
    :meth:`beat` and :meth:`look` themselves, with clocks they advance."""

    def __init__(self, reactor: Any, now: Callable[[], float] = time.monotonic,
                 frames: Callable[[], dict[int, FrameType]] = sys._current_frames,
                 beat: float = BEAT, blocked: float = BLOCKED) -> None:
        self._reactor = reactor
        self._now = now
        self._frames = frames
        self.beat_interval = beat
        self.blocked = blocked
        self.reactor_thread = threading.get_ident()
        self._last_beat = now()
        # (the beat it belongs to, seconds late when taken, the stack), by the thread.
        self._taken: tuple[float, float, str] | None = None
        # The thread's measure starts here (it moves on when the process was stopped).
        self._measure_from = self._last_beat
        self._looping: LoopingCall | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------ reactor
    def beat(self) -> None:
        """On the reactor: stamp the time, and report a stall the thread saw."""
        now = self._now()
        last, self._last_beat = self._last_beat, now
        taken, self._taken = self._taken, None
        if taken is None or taken[0] != last:
            return
        held = now - last
        metrics.REACTOR_STALLS.inc()
        metrics.REACTOR_STALLED_SECONDS.inc(held)
        log.warn("The reactor was held for {held:.1f}s (every connection, timer and answer "
                 "waited); {late:.1f}s in, it was in: {stack}", held=held, late=taken[1],
                 stack=taken[2])

    # ------------------------------------------------------------- thread
    def look(self, slept_from: float) -> None:
        """On the thread, after a sleep that began at ``slept_from``: take
        the reactor's stack if it is late, once per stall."""
        now = self._now()
        if now - slept_from > self.beat_interval + self.blocked:
            # The thread overslept as much: the whole process was stopped.
            self._measure_from = now
            return
        last = self._last_beat
        late = now - max(last, self._measure_from)
        if late < self.blocked or (self._taken is not None and self._taken[0] == last):
            return
        frame = self._frames().get(self.reactor_thread)
        if frame is None:
            return
        self._taken = (last, late, describe(frame))

    def blocked_for(self) -> float:
        """Seconds since the reactor's last beat, beyond the beat's own interval."""
        return max(0.0, self._now() - self._last_beat - self.beat_interval)

    def _run(self) -> None:
        while True:
            slept_from = self._now()
            if self._stop.wait(self.beat_interval):
                return
            self.look(slept_from)

    # ------------------------------------------------------------ service
    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self.reactor_thread = threading.get_ident()
        self._last_beat = self._measure_from = self._now()
        self._looping = LoopingCall(self.beat)
        self._looping.clock = self._reactor
        self._looping.start(self.beat_interval, now=False)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="reactor-watch", daemon=True)
        self._thread.start()
        metrics.REACTOR_BLOCKED.set_function(self.blocked_for)

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._looping is not None and self._looping.running:
            self._looping.stop()
        self._looping = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
            self._thread = None
        metrics.REACTOR_BLOCKED.set_function(lambda: 0.0)


def describe(frame: FrameType) -> str:
    """A stack as one line, innermost call first: ``file:line function``,
    paths from the package or library directory they belong to.  The
    import machinery's own frames (a module compiled and run on first
    use) are one ``(import)``, so the frames that name what was imported,
    and who asked, are the ones shown."""
    entries: list[str] = []
    for e in reversed(traceback.extract_stack(frame)):
        if e.filename.startswith("<frozen importlib"):
            if not entries or entries[-1] != "(import)":
                entries.append("(import)")
            continue
        entries.append(f"{_short(e.filename)}:{e.lineno} {e.name}")
        if len(entries) >= FRAMES:
            break
    return " < ".join(entries)


def _short(path: str) -> str:
    for marker in (os.sep + "site-packages" + os.sep, os.sep + "replicator" + os.sep):
        at = path.rfind(marker)
        if at >= 0:
            rest = path[at + len(marker):]
            return rest if "site-packages" in marker else "replicator" + os.sep + rest
    return os.path.basename(path)
