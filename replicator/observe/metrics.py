"""Every Prometheus metric of the daemon, defined once.

Hot paths count per batch, never per line.  Names follow Prometheus
conventions: counters end in ``_total``, durations are ``_seconds``, sizes
``_bytes``.  Gauges that describe live state (positions, in-flight IDs, lag,
queues, the health verdict) are never set on the hot path: they are
:class:`LiveGauge` definitions whose series the sources registered with
:func:`add_source` give at each scrape, from one snapshot.
"""

import threading
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from twisted.logger import Logger

log = Logger(namespace="replicator.observe.metrics")

# ---------------------------------------------------------------- build
BUILD_INFO = Gauge(
    "replicator_build_info", "Always 1; the labels say which build is running",
    ["version", "python", "twisted"],
)


def _record_build() -> None:
    import platform

    import twisted

    from .. import __version__

    BUILD_INFO.labels(__version__, platform.python_version(), twisted.__version__).set(1)


_record_build()

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
WRITE_GROUP_SIZE = Histogram(
    "replicator_write_group_size",
    "Facts per write transaction: concurrent writes of a writer go together (group commit); "
    "a failed group's writes retried alone count again, as groups of their own", ["stream"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
)

# ------------------------------------------------------------ retention
RETENTION_TRIMMED = Counter(
    "replicator_retention_trimmed_facts_total",
    "Facts deleted from a stream's table by its retention (on the instance that trims)",
    ["stream"],
)
RETENTION_BOUNDARY = Gauge(
    "replicator_retention_trimmed_through",
    "A stream's trim boundary: every fact at or below this ID was trimmed (on the instance "
    "that trims)", ["stream"],
)
RETENTION_GAP = Gauge(
    "replicator_retention_gap",
    "1 while this instance's reader of a (stream, writer) is stopped because facts it needs "
    "were trimmed by retention (until an operator rewinds and restarts)", ["stream", "writer"],
)

# The read API: event streams ended because retention trimmed facts they
# still had to send (docs/read-api.md, "Trimmed facts").
HTTP_READER_TRIMMED = Counter(
    "replicator_http_reader_trimmed_total",
    "Event streams of this read API reader ended with an error event because retention "
    "trimmed facts they had not sent yet (the reader fell behind)", ["reader", "stream"],
)

# ---------------------------------------------------------- replication
# "name" labels are bounded: a peer's NAME only if the configuration knows
# it (replication.interfaces.metrics_label), else "other".
CONNECTIONS = Gauge(
    "replicator_connections", "Open replication connections", ["name"]
)
BACKGROUND_FAILURES = Counter(
    "replicator_background_failures_total",
    "Background tasks (fan-out, reader pipelines) that ended with an exception", ["task"],
)
COMMANDS_IN = Counter(
    "replicator_commands_received_total", "Commands received", ["command", "name"]
)
COMMANDS_OUT = Counter(
    "replicator_commands_sent_total", "Commands sent", ["command", "name"]
)
COMMANDS_DROPPED = Counter(
    "replicator_commands_dropped_total",
    "Outbound commands never written (line too long) or inbound ones ignored (unknown; "
    "unknown_writer: a writer of a stream read here that its writers do not name)",
    ["command", "reason"],
)
FACTS_BY_POSITION = Counter(
    "replicator_facts_announced_by_position_total",
    "Local facts too big for one batch or line (max_batch_rows, max_batch_bytes, "
    "max_line_length), announced as POSITION t t: readers read them from the table",
    ["stream"],
)
INBOUND_REFUSED = Counter(
    "replicator_inbound_refused_total",
    "RDATA/POSITION of a peer refused and never acted on: a token beyond the stream's "
    "sequence (beyond_sequence), a row that does not fit the stream (bad_row), a partial "
    "batch over its bounds (batch_too_large)",
    ["stream", "reason"],
)
DISCONNECTS = Counter(
    "replicator_disconnects_total", "Replication disconnects by reason", ["reason"]
)
REDIS_AUTH_REFUSED = Counter(
    "replicator_redis_auth_refused_total",
    "AUTH/SELECT of a Redis link not accepted (a wrong password, or the connection closed "
    "before the answer); the link retries with backoff", ["link"]
)
REDIS_REFUSED = Counter(
    "replicator_redis_refused_total",
    "Lines on our own Redis channels refused and never acted on (replication.redis.keys): "
    "unsigned, malformed, unknown_signer, wrong_signer (signed by another instance than "
    "the one it names), bad_signature, out_of_order (a fact's later row without its start)",
    ["reason"]
)
REDIS_UNSIGNED_ACCEPTED = Counter(
    "replicator_redis_unsigned_accepted_total",
    "Unsigned lines on our own Redis channels taken because of accept_unsigned (a rolling "
    "upgrade is over when this stops growing on every instance)"
)
CONNECTIONS_REFUSED = Counter(
    "replicator_connections_refused_total",
    "Replication connections refused or closed to make room (ERROR and close), by reason "
    "(a cap; name_held; unproven: RDATA/POSITION of a writer that has not proven its NAME; "
    "bad_proof: a wrong AUTH)", ["reason"]
)
RECONNECT_DELAY = Gauge(
    "replicator_reconnect_delay_seconds",
    "Last reconnect wait of an outgoing link, or retry wait of a fan-out or reader "
    "during a database outage (0 once healthy again)", ["link"]
)
UNRECEIVED_FACTS = Gauge(
    "replicator_unreceived_facts",
    "Facts of a remote writer committed in the database above this reader's position "
    "(last check; capped at 10000)", ["stream", "writer"],
)
UNRECEIVED_AGE = Gauge(
    "replicator_unreceived_age_seconds",
    "How long the oldest committed fact above this reader's position has gone unreceived "
    "(last check)", ["stream", "writer"],
)
POSITIONS_CONTRADICTED = Counter(
    "replicator_positions_contradicted_total",
    "POSITIONs of another instance's writer that the table contradicted: the range they "
    "passed held the writer's facts (caught up from the table), or one of its facts arrived "
    "later (the stream stopped)", ["stream"],
)
AUDIT_RANGES = Counter(
    "replicator_audit_ranges_total",
    "Ranges of a reader's delivered facts checked against the table, by result "
    "(equal, different, failed)", ["stream", "result"],
)
AUDIT_FACTS = Counter(
    "replicator_audit_facts_total",
    "Delivered facts the audit found equal to the table (each counted at each check)",
    ["stream"],
)
AUDIT_ALTERED = Counter(
    "replicator_audit_altered_facts_total",
    "Sampled delivered facts whose rows the audit found different from the table's",
    ["stream"],
)
AUDIT_MISMATCH = Gauge(
    "replicator_audit_mismatch",
    "1 while this instance's reader of a (stream, writer) is stopped because what it "
    "delivered differs from the table (until an operator acts and restarts)",
    ["stream", "writer"],
)
CATCHUP_FETCHES = Counter(
    "replicator_catchup_fetches_total", "Out-of-band fetches to fill a position gap", ["stream"]
)
CATCHUP_ROWS = Counter(
    "replicator_catchup_rows_total", "Rows fetched out of band to fill position gaps", ["stream"]
)
SEQUENCE_MOVED = Counter(
    "replicator_sequence_moved_total",
    "Times a stream's sequence was found behind known positions on a new database "
    "connection (e.g. after a PostgreSQL crash) and moved past them", ["stream"]
)
FOREIGN_FACTS = Counter(
    "replicator_foreign_facts_total",
    "Facts found in a single-writer stream's table under IDs this instance never "
    "reserved (written by SQL, not through replicator); delivered from the table", ["stream"]
)
FANOUT_LATENCY = Histogram(
    "replicator_fanout_latency_seconds",
    "From a writer's token advancing to its rows being written to every connection",
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1),
)

BOOKKEEPING_EVICTED = Counter(
    "replicator_bookkeeping_evicted_total",
    "USER_SYNC / USER_IP / FEDERATION_ACK entries dropped to make room (table full)", ["table"],
)
BOOKKEEPING_EXPIRED = Counter(
    "replicator_bookkeeping_expired_total",
    "USER_IP / FEDERATION_ACK entries dropped for age (bookkeeping_max_age)", ["table"],
)


# ------------------------------------------------------------- reactor
# (observe.reactor_watch: a second without a turn is a stall.)
REACTOR_STALLS = Counter(
    "replicator_reactor_stalls_total",
    "Times the reactor thread went a second or more without a turn (every connection, "
    "timer and answer of the instance waited); the log says where it was",
)
REACTOR_STALLED_SECONDS = Counter(
    "replicator_reactor_stalled_seconds_total",
    "Seconds the reactor thread spent in those stalls",
)
REACTOR_BLOCKED = Gauge(
    "replicator_reactor_blocked_seconds",
    "Seconds the reactor thread has gone without a turn beyond its beat, now (0 while it "
    "turns; read by the metrics thread, so it rises while the reactor is held)",
)


# ----------------------------------------------------------- live state
class LiveGauge:
    """A gauge of live state (a position, a queue, a verdict).  Never set:
    its series are the samples the sources give at each scrape
    (:class:`LiveCollector`), so a series that is gone is gone at once."""

    __slots__ = ("name", "documentation", "labelnames")

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()):
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)

    def family(self, values: dict[tuple[str, ...], float]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in values.items():
            family.add_metric(labels, value)
        return family

    def __repr__(self) -> str:
        return f"<LiveGauge {self.name}>"


STREAM_POSITION = LiveGauge(
    "replicator_stream_position", "Current token per stream and writer, as this instance knows it",
    ["stream", "writer"])
STREAM_LINEAR_POSITION = LiveGauge(
    "replicator_stream_linear_position", "Linear (minimum over writers) token per stream",
    ["stream"])
IN_FLIGHT = LiveGauge(
    "replicator_stream_in_flight_ids", "Stream IDs reserved and not yet completed", ["stream"])
PENDING_COMMANDS = LiveGauge(
    "replicator_pending_commands", "Commands queued while the connection is paused", ["name"])
TRANSPORT_BUFFER = LiveGauge(
    "replicator_transport_buffer_bytes", "Bytes in the transport's write buffer", ["name"])
READER_LAG = LiveGauge(
    "replicator_reader_lag", "Writer's announced token minus this reader's token",
    ["stream", "writer"])
# Labelled by instance names the configuration knows; any other is "other".
USER_SYNCS = LiveGauge(
    "replicator_user_syncs", "Users syncing per instance (USER_SYNC bookkeeping)", ["instance"])
FEDERATION_ACK_POSITION = LiveGauge(
    "replicator_federation_ack_position",
    "Federation stream position acknowledged per instance (FEDERATION_ACK)", ["instance"])
HEALTHY = LiveGauge(
    "replicator_healthy",
    "1 while this instance's /health replication verdict is OK (streams loaded, replication "
    "links up and keeping up, the unreceived-facts check answering), else 0; set at scrape "
    "time")
WRITER_CONNECTED = LiveGauge(
    "replicator_writer_connected",
    "On a TCP master (hub): 1 while a connection of this remote writer is open, else 0 "
    "(disconnected or never connected); absent where writers do not connect here", ["writer"])
WRITER_HEARD_AGE = LiveGauge(
    "replicator_writer_heard_age_seconds",
    "Seconds since the last POSITION or RDATA of this remote writer of the stream arrived; "
    "absent until one did", ["stream", "writer"])
LINEAR_HELD = LiveGauge(
    "replicator_linear_held_seconds",
    "Seconds the stream's linear token has stayed below the largest ID known (0: not held); "
    "the status page and the positions API name what holds it", ["stream"])
# The read API's readers (docs/read-api.md), by reader name and stream.
HTTP_READERS_CONNECTED = LiveGauge(
    "replicator_http_reader_connected",
    "Long-polls waiting and event streams open of this read API reader", ["reader", "stream"])
HTTP_READER_POSITION = LiveGauge(
    "replicator_http_reader_position",
    "The smallest writer position this read API reader reached (the most behind of its "
    "event streams while any is open)", ["reader", "stream"])
HTTP_READER_LAG = LiveGauge(
    "replicator_http_reader_lag",
    "IDs this read API reader is behind the stream's current tokens (largest over writers)",
    ["reader", "stream"])
LIVE_GAUGES = (STREAM_POSITION, STREAM_LINEAR_POSITION, IN_FLIGHT, PENDING_COMMANDS,
               TRANSPORT_BUFFER, READER_LAG, USER_SYNCS, FEDERATION_ACK_POSITION, HEALTHY,
               WRITER_CONNECTED, WRITER_HEARD_AGE, LINEAR_HELD, HTTP_READERS_CONNECTED,
               HTTP_READER_POSITION, HTTP_READER_LAG)

#: One live sample: the gauge, its label values, the value.
Sample = tuple[LiveGauge, tuple[str, ...], float]
#: A source of live samples: called once per scrape, in the scrape's thread.
Source = Callable[[], Iterable[Sample]]
#: Tries of a source whose state changed size while it read it.
SOURCE_TRIES = 3


class LiveCollector:
    """The live gauges, built from one snapshot per scrape.

    Each scrape calls every source once; a source returns its samples from
    one snapshot of its state.  The metric families are built afresh from
    what the sources returned and nothing is kept between scrapes, so
    scrapes from several threads (the metrics thread, ``/metrics`` on the
    HTTP listener) never see each other's work half done.  A label set
    given twice (two instances in one process) is reported once, the later
    source's value.  A source that fails gives nothing for that scrape and
    logs why.
    """

    def __init__(self) -> None:
        self._sources: list[Source] = []
        self._lock = threading.Lock()

    def add(self, source: Source) -> None:
        with self._lock:
            self._sources.append(source)

    def remove(self, source: Source) -> None:
        with self._lock:
            if source in self._sources:
                self._sources.remove(source)

    def describe(self) -> list[GaugeMetricFamily]:
        return [gauge.family({}) for gauge in LIVE_GAUGES]

    def collect(self) -> list[GaugeMetricFamily]:
        with self._lock:
            sources = list(self._sources)
        values: dict[LiveGauge, dict[tuple[str, ...], float]] = {g: {} for g in LIVE_GAUGES}
        for source in sources:
            for gauge, labels, value in _read(source):
                values[gauge][tuple(labels)] = value
        return [gauge.family(values[gauge]) for gauge in LIVE_GAUGES]


def _read(source: Source) -> list[Sample]:
    """The samples of one source, read whole (a source read while its state
    changed size is read again)."""
    for attempt in range(SOURCE_TRIES):
        try:
            return list(source())
        except RuntimeError:  # "changed size during iteration"
            if attempt + 1 < SOURCE_TRIES:
                continue
            log.failure("Live metrics source {source} failed", source=source)
        except Exception:
            log.failure("Live metrics source {source} failed", source=source)
            break
    return []


LIVE = LiveCollector()
REGISTRY.register(LIVE)
#: Give a source's samples at every scrape / stop giving them.
add_source = LIVE.add
remove_source = LIVE.remove


