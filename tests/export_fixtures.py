"""What the exporter's tests share: the streams they export
(:data:`STREAMS`), the run's clock (:data:`RUN1_MS`, :func:`run1`),
deterministic facts (:class:`Generator`) and their insertion, the
positions' table (:func:`set_positions`, :func:`sqlite_with_positions`),
one SparkSession for the whole test run (:func:`shared_spark`) and an
export on it (:func:`export`).  Test modules take them from here, never
from one another."""

import random

from tests.servers import unavailable

BASE_MS = 1709337000000  # 2024-03-01T23:50:00Z: the facts cross midnight
RUN1_MS = 1709380810000  # 2024-03-02T12:00:10Z


STREAMS = [
    {"name": "events", "table": "ev", "writers": ["w1", "w2"],
     "columns": [{"body": "text"}, {"ts": "bigint?"}], "timestamp_column": "ts"},
    {"name": "receipts/v2", "table": "rc", "writer_column": None, "writers": ["main"],
     "columns": [{"data": "json"}]},
]

_spark = None


def shared_spark():
    """The test run's SparkSession, with both Debian JDBC drivers on it."""
    global _spark
    if _spark is None:
        try:
            import pyspark  # noqa: F401
        except ImportError:
            unavailable("pyspark is not installed (pip install -e '.[spark]')")
        from replicator.export.source import SourceError, find_jdbc_jar
        from replicator.export.spark import spark_session

        try:
            jars = [find_jdbc_jar("postgres"), find_jdbc_jar("sqlite")]
        except SourceError as e:
            unavailable(str(e))
        _spark = spark_session("local[2]", jars, shuffle_partitions=4)
        _spark.conf.set("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
    return _spark


def export(db, configs, out, spark=None, **kw):
    from replicator.export.job import run_export
    from replicator.export.options import ExportOptions

    kw.setdefault("partitions", 3)
    kw.setdefault("shuffle_partitions", 4)
    kw.setdefault("progress_interval", 0)
    return run_export(db, configs, ExportOptions(output=out, **kw),
                      spark=spark or shared_spark())


def run1(_id):
    return RUN1_MS


class Generator:
    """Deterministic stream rows: gaps, multi-row facts, writers, timestamps."""

    SIZES = [1] * 80 + [2] * 6 + [3, 4, 5, 7, 8, 9, 12, 16, 17, 20]

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.t = BASE_MS

    def facts(self, first, last, writers, gap=0.06, null_ts=0.02):
        """[(id, writer, [ts, ...])] for IDs first..last, some rolled back."""
        out = []
        for id_ in range(first, last + 1):
            if self.rng.random() < gap:
                continue
            self.t += self.rng.randint(0, 1400)
            when = self.t - 7000 if self.rng.random() < 0.03 else self.t
            n = self.rng.choice(self.SIZES)
            stamps = [None if self.rng.random() < null_ts else when + k for k in range(n)]
            out.append((id_, self.rng.choice(writers), stamps))
        return out


def insert_events(cur, facts):
    from psycopg2.extras import execute_values

    rows = [(i, w, f"body {i}/{k}", ts) for i, w, stamps in facts for k, ts in enumerate(stamps)]
    execute_values(cur, "INSERT INTO ev (stream_id, instance_name, body, ts) VALUES %s", rows)


def set_positions(cur, stream, **positions):
    for writer, pos in positions.items():
        cur.execute(
            "INSERT INTO stream_positions VALUES (%s, %s, %s) ON CONFLICT (stream_name, "
            "instance_name) DO UPDATE SET stream_id = excluded.stream_id", (stream, writer, pos))


def sqlite_with_positions(path):
    """A new SQLite database at ``path`` with the ``stream_positions`` table."""
    import sqlite3

    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE stream_positions (stream_name TEXT NOT NULL, instance_name "
                 "TEXT NOT NULL, stream_id BIGINT NOT NULL, PRIMARY KEY (stream_name, "
                 "instance_name))")
    return conn
