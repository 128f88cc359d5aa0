"""Every Prometheus metric of the daemon, defined once.

Hot paths count per batch, never per line.  Names follow Prometheus
conventions: counters end in ``_total``, durations are ``_seconds``, sizes
``_bytes``.  Gauges that describe live state (positions, in-flight IDs, lag,
connections) are refreshed from that state by :func:`set_collector` at scrape
time where keeping them current on every change would cost the hot path.
"""

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

# ------------------------------------------------------------- streams
FACTS_WRITTEN = Counter(
    "replicator_facts_written_total", "Facts committed by local writers", ["stream"]
)
FACTS_ROLLED_BACK = Counter(
    "replicator_facts_rolled_back_total",
    "Reserved stream IDs completed without rows (rolled back)", ["stream"],
)
WRITE_LATENCY = Histogram(
    "replicator_write_latency_seconds",
    "From the start of a write to its completion (reserve, insert, commit)", ["stream"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
STREAM_POSITION = Gauge(
    "replicator_stream_position", "Current token per stream and writer, as this instance knows it",
    ["stream", "writer"],
)
STREAM_LINEAR_POSITION = Gauge(
    "replicator_stream_linear_position", "Linear (minimum over writers) token per stream",
    ["stream"],
)
IN_FLIGHT = Gauge(
    "replicator_stream_in_flight_ids", "Stream IDs reserved and not yet completed", ["stream"]
)

# ---------------------------------------------------------- replication
CONNECTIONS = Gauge(
    "replicator_connections", "Open replication connections", ["name"]
)
COMMANDS_IN = Counter(
    "replicator_commands_received_total", "Commands received", ["command", "name"]
)
COMMANDS_OUT = Counter(
    "replicator_commands_sent_total", "Commands sent", ["command", "name"]
)
COMMANDS_DROPPED = Counter(
    "replicator_commands_dropped_total",
    "Outbound commands never written (line too long) or inbound ones ignored (unknown)",
    ["command", "reason"],
)
PENDING_COMMANDS = Gauge(
    "replicator_pending_commands", "Commands queued while the connection is paused", ["name"]
)
TRANSPORT_BUFFER = Gauge(
    "replicator_transport_buffer_bytes", "Bytes in the transport's write buffer", ["name"]
)
DISCONNECTS = Counter(
    "replicator_disconnects_total", "Replication disconnects by reason", ["reason"]
)
READER_LAG = Gauge(
    "replicator_reader_lag", "Writer's announced token minus this reader's token",
    ["stream", "writer"],
)
CATCHUP_FETCHES = Counter(
    "replicator_catchup_fetches_total", "Out-of-band fetches to fill a position gap", ["stream"]
)
CATCHUP_ROWS = Counter(
    "replicator_catchup_rows_total", "Rows fetched out of band to fill position gaps", ["stream"]
)
FANOUT_LATENCY = Histogram(
    "replicator_fanout_latency_seconds",
    "From a writer's token advancing to its rows being written to every connection",
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1),
)

_collectors = []


class _StateCollector:
    """Refreshes live-state gauges right before each scrape."""

    def __init__(self, refresh):
        self._refresh = refresh

    def collect(self):
        self._refresh()
        return []


def set_collector(refresh) -> _StateCollector:
    """Run ``refresh()`` at every scrape (it sets gauges from live state)."""
    collector = _StateCollector(refresh)
    REGISTRY.register(collector)
    _collectors.append(collector)
    return collector


def remove_collector(collector: _StateCollector) -> None:
    if collector in _collectors:
        _collectors.remove(collector)
        REGISTRY.unregister(collector)


def clear_collectors() -> None:
    while _collectors:
        REGISTRY.unregister(_collectors.pop())
