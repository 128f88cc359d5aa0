"""``replicator-export --master spark://...`` on a standalone Spark cluster.

A Spark master and two workers (one core, 1 GB each) run on loopback,
started by the steps of docs/operations.md ("Spark cluster") as written
(:mod:`tests.spark_cluster`); the export is that page's ``spark-export``
step.  The same PostgreSQL stream is exported once with ``local[*]`` and
once on the cluster, each by the CLI in a process of its own (a process
holds one SparkContext), and:

* the executors on both workers ran tasks, the JDBC reads among them (the
  executors' logs), and each fetched the JDBC driver jar from the driver
  (``spark.jars``);
* the two outputs are the same: the same generation, the same state (but
  its time stamps), the same Parquet files (data pages byte for byte,
  footers as read: :func:`parquet_content`; not their names, which hold a
  job's random ID), and the rows the plain-Python reference computes;
* the executors need no Python: the cluster's export is run with
  ``PYSPARK_PYTHON`` pointing at a program that is not Python.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml
from twisted.trial.unittest import TestCase

from replicator.config import parse_streams
from replicator.export.reference import Aggregator
from tests.export_fixtures import STREAMS, Generator, insert_events, set_positions
from tests.servers import PostgresServer, unavailable
from tests.spark_cluster import SparkCluster, export_command

#: The stream: timestamped facts only (no fact is timed by the run, so two
#: runs at different times write the same rows).
STREAM = STREAMS[0]
POSITION = 3000


def parquet_content(path: str):
    """A Parquet file as (its data pages' bytes, its footer as pyarrow reads
    it, its key/value metadata).  The footer's bytes are not compared: the
    writer lists a column's encodings in the order of a hash set, which
    changes from one JVM to the next (the set does not)."""
    import pyarrow.parquet as pq

    with open(path, "rb") as f:
        data = f.read()
    footer = int.from_bytes(data[-8:-4], "little")
    meta = pq.read_metadata(path)
    described = meta.to_dict()
    for group in described["row_groups"]:
        for column in group["columns"]:
            column["encodings"] = sorted(column["encodings"])
    return data[:len(data) - 8 - footer], described, meta.metadata


def parquet_files(root: str):
    """{directory relative to ``root``: [:func:`parquet_content` of each
    Parquet file in it]} (file names hold a job's random ID)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        parts = sorted(f for f in files if f.endswith(".parquet"))
        if parts:
            out[os.path.relpath(dirpath, root)] = sorted(
                (parquet_content(os.path.join(dirpath, name)) for name in parts),
                key=lambda content: content[0])
    return out


def state_without_times(root: str) -> dict:
    import json

    with open(os.path.join(root, "state.json")) as f:
        state = json.load(f)
    for st in state.get("streams", {}).values():
        st.pop("updated_at", None)
    return state


class SparkClusterExportTests(TestCase):
    timeout = 600

    def setUp(self):
        try:
            import pyarrow  # noqa: F401
            import pyspark  # noqa: F401
        except ImportError as e:
            unavailable(f"{e.name} is not installed (pip install -e '.[spark]')")
        self.pg = PostgresServer.shared()
        self.dsn = self.pg.create_database("export_cluster")
        import psycopg2

        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        self.addCleanup(conn.close)
        cur = conn.cursor()
        cur.execute("CREATE TABLE stream_positions (stream_name TEXT NOT NULL, "
                    "instance_name TEXT NOT NULL, stream_id BIGINT NOT NULL, "
                    "PRIMARY KEY (stream_name, instance_name))")
        cur.execute("CREATE TABLE ev (stream_id BIGINT NOT NULL, instance_name TEXT "
                    "NOT NULL, body TEXT NOT NULL, ts BIGINT)")
        cur.execute("CREATE INDEX ev_id ON ev (stream_id)")
        self.facts = Generator(11).facts(1, POSITION + 200, ["w1", "w2"], null_ts=0)
        insert_events(cur, self.facts)
        set_positions(cur, "events", w1=POSITION, w2=POSITION + 100)
        self.tmp = tempfile.mkdtemp(prefix="export-cluster-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.conf = os.path.join(self.tmp, "export.yaml")
        with open(self.conf, "w") as f:
            yaml.safe_dump({"database": {"postgres": self.dsn}, "streams": [STREAM]}, f)

    def run_cli(self, script: str, **env_vars: str) -> str:
        env = dict(os.environ, **env_vars)
        env.pop("PYSPARK_GATEWAY_PORT", None)
        env.pop("SPARK_LOCAL_IP", None)  # the step sets it
        proc = subprocess.run(["bash", "-e", "-c", script], env=env, capture_output=True,
                              text=True, timeout=400)
        self.assertEqual(proc.returncode, 0, f"{script}\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout + proc.stderr

    def test_cluster_export_is_local_export(self):
        local_out = os.path.join(self.tmp, "local")
        self.run_cli(f"{sys.prefix}/bin/replicator-export -c {self.conf} -o {local_out} "
                     "--master 'local[*]' -q")

        cluster = SparkCluster(workers=2, cores=1, memory="1g")
        self.addCleanup(cluster.stop)
        cluster_out = os.path.join(self.tmp, "cluster")
        # The executors need no Python: the job runs no Python task.
        self.run_cli(export_command(cluster.url, self.conf, cluster_out),
                     PYSPARK_PYTHON="/bin/false")

        # The application ran its tasks on both workers' executors, the JDBC
        # reads included, each executor with the driver jar from spark.jars.
        apps = cluster.status().get("completedapps", [])
        self.assertEqual([a["name"] for a in apps], ["replicator-export"])
        workers = cluster.executor_logs(apps[0]["id"])
        self.assertEqual(len(workers), 2)
        jdbc_tasks = 0
        for logs in workers:
            self.assertTrue(logs, "an executor on every worker")
            text = "\n".join(logs)  # (an executor replaced under load: its successor's too)
            self.assertRegex(text, r"Fetching spark://[^/\s]+/jars/postgresql[^/\s]*\.jar")
            self.assertRegex(text, r"Running task \d+\.\d+ in stage")
            jdbc_tasks += len(re.findall(r"JDBCRDD: closed connection", text))
        self.assertGreaterEqual(jdbc_tasks, 4, "the executors read the 4 JDBC partitions")

        # The same output: the same data pages, byte for byte, and the same
        # footers (but the order of a set in them).
        local_cur = os.path.realpath(os.path.join(local_out, "current"))
        cluster_cur = os.path.realpath(os.path.join(cluster_out, "current"))
        self.assertEqual(os.path.basename(local_cur), os.path.basename(cluster_cur))
        self.assertEqual(state_without_times(local_cur), state_without_times(cluster_cur))
        got, want = parquet_files(cluster_cur), parquet_files(local_cur)
        self.assertEqual(sorted(got), sorted(want))
        self.assertTrue(any(d.startswith("minute/stream=events/date=") for d in got), got)
        for directory in want:
            self.assertEqual(got[directory], want[directory], f"{directory} differs")

        # And the rows are the reference's.
        import pyarrow.dataset as ds

        stream = parse_streams([STREAM])[0]
        agg = Aggregator(len(stream.writers), True)
        agg.feed([(i, w, ts) for i, w, stamps in self.facts if i <= POSITION for ts in stamps])
        want_minutes = {(w, b): v["facts"] for (g, w, b), v in agg.result().items()
                        if g == "minute"}
        table = ds.dataset(os.path.join(cluster_cur, "minute"), partitioning="hive").to_table()
        got_minutes = {}
        for row in table.to_pylist():
            got_minutes[(row["writer"], int(row["bucket_start"].timestamp() * 1000))] = \
                row["facts"]
        self.assertEqual(got_minutes, want_minutes)


class LocalAddressTests(TestCase):
    def test_only_a_local_driver_defaults_to_loopback(self):
        """A driver in local mode listens on loopback; on a cluster the
        executors connect back to it, so its address is left to Spark."""
        from replicator.export.spark import is_local

        self.assertTrue(is_local(None))
        self.assertTrue(is_local("local[*]"))
        self.assertTrue(is_local("local"))
        self.assertFalse(is_local("spark://10.0.0.5:7077"))
        self.assertFalse(is_local(None, submitted=True))  # spark-submit's master
