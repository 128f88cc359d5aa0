"""Many short, independent transactions with few thread hops.

Each job is its own transaction on a pooled connection, committed or rolled
back on its own, exactly as ``runInteraction`` would run it; but a pool
thread that picks up a job keeps taking queued jobs (up to ``per_hop``)
before it hands the results back to the reactor together.  Under load the
cost of the reactor/thread hand-off is paid once per batch of transactions
instead of once per transaction; when idle, a job goes out at once.

Blocking calls happen only in the pool's threads.  Results are delivered in
the order the jobs were taken.
"""

from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.enterprise import adbapi
from twisted.internet import defer
from twisted.python.failure import Failure

_PENDING = object()


class _Job:
    __slots__ = ("fn", "args", "result", "failure", "deferred")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.result: Any = _PENDING
        self.failure: Failure | None = None
        self.deferred: defer.Deferred[Any] = defer.Deferred()


class TransactionQueue:
    """Runs ``fn(cursor, *args)`` transactions on at most ``workers`` pooled
    connections at a time."""

    def __init__(self, pool: adbapi.ConnectionPool, workers: int = 1, per_hop: int = 32) -> None:
        self._pool = pool
        self._workers = max(1, workers)
        self._per_hop = per_hop
        self._jobs: deque[_Job] = deque()  # append/popleft are thread-safe
        self._busy = 0

    def run(self, fn: Callable[..., Any], *args: Any) -> "defer.Deferred[Any]":
        job = _Job(fn, args)
        self._jobs.append(job)
        self._kick()
        return job.deferred

    def _kick(self) -> None:
        while self._busy < self._workers and self._jobs:
            self._busy += 1
            taken: list[_Job] = []
            d = self._pool.runWithConnection(self._work, taken)
            d.addBoth(self._done, taken)

    def _work(self, conn: adbapi.Connection, taken: list[_Job]) -> None:
        """In a pool thread: one transaction per job until none is queued."""
        for _ in range(self._per_hop):
            try:
                job = self._jobs.popleft()
            except IndexError:
                return
            taken.append(job)
            cursor = conn.cursor()
            try:
                job.result = job.fn(cursor, *job.args)
                conn.commit()
            except BaseException:
                job.result = _PENDING
                job.failure = Failure()
                # A connection that died under the job is dropped here
                # (quietly, on PostgreSQL); the next job's cursor() opens a
                # new one, so no queued job is failed without being tried.
                # Where rollback raises instead, the hop ends and the jobs
                # still queued go to the next one.
                conn.rollback()
            finally:
                try:
                    cursor.close()
                except Exception:
                    pass

    def _done(self, outcome: object, taken: list[_Job]) -> None:
        self._busy -= 1
        hop_failure = outcome if isinstance(outcome, Failure) else None
        if hop_failure is not None and not taken:
            # No connection could be had: every job waiting now would meet
            # the same fate; fail them instead of spinning on the pool.
            while self._jobs:
                taken.append(self._jobs.popleft())
        for job in taken:
            if job.failure is not None:
                job.deferred.errback(job.failure)
            elif job.result is _PENDING:
                job.deferred.errback(hop_failure or RuntimeError("transaction not run"))
            else:
                job.deferred.callback(job.result)
        self._kick()

    @property
    def queued(self) -> int:
        return len(self._jobs)
