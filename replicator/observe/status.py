"""What the status page shows, an operator on call's first look: its content and lag history.

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
  findings seen (a bounded ring of :class:`Problem`: from, to or ongoing,
  the latest line; a finding that goes on with other figures updates its
  entry; one that says when it began (``since``) starts there, and is a
  new entry when that changes).  Given a
  :class:`replicator.observe.problem_log.ProblemLog` (:meth:`StatusRecorder.restore`),
  it writes each problem to the database when it starts and when it ends,
  and shows at a start the ones from before it (an entry ongoing when the
  instance stopped is shown so, its end unknown).
* :func:`snapshot` — the page's content as a JSON-able dict.
* :class:`Positions` — one look at the core's positions, and the fields of
  one writer's row that ``/positions`` (:mod:`replicator.http.streams`)
  shows too: written once, here.
* :mod:`.status_html` — the page's HTML rendered from it, its stylesheet
  and its script.

Invariants: memory is bounded (``window / interval`` samples per configured
key, :data:`MAX_PROBLEMS` problems; the handler keeps its own bounded ring
of disconnects); nothing here blocks or touches the database (the problem
log writes in the pool, and only when a problem starts or ends).
"""

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
)

from twisted.application.internet import TimerService
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from .. import __version__
from ..addresses import peer_address
from ..keys import Key
from ..replication.interfaces import IReplicationView
from .health import Finding
from .writers import WriterWatch, clock_time, duration

if TYPE_CHECKING:
    from ..streams.registry import StreamRegistry
    from ..streams.stream import Stream
    from .problem_log import ProblemLog

log = Logger(namespace="replicator.observe.status")

#: Sampling interval and the sparkline's window, in seconds.
SAMPLE_INTERVAL = 5.0
WINDOW = 15 * 60.0
#: Health problems remembered.
MAX_PROBLEMS = 20
#: In-flight IDs listed per writer (the count is always given).
MAX_IN_FLIGHT_SHOWN = 10
#: A connection whose peer sent nothing for this many ping intervals is
#: shown as not answering (a live peer is heard every interval; the link
#: closes it at ``ping_timeout``).
STALLED_INTERVALS = 2.0


class Problem:
    """One entry of "Recent problems": a finding from ``since`` to
    ``until`` (None: ongoing), with its latest line.  One from before this
    start (``before_restart``) that had not ended is not ongoing: it was
    ongoing at the stop, ``stopped_at`` (when the stop was recorded), else
    some time before the restart at ``restarted_at``; its end is unknown."""

    __slots__ = ("key", "since", "until", "reason", "fails_health", "before_restart",
                 "stopped_at", "restarted_at")

    def __init__(self, key: tuple[Any, ...], since: float, reason: str,
                 fails_health: bool) -> None:
        self.key = key
        self.since = since
        self.until: float | None = None
        self.reason = reason
        self.fails_health = fails_health
        self.before_restart = False
        self.stopped_at: float | None = None
        self.restarted_at: float | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Problem":
        """One kept by an earlier run (:func:`replicator.storage.problems.load`)."""
        def seconds(ms: float | None) -> float | None:
            return None if ms is None else ms / 1000.0
        p = cls((row["kind"], row["stream"], row["writer"]), row["started_ms"] / 1000.0,
                row["text"], row["fails_health"])
        p.until = seconds(row["ended_ms"])
        p.before_restart = True
        if p.until is None:
            p.stopped_at = seconds(row["stopped_ms"])
            p.restarted_at = seconds(row["restarted_ms"])
        return p

    def as_dict(self) -> dict[str, Any]:
        return {"at": self.since, "until": self.until, "reason": self.reason,
                "fails_health": self.fails_health, "before_restart": self.before_restart,
                "stopped_at": self.stopped_at, "restarted_at": self.restarted_at}


class StatusRecorder(TimerService):
    """Samples reader lag and the health findings for the status page, every
    ``interval`` seconds while running (from its start on).

    ``findings()`` returns the current :class:`replicator.observe.health.Finding` s.
    A finding is one problem for as long as its ``(kind, stream, writer)``
    is found at every sample; it ends at the first sample without it.
    ``journal`` (:meth:`restore`) is told of each start and end.
    """

    def __init__(self, *, handler: IReplicationView, findings: Callable[[], list[Finding]],
                 clock: IReactorTime, interval: float = SAMPLE_INTERVAL,
                 window: float = WINDOW) -> None:
        self._clock = clock
        self.handler = handler
        self._findings = findings
        self.interval = interval
        self.window = window
        self._size = max(1, int(window // interval) + 1)
        self.lag: dict[Key, deque[tuple[float, int]]] = {}
        self.problems: deque[Problem] = deque(maxlen=MAX_PROBLEMS)
        self._ongoing: dict[Any, Problem] = {}
        #: The :class:`replicator.observe.problem_log.ProblemLog`, or None
        #: (nothing kept across a restart).
        self.journal: ProblemLog | None = None
        #: When the history from before this start was loaded (None: not).
        self.restored_at: float | None = None
        super().__init__(interval, self.sample)  # type: ignore[no-untyped-call]
        self.clock = clock

    async def restore(self, journal: "ProblemLog", started: float | None = None) -> None:
        """Before the service starts: the problems ``journal`` kept from
        before this start (at ``started``, by default now) head the
        history, and every problem from now on is written to it.  A
        history that cannot be read is logged, and the page starts without
        it."""
        self.journal = journal
        self.restored_at = self._clock.seconds() if started is None else started
        try:
            rows = await journal.load(MAX_PROBLEMS, self.restored_at)
        except Exception as e:
            log.error("The status page's problems from before this start could not be "
                      "read ({error}): the page starts without them",
                      error=f"{type(e).__name__}: {str(e)[:300]}")
            return
        for row in rows:
            self.problems.append(Problem.from_row(row))

    def stopService(self) -> "defer.Deferred[Any]":
        stopped: defer.Deferred[Any] = super().stopService()  # type: ignore[no-untyped-call]
        if self.journal is None:
            return stopped
        journal, ongoing = self.journal, bool(self._ongoing)
        d: defer.Deferred[Any] = defer.maybeDeferred(lambda: stopped)
        d.addCallback(lambda _: defer.ensureDeferred(journal.stop(ongoing)))
        return d

    def sample(self) -> None:
        """One sample of every reader's lag and of the health findings."""
        now = self._clock.seconds()
        for key, lag in self.handler.reader_lag().items():
            ring = self.lag.get(key)
            if ring is None:
                ring = self.lag[key] = deque(maxlen=self._size)
            ring.append((now, lag))
        try:
            found = self._findings()
        except Exception:
            log.failure("Computing the health findings failed")
            found = [Finding("verdict", None, None, "health verdict unavailable", "")]
        self.note(found)

    def note(self, found: list[Finding]) -> None:
        """The problems as of now are ``found``: entries start, go on or
        end (at every sample, and whenever the page is shown, so that its
        history never disagrees with its banner)."""
        now = self._clock.seconds()
        seen: set[tuple[Any, ...]] = set()
        for finding in found:
            if finding.key in seen:
                continue
            seen.add(finding.key)
            entry = self._ongoing.get(finding.key)
            began = finding.since if finding.since is not None and finding.since <= now else None
            if entry is not None and entry in self.problems and (
                    began is None or began == entry.since):
                entry.reason = finding.text  # the same problem, still going
                continue
            if entry is not None:
                # Ended between two samples and began again (a link that
                # answered, then stopped): two problems, not one.
                entry.until = max(entry.since, began) if began is not None else now
                self._ended(entry)
            entry = self._ongoing[finding.key] = Problem(
                finding.key, now if began is None else began, finding.text,
                finding.fails_health)
            self.problems.append(entry)
            if self.journal is not None:
                self.journal.started(entry)
        for key in [k for k in self._ongoing if k not in seen]:
            entry = self._ongoing.pop(key)
            entry.until = now
            self._ended(entry)

    def _ended(self, entry: Problem) -> None:
        if self.journal is not None:
            self.journal.ended(entry)

    def history(self, key: Key) -> list[list[float]]:
        """``[[time, lag], ...]`` of the last ``window`` seconds, oldest first."""
        ring: Sequence[tuple[float, int]] = self.lag.get(key, ())
        since = self._clock.seconds() - self.window
        return [[t, lag] for t, lag in ring if t >= since]


def link_state(conn: Any, since: float, now: float) -> dict[str, Any]:
    """What one connection is: ``state`` (``connected``; ``handshake``: our
    upstream accepted the socket but has not named itself with ``SERVER``;
    ``stalled``: nothing heard for :data:`STALLED_INTERVALS` ping
    intervals), ``since`` when it is so, and ``text`` saying both."""
    if not conn.accepted and not getattr(conn, "established", True):
        return {"state": "handshake", "since": since,
                "text": f"handshake not answered since {clock_time(since)} "
                        f"({duration(now - since)})"}
    heard = getattr(conn, "last_received", None)
    interval = getattr(conn, "ping_interval", None)
    if heard is not None and interval is not None and now - heard > STALLED_INTERVALS * interval:
        return {"state": "stalled", "since": heard,
                "text": f"not answering since {clock_time(heard)} ({duration(now - heard)})"}
    return {"state": "connected", "since": since, "text": f"connected since {clock_time(since)}"}


def row_verdict(findings: list[Finding], stream: str, writer: str, fallback: str
                ) -> tuple[str, str]:
    """A row's verdict and its level (``ok``, ``warn``: a finding that does
    not fail health, ``bad``): the findings about the row, the same ones the
    banner gives, else ``fallback`` (level ``ok``)."""
    about = [f for f in findings if f.about(stream, writer)]
    if not about:
        return fallback, "ok"
    verdict = "; ".join(dict.fromkeys(f.verdict or f.text for f in about))
    return verdict, "bad" if any(f.fails_health for f in about) else "warn"


class Positions:
    """One look at the core's positions, taken once for a page: what this
    instance announced of its own writers, and what its readers of the
    others delivered and how far behind they are."""

    def __init__(self, core: IReplicationView) -> None:
        self.announced = core.announced_positions()
        self.readers = core.reader_positions()
        self.lags = core.reader_lag()

    def writer_row(self, stream: "Stream", writer: str,
                   positions: Mapping[str, int]) -> dict[str, Any]:
        """The fields of ``writer``'s row that ``/positions`` and the status
        page both show: ``position`` (of ``positions``, the stream's) and
        ``local``; a local writer's ``in_flight`` and ``announced``, a
        remote one's ``reader_position`` and ``lag``."""
        key = (stream.name, writer)
        local = writer in stream.local_writers
        row: dict[str, Any] = {"position": positions.get(writer), "local": local}
        if local:
            gen = stream.id_gen
            row["in_flight"] = gen.in_flight(writer) if gen is not None else 0
            row["announced"] = self.announced.get(key)
        else:
            row["reader_position"] = self.readers.get(key)
            row["lag"] = self.lags.get(key, 0)
        return row


def snapshot(*, instance: str, role: str, registry: "StreamRegistry",
             handler: IReplicationView, recorder: StatusRecorder,
             findings: list[Finding], clock: IReactorTime, redact: Callable[[str], str],
             writers: WriterWatch | None = None,
             http_readers: Callable[[], list[dict[str, Any]]] | None = None,
             ) -> dict[str, Any]:
    """What the page shows, as a JSON-able dict (see the README).
    ``findings`` are the current health findings (the banner and every
    row's verdict come from them); ``writers`` the instance's
    :class:`replicator.observe.writers.WriterWatch` (links, linear holders)."""
    seen = Positions(handler)
    recorder.note(findings)
    failing = [f for f in findings if f.fails_health]
    warnings = [f for f in findings if not f.fails_health]
    streams = []
    for stream in registry:
        gen = stream.id_gen
        positions = gen.get_positions() if gen is not None else {}
        writer_rows = []
        for writer in stream.config.writers:
            key = (stream.name, writer)
            entry: dict[str, Any] = {"writer": writer,
                                     **seen.writer_row(stream, writer, positions)}
            if entry["local"]:
                entry["in_flight_ids"] = (gen.in_flight_ids(writer, MAX_IN_FLIGHT_SHOWN)
                                          if gen is not None else [])
                fallback = "loading" if gen is None else "ok"
            else:
                lag = entry["lag"]
                entry["lag_history"] = recorder.history(key)
                if writers is not None:
                    entry["link"] = writers.link(writer, stream.name)
                if gen is None:
                    fallback = "loading"
                elif entry["reader_position"] is None:
                    fallback = "not heard yet"
                elif lag:
                    fallback = f"behind by {lag}"
                else:
                    fallback = "ok"
            entry["verdict"], entry["level"] = row_verdict(
                findings, stream.name, writer, fallback)
            entry["verdict"] = redact(entry["verdict"])
            writer_rows.append(entry)
        holder = writers.linear_holder(stream) if writers is not None and gen is not None \
            else None
        streams.append({"name": stream.name,
                        "linear": gen.get_linear_token() if gen is not None else None,
                        "linear_holder": holder,
                        "writers": writer_rows})
    connections = []
    now = clock.seconds()
    for open_conn in handler.open_connections():
        conn = open_conn.conn
        link = link_state(conn, open_conn.since, now)
        connections.append({
            "peer": redact(open_conn.peer),
            "address": peer_address(conn),
            "role": conn.role,
            "queued_lines": int(conn.queued),
            "queued_bytes": int(conn.queued_bytes),
            "connected_since": open_conn.since,
            "state": link["state"],
            "state_since": link["since"],
            "state_text": link["text"],
        })
    connections.sort(key=lambda c: (c["role"], c["peer"], c["address"] or ""))
    return {
        "instance": instance,
        "role": role,
        "version": __version__,
        "now": now,
        "healthy": not failing,
        "problem": redact(failing[0].text) if failing else None,
        "warning": redact(warnings[0].text) if warnings else None,
        "findings": [{"kind": f.kind, "stream": f.stream, "writer": f.writer,
                      "text": redact(f.text), "fails_health": f.fails_health}
                     for f in findings],
        "problems": [dict(p.as_dict(), reason=redact(p.reason))
                     for p in reversed(recorder.problems)],
        # This start: the problems with before_restart are from before it
        # (null: the history is not kept across restarts).
        "started_at": recorder.restored_at,
        "streams": streams,
        "connections": connections,
        "disconnects": [{"at": d.at, "peer": redact(d.peer), "address": d.address,
                         "reason": d.reason}
                        for d in reversed(handler.recent_disconnects())],
        "window": recorder.window,
        # The read API's readers (docs/read-api.md): reader, stream,
        # connected, position, lag, seen_age.
        "readers": http_readers() if http_readers is not None else [],
    }
