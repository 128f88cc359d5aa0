"""Coroutines run in the background: started, not awaited by their caller.

:meth:`Background.run` is the one way to start such work.  Invariants: every
Deferred it hands out has an errback, so a failure never surfaces later as
"Unhandled error in Deferred" at garbage collection; a failure is logged as
one line and counted in ``replicator_background_failures_total{task}``; the
work still running is in :attr:`Background.running`, which
:meth:`Background.wait` waits on (shutdown drains).
"""

from typing import Coroutine, Set

from twisted.internet import defer, error
from twisted.logger import Logger

from . import metrics

log = Logger()


class Background:
    """The background coroutines one component started and that have not ended."""

    def __init__(self):
        self.running: Set[defer.Deferred] = set()

    def run(self, task: str, coroutine: Coroutine) -> defer.Deferred:
        """Start ``coroutine``; its Deferred fires with None once it ended,
        however it ended.  ``task`` names it in the log line and metric."""
        d = defer.ensureDeferred(coroutine)
        d.addErrback(self._failed, task)
        if not d.called:
            self.running.add(d)
            d.addBoth(self._ended, d)
        return d

    @staticmethod
    def _failed(failure, task: str) -> None:
        metrics.BACKGROUND_FAILURES.labels(task).inc()
        log.error("Background task {task} failed: {error}", task=task,
                  error=f"{failure.type.__name__}: {failure.getErrorMessage()}")

    def _ended(self, result, d: defer.Deferred):
        self.running.discard(d)
        return result

    async def wait(self, clock, timeout: float) -> bool:
        """Wait until the work running now has ended, at most ``timeout``
        seconds on ``clock``; whether it ended."""
        if not self.running:
            return True
        done = defer.Deferred()
        both = defer.DeferredList(list(self.running))
        both.addCallback(lambda _: done.called or done.callback(None))
        done.addTimeout(timeout, clock)
        try:
            await done
        except (defer.TimeoutError, error.TimeoutError):
            return False
        return True
