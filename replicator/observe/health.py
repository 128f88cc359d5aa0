"""What ``/health`` says about replication, beyond "the database answers".

A :class:`HealthMonitor` per instance decides whether this instance's
readers are getting the facts they should, and says which (stream, writer)
is not.  Its problems, in the order they are reported:

0. a *standing condition* (``conditions``): e.g. a Synapse seen on this
   instance's Redis channel, which stops it publishing there
   (:mod:`replicator.replication.transport.synapse_watch`); reported at once and
   until a restart.  Likewise a stream stopped because retention trimmed
   facts a reader needs, or an audit mismatch: the core's own findings
   (:meth:`replicator.replication.interfaces.IReplicationView.findings`).
1. *not connected* (a worker): a replication link is down.
2. *committed, not received* (any instance that reads): readers share the
   writers' database, so every ``check_interval`` seconds one indexed query
   per (stream, remote writer) in the pool (never on the reactor thread)
   asks for that writer's committed facts above this reader's position.  A
   fact that is committed and not received is normal for a moment (in
   flight, or waiting behind an earlier ID of its writer); once one has
   stayed unreceived for ``lag_grace`` seconds it is a problem:
   ``stream S: writer W has N committed facts not received for T s``.  This
   catches a writer whose own link is silently dead while it keeps writing.
3. *lagging* (a worker): a stream's reader lagged behind what its writer
   announced, or reader work stayed queued, for ``lag_grace`` seconds.
4. *never announced* (a worker): a configured remote writer of a stream
   from which no POSITION or RDATA has arrived ``lag_grace`` seconds after
   start (a writer that is down, or a hub that does not know it).

Every check gives :class:`Finding` s (what, which stream and writer, the
banner's line, the row's verdict, whether it fails ``/health``):
:meth:`HealthMonitor.findings` is the one list the banner, the rows of the
status page and ``/health`` (its first finding that fails health) all come
from.  A :class:`replicator.observe.writers.WriterWatch`, when given, adds the
writers' findings (a writer down, a linear token held): warnings that show
on the page and never fail ``/health`` (this instance still serves).

Invariants: a problem is reported only once its condition has lasted the
grace (no flapping under load); the query counts committed rows only (a
plain ``SELECT`` sees nothing uncommitted) and at most ``COUNT_LIMIT``
facts per writer, so a reader far behind costs one bounded index scan; one
check runs at a time.  The gauges ``replicator_unreceived_facts`` and
``replicator_unreceived_age_seconds`` carry the last check's figures;
``replicator_healthy`` the verdict at scrape time (:meth:`HealthMonitor.healthy`).
"""

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    NamedTuple,
)

from twisted.application.internet import TimerService
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python import threadable

from ..keys import Key
from . import metrics

if TYPE_CHECKING:
    from ..config import StreamConfig
    from ..replication.interfaces import IReplicationView
    from ..storage.database import Database
    from ..streams.registry import StreamRegistry
    from .writers import WriterWatch

log = Logger(namespace="replicator.observe.health")


#: Facts counted per (stream, writer) and check at most; more show as "N+".
COUNT_LIMIT = 10_000
#: A scrape waits this long for the reactor to give the health verdict.
VERDICT_WAIT = 2.0
#: Observations kept per key (a staircase of "first seen" times).
MAX_OBSERVATIONS = 64


class Finding(NamedTuple):
    """One thing found wrong.  ``kind`` says which check (``link``,
    ``condition``, ``trimmed``, ``unloaded``, ``unreceived``, ``lagging``, ``work``,
    ``never_announced``, ``writer_down``, ``linear_held``, ``foreign_held``); ``stream`` and
    ``writer`` what it is about (None: every stream of that writer, or the
    whole instance); ``text`` the banner's line; ``verdict`` the row's;
    ``fails_health`` whether ``/health`` answers 503 for it; ``since`` when
    the condition began if it is known (a link: when its peer was last
    heard), else None.  The identity of a finding that goes on is
    ``(kind, stream, writer)``; one whose ``since`` changed is a new one."""

    kind: str
    stream: str | None
    writer: str | None
    text: str
    verdict: str
    fails_health: bool = True
    since: float | None = None

    @property
    def key(self) -> tuple[str, str | None, str | None]:
        return (self.kind, self.stream, self.writer)

    def about(self, stream: str, writer: str) -> bool:
        """Whether this finding is about the row (stream, writer)."""
        return self.writer == writer and self.stream in (None, stream)


class _Unreceived:
    """What the checks saw of one (stream, remote writer).

    ``observations`` are ``(time, stream ID)`` pairs: at ``time`` the
    writer's committed fact ``stream ID`` was above this reader's position.
    Since a reader receives a writer's facts in ID order, the fact is still
    unreceived for as long as the reader's position stays below its ID.
    """

    __slots__ = ("observations", "count", "capped")

    def __init__(self) -> None:
        self.observations: deque[tuple[float, int]] = deque()
        self.count = 0
        self.capped = False

    def prune(self, position: int) -> None:
        """Forget the facts received (at or below ``position``)."""
        if any(stream_id <= position for _, stream_id in self.observations):
            self.observations = deque(o for o in self.observations if o[1] > position)

    def forget_below(self, lowest: int | None) -> None:
        """Forget sightings of facts below ``lowest``, the least committed
        fact the last check found above the position (None: none)."""
        if self.observations and (lowest is None or self.observations[0][1] < lowest):
            self.observations = deque(o for o in self.observations
                                      if lowest is not None and o[1] >= lowest)

    def observe(self, now: float, lowest: int) -> None:
        if self.observations and self.observations[-1][1] == lowest:
            return  # the same fact still unreceived: keep its first sighting
        self.observations.append((now, lowest))
        if len(self.observations) > MAX_OBSERVATIONS:
            # Keep the oldest (the age) and the newest; a dropped middle
            # sighting can only make a later age smaller, never a false alarm.
            del self.observations[1]

    def oldest(self) -> float | None:
        return self.observations[0][0] if self.observations else None


class HealthMonitor(TimerService):
    """Replication health of one instance (see the module docstring).

    ``expect_upstream`` is True on a worker (an instance with an upstream or
    Redis): only there do link, lag and never-announced problems count; the
    committed-not-received check runs on every instance that reads.
    """

    def __init__(self, *, registry: "StreamRegistry", handler: "IReplicationView",
                 db: "Database | None", clock: IReactorTime, lag_grace: float = 10.0,
                 check_interval: float = 5.0, expect_upstream: bool = False,
                 conditions: Sequence[Callable[[], str | None]] = (),
                 writers: "WriterWatch | None" = None,
                 link_since: Callable[[], float | None] | None = None) -> None:
        self.registry = registry
        #: Each returns a problem that holds until a restart, or None.
        self.conditions = list(conditions)
        self.handler = handler
        self.db = db
        self._clock = clock
        self.lag_grace = lag_grace
        self.check_interval = check_interval
        self.expect_upstream = expect_upstream
        self.writers = writers  # a WriterWatch, or None
        #: Since when the link has been down (its finding's ``since``), or None.
        self.link_since = link_since
        self._behind_since: dict[Any, float] = {}
        self._unreceived: dict[Key, _Unreceived] = {}
        #: Per fenced stream read here: who held its fence at the last check.
        self._held: dict[str, list[Any]] = {}
        self._pollers: dict[str, Any] = {}
        self._fenced_writer: dict[str, str] = {}  # (the writer a fence speaks for)
        self._started_at = clock.seconds()
        self._checking: defer.Deferred[None] | None = None
        self._check_failed = False
        # Checks every check_interval while running; stopping waits for the
        # check under way.
        super().__init__(check_interval, self.check_unreceived)  # type: ignore[no-untyped-call]
        self.clock = clock

    def set_settings(self, lag_grace: float, check_interval: float) -> None:
        """New ``health`` settings (a reload): the grace counts from now on,
        the next check comes ``check_interval`` after the last one."""
        self.lag_grace = lag_grace
        self.check_interval = self.step = check_interval
        if self._loop is not None:
            self._loop.interval = check_interval

    # ------------------------------------------------------------ service
    def startService(self) -> None:
        self._started_at = self._clock.seconds()
        super().startService()  # type: ignore[no-untyped-call]

    # -------------------------------------------------------------- check
    def _remote_keys(self) -> list[tuple[Any, str, int]]:
        """``(stream, writer, reader position)`` of every remote writer this
        instance has a position for (no position yet: nothing is expected)."""
        positions = self.handler.reader_positions()
        out = []
        for stream in self.registry:
            for writer in stream.config.writers:
                if writer in stream.local_writers:
                    continue
                position = positions.get((stream.name, writer))
                if position is not None:
                    out.append((stream, writer, position))
        return out

    def check_unreceived(self) -> "defer.Deferred[None]":
        """Ask the database once for committed facts above each reader's
        position; fires when done (never fails).  A check still running is
        not started twice."""
        if self._checking is not None:
            return self._checking
        if self.writers is not None:
            self.writers.observe()
        keys = self._remote_keys()
        if not keys:
            return defer.succeed(None)
        queries = [(stream.name, writer, self._query(stream.config),
                    ((writer,) if stream.config.writer_column else ()) + (position,))
                   for stream, writer, position in keys]
        started = self._clock.seconds()
        assert self.db is not None  # (a reader's position: the instance has its database)
        d: defer.Deferred[None] = self.db.runInteraction(
            _count_unreceived, queries, self._fence_pollers())
        self._checking = d

        def done(answer: tuple[dict[Key, tuple[int | None, int]], dict[str, list[Any]]]
                 ) -> None:
            self._checking = None
            if self._check_failed:
                log.info("Checking for unreceived facts works again")
                self._check_failed = False
            results, self._held = answer
            self._record(started, results)

        def failed(f: Any) -> None:
            self._checking = None
            if not self._check_failed:
                log.warn("Checking for unreceived facts failed: {error}",
                         error=f.getErrorMessage()[:300])
                self._check_failed = True

        d.addCallbacks(done, failed)
        return d

    def _fence_pollers(self) -> list[tuple[str, Any]]:
        """The fenced streams this instance reads but does not poll (a
        reader of a stream with ``foreign_writers``): the check also asks
        who holds their fence, to name it."""
        if self.db is None or not self.db.is_postgres:
            return []
        from ..streams.fence import Poller

        out = []
        for stream in self.registry:
            if stream.config.foreign_writers and getattr(stream, "fence", None) is None:
                poller = self._pollers.get(stream.name)
                if poller is None:
                    poller = self._pollers[stream.name] = Poller(stream.config)
                self._fenced_writer[stream.name] = stream.config.writers[0]
                out.append((stream.name, poller))
        return out

    def _query(self, config: "StreamConfig") -> str:
        where = f"{config.writer_column} = %s AND " if config.writer_column else ""
        assert self.db is not None
        return self.db.sql(
            f"SELECT MIN({config.id_column}), COUNT(DISTINCT {config.id_column}) FROM "
            f"(SELECT {config.id_column} FROM {config.table} WHERE {where}"
            f"{config.id_column} > %s ORDER BY {config.id_column} LIMIT %s) AS unreceived")

    def _record(self, started: float, results: dict[Key, tuple[int | None, int]]) -> None:
        positions = self.handler.reader_positions()
        for key, (lowest, count) in results.items():
            state = self._unreceived.setdefault(key, _Unreceived())
            state.count = count
            state.capped = count > COUNT_LIMIT
            # What was seen below the lowest unreceived fact now is gone
            # from the table (received is pruned by the position below):
            # a row deleted by hand is no fact to wait for.
            state.forget_below(lowest)
            if lowest is not None:
                state.observe(started, lowest)
            state.prune(positions.get(key) or 0)
        for key in [k for k in self._unreceived if k not in results]:
            del self._unreceived[key]  # no position any more
            for gauge in (metrics.UNRECEIVED_FACTS, metrics.UNRECEIVED_AGE):
                try:
                    gauge.remove(*key)
                except KeyError:
                    pass
        now = self._clock.seconds()
        for (stream, writer), state in self._unreceived.items():
            oldest = state.oldest()
            metrics.UNRECEIVED_FACTS.labels(stream, writer).set(
                min(state.count, COUNT_LIMIT) if oldest is not None else 0)
            metrics.UNRECEIVED_AGE.labels(stream, writer).set(
                now - oldest if oldest is not None else 0)

    # ------------------------------------------------------------ verdict
    def _unreceived_findings(self) -> list[Finding]:
        """Every (stream, writer) with a committed fact unreceived for
        ``lag_grace`` seconds."""
        now = self._clock.seconds()
        positions = self.handler.reader_positions()
        out = []
        for key in sorted(self._unreceived):
            state = self._unreceived[key]
            state.prune(positions.get(key) or 0)
            oldest = state.oldest()
            if oldest is not None and now - oldest >= self.lag_grace:
                count = f"{COUNT_LIMIT}+" if state.capped else str(state.count)
                noun = "fact" if count == "1" else "facts"
                what = f"{count} committed {noun} not received for {now - oldest:.0f}s"
                holders = (self._held.get(key[0], [])
                           if self._fenced_writer.get(key[0]) == key[1] else [])
                least = min(holders, key=lambda h: h.first_id) if holders else None
                if least is not None and state.observations[0][1] > least.first_id:
                    # Every one of them is above an ID a plain-SQL transaction
                    # holds: no reader gets them before it ends (a warning,
                    # as on the instance that polls the fence).
                    text = (f"stream {key[0]}: writer {key[1]} has {what}: held back by a "
                            f"plain-SQL transaction holding ID {least.first_id}, "
                            f"{holder_text(least)}; they come when it ends")
                    out.append(Finding("foreign_held", key[0], key[1], text,
                                       f"held by ID {least.first_id}", fails_health=False,
                                       since=oldest))
                    continue
                out.append(Finding("unreceived", key[0], key[1],
                                   f"stream {key[0]}: writer {key[1]} has {what}", what))
        return out

    def _lag_findings(self) -> list[Finding]:
        """Streams that lagged (or work that stayed queued) for the grace."""
        now = self._clock.seconds()
        behind: dict[Any, int | None] = {
            key: lag for key, lag in self.handler.reader_lag().items() if lag}
        if not self.handler.idle():
            behind["work"] = None
        since = self._behind_since
        for key in [k for k in since if k not in behind]:
            del since[key]
        out = []
        for key in sorted(behind, key=str):
            started = since.setdefault(key, now)
            if now - started < self.lag_grace:
                continue
            for_ = f"for {now - started:.0f}s"
            if key == "work":
                out.append(Finding("work", None, None,
                                   f"replication catching up (work queued) {for_}", "", True))
            else:
                what = f"lagging by {behind[key]} {for_}"
                out.append(Finding("lagging", key[0], key[1],
                                   f"stream {key[0]}/{key[1]} {what}", what))
        return out

    def _silent_findings(self) -> list[Finding]:
        """Configured remote writers never heard of after the grace."""
        waited = self._clock.seconds() - self._started_at
        if waited < self.lag_grace:
            return []
        heard = self.handler.reader_heard()
        out = []
        for stream in self.registry:
            for writer in stream.config.writers:
                if writer not in stream.local_writers and (stream.name, writer) not in heard:
                    what = f"never announced anything in {waited:.0f}s"
                    out.append(Finding("never_announced", stream.name, writer,
                                       f"stream {stream.name}: writer {writer} {what}", what))
        return out

    def findings(self, connected: bool, detail: str) -> list[Finding]:
        """Everything found, in the order ``/health`` reports it: the link
        (where one is expected), unreceived facts, lag and queued work and
        writers never heard (where a link is expected), then the writers'
        warnings.  ``connected`` and ``detail`` are the links' status."""
        out: list[Finding] = []
        for condition in self.conditions:
            text = condition()
            if text is not None:
                out.append(Finding("condition", None, None, text, ""))
        out += self.handler.findings()
        if self.expect_upstream and not connected:
            since = self.link_since() if self.link_since is not None else None
            out.append(Finding("link", None, None, f"replication not connected: {detail}", "",
                               since=since))
        out += self._unreceived_findings()
        if self.expect_upstream:
            out += self._lag_findings()
            out += self._silent_findings()
        if self.writers is not None:
            out += self.writers.findings(self.lag_grace)
        out += self._fence_findings()
        return out

    def _fence_findings(self) -> list[Finding]:
        """Plain-SQL transactions that have held a fenced stream's first
        writer for more than the grace (:mod:`replicator.streams.fence`):
        a warning (only that stream waits; this instance serves), naming
        who (``pid``, ``application_name``, when its transaction began)."""
        out = []
        for stream in self.registry:
            fence = getattr(stream, "fence", None)
            if fence is None:
                continue
            hung = fence.hung(self.lag_grace)
            if not hung:
                continue
            holder, since = hung[0]
            held = self._clock.seconds() - since
            who = holder_text(holder)
            more = f" and {len(hung) - 1} more" if len(hung) > 1 else ""
            if holder.first_id is None:
                # Not an insert: the fence's lock taken by hand (an advisory
                # lock of the same key), which every plain-SQL insert waits on.
                text = (f"stream {stream.name}: the plain-SQL writers' fence lock has been held "
                        f"without an ID for {held:.0f}s (an advisory lock taken by hand, not "
                        f"an insert): {who}{more}; plain-SQL inserts wait until it is released")
            else:
                text = (f"stream {stream.name}: a plain-SQL transaction has held ID "
                        f"{holder.first_id} for {held:.0f}s: {who}{more}; facts of writer "
                        f"{fence.writer} from {holder.first_id} on wait until it ends")
            out.append(Finding("foreign_held", stream.name, fence.writer, text,
                               (f"held by pid {holder.pid}" if holder.pid is not None
                                else "held by a prepared transaction") + f" for {held:.0f}s",
                               fails_health=False, since=since))
        return out

    def problem(self, connected: bool, detail: str) -> str | None:
        """The first replication problem that fails ``/health``, or None.
        ``connected`` and ``detail`` are the replication links' status."""
        return _first_text(self.findings(connected, detail))

    def healthy(self, connected: bool, detail: str) -> bool:
        """The verdict ``/health`` gives, without its database probe: every
        stream loaded, the last unreceived-facts check answered, and no
        replication :meth:`problem`.  Cheap (no I/O)."""
        if not all(stream.loaded for stream in self.registry):
            return False
        return not self._check_failed and self.problem(connected, detail) is None

    def healthy_source(self, replication_status: Callable[[], tuple[bool, str]],
                       ) -> "metrics.Source":
        """A live metrics source (:func:`metrics.add_source`) giving
        ``replicator_healthy`` from :meth:`healthy`.  Scrapes run in a
        thread; the verdict reads and updates reactor-owned state, so it is
        computed on the reactor thread, waiting at most ``VERDICT_WAIT``
        seconds: a reactor that does not answer in that time is unhealthy."""
        def verdict() -> bool:
            return self.healthy(*replication_status())

        def source() -> list[metrics.Sample]:
            if threadable.isInIOThread():
                return [(metrics.HEALTHY, (), 1 if verdict() else 0)]
            answer: list[bool] = []
            done = threading.Event()

            def on_reactor() -> None:
                try:
                    answer.append(verdict())
                finally:
                    done.set()

            # The registry's reactor: the clock may be a test's Clock.
            self.registry.reactor.callFromThread(on_reactor)
            done.wait(VERDICT_WAIT)
            return [(metrics.HEALTHY, (), 1 if answer and answer[0] else 0)]

        return source


def _first_text(findings: list[Finding]) -> str | None:
    """The line of the first finding that fails health, or None."""
    for finding in findings:
        if finding.fails_health:
            return finding.text
    return None


def holder_text(holder: Any) -> str:
    """Who holds a fenced stream (:class:`..streams.fence.Holder`), in words."""
    if holder.pid is None:
        return "prepared transaction (no session; see pg_prepared_xacts)"
    started = (f", transaction started {holder.xact_start}"
               if holder.xact_start is not None else "")
    state = f", {holder.state}" if holder.state is not None else ""
    return (f"session pid {holder.pid} (application_name {holder.application_name!r}"
            f"{started}{state})")


def _count_unreceived(txn: Any, queries: Sequence[tuple[str, str, str, tuple[Any, ...]]],
                      pollers: Sequence[tuple[str, Any]] = (),
                      ) -> tuple[dict[Key, tuple[int | None, int]], dict[str, list[Any]]]:
    """Per (stream, writer): the lowest committed stream ID above the
    reader's position and how many there are (up to ``COUNT_LIMIT + 1``);
    and per fenced stream read here (``pollers``), who holds its fence."""
    out: dict[Key, tuple[int | None, int]] = {}
    for stream, writer, sql, params in queries:
        txn.execute(sql, params + (COUNT_LIMIT + 1,))
        lowest, count = txn.fetchone()
        out[(stream, writer)] = (int(lowest) if lowest is not None else None, int(count or 0))
    held = {name: [h for h in poller.holders(txn) if h.first_id is not None]
            for name, poller in pollers}
    return out, held
