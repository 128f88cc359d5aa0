"""Per writer: its link and when it was last heard; per stream: what holds
the linear token.  What the status page, ``/status.json``, the positions
API and the metrics say about the *other* instances' writers.

What an instance can know depends on where it stands:

* the **hub** (a TCP master: ``replication.listen``, no Redis) has one connection per
  worker, named by its ``NAME``: a remote writer is *connected* while a
  connection of that name is open (since it opened), else *disconnected*
  since its last connection closed, or *never connected* since start.
* a **TCP worker** hears every other writer through its upstream, and a
  **Redis** peer through the bus: there is no connection per writer, and a
  writer does not announce itself on a timer (it speaks when it writes, or
  when its position moves), so ``connected`` is unknown (null) and what is
  known is when it was **last heard** (its last POSITION or RDATA; on a
  TCP worker that includes the hub's answer to REPLICATE, which names every
  writer the hub knows).  A writer that is down shows there by holding the
  linear token.

The **linear token** of a stream is held below the largest ID known by
the remote writers whose position is the linear token, and by the lowest
ID a local writer has in flight above it.  :meth:`WriterWatch.observe`
notes when each stream's linear token last moved, so "held for" is how long
it has stayed where it is (to within the interval between observations); a
token that moved since the last observation is moving, not held (under
steady writes it is below the largest ID known at every look, for 0s).
A remote writer whose position is below the linear token (one added by a
reload starts at the stream's smallest persisted position) holds it too.

A writer's "never connected" / "never heard" counts from when it was
configured: the start for the writers of the file the instance started
with, the first observation after the reload that added it otherwise.

Invariants: nothing here blocks, touches the database or keeps more than
one entry per configured stream; :meth:`WriterWatch.metric_samples` only
reads (it runs in a scrape thread).
"""

import time
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IReactorTime

from ..replication.interfaces import IReplicationView
from . import metrics
from .health import Finding

if TYPE_CHECKING:
    from ..config import InstanceConfig
    from ..streams.registry import StreamRegistry
    from ..streams.stream import Stream


def clock_time(t: float) -> str:
    """``HH:MM:SS UTC`` of a clock time (the page gives dates elsewhere)."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def duration(seconds: float) -> str:
    """``41s``, ``12m05s`` or ``3h02m``: an age an operator reads at a glance."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def writer_watch(config: "InstanceConfig", registry: "StreamRegistry",
                 handler: IReplicationView, clock: IReactorTime) -> "WriterWatch":
    """The :class:`WriterWatch` of an instance of ``config``."""
    rep = config.replication
    # A hub's writers connect to it; beside Redis they may be on the bus instead.
    return WriterWatch(registry=registry, handler=handler, clock=clock,
                       hub=bool(rep.listen) and not rep.redis,
                       via="upstream" if rep.upstream else "redis" if rep.redis else None)


class WriterWatch:
    """The writers' links and the linear tokens' holders of one instance.

    ``hub`` says whether writers connect to this instance (a TCP master);
    ``via`` names what the others are heard through otherwise
    (``"upstream"``, ``"redis"``, or None: nothing)."""

    def __init__(self, *, registry: "StreamRegistry", handler: IReplicationView,
                 clock: IReactorTime, hub: bool, via: str | None) -> None:
        self.registry = registry
        self.handler = handler
        self._clock = clock
        self.hub = hub
        self.via = via
        self._started_at = clock.seconds()
        #: stream -> (linear token, since when it is held there; None: not held)
        self._linear: dict[str, tuple[int, float | None]] = {}
        self._moving: dict[str, bool] = {}  # stream -> its token moved at the last look
        #: remote writer -> when it was first configured here
        self._configured: dict[str, float] = {}
        self.observe()  # (where the tokens start: a later look tells moving from held)

    def _note_writers(self) -> None:
        """Note when each remote writer was first seen in the config."""
        now = self._clock.seconds()
        for stream in self.registry:
            for w in stream.config.writers:
                if w not in stream.local_writers and w not in self._configured:
                    self._configured[w] = now

    def _never(self, writer: str, what: str) -> str:
        """``never connected (up 3m53s)``, or ``(added 12s ago)`` for a
        writer a reload added."""
        now = self._clock.seconds()
        since = self._configured.get(writer, self._started_at)
        if since <= self._started_at:
            return f"never {what} (up {duration(now - self._started_at)})"
        return f"never {what} (added {duration(now - since)} ago)"

    # -------------------------------------------------------------- links
    def _connections(self) -> dict[str, float]:
        """Named peers connected to this hub: name -> connected since."""
        out: dict[str, float] = {}
        for seen in self.handler.open_connections():
            name = seen.conn.instance_name
            if name is not None and seen.conn.accepted:
                out[name] = min(out.get(name, seen.since), seen.since)
        return out

    def link(self, writer: str, stream: str | None = None,
             connected: dict[str, float] | None = None) -> dict[str, Any]:
        """What is known of a remote writer's link: ``connected`` (None:
        not known here), ``since`` (of that state; None: since start),
        ``heard_age`` (seconds since its last POSITION/RDATA, of ``stream``
        or of any stream; None: never) and ``text`` (one phrase)."""
        self._note_writers()
        now = self._clock.seconds()
        heard_at = self.handler.reader_heard_at()
        times = [t for (s, w), t in heard_at.items()
                 if w == writer and (stream is None or s == stream)]
        heard_age = now - max(times) if times else None
        state: bool | None
        since: float | None
        if self.hub:
            if connected is None:
                connected = self._connections()
            if writer in connected:
                since = connected[writer]
                state, text = True, f"connected since {clock_time(since)}"
            else:
                lost = self.handler.last_lost(writer)
                state, since = False, lost
                text = (f"disconnected since {clock_time(lost)} ({duration(now - lost)})"
                        if lost is not None else self._never(writer, "connected"))
        else:
            state, since = None, None
            text = (f"last heard {duration(heard_age)} ago" if heard_age is not None
                    else self._never(writer, "heard"))
        return {"connected": state, "since": since, "heard_age": heard_age, "text": text,
                "via": "connection" if self.hub else self.via}

    def down_for(self, writer: str, link: dict[str, Any]) -> float | None:
        """How long a writer has been known to be down (hub only), or None:
        since its last connection closed, else since it was configured."""
        if link["connected"] is not False:
            return None
        since: float | None = link["since"]
        if since is None:
            since = self._configured.get(writer, self._started_at)
        return self._clock.seconds() - since

    # -------------------------------------------------------------- linear
    def observe(self) -> None:
        """Note where each stream's linear token is and since when it is
        held below the largest ID known (reactor thread)."""
        self._note_writers()
        now = self._clock.seconds()
        for stream in self.registry:
            gen = stream.id_gen
            if gen is None:
                continue
            linear = gen.get_linear_token()
            held = linear < gen.get_max_known()
            seen = self._linear.get(stream.name)
            # Moving: the token is not where the last look saw it.
            self._moving[stream.name] = seen is not None and seen[0] != linear
            if seen is None or seen[0] != linear or (seen[1] is None) == held:
                self._linear[stream.name] = (linear, now if held else None)

    def held_for(self, stream: "Stream") -> float | None:
        """Seconds the linear token of ``stream`` has stayed below the
        largest ID known, or None when it is not held (read only)."""
        gen = stream.id_gen
        if gen is None:
            return None
        linear = gen.get_linear_token()
        if linear >= gen.get_max_known():
            return None
        seen = self._linear.get(stream.name)
        if seen is None or seen[0] != linear or seen[1] is None:
            return 0.0
        return self._clock.seconds() - seen[1]

    def linear_holder(self, stream: "Stream", connected: dict[str, float] | None = None,
                      ) -> dict[str, Any] | None:
        """What holds ``stream``'s linear token: ``{"linear", "held_for",
        "writers" (remote holders), "in_flight" ([ID, writer] or None),
        "text"}``; None when it is at the largest ID known or moved since
        the last observation."""
        self.observe()
        held = self.held_for(stream)
        if held is None or (held == 0 and self._moving.get(stream.name)):
            return None  # at the largest ID known, or moved since the last look
        gen = stream.id_gen
        linear = gen.get_linear_token()
        positions = gen.get_positions()
        holders = [w for w in stream.config.writers
                   if w not in stream.local_writers
                   and positions.get(w, linear + 1) <= linear]
        parts = [f"{w}: {self.link(w, stream.name, connected)['text']}" for w in holders]
        lowest: list[Any] | None = None  # [ID, writer]
        for w in stream.local_writers:
            ids = gen.in_flight_ids(w, 1)
            if ids and ids[0] > linear and (lowest is None or ids[0] < lowest[0]):
                lowest = [ids[0], w]
        if lowest is not None and (not holders or lowest[0] == linear + 1):
            parts.append(f"ID {lowest[0]} of {lowest[1]}, in flight")
        by = "; ".join(parts) or "an unknown writer"
        return {"linear": linear, "held_for": held, "writers": holders,
                "in_flight": lowest, "by": by, "held": duration(held),
                "text": f"linear held at {linear} by {by}, for {duration(held)}"}

    # ------------------------------------------------------------ findings
    def findings(self, grace: float) -> list[Finding]:
        """Writers down (hub) and linear tokens held, once they lasted
        ``grace`` seconds.  Warnings: they do not fail ``/health`` (this
        instance serves; another is down), they show on the page."""
        out: list[Finding] = []
        connected = self._connections() if self.hub else None
        remote = []
        for stream in self.registry:
            for w in stream.config.writers:
                if w not in stream.local_writers and w not in remote:
                    remote.append(w)
        if self.hub:
            for w in remote:
                link = self.link(w, connected=connected)
                down = self.down_for(w, link)
                if down is not None and down >= grace:
                    out.append(Finding("writer_down", None, w, f"writer {w} {link['text']}",
                                       link["text"], False))
        for stream in self.registry:
            holder = self.linear_holder(stream, connected)
            if holder is None or holder["held_for"] < grace:
                continue
            text = f"stream {stream.name}: {holder['text']}"
            held = f"holds the linear token at {holder['linear']}"
            for w in holder["writers"]:
                verdict = held if self.hub else \
                    f"{held}, {self.link(w, stream.name, connected)['text']}"
                out.append(Finding("linear_held", stream.name, w, text, verdict, False))
            if holder["in_flight"] is not None:
                stream_id, w = holder["in_flight"]
                out.append(Finding("linear_held", stream.name, w, text,
                                   f"ID {stream_id} in flight, {held}", False))
        return out

    # ------------------------------------------------------------- metrics
    def metric_samples(self) -> list[metrics.Sample]:
        """Per remote writer ``replicator_writer_connected`` (on a hub),
        ``replicator_writer_heard_age_seconds``; per stream
        ``replicator_linear_held_seconds``.  Read only (scrape thread)."""
        now = self._clock.seconds()
        out: list[metrics.Sample] = []
        connected = self._connections() if self.hub else {}
        heard_at = self.handler.reader_heard_at()
        remote = set()
        for stream in list(self.registry):
            for w in stream.config.writers:
                if w in stream.local_writers:
                    continue
                remote.add(w)
                t = heard_at.get((stream.name, w))
                if t is not None:
                    out.append((metrics.WRITER_HEARD_AGE, (stream.name, w), now - t))
            held = self.held_for(stream)
            if stream.loaded:
                out.append((metrics.LINEAR_HELD, (stream.name,), held or 0.0))
        if self.hub:
            out.extend((metrics.WRITER_CONNECTED, (w,), 1 if w in connected else 0)
                       for w in sorted(remote))
        return out
