"""Every Prometheus metric of the daemon, defined once.

Hot paths count per batch, never per line.  Names follow Prometheus
conventions: counters end in ``_total``, durations are ``_seconds``, sizes
``_bytes``.  Gauges that describe live state (positions, in-flight IDs, lag,
queues) are set from that state by refreshers (:func:`add_refresher`) right
before each scrape, instead of on every change on the hot path.
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
WRITE_GROUP_SIZE = Histogram(
    "replicator_write_group_size",
    "Facts per write transaction: concurrent writes of a writer go together (group commit); "
    "a failed group's writes retried alone count again, as groups of their own", ["stream"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
)
STREAM_POSITION = Gauge(
    "replicator_stream_position", "Current token per stream and writer, as this instance knows it",
    ["stream", "writer"], registry=None,
)
STREAM_LINEAR_POSITION = Gauge(
    "replicator_stream_linear_position", "Linear (minimum over writers) token per stream",
    ["stream"], registry=None,
)
IN_FLIGHT = Gauge(
    "replicator_stream_in_flight_ids", "Stream IDs reserved and not yet completed", ["stream"],
    registry=None,
)

# ---------------------------------------------------------- replication
# "name" labels are bounded: a peer's NAME only if the configuration knows
# it (replication.peers.metrics_label), else "other".
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
    "Outbound commands never written (line too long) or inbound ones ignored (unknown)",
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
PENDING_COMMANDS = Gauge(
    "replicator_pending_commands", "Commands queued while the connection is paused", ["name"],
    registry=None,
)
TRANSPORT_BUFFER = Gauge(
    "replicator_transport_buffer_bytes", "Bytes in the transport's write buffer", ["name"],
    registry=None,
)
DISCONNECTS = Counter(
    "replicator_disconnects_total", "Replication disconnects by reason", ["reason"]
)
REDIS_AUTH_REFUSED = Counter(
    "replicator_redis_auth_refused_total",
    "AUTH/SELECT of a Redis link not accepted (a wrong password, or the connection closed "
    "before the answer); the link retries with backoff", ["link"]
)
CONNECTIONS_REFUSED = Counter(
    "replicator_connections_refused_total",
    "Replication connections refused at accept (ERROR and close), by reason", ["reason"]
)
RECONNECT_DELAY = Gauge(
    "replicator_reconnect_delay_seconds",
    "Last reconnect wait of an outgoing link, or retry wait of a fan-out or reader "
    "during a database outage (0 once healthy again)", ["link"]
)
READER_LAG = Gauge(
    "replicator_reader_lag", "Writer's announced token minus this reader's token",
    ["stream", "writer"], registry=None,
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
# Labelled by instance names the configuration knows; any other is "other".
USER_SYNCS = Gauge(
    "replicator_user_syncs", "Users syncing per instance (USER_SYNC bookkeeping)", ["instance"],
    registry=None,
)
FEDERATION_ACK_POSITION = Gauge(
    "replicator_federation_ack_position",
    "Federation stream position acknowledged per instance (FEDERATION_ACK)", ["instance"],
    registry=None,
)

HEALTHY = Gauge(
    "replicator_healthy",
    "1 while this instance's /health replication verdict is OK (streams loaded, replication "
    "links up and keeping up, the unreceived-facts check answering), else 0; set at scrape "
    "time", registry=None,
)

# Gauges of live state, set by refreshers right before each scrape and
# exported by the collector below (so a scrape never sees stale values).
LIVE_GAUGES = (STREAM_POSITION, STREAM_LINEAR_POSITION, IN_FLIGHT, PENDING_COMMANDS,
               TRANSPORT_BUFFER, READER_LAG, USER_SYNCS, FEDERATION_ACK_POSITION, HEALTHY)
_refreshers = []


class _LiveState:
    """Runs every refresher, then reports the live gauges; scrapes may come
    from another thread, so refreshers work on snapshots."""

    def collect(self):
        for refresh in list(_refreshers):
            try:
                refresh()
            except Exception:  # state changed under us: the next scrape sees it
                pass
        for gauge in LIVE_GAUGES:
            yield from gauge.collect()


REGISTRY.register(_LiveState())


def add_refresher(refresh) -> None:
    """Call ``refresh()`` (it sets live gauges) before every scrape."""
    _refreshers.append(refresh)


def remove_refresher(refresh) -> None:
    if refresh in _refreshers:
        _refreshers.remove(refresh)
