"""Coroutines run in the background: started, not awaited by their caller.

:meth:`Background.run` is the one way to start such work.  Invariants: every
Deferred it hands out has an errback, so a failure never surfaces later as
"Unhandled error in Deferred" at garbage collection; a failure is logged as
one line and counted in ``replicator_background_failures_total{task}``; the
work still running is in :attr:`Background.running`, which
:meth:`Background.wait` waits on (shutdown drains).
"""

from collections.abc import Coroutine
from typing import Any

from twisted.internet import defer, error
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from .observe import metrics

log = Logger()


class Background:
    """The background coroutines one component started and that have not ended."""

    def __init__(self) -> None:
        self.running: set[defer.Deferred[Any]] = set()

    def run(self, task: str, coroutine: Coroutine[Any, Any, Any]) -> defer.Deferred[Any]:
        """Start ``coroutine``; its Deferred fires with None once it ended,
        however it ended.  ``task`` names it in the log line and metric."""
        d = defer.ensureDeferred(coroutine)
        d.addErrback(self._failed, task)
        if not d.called:
            self.running.add(d)
            d.addBoth(self._ended, d)
        return d

    @staticmethod
    def _failed(failure: Failure, task: str) -> None:
        metrics.BACKGROUND_FAILURES.labels(task).inc()
        log.error("Background task {task} failed: {error}", task=task,
                  error=f"{type(failure.value).__name__}: {failure.getErrorMessage()}")

    def _ended(self, result: Any, d: defer.Deferred[Any]) -> Any:
        self.running.discard(d)
        return result

    async def wait(self, clock: IReactorTime, timeout: float) -> bool:
        """Wait until the work running now has ended, at most ``timeout``
        seconds on ``clock``; whether it ended."""
        if not self.running:
            return True
        done: defer.Deferred[None] = defer.Deferred()

        def finished(_: object) -> None:
            if not done.called:
                done.callback(None)

        defer.DeferredList(list(self.running)).addCallback(finished)
        done.addTimeout(timeout, clock)
        try:
            await done
        except (defer.TimeoutError, error.TimeoutError):
            return False
        return True
