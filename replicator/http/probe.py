"""``GET /health``: the database probe and the replication problems.

200 ``{"status": "ok", ...summary}`` once ``SELECT 1`` answers within
``db_timeout``, the streams are loaded and replication keeps up (the lag
grace and the rest are :class:`replicator.observe.health.HealthMonitor`'s); else 503
``{"status": "unhealthy", "reason": "..."}`` with the first problem found.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from .. import __version__
from ..observe.health import Finding
from ..replication.interfaces import IReplicationView
from .answers import HttpError
from .redact import Redactor

if TYPE_CHECKING:
    from ..observe.health import HealthMonitor
    from ..storage.database import Database
    from ..streams.registry import StreamRegistry

log = Logger(namespace="replicator.http")

DB_TIMEOUT = 2.0


class Unhealthy(HttpError):
    """503 ``{"status": "unhealthy", "reason": "..."}``."""

    key = "reason"
    extra = {"status": "unhealthy"}

    def __init__(self, reason: str):
        super().__init__(503, reason)


class HealthRoute:
    """The health endpoint of one instance.

    ``replication_status()`` returns ``(connected, detail)``; it decides
    health on a worker and is only reported on a master.  Invariant: at most
    one database probe runs at a time (a hung database ties up one pool
    thread, not one per health check).
    """

    def __init__(self, *, instance_name: str, role: str, registry: "StreamRegistry",
                 handler: IReplicationView, db: "Database", monitor: "HealthMonitor",
                 replication_status: Callable[[], tuple[bool, str]], redact: Redactor,
                 db_timeout: float, clock: IReactorTime) -> None:
        self.instance_name = instance_name
        self.role = role  # replicator.observe.roles.role(config)
        self.registry = registry
        self.handler = handler
        self.db = db
        self.monitor = monitor
        self.replication_status = replication_status
        self.redact = redact
        self.db_timeout = db_timeout
        self._clock = clock
        self._db_probe: defer.Deferred[Any] | None = None
        self._db_waiters: list[defer.Deferred[str | None]] = []

    def check_database(self) -> "defer.Deferred[str | None]":
        """Fires with None if ``SELECT 1`` answers within ``db_timeout``, else
        with the reason."""
        waiter: defer.Deferred[str | None] = defer.Deferred(
            lambda d: self._db_waiters.remove(d) if d in self._db_waiters else None)
        self._db_waiters.append(waiter)
        if self._db_probe is None:
            try:
                probe: defer.Deferred[Any] = self.db.runQuery("SELECT 1")
            except Exception:  # e.g. a pool already closed
                probe = defer.fail()
            self._db_probe = probe
            probe.addBoth(self._db_probe_done)
        waiter.addTimeout(self.db_timeout, self._clock)

        def reason(f: Failure) -> str:
            if f.check(defer.TimeoutError):
                return f"database unreachable: no answer within {self.db_timeout:g}s"
            log.warn("Health check: the database is unreachable: {error}",
                     error=self.redact(f.getErrorMessage()))
            return f"database unreachable: {type(f.value).__name__}"

        waiter.addCallbacks(lambda _: None, reason)
        return waiter

    def _db_probe_done(self, result: object) -> None:
        self._db_probe = None
        waiters, self._db_waiters = self._db_waiters, []
        for waiter in waiters:
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(None)
        return None

    def replication(self) -> tuple[bool, str]:
        """``replication_status()``, redacted; never raises."""
        try:
            connected, detail = self.replication_status()
            return bool(connected), self.redact(str(detail))
        except Exception:
            self.redact.log_failure("replication_status() failed", Failure())
            return False, "replication status unavailable"

    def _unloaded(self) -> str | None:
        unloaded = [s.name for s in self.registry if not s.loaded]
        return f"streams not loaded: {', '.join(unloaded)}" if unloaded else None

    def current_problem(self) -> str | None:
        """The first replication problem ``/health`` would give (streams not
        loaded, link, unreceived, lag), without the database probe; None if
        there is none."""
        return self._unloaded() or self.monitor.problem(*self.replication())

    def current_findings(self) -> list[Finding]:
        """Every finding (:meth:`.HealthMonitor.findings`), streams not
        loaded first: what the status page shows, banner and rows.  The
        first that fails health is :meth:`current_problem`."""
        unloaded = self._unloaded()
        first = [Finding("unloaded", None, None, unloaded, "")] if unloaded else []
        return first + self.monitor.findings(*self.replication())

    async def get(self, request: Any) -> dict[str, Any]:
        problem = await self.check_database()
        if problem is None:
            problem = self._unloaded()
        connected, detail = self.replication()
        if problem is None:
            problem = self.monitor.problem(connected, detail)
        if problem is not None:
            raise Unhealthy(problem)
        answer = {
            "status": "ok",
            "instance": self.instance_name,
            "role": self.role,
            "version": __version__,
            "replication": {"connected": connected, "detail": detail},
            "connections": len(self.handler.open_connections()),
            "positions": {s.name: s.id_gen.get_positions() for s in self.registry},
        }
        held = [f.text for f in self.monitor.findings(connected, detail)
                if f.kind == "foreign_held"]
        if held:
            answer["foreign_held"] = held  # plain-SQL transactions holding a stream
        return answer
