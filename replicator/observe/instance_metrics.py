"""The live metrics of one instance: one source for :data:`metrics.LIVE`.

At each scrape, in the scrape's thread, :class:`InstanceMetrics` reads the
instance's live state once and returns it as samples: every loaded stream's
positions, linear token and in-flight IDs; each reader's lag; per peer
label, the commands queued while its connection is paused and the bytes
its transport has not sent; the master's bookkeeping; the writers' links
and how long each linear token has been held (:mod:`.writers`); the health
verdict.

Invariants: nothing here is written on the hot path or kept between
scrapes; reactor-owned collections are read through one-step snapshots
(``list(...)``, copies the state hands out), and the health verdict, which
reads and updates reactor-owned state, is computed on the reactor thread
(:meth:`replicator.observe.health.HealthMonitor.healthy_source`).
"""

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..net.twisted_private import unsent_bytes
from ..replication.interfaces import IReplicationView
from . import metrics

if TYPE_CHECKING:
    from ..streams.registry import StreamRegistry
    from .writers import WriterWatch


def stream_samples(registry: "StreamRegistry") -> list[metrics.Sample]:
    """Positions, linear token and in-flight IDs of every loaded stream."""
    out: list[metrics.Sample] = []
    for stream in list(registry):
        gen = stream.id_gen
        if gen is None:
            continue
        out.extend((metrics.STREAM_POSITION, (stream.name, writer), token)
                   for writer, token in gen.get_positions().items())
        out.append((metrics.STREAM_LINEAR_POSITION, (stream.name,), gen.get_linear_token()))
        out.append((metrics.IN_FLIGHT, (stream.name,), gen.in_flight()))
    return out


def connection_samples(core: IReplicationView) -> list[metrics.Sample]:
    """Reader lag, and per peer label the queued commands and unsent bytes
    of its connections (summed)."""
    out: list[metrics.Sample] = [(metrics.READER_LAG, key, lag)
                                 for key, lag in core.reader_lag().items()]
    pending: dict[str, int] = {}
    unsent: dict[str, int] = {}
    for seen in core.open_connections():
        name = seen.label
        pending[name] = pending.get(name, 0) + int(seen.conn.queued)
        unsent[name] = unsent.get(name, 0) + unsent_bytes(seen.conn.transport)
    out.extend((metrics.PENDING_COMMANDS, (name,), n) for name, n in pending.items())
    out.extend((metrics.TRANSPORT_BUFFER, (name,), n) for name, n in unsent.items())
    return out


class InstanceMetrics:
    """The live samples of one instance (a :data:`metrics.Source`).

    ``healthy`` is the health monitor's source of the verdict
    (:meth:`~replicator.observe.health.HealthMonitor.healthy_source`), or None.
    """

    def __init__(self, *, registry: "StreamRegistry", handler: IReplicationView,
                 healthy: Callable[[], Iterable[metrics.Sample]] | None = None,
                 writers: "WriterWatch | None" = None,
                 readers: Callable[[], list[metrics.Sample]] | None = None) -> None:
        self.registry = registry
        self.readers = readers  # the read API's readers (ReadRoutes.metric_samples)
        self.handler = handler
        self.healthy = healthy
        self.writers = writers  # a WriterWatch: writers' links, linear tokens held

    def __call__(self) -> list[metrics.Sample]:
        samples = stream_samples(self.registry)
        samples += connection_samples(self.handler)
        samples += self.handler.bookkeeping_samples()
        if self.writers is not None:
            samples += self.writers.metric_samples()
        if self.healthy is not None:
            samples += self.healthy()
        if self.readers is not None:
            samples += self.readers()
        return samples

    def __repr__(self) -> str:
        return f"<InstanceMetrics of {self.handler.instance_name}>"
