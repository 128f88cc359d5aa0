"""The typed configuration: frozen dataclasses, one per section, built only
by the parsers of this package (their values are already checked)."""

from dataclasses import dataclass, field
from typing import Any

from ..net.backoff import RECONNECT_INITIAL_DELAY, RECONNECT_MAX_DELAY

#: The table the replicator keeps positions in.
POSITIONS_TABLE = "stream_positions"
#: The table holding the schema version (:mod:`replicator.storage.migrations`).
SCHEMA_TABLE = "replicator_schema"
#: The table the trim boundaries of retention are kept in.
RETENTION_TABLE = "stream_retention"
#: The table the idempotency keys of writes are kept in.
IDEMPOTENCY_TABLE = "stream_idempotency"
#: The table the status page's problem history is kept in
#: (:mod:`replicator.storage.problems`).
PROBLEMS_TABLE = "replicator_problems"
#: The table the delivery audit's findings are kept in
#: (:mod:`replicator.storage.findings`).
AUDIT_TABLE = "stream_audit"
#: The column of a table the replicator owns (:attr:`StreamConfig.owns_table`)
#: holding each row's place in its fact (0, 1, ...), in the order the writer
#: gave the rows: what every read of the table orders a fact's rows by.
ROW_INDEX_COLUMN = "row_index"
COLUMN_TYPES = ("text", "bigint", "boolean", "json")
LOG_LEVELS = ("debug", "info", "warn", "error", "critical")
#: ``log_format``: see :mod:`replicator.logs.formats`.
LOG_FORMATS = ("text", "logfmt", "json")
#: ``replication.redis.channels``, the default first (docs/protocol.md, "Redis").
REDIS_CHANNELS = ("single", "per_stream")


@dataclass(frozen=True)
class ColumnConfig:
    """One column of a stream's RDATA row, in wire order."""

    name: str
    type: str  # one of COLUMN_TYPES
    nullable: bool = False
    # A json column stored as JSON text in a TEXT column (Synapse's tables;
    # presets only): decoded when read.
    json_text: bool = False


#: The columns of a stream with ``durable_streams: true``: one row per
#: fact, the Durable Stream's path, the operation (``create``, ``append``,
#: ``delete``), the content type it was created with, the body (base64
#: of the bytes; in JSON mode, the messages as a JSON array), and an
#: append's ``Stream-Seq``.
DS_COLUMNS = (
    ColumnConfig("ds_path", "text"),
    ColumnConfig("ds_op", "text"),
    ColumnConfig("content_type", "text", nullable=True),
    ColumnConfig("body", "text", nullable=True),
    ColumnConfig("seq", "text", nullable=True),
)


@dataclass(frozen=True)
class RetentionConfig:
    """What a stream keeps (``retention``, docs/streams.md, "Retention"):
    facts older than ``max_age`` seconds (by the stream's
    ``timestamp_column``) and facts beyond the ``max_facts`` newest are
    trimmed, every ``interval`` seconds, at most ``batch`` facts per
    transaction; never a fact at or above the persisted linear position."""

    max_age: float | None = None  # seconds
    max_facts: int | None = None
    interval: float = 60.0
    batch: int = 1000


@dataclass(frozen=True)
class StreamConfig:
    """A stream: its backing table and who writes it.

    ``writer_column`` is None for a table without one (then the stream must
    have exactly one writer).  ``sequence`` defaults to ``<table>_seq``.
    """

    name: str
    table: str
    id_column: str
    writer_column: str | None
    columns: tuple[ColumnConfig, ...]
    sequence: str
    writers: tuple[str, ...]
    timestamp_column: str | None = None
    create: bool = True
    preset: str | None = None  # e.g. "synapse/caches": a Synapse stream, read-only
    # The stream_name of its rows in stream_positions when it is not ``name``
    # (Synapse's presets: its ID generator's name, e.g. "presence_stream").
    positions_name: str | None = None
    # What is trimmed from the table (None: everything is kept).
    retention: RetentionConfig | None = None
    # Its facts are the operations on Durable Streams created over HTTP
    # (``durable_streams: true``; its columns are DS_COLUMNS).
    durable_streams: bool = False
    #: Plain-SQL writers may insert into the table (PostgreSQL): its ID
    #: default takes the fence (:mod:`replicator.streams.fence`), and their
    #: rows are facts of the first writer (``writers[0]``).
    foreign_writers: bool = False

    @property
    def foreign_writer(self) -> str | None:
        """The writer whose facts plain-SQL rows are (None: none accepted)."""
        return self.writers[0] if self.foreign_writers else None

    @property
    def positions_key(self) -> str:
        """The ``stream_name`` of this stream's ``stream_positions`` rows."""
        return self.positions_name or self.name

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def owns_table(self) -> bool:
        """Whether the table is the replicator's: made by its writers
        (``create``, no preset), with :data:`ROW_INDEX_COLUMN`.  A table
        with ``create: false`` or a preset's (Synapse's) is someone else's:
        the replicator adds no column to it."""
        return self.create and self.preset is None


@dataclass(frozen=True)
class DatabaseConfig:
    """Where the streams live: ``engine`` is ``sqlite`` or ``postgres``."""

    engine: str
    path: str | None = None  # sqlite
    dsn: str | None = None  # postgres
    pool_min: int = 1
    pool_max: int = 5
    write_group_max: int = 256  # facts per write transaction (group commit)
    #: Whether a start migrates an older schema (:mod:`replicator.storage.migrations`);
    #: false: the start refuses and ``replicator migrate`` does it.
    auto_migrate: bool = True


@dataclass(frozen=True)
class RedisKeys:
    """``replication.redis.keys``: Ed25519 keys that sign and check the
    lines on our own Redis channels
    (:mod:`replicator.replication.transport.redis_signing`).  Paths only:
    the files are read by :func:`.validate.validate` and by the link."""

    #: This instance's private key (PEM, PKCS#8), which signs what it publishes.
    private_key: str
    #: (instance name, path of its public key, PEM) of every other instance.
    public_keys: tuple[tuple[str, str], ...] = ()
    #: During a rolling upgrade: take unsigned lines too (counted).
    accept_unsigned: bool = False


@dataclass(frozen=True)
class RedisConfig:
    """Replication through Redis pub/sub instead of (or beside) TCP.

    Either ``endpoint`` (a client endpoint string: ``tcp:``, ``tls:``,
    ``unix:``) or ``sentinels`` (``(host, port)`` pairs) with
    ``master_name``: the master Sentinel names, found again after a
    failover (:mod:`replicator.replication.transport.redis_sentinel`)."""

    endpoint: str | None
    password: str | None = None
    dbid: int | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    master_name: str | None = None
    #: One of REDIS_CHANNELS: every line on one channel, or a channel per stream.
    channels: str = "single"
    #: A Redis cluster's seed nodes (sharded pub/sub; ``endpoint`` is the first).
    cluster: tuple[str, ...] = ()
    #: Lines on our own channels signed and checked; None: trusted by design.
    keys: RedisKeys | None = None

    @property
    def where(self) -> str:
        """Where the links go, for log lines and ``/health``."""
        if self.endpoint is not None:
            return self.endpoint
        return f"master {self.master_name} (Sentinel)"


@dataclass(frozen=True)
class WriterSecret:
    """A remote writer that must prove its NAME to this listener
    (``replication.writer_secrets``); ``secret`` is None until validate()
    has read ``secret_file``."""

    name: str
    secret_file: str
    secret: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ReplicationConfig:
    """How this instance joins replication.

    ``listen``: endpoint string the master accepts workers on.
    ``upstream``: endpoint string a worker connects to.
    """

    listen: str | None = None
    upstream: str | None = None
    redis: RedisConfig | None = None
    client_ca: str | None = None  # ssl: listener: require client certs from this CA
    ping_interval: float = 5.0
    ping_timeout: float = 15.0
    max_queued_lines: int = 10_000
    max_queued_bytes: int = 16 * 1024 * 1024
    max_line_length: int = 16_384
    idle_timeout: float = 60.0
    max_connections: int = 256  # identified peers the config does not name
    max_connections_per_address: int = 32  # of those, from one address
    max_unidentified: int = 64  # connections that have not sent NAME yet
    identify_timeout: float = 10.0  # seconds a connection has to send NAME
    reconnect_initial_delay: float = RECONNECT_INITIAL_DELAY
    reconnect_max_delay: float = RECONNECT_MAX_DELAY
    fetch_limit: int = 1000
    fanout_interval: float = 0.003
    max_batch_rows: int = 10_000  # rows of one fact received as a batch
    max_batch_bytes: int = 16 << 20  # bytes of a writer's partial batches (4x once decoded)
    # The delivery audit (docs/streams.md), and the seconds from a delivered
    # range's seal to its second, last check.
    audit: bool = True
    audit_recheck: float = 300.0
    # Who may connect (README, "Security model"); None: anyone.
    allowed_peers: tuple[str, ...] | None = None
    allowed_networks: tuple[str, ...] | None = None
    # A listener beyond loopback without client_ca or allowed_networks starts
    # only with this (README, "Security model").
    insecure_public_listener: bool = False
    # Bounds of the USER_SYNC / USER_IP / FEDERATION_ACK bookkeeping.
    max_user_syncs: int = 50_000
    max_user_ips: int = 20_000
    max_federation_acks: int = 1_000
    bookkeeping_max_age: float = 86_400.0
    # Proof of a writer's NAME (docs/protocol.md): on a listener, the remote
    # writers that must prove theirs; on a worker, its own secret's file
    # (``secret`` is None until validate() has read it).
    writer_secrets: tuple[WriterSecret, ...] = ()
    secret_file: str | None = None
    secret: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ReaderConfig:
    """One credential of the read API (``http.readers[]``): ``streams`` it
    may read (``("*",)``: every stream).  With ``secret_file``, ``secret``
    is None until validate() has read it."""

    name: str
    secret_file: str
    streams: tuple[str, ...]
    secret: str | None = field(default=None, repr=False)

    def covers(self, stream: str) -> bool:
        return "*" in self.streams or stream in self.streams


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP API: write facts, positions, health, metrics."""

    listen: str | None = None
    # With secret_file, None until validate() has read it.
    secret: str | None = field(default=None, repr=False)
    metrics_listen: str | None = None  # host:port served from its own thread
    secret_file: str | None = None  # the file validate() reads the secret from
    # A request's headers must arrive within header_timeout seconds of its
    # first byte (or of the connection opening), its body within
    # body_timeout of its headers; at most max_connections at once.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 256
    max_connections_per_address: int = 64
    # Beyond max_connections, from any address: connections for /health
    # (one request each) and for requests with the secret (replicator.http.slots).
    reserved_for_health: int = 4
    reserved_for_writers: int = 16
    # The read API (docs/read-api.md): credentials, and how many long-polls
    # and event streams may be open at once (all, and from one address).
    readers: tuple[ReaderConfig, ...] = ()
    max_waiting_reads: int = 128
    max_waiting_reads_per_address: int = 32
    heartbeat_interval: float = 15.0
    # A page of the read API ends at the fact whose JSON reaches this.
    max_page_bytes: int = 4 * 1024 * 1024
    # Seconds a Durable Streams long-poll waits by default (its 204 then).
    ds_long_poll: float = 20.0
    # How long a write's Idempotency-Key is answered with its first
    # fact's ID (replicator.streams.idempotency), in seconds.
    idempotency_window: float = 86_400.0


@dataclass(frozen=True)
class HealthConfig:
    """What ``/health`` tolerates: a lag, an unreceived committed fact or a
    writer never heard of is a problem once it has lasted ``lag_grace``
    seconds; the database is asked for unreceived facts every
    ``check_interval`` seconds."""

    lag_grace: float = 10.0
    check_interval: float = 5.0


@dataclass(frozen=True)
class ConsumerConfig:
    """One consumer: ``type`` is a built-in name, an entry point name of the
    ``replicator.consumers`` group, or a dotted path ``package.module:Class``."""

    type: str
    streams: tuple[str, ...] | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SynapseConfig:
    """A Synapse shares this deployment (README, "Beside Synapse").

    ``server_name``: Synapse's; its Redis channel is ``<server_name>``.
    ``database``/``redis``: its database DSN and Redis endpoint, the
    defaults of ``database.postgres`` and ``replication.redis``.
    """

    server_name: str
    database: str | None = None
    redis: str | None = None


@dataclass(frozen=True)
class InstanceConfig:
    """Everything one instance needs, validated."""

    server_name: str
    instance_name: str
    database: DatabaseConfig
    streams: tuple[StreamConfig, ...]
    replication: ReplicationConfig
    http: HttpConfig
    consumers: tuple[ConsumerConfig, ...] = ()
    log_level: str = "info"
    log_format: str = "text"
    health: HealthConfig = HealthConfig()
    path: str | None = None
    synapse: SynapseConfig | None = None
    #: The file holding the running daemon's PID (locked while it runs):
    #: how ``replicator reopen`` finds it (:mod:`replicator.daemon.pidfile`).
    pid_file: str | None = None
