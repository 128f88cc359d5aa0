"""The SparkSession an export runs on, and its progress lines.

Settings come in two kinds:

* **session settings** (master, ``spark.jars``, the UI, the output
  committer) only take effect when the session is created:
  :func:`spark_session` gives them to the builder;
* **run settings** (:func:`run_settings`: UTC session time zone, shuffle
  partitions, Parquet timestamp type) are SQL runtime settings the
  aggregation depends on: :func:`configure` sets them once per run, on a
  session we started (right after it starts, after any ``--conf``, so the
  run's own values win) or on one we were given (a test's, a notebook's).
"""

import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from ..config import DatabaseConfig
from .options import ExportOptions
from .source import find_jdbc_jar

if TYPE_CHECKING:  # PySpark is the exporter's extra, imported when a run starts
    from pyspark.sql import SparkSession

log = logging.getLogger("replicator.export")


def run_settings(shuffle_partitions: int) -> dict[str, str]:
    """The SQL runtime settings every export run needs."""
    return {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    }


def configure(spark: "SparkSession", shuffle_partitions: int) -> None:
    """Apply :func:`run_settings` to ``spark``."""
    for key, value in run_settings(shuffle_partitions).items():
        spark.conf.set(key, value)


def is_local(master: str | None, submitted: bool = False) -> bool:
    """Whether the run's Spark is in this process (``local[...]``, or no
    master outside ``spark-submit``): its driver then listens on loopback
    unless ``SPARK_LOCAL_IP`` says otherwise.  On a cluster the executors
    connect back to the driver, so its address is left to Spark (the host
    name's address) or to ``SPARK_LOCAL_IP``."""
    if master is None:
        return not submitted
    return master == "local" or master.startswith("local[")


def spark_session(master: str | None, jars: Sequence[str], shuffle_partitions: int = 8,
                  extra_conf: dict[str, str] | None = None) -> "SparkSession":
    """The SparkSession of this process (created if needed), configured for a run.

    ``master`` None leaves the master to ``spark-submit`` when launched by
    it, else ``local[*]``.  The JDBC jars go on ``spark.jars``: the
    executors of a cluster (``spark://...``) fetch them from the driver
    (under ``spark-submit``, give them to ``--jars``).
    ``extra_conf`` (``--conf``) goes to the builder; the run settings are
    applied after it.
    """
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    if is_local(master, submitted):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("replicator-export")
    if master:
        builder = builder.master(master)
    elif not submitted:
        builder = builder.master("local[*]")
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    if not submitted:
        builder = builder.config("spark.ui.enabled", "false")
    builder = (
        builder.config("spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    for key, value in (extra_conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    configure(spark, shuffle_partitions)
    return spark


class RunSession:
    """The SparkSession of one run: the caller's (or the process's active
    one), configured once for the run; or one started on first need with the
    run's options, and stopped at the end."""

    def __init__(self, spark: Optional["SparkSession"], db: DatabaseConfig,
                 options: ExportOptions) -> None:
        self.spark = spark
        self.db = db
        self.options = options
        self.own = False
        self._configured = False

    def get(self) -> "SparkSession":
        if self.spark is None:
            from pyspark.sql import SparkSession

            self.spark = SparkSession.getActiveSession()  # e.g. a test's, a notebook's
        if self.spark is None:
            jar = find_jdbc_jar(self.db.engine, self.options.jdbc_jar)
            log.info("starting Spark (%s)", self.options.master or "local[*]")
            self.spark = spark_session(self.options.master, [jar],
                                       self.options.shuffle_partitions, self.options.spark_conf)
            self.own = self._configured = True
        spark: SparkSession = self.spark
        if not self._configured:
            configure(spark, self.options.shuffle_partitions)
            self._configured = True
        return spark

    def stop(self) -> None:
        if self.own and self.spark is not None:
            self.spark.stop()
            self.spark = None


class Progress:
    """Prints the running Spark stages of the current stream every few seconds."""

    def __init__(self, spark: "SparkSession", interval: float) -> None:
        self.sc = spark.sparkContext
        self.interval = interval
        self.stream = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: str | None = None

    def start(self) -> "Progress":
        if self.interval > 0:
            thread = self._thread = threading.Thread(target=self._run, name="export-progress",
                                                     daemon=True)
            thread.start()
        return self

    def _run(self) -> None:
        tracker = self.sc.statusTracker()
        while not self._stop.wait(self.interval):
            try:
                parts = []
                for sid in sorted(tracker.getActiveStageIds()):
                    info = tracker.getStageInfo(sid)
                    if info is not None:
                        parts.append(f"stage {sid} {info.numCompletedTasks}/{info.numTasks}")
            except Exception:  # the context is stopping
                return
            line = ", ".join(parts)
            if line and line != self._last:
                log.info("[%s] %s tasks done", self.stream, line)
            self._last = line

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
