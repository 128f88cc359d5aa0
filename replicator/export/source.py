"""Where the exporter's rows come from: JDBC for the bulk, DB-API for bounds.

The facts of a stream's backing table are read by Spark's JDBC source in
``numPartitions`` parallel range partitions over the ID column, always through
a subquery bounded to ``[floor, upper]`` (Spark's partition predicates alone do
not bound the first and last partition) that groups the rows per ID in the
database, so the rows never cross to Spark.  Every read yields exactly four
columns, whatever the table looks like:

* ``id``      -- the stream ID (bigint);
* ``nrows``   -- how many rows the fact has (bigint);
* ``writer``  -- the smallest writer value of its rows in byte-wise order
  (string; the stream's only writer when the table has no writer column);
* ``rowtime`` -- the smallest non-NULL timestamp of its rows, milliseconds
  since the epoch (bigint; NULL for a stream without a timestamp column or
  a fact whose timestamps are all NULL).

The small queries (persisted positions, ID bounds, the first ID at or after a
time) run on the driver through psycopg2 / sqlite3: they return one row and
need no Spark job.

JDBC drivers are Debian's (``libpostgresql-jdbc-java``,
``libxerial-sqlite-jdbc-java``), found under ``/usr/share/java`` at run time;
``--jdbc-jar`` or ``REPLICATOR_JDBC_JAR`` override the search.
"""

import glob
import os
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Protocol,
    TypeVar,
)
from urllib.parse import quote

from ..config import DatabaseConfig, StreamConfig
from ..streams.trimmed import boundary_key

if TYPE_CHECKING:  # PySpark is the exporter's extra, imported when a run starts
    from psycopg2.extensions import connection as PostgresConnection
    from pyspark.sql import DataFrame, SparkSession

T = TypeVar("T")
#: One row of a query's result, as the DB-API gives it.
Row = tuple[Any, ...]


class _Cursor(Protocol):
    """What :class:`Metadata` uses of a DB-API cursor (sqlite3's, psycopg2's)."""

    def execute(self, sql: str, args: Sequence[Any], /) -> object: ...

    def fetchone(self) -> Row | None: ...

    def fetchall(self) -> list[Row]: ...

    def close(self) -> None: ...


def sqlite_path(db: DatabaseConfig) -> str:
    """The absolute path of ``db``'s SQLite file, which must exist."""
    assert db.path is not None, "validated: an sqlite database has a path"
    path = os.path.abspath(db.path)
    if not os.path.exists(path):
        raise SourceError(f"database.sqlite: {path} does not exist")
    return path

#: Smaller than every stream ID: the exclusive lower bound of a first export.
MIN_TOKEN = -(2 ** 63)

JAR_CANDIDATES = {
    "postgres": ("/usr/share/java/postgresql.jar", "/usr/share/java/postgresql-*.jar"),
    "sqlite": ("/usr/share/java/sqlite-jdbc.jar", "/usr/share/java/xerial-sqlite-jdbc.jar",
               "/usr/share/java/xerial-sqlite-jdbc-*.jar", "/usr/share/java/sqlite-jdbc-*.jar"),
}
JAR_PACKAGES = {"postgres": "libpostgresql-jdbc-java", "sqlite": "libxerial-sqlite-jdbc-java"}
DRIVERS = {"postgres": "org.postgresql.Driver", "sqlite": "org.sqlite.JDBC"}


class SourceError(RuntimeError):
    """The source cannot be read as configured (driver, DSN, tables): one line."""


class TrimmedError(SourceError):
    """Facts a run needs were trimmed by retention before it read them (a
    gap): the run commits nothing, one line naming the range and what
    accepts it."""


# ------------------------------------------------------------------ drivers
def find_jdbc_jar(engine: str, override: str | None = None) -> str:
    """The path of the JDBC driver jar for ``engine``; SourceError if none.

    ``override`` (``--jdbc-jar``) or ``$REPLICATOR_JDBC_JAR`` wins when given;
    it must exist.
    """
    override = override or os.environ.get("REPLICATOR_JDBC_JAR")
    if override:
        if not os.path.isfile(override):
            raise SourceError(f"JDBC driver jar {override} does not exist")
        return override
    for pattern in JAR_CANDIDATES[engine]:
        for path in sorted(glob.glob(pattern)):
            if os.path.isfile(path):
                return os.path.realpath(path)
    raise SourceError(
        f"no {engine} JDBC driver found in /usr/share/java: install the Debian package "
        f"{JAR_PACKAGES[engine]} (make test / make run do) or give --jdbc-jar PATH"
    )


@dataclass(frozen=True)
class JdbcTarget:
    """A JDBC URL plus the connection properties Spark passes to the driver,
    and the engine (``sqlite``/``postgres``) behind it."""

    url: str
    properties: dict[str, str]
    engine: str


def parse_dsn(dsn: str) -> dict[str, str]:
    """libpq key/value DSN or postgresql:// URI -> its keywords."""
    from psycopg2.extensions import parse_dsn as _parse

    try:
        return dict(_parse(dsn))
    except Exception as e:  # psycopg2.ProgrammingError
        raise SourceError(f"database.postgres: not a valid DSN: {str(e).strip()}") from None


def jdbc_target(db: DatabaseConfig) -> JdbcTarget:
    """How Spark's JDBC source reaches ``db``."""
    if db.engine == "sqlite":
        path = sqlite_path(db)
        return JdbcTarget(f"jdbc:sqlite:{path}", {"driver": DRIVERS["sqlite"]}, "sqlite")
    assert db.dsn is not None, "validated: a postgres database has a DSN"
    params = parse_dsn(db.dsn)
    host = params.get("host") or params.get("hostaddr") or "localhost"
    if "," in host:
        host = host.split(",")[0]
    if host.startswith("/"):
        raise SourceError(
            "database.postgres: the JDBC driver cannot use a Unix socket "
            f"(host={host}); give host=127.0.0.1 or a host name"
        )
    port = (params.get("port") or "5432").split(",")[0]
    user = params.get("user") or os.environ.get("PGUSER") or _login_name()
    dbname = params.get("dbname") or os.environ.get("PGDATABASE") or user
    host_part = f"[{host}]" if ":" in host else host
    url = f"jdbc:postgresql://{host_part}:{port}/{quote(dbname, safe='')}"
    props = {"driver": DRIVERS["postgres"], "user": user}
    password = params.get("password") or os.environ.get("PGPASSWORD")
    if password:
        props["password"] = password
    for key in ("sslmode", "sslrootcert", "sslcert", "sslkey", "application_name"):
        if params.get(key):
            props[key] = params[key]
    props.setdefault("ApplicationName", params.get("application_name") or "replicator-export")
    return JdbcTarget(url, props, "postgres")


def _login_name() -> str:
    import getpass

    return getpass.getuser()


# --------------------------------------------------------------- metadata
def linear_position(positions: dict[str, int], writers: Sequence[str]) -> int:
    """The stream's linear persisted position: the minimum over its writers.

    A configured writer with no row in ``stream_positions`` has persisted
    nothing we can trust, so it counts as 0 (and holds the stream there).
    Rows of instances that are not configured writers are ignored.
    """
    return min(positions.get(w, 0) for w in writers)


@dataclass(frozen=True)
class RangeBounds:
    """What the rows with ``lower < id <= upper`` look like (one query).

    ``min_id``/``max_id`` are None when the range holds no row; ``min_ts`` is
    the smallest non-NULL timestamp, ``has_null_ts`` whether some row lacks
    one (always true for a stream without a timestamp column).
    """

    min_id: int | None
    max_id: int | None
    min_ts: int | None
    has_null_ts: bool


class Metadata:
    """A plain DB-API connection for the exporter's one-row queries.

    Opened read-only where the engine allows it; every query is its own
    short statement (autocommit), so nothing holds a snapshot or a lock.
    """

    def __init__(self, db: DatabaseConfig):
        self.engine = db.engine
        self.conn: sqlite3.Connection | PostgresConnection
        if db.engine == "sqlite":
            path = sqlite_path(db)
            self.conn = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True,
                                        isolation_level=None)
            self.conn.execute("PRAGMA busy_timeout=5000")
        else:
            import psycopg2

            try:
                conn = psycopg2.connect(db.dsn, application_name="replicator-export")
            except psycopg2.Error as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise SourceError(f"cannot connect to PostgreSQL: {first}") from None
            conn.autocommit = True
            self.conn = conn

    def close(self) -> None:
        self.conn.close()

    def _query(self, sql: str, args: Row, fetch: Callable[[_Cursor], T]) -> T:
        """``fetch(cursor)`` after running ``sql``; a failure is one SourceError line."""
        if self.engine == "sqlite":
            sql = sql.replace("%s", "?")
        cur: _Cursor = self.conn.cursor()
        try:
            cur.execute(sql, args)
            return fetch(cur)
        except Exception as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SourceError(f"query failed: {text}") from None
        finally:
            cur.close()

    def _first(self, sql: str, args: Row = ()) -> Row | None:
        return self._query(sql, args, lambda cur: cur.fetchone())

    def _one(self, sql: str, args: Row = ()) -> Row:
        """The row of an aggregate query (there is always one)."""
        row = self._first(sql, args)
        if row is None:
            raise SourceError(f"query returned no row: {sql}")
        return row

    def _all(self, sql: str, args: Row = ()) -> list[Row]:
        return self._query(sql, args, lambda cur: cur.fetchall())

    def positions(self, stream_name: str) -> dict[str, int]:
        """Persisted position of every instance listed for the stream."""
        rows = self._all(
            "SELECT instance_name, stream_id FROM stream_positions WHERE stream_name = %s",
            (stream_name,),
        )
        return {name: int(pos) for name, pos in rows}

    def trimmed_through(self, stream: StreamConfig) -> int:
        """The trim boundary of the stream's table (docs/streams.md, "The
        trim boundary"): every fact at or below it was deleted by retention;
        0 when nothing was (no ``stream_retention`` table or row, or
        Synapse's table)."""
        if stream.preset is not None:
            return 0
        if self.engine == "sqlite":
            exists = self._one("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND "
                               "name = 'stream_retention'")[0]
        else:
            exists = self._one("SELECT to_regclass('stream_retention') IS NOT NULL")[0]
        if not exists:
            return 0
        row = self._first("SELECT trimmed_through FROM stream_retention WHERE table_name = %s",
                          (boundary_key(stream),))
        return int(row[0]) if row is not None else 0

    def bounds(self, stream: StreamConfig, lower: int, upper: int) -> RangeBounds:
        """ID and timestamp bounds of the rows with ``lower < id <= upper``."""
        idc = stream.id_column
        if stream.timestamp_column:
            ts = stream.timestamp_column
            row = self._one(
                f"SELECT MIN({idc}), MAX({idc}), MIN({ts}), "
                f"MAX(CASE WHEN {ts} IS NULL THEN 1 ELSE 0 END) "
                f"FROM {stream.table} WHERE {idc} > %s AND {idc} <= %s",
                (lower, upper),
            )
            return RangeBounds(_int(row[0]), _int(row[1]), _int(row[2]), bool(row[3]))
        row = self._one(
            f"SELECT MIN({idc}), MAX({idc}) FROM {stream.table} "
            f"WHERE {idc} > %s AND {idc} <= %s",
            (lower, upper),
        )
        return RangeBounds(_int(row[0]), _int(row[1]), None, row[0] is not None)

    def max_id_below(self, stream: StreamConfig, floor: int, bound: int) -> int | None:
        """Largest ID in ``[floor, bound)`` (an index probe), None if none."""
        idc = stream.id_column
        row = self._one(
            f"SELECT MAX({idc}) FROM {stream.table} WHERE {idc} >= %s AND {idc} < %s",
            (floor, bound),
        )
        return _int(row[0])

    def first_id_at(self, stream: StreamConfig, lower: int, upper: int, ms: int,
                    null_counts: bool) -> int | None:
        """Smallest ID in ``(lower, upper]`` of a row timed at or after ``ms``.

        ``null_counts``: a row without a timestamp counts as timed after
        ``ms`` (its fact is timed by the export run, which is later).
        """
        idc, ts = stream.id_column, stream.timestamp_column
        cond = f"{ts} >= %s" + (f" OR {ts} IS NULL" if null_counts else "")
        row = self._one(
            f"SELECT MIN({idc}) FROM {stream.table} "
            f"WHERE {idc} > %s AND {idc} <= %s AND ({cond})",
            (lower, upper, ms),
        )
        return _int(row[0])


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


# --------------------------------------------------------------------- reads
#: How the database compares writer names inside MIN(): byte-wise, as Spark
#: and Python compare strings (a fact's writer is its smallest writer value,
#: whatever the database's or the column's collation).
BYTEWISE_COLLATION = {"postgres": 'COLLATE "C"', "sqlite": "COLLATE BINARY"}


def chunk_ranges(floor: int, upper: int, chunk_len: int) -> list[tuple[int, int]]:
    """The ID ranges ``[lo, hi]`` of the chunks ``0, 1, ...`` of ``[floor, upper]``
    (``[floor + k * chunk_len, floor + (k + 1) * chunk_len)``, see
    :func:`.aggregate.chunking`)."""
    out = []
    lo = floor
    while lo <= upper:
        out.append((lo, min(upper, lo + chunk_len - 1)))
        lo += chunk_len
    return out


def _time_sql(stream: StreamConfig, observed: Sequence[tuple[int, int, int]],
              default_ms: int) -> str:
    """A fact's time (:mod:`.reference`): its row time, else the export run
    that first exported it (``observed`` ``(lo, hi, ms)``: ``lo < id <= hi``;
    the first matching range wins; ``default_ms`` when none does)."""
    idc = stream.id_column
    run = "".join(f"WHEN {idc} > {int(lo)} AND {idc} <= {int(hi)} THEN {int(ms)} "
                  for lo, hi, ms in observed)
    run = f"CASE {run}ELSE {int(default_ms)} END" if run else str(int(default_ms))
    run = f"CAST({run} AS BIGINT)"
    if stream.timestamp_column:
        return f"COALESCE(MIN({stream.timestamp_column}), {run})"
    return run


def fact_query(stream: StreamConfig, engine: str, floor: int, upper: int, chunk_len: int,
               observed: Sequence[tuple[int, int, int]], default_ms: int) -> str:
    """The bounded subquery one stream's JDBC read runs, one ID chunk per
    partition (``WHERE chunk = k``).

    The database groups the rows per ID (see :mod:`.reference`'s facts):
    one row per fact with its row count, smallest writer (byte-wise), row
    time and time.  Each chunk is a ``UNION ALL`` arm of its own with the
    chunk number as a constant, so a partition's predicate leaves only its
    arm to run (PostgreSQL prunes the others; an engine that does not still
    returns the right rows), and each arm reads one ID range through the
    index.  Within its chunk an arm also finds, in ID order, the previous
    fact (``chunk_prev_id``) and the previous fact of the same writer and
    UTC day (``day_prev_id``, ``day_prev_rowtime``): the two lags of the
    aggregation, patched at chunk starts by :mod:`.aggregate`.
    """
    idc = stream.id_column
    cols = [f"{idc} AS id", "COUNT(*) AS nrows"]
    if stream.writer_column:
        cols.append(f"MIN({stream.writer_column} {BYTEWISE_COLLATION[engine]}) AS writer")
    else:
        cols.append("CAST(NULL AS VARCHAR(1)) AS writer")
    if stream.timestamp_column:
        cols.append(f"MIN({stream.timestamp_column}) AS rowtime")
    else:
        cols.append("CAST(NULL AS BIGINT) AS rowtime")
    cols.append(f"{_time_sql(stream, observed, default_ms)} AS time_ms")
    day = "(g.time_ms - (((g.time_ms % 86400000) + 86400000) % 86400000)) / 86400000"
    by_day = f"PARTITION BY g.writer, {day} ORDER BY g.id"
    arms = []
    for k, (lo, hi) in enumerate(chunk_ranges(floor, upper, chunk_len)):
        # Nested so that the chunk constant is outside the window functions
        # (a predicate on it prunes the arm), and the ID-order lag runs on
        # the GROUP BY's output order before the one sort by writer and day.
        arms.append(
            f"SELECT {k} AS chunk, d.* FROM ("
            f"SELECT g.*, LAG(g.id) OVER ({by_day}) AS day_prev_id, "
            f"LAG(g.rowtime) OVER ({by_day}) AS day_prev_rowtime FROM ("
            f"SELECT f.*, LAG(f.id) OVER (ORDER BY f.id) AS chunk_prev_id FROM ("
            f"SELECT {', '.join(cols)} FROM {stream.table} "
            f"WHERE {idc} >= {int(lo)} AND {idc} <= {int(hi)} GROUP BY {idc}"
            f") AS f) AS g) AS d"
        )
    return f"({' UNION ALL '.join(arms)}) AS export_facts"


#: The columns of a read (:func:`read_facts`).
FACT_SCHEMA = ("chunk INT, id BIGINT, nrows BIGINT, writer STRING, rowtime BIGINT, "
               "time_ms BIGINT, chunk_prev_id BIGINT, day_prev_id BIGINT, "
               "day_prev_rowtime BIGINT")


#: ``work_mem`` of the export's PostgreSQL sessions.
SORT_MEMORY = "64MB"


def read_facts(spark: "SparkSession", target: JdbcTarget, stream: StreamConfig, floor: int,
               upper: int, chunk_len: int, observed: Sequence[tuple[int, int, int]],
               default_ms: int, fetch_size: int = 10000) -> "DataFrame":
    """DataFrame of the facts with ``floor <= id <= upper``, one row each, in
    one partition per ID chunk (:func:`fact_query`; columns :data:`FACT_SCHEMA`).
    """
    from pyspark.sql import functions as F

    chunks = len(chunk_ranges(floor, upper, chunk_len))
    props = dict(target.properties)
    props.update(customSchema=FACT_SCHEMA, fetchsize=str(fetch_size))
    if target.engine == "postgres":
        # Each chunk's sort by (writer, day, ID) spilled to disk at the
        # default 4 MB (23 MB for 500,000 rows: 2.1-2.5 s a chunk, 1.7 s
        # in memory).  Per export connection, one per running task.
        props["sessionInitStatement"] = f"SET work_mem = '{SORT_MEMORY}'"
    df = spark.read.jdbc(
        target.url, fact_query(stream, target.engine, floor, upper, chunk_len, observed,
                               default_ms),
        predicates=[f"chunk = {k}" for k in range(chunks)], properties=props)
    if not stream.writer_column:
        df = df.withColumn("writer", F.lit(stream.writers[0]))
    return df
