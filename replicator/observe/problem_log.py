"""The status page's problem history written to the database, so that a
restart does not forget it (:mod:`replicator.storage.problems`).

A :class:`ProblemLog` is told when a problem of the page starts and when
it ends (:meth:`ProblemLog.started`, :meth:`ProblemLog.ended`: the only
moments anything is written) and writes it in a pool thread, never on the
reactor thread.  A write that fails (the database is down, which is one of
the problems most worth remembering) is kept in memory and tried again with
the project's backoff (:class:`replicator.net.backoff.Outage`: one warning
when it starts failing, one line when it works again), so an outage's
start and end are both written once the database is back.

Invariants: one write at a time, each one transaction of everything
pending, in the order the problems started; a problem is pending at most
once (its start and end written together if both wait); at most
``max_pending`` problems wait (the oldest dropped first, counted, as the
table keeps the last rows); the text written is redacted.
"""

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger

from ..net.backoff import Outage
from ..storage import problems

log = Logger(namespace="replicator.observe.problem_log")

#: Problems waiting for the database at most.
MAX_PENDING = problems.KEEP
#: The first wait after a failed write (seconds); the backoff's cap after.
RETRY = 1.0


def _ms(t: float | None) -> int | None:
    return None if t is None else int(round(t * 1000))


class _Pending:
    __slots__ = ("problem", "dirty")

    def __init__(self, problem: Any):
        self.problem = problem
        self.dirty = True  # changed since the last write began


class ProblemLog:
    """Writes one instance's problems (:class:`replicator.observe.status.Problem`)
    to ``replicator_problems`` as they start and end; see the module docstring."""

    def __init__(self, db, instance: str, clock, *,
                 redact: Callable[[str], str] = lambda text: text,
                 max_pending: int = MAX_PENDING, keep: int = problems.KEEP,
                 retry: float = RETRY):
        self.db = db
        self.instance = instance
        self._clock = clock
        self._redact = redact
        self.max_pending = max_pending
        self.keep = keep
        self._outage = Outage("keeping the status page's problems in the database", retry)
        #: What is not written yet, by problem, in the order they started.
        self._pending: OrderedDict[Any, _Pending] = OrderedDict()
        #: Problems whose row is written and open (not ended): at most the
        #: problems ongoing now.
        self._open: set[Any] = set()
        #: Problems dropped from :attr:`_pending` (it was full) in this outage.
        self.dropped = 0
        self._writing: defer.Deferred | None = None
        self._retry = None  # the delayed call of the next try
        self._stopped = False

    @property
    def pending(self) -> int:
        """How many problems wait to be written."""
        return len(self._pending)

    async def load(self, limit: int, started: float) -> list[dict[str, Any]]:
        """The instance's last ``limit`` problems from before this start,
        at ``started`` (:func:`replicator.storage.problems.load`)."""
        return await self.db.runInteraction(problems.load, self.db, self.instance,
                                            _ms(started), limit)

    def started(self, problem: Any) -> None:
        self._queue(problem)

    def ended(self, problem: Any) -> None:
        self._queue(problem)

    def _queue(self, problem: Any) -> None:
        if self._stopped:
            return
        entry = self._pending.get(problem)
        if entry is not None:
            entry.dirty = True
        else:
            if len(self._pending) >= self.max_pending:
                _, gone = self._pending.popitem(last=False)
                self._open.discard(gone.problem)  # (its end will not be written)
                if not self.dropped:
                    log.warn("The status page's problems wait for the database, more than "
                             "{n}: the oldest are not kept", n=self.max_pending)
                self.dropped += 1
            self._pending[problem] = _Pending(problem)
        if self._writing is None and self._retry is None:
            self._write()

    def _records(self) -> list[tuple[_Pending, problems.Record]]:
        """What is dirty, as records; no longer dirty (until it changes)."""
        out = []
        for entry in self._pending.values():
            if entry.dirty:
                p = entry.problem
                kind, stream, writer = p.key
                out.append((entry, problems.Record(
                    kind, stream, writer, self._redact(p.reason), p.fails_health,
                    int(round(p.since * 1000)), _ms(p.until), p not in self._open)))
                entry.dirty = False
        return out

    def _write(self, stopped_ms: int | None = None) -> defer.Deferred:
        """One transaction of everything pending (and, at the stop, the
        mark of what is still open: ``stopped_ms``); fires when done, never
        fails."""
        self._retry = None
        written = self._records()
        d = self._writing = self.db.runInteraction(
            problems.write, self.db, self.instance, [r for _, r in written], stopped_ms,
            self.keep)

        def done(_):
            self._writing = None
            self._outage.succeeded()
            self.dropped = 0
            for entry, record in written:
                if record.ended_ms is None:
                    self._open.add(entry.problem)
                else:
                    self._open.discard(entry.problem)
                if not entry.dirty and self._pending.get(entry.problem) is entry:
                    del self._pending[entry.problem]
            if not self._stopped and any(e.dirty for e in self._pending.values()):
                self._write()

        def failed(f):
            self._writing = None
            for entry, _ in written:
                entry.dirty = True
            if stopped_ms is not None:
                log.warn("The status page's last {n} problems were not kept in the "
                         "database at the stop ({error}): the next start will not show them",
                         n=len(self._pending), error=f.getErrorMessage()[:300])
            elif not self._stopped:
                delay = self._outage.failed(f.value)
                self._retry = self._clock.callLater(delay, self._write)

        # (Its callbacks may run at once: it is _writing until they do.)
        d.addCallbacks(done, failed)
        return d

    async def stop(self, open_problems: bool) -> None:
        """At the instance's stop: one last write of what is pending, and
        (``open_problems``: some are ongoing) this run's open rows marked as
        open at this stop; nothing is written after it."""
        self._stopped = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if self._writing is not None:
            await self._writing
        if self._pending or open_problems:
            for entry in self._pending.values():
                entry.dirty = True
            await self._write(stopped_ms=_ms(self._clock.seconds()))
