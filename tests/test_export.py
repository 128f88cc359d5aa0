"""The Spark exporter on a real PostgreSQL (and SQLite), against plain Python.

Every export here is compared, bucket by bucket and metric by metric, with
:mod:`replicator.export.reference` fed the same rows by psycopg2 in ID order
-- the rows at or below the linear persisted position, nothing else.  The
generated streams have multi-row facts (up to 20 rows), rollbacks (gaps in
the sequence, some of them real ROLLBACKs), two writers, facts across
midnight, NULL timestamps, a late fact landing on an exported date, and one
ID reserved by a transaction that is still open while the export runs.

One SparkSession (``local[2]``) is shared by the module: the JVM takes
seconds to start.  The killed-run test starts the CLI in a process of its
own and SIGKILLs it in the middle of writing.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from twisted.trial.unittest import TestCase

from replicator.config import parse_database, parse_streams
from replicator.export.reference import GRANULARITIES, Aggregator
from replicator.export.state import OutputStore, escape_partition_value
from tests.export_fixtures import (
    BASE_MS,
    RUN1_MS,
    STREAMS,
    Generator,
    export,
    insert_events,
    run1,
    set_positions,
    shared_spark,
    sqlite_with_positions,
)
from tests.servers import PostgresServer, unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN2_MS = RUN1_MS + 20_000  # same minute: the receipts bucket is merged


METRICS = ("facts", "rows", "multi_row_facts", "max_fact_rows", "size_1", "size_2",
           "size_3_4", "size_5_8", "size_9_16", "size_17_up", "rollbacks", "first_token",
           "last_token", "facts_per_s", "rows_per_s", "gap_ms_p50", "gap_ms_p95",
           "gap_ms_p99", "date")


#: Runs the exporter's CLI (arguments after ``-c``), stopping the process with
#: SIGSTOP once its first partition is written.
STOP_AFTER_FIRST_PARTITION = """
import os, signal, sys
from replicator.export import aggregate
real = aggregate.write_partitions
def write_then_stop(df, path):
    real(df, path)
    os.kill(os.getpid(), signal.SIGSTOP)
aggregate.write_partitions = write_then_stop
from replicator.export.cli import main
sys.argv[0] = "replicator-export"
sys.exit(main())
"""


def _process_state(pid):
    """The state letter of a process (``T`` when stopped), or None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def read_export(out):
    """{(stream, granularity, writer, bucket_ms): {metric: value}} of ``current``."""
    from pyspark.sql import functions as F

    spark = shared_spark()
    result = {}
    for granularity in GRANULARITIES:
        path = os.path.join(out, "current", granularity)
        if not any(e.startswith("stream=") for e in os.listdir(path)):
            continue
        df = spark.read.option("basePath", path).parquet(path)
        for r in df.withColumn("bucket_ms", F.unix_millis("bucket_start")).collect():
            d = r.asDict()
            key = (d["stream"], granularity, d["writer"], d["bucket_ms"])
            assert key not in result, f"bucket exported twice: {key}"
            result[key] = {m: (str(d[m]) if m == "date" else d[m]) for m in METRICS}
    return result


def run2_after(token):
    """Facts without a row time: timed by run 1 up to ``token``, then run 2."""
    return lambda i: RUN1_MS if i <= token else RUN2_MS


def reference(cur, stream, upper, observed=run1):
    """The reference aggregates of ``stream``'s rows with ID <= upper."""
    writer = stream.writer_column or f"'{stream.writers[0]}'"
    ts = stream.timestamp_column or "NULL::bigint"
    cur.execute(f"SELECT {stream.id_column}, {writer}, {ts} FROM {stream.table} "
                f"WHERE {stream.id_column} <= %s ORDER BY 1", (upper,))
    agg = Aggregator(len(stream.writers), stream.timestamp_column is not None, observed)
    agg.feed(cur.fetchall())
    return {(stream.name,) + key: value for key, value in agg.result().items()}


def insert_receipts(cur, facts):
    from psycopg2.extras import execute_values

    rows = [(i, f'{{"k": {k}}}') for i, _w, stamps in facts for k in range(len(stamps))]
    execute_values(cur, "INSERT INTO rc (stream_id, data) VALUES %s", rows)


def tree_inodes(path):
    out = {}
    for dirpath, _d, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            out[os.path.relpath(full, path)] = os.stat(full).st_ino
    return out


class ExportTestBase(TestCase):
    def setUp(self):
        self.spark = shared_spark()
        self.pg = PostgresServer.shared()
        self.dsn = self.pg.create_database("export")
        import psycopg2

        self.conn = psycopg2.connect(self.dsn)
        self.conn.autocommit = True
        self.addCleanup(self.conn.close)
        self.cur = self.conn.cursor()
        self.cur.execute("CREATE TABLE stream_positions (stream_name TEXT NOT NULL, "
                         "instance_name TEXT NOT NULL, stream_id BIGINT NOT NULL, "
                         "PRIMARY KEY (stream_name, instance_name))")
        self.cur.execute("CREATE SEQUENCE ev_seq")
        self.cur.execute("CREATE TABLE ev (stream_id BIGINT NOT NULL, instance_name TEXT "
                         "NOT NULL, body TEXT NOT NULL, ts BIGINT)")
        self.cur.execute("CREATE INDEX ev_id ON ev (stream_id)")
        self.cur.execute("CREATE SEQUENCE rc_seq")
        self.cur.execute("CREATE TABLE rc (stream_id BIGINT NOT NULL, data JSONB NOT NULL)")
        self.db = parse_database({"postgres": self.dsn})
        self.streams = parse_streams(STREAMS)
        self.events, self.receipts = self.streams
        self.out = tempfile.mkdtemp(prefix="export-out-")
        self.addCleanup(shutil.rmtree, self.out, True)

    def assertMatches(self, got, want):
        self.assertEqual(sorted(got), sorted(want))
        for key in want:
            for metric in METRICS:
                g, w = got[key][metric], want[key][metric]
                if isinstance(w, float) or isinstance(g, float):
                    self.assertIsNotNone(g, (key, metric))
                    self.assertAlmostEqual(g, w, delta=1e-6 * max(1.0, abs(w)),
                                           msg=(key, metric))
                else:
                    self.assertEqual(g, w, (key, metric))

    def load_phase1(self):
        """events: facts 1..1200 final, 1201 in flight (w1), 1202..1250 by w2;
        receipts: 1..300 written, position 280."""
        gen = Generator(7)
        self.ev1 = gen.facts(1, 1200, ["w1", "w2"])
        insert_events(self.cur, self.ev1)
        # A real rollback on the sequence, then the in-flight reservation.
        self.cur.execute("SELECT setval('ev_seq', 1200)")
        import psycopg2

        self.inflight = psycopg2.connect(self.dsn)
        self.addCleanup(self.inflight.close)
        icur = self.inflight.cursor()
        icur.execute("SELECT nextval('ev_seq')")
        self.inflight_id = icur.fetchone()[0]
        icur.execute("INSERT INTO ev VALUES (%s, 'w1', 'in flight', %s)",
                     (self.inflight_id, BASE_MS + 10 ** 6))
        self.ev1b = gen.facts(1202, 1250, ["w2"])
        insert_events(self.cur, self.ev1b)
        self.cur.execute("SELECT setval('ev_seq', 1250)")
        set_positions(self.cur, "events", w1=1200, w2=1250, w3=5000)  # w3: not configured
        self.rc1 = Generator(8).facts(1, 300, ["main"])
        insert_receipts(self.cur, self.rc1)
        set_positions(self.cur, "receipts/v2", main=280)
        return gen


class ExportTests(ExportTestBase):
    def test_matches_reference_incremental_and_noop(self):
        gen = self.load_phase1()
        self.assertEqual(self.inflight_id, 1201)

        # ---- run 1: only what is at or below the linear positions.
        r1 = export(self.db, self.streams, self.out, now_ms=RUN1_MS)
        self.assertTrue(r1.changed)
        got = read_export(self.out)
        want = reference(self.cur, self.events, 1200)
        want.update(reference(self.cur, self.receipts, 280))
        self.assertMatches(got, want)
        self.assertTrue(any(k[2] == "" for k in got), "no rollback rows for the multi-writer")
        self.assertTrue(any(v["size_17_up"] for v in got.values()))
        self.assertTrue(any(v["rollbacks"] and k[2] == "main" for k, v in got.items()))
        self.assertEqual({v["date"] for k, v in got.items() if k[0] == "events"},
                         {"2024-03-01", "2024-03-02"})
        self.assertLessEqual(max(v["last_token"] or 0 for k, v in got.items()
                                 if k[0] == "events"), 1200)
        self.assertLessEqual(max(v["last_token"] or 0 for k, v in got.items()
                                 if k[0] == "receipts/v2"), 280)
        state = OutputStore(self.out).load_state()
        self.assertEqual(state.streams["events"].token, 1200)
        self.assertEqual(state.streams["receipts/v2"].token, 280)
        n_ev = len([f for f in self.ev1 if f[0] <= 1200])
        self.assertEqual(state.streams["events"].facts, n_ev)
        self.assertEqual(sum(v["facts"] for k, v in got.items() if k[:2] == ("events", "minute")),
                         n_ev)
        self.assertEqual({r.stream: r.facts for r in r1.reports},
                         {"events": n_ev, "receipts/v2": len([f for f in self.rc1
                                                               if f[0] <= 280])})
        self.assertTrue(os.path.isdir(os.path.join(
            self.out, "current", "minute", "stream=" + escape_partition_value("receipts/v2"))))

        # ---- nothing new: no-op, not a single file touched.
        link = os.readlink(os.path.join(self.out, "current"))
        before = tree_inodes(os.path.join(self.out, "current"))
        r_noop = export(self.db, self.streams, self.out, now_ms=RUN2_MS)
        self.assertFalse(r_noop.changed)
        self.assertEqual([r.facts for r in r_noop.reports], [0, 0])
        self.assertEqual(os.readlink(os.path.join(self.out, "current")), link)
        self.assertEqual(tree_inodes(os.path.join(self.out, "current")), before)

        # ---- the in-flight fact completes, new facts (one late, real
        # rollbacks), positions advance.
        self.inflight.commit()
        new = gen.facts(1251, 1400, ["w1", "w2"])
        new.append((1401, "w1", [BASE_MS + 5000]))  # late: lands on 2024-03-01
        insert_events(self.cur, new)
        self.cur.execute("SELECT setval('ev_seq', 1401)")
        for _ in range(2):  # reserved, written, rolled back: gaps 1402, 1403
            self.cur.execute("BEGIN")
            self.cur.execute("INSERT INTO ev VALUES (nextval('ev_seq'), 'w2', 'x', %s)",
                             (BASE_MS,))
            self.cur.execute("ROLLBACK")
        self.cur.execute("INSERT INTO ev VALUES (nextval('ev_seq'), 'w2', 'last', %s)",
                         (gen.t + 100,))
        set_positions(self.cur, "events", w1=1404, w2=1404)
        rc2 = Generator(9).facts(301, 320, ["main"])
        insert_receipts(self.cur, rc2)
        set_positions(self.cur, "receipts/v2", main=320)

        r2 = export(self.db, self.streams, self.out, now_ms=RUN2_MS)
        self.assertTrue(r2.changed)
        got2 = read_export(self.out)
        want2 = reference(self.cur, self.events, 1404, run2_after(1200))
        want2.update(reference(self.cur, self.receipts, 320, run2_after(280)))
        self.assertMatches(got2, want2)
        # Exactly the new facts were added: 1201, 1202..1250's, the new ones, 1404.
        self.cur.execute("SELECT count(DISTINCT stream_id) FROM ev WHERE stream_id > 1200 "
                         "AND stream_id <= 1404")
        added = self.cur.fetchone()[0]
        self.assertEqual(added, 1 + len(self.ev1b) + len(new) + 1)
        self.assertEqual({r.stream: r.facts for r in r2.reports},
                         {"events": added, "receipts/v2": len([f for f in self.rc1
                                                               if f[0] > 280]) + len(rc2)})
        total = sum(v["facts"] for k, v in got2.items() if k[:2] == ("events", "minute"))
        self.assertEqual(total, n_ev + added)
        # Rollbacks are exactly the IDs with no row between the first fact and
        # the position: the in-flight ID 1201 is a fact, 1402 and 1403 are not.
        self.cur.execute("SELECT min(stream_id), count(DISTINCT stream_id) FROM ev "
                         "WHERE stream_id <= 1404")
        first, distinct = self.cur.fetchone()
        self.assertEqual(
            sum(v["rollbacks"] for k, v in got2.items() if k[:2] == ("events", "minute")),
            1404 - first + 1 - distinct)
        state2 = OutputStore(self.out).load_state()
        self.assertEqual(state2.streams["events"].token, 1404)
        self.assertEqual(
            state2.streams["events"].rollbacks,
            sum(v["rollbacks"] for k, v in got2.items() if k[:2] == ("events", "minute")))
        # The receipts minute of run 1 and run 2 is one bucket, recomputed.
        rc_minute = [v for k, v in got2.items() if k[:2] == ("receipts/v2", "minute")]
        self.assertEqual(len(rc_minute), 1)
        self.assertEqual(rc_minute[0]["facts"], len([f for f in self.rc1]) + len(rc2))

    def test_late_fact_on_a_date_first_exported_by_an_earlier_run(self):
        """Run 2 opens 2024-03-03 (after rollbacks); run 3 brings a late fact for
        it: the date is re-aggregated from its first fact, whose predecessor
        (for the rollback count) comes from the state."""
        gen = self.load_phase1()
        export(self.db, self.streams, self.out, now_ms=RUN1_MS, streams=["events"])
        self.inflight.commit()
        day3 = 1709424000000  # 2024-03-03T00:00:00Z
        gen.t = day3 + 3_600_000
        facts = gen.facts(1260, 1300, ["w1", "w2"])  # 1251..1259 rolled back
        insert_events(self.cur, facts)
        set_positions(self.cur, "events", w1=1300, w2=1300)
        export(self.db, self.streams, self.out, now_ms=RUN2_MS, streams=["events"])
        state = OutputStore(self.out).load_state().streams["events"]
        self.cur.execute("SELECT max(stream_id) FROM ev WHERE stream_id < 1260")
        self.assertEqual(state.dates["2024-03-03"], [facts[0][0], self.cur.fetchone()[0]])
        late = [(1305, "w2", [day3 + 60_000, day3 + 60_001])]  # 1301..1304 rolled back
        insert_events(self.cur, late)
        set_positions(self.cur, "events", w1=1305, w2=1305)
        r = export(self.db, self.streams, self.out, now_ms=RUN2_MS, streams=["events"])
        self.assertEqual((r.reports[0].facts, r.reports[0].rows, r.reports[0].rollbacks),
                         (1, 2, 1305 - facts[-1][0] - 1))
        self.assertEqual(r.reports[0].dates, ["2024-03-03"])
        self.assertMatches(read_export(self.out),
                           reference(self.cur, self.events, 1305, run2_after(1200)))

    def test_nothing_past_persisted_position(self):
        self.load_phase1()
        # A writer missing from stream_positions holds its stream back.
        self.cur.execute("DELETE FROM stream_positions WHERE instance_name = 'w2'")
        r = export(self.db, self.streams, self.out, now_ms=RUN1_MS)
        got = read_export(self.out)
        self.assertEqual({k[0] for k in got}, {"receipts/v2"})
        self.assertEqual([(x.stream, x.position, x.facts) for x in r.reports],
                         [("events", 0, 0), ("receipts/v2", 280, len([f for f in self.rc1
                                                                      if f[0] <= 280]))])
        self.assertNotIn("events", OutputStore(self.out).load_state().streams)

    def test_failed_run_keeps_previous_export(self):
        from replicator.export import aggregate

        self.load_phase1()
        export(self.db, self.streams, self.out, now_ms=RUN1_MS)
        link = os.readlink(os.path.join(self.out, "current"))
        before = read_export(self.out)
        self.inflight.commit()
        set_positions(self.cur, "events", w1=1250)
        set_positions(self.cur, "receipts/v2", main=300)
        real = aggregate.write_partitions
        calls = []

        def failing(df, path):
            calls.append(path)
            real(df, path)
            if len(calls) == 3:  # events written, receipts half-way
                raise RuntimeError("disk full")

        aggregate.write_partitions = failing
        self.addCleanup(setattr, aggregate, "write_partitions", real)
        with self.assertRaises(RuntimeError):
            export(self.db, self.streams, self.out, now_ms=RUN2_MS)
        self.assertEqual(len(calls), 3)
        self.assertEqual(os.readlink(os.path.join(self.out, "current")), link)
        self.assertEqual(read_export(self.out), before)
        self.assertEqual(OutputStore(self.out).load_state().streams["events"].token, 1200)
        self.assertEqual([e for e in os.listdir(self.out) if e.startswith(".staging")], [])
        aggregate.write_partitions = real
        export(self.db, self.streams, self.out, now_ms=RUN2_MS)
        want = reference(self.cur, self.events, 1250, run2_after(1200))
        want.update(reference(self.cur, self.receipts, 300, run2_after(280)))
        self.assertMatches(read_export(self.out), want)

    def test_killed_run_leaves_previous_export_readable(self):
        self.load_phase1()
        export(self.db, self.streams, self.out, now_ms=RUN1_MS)
        link = os.readlink(os.path.join(self.out, "current"))
        before = read_export(self.out)
        self.inflight.commit()
        set_positions(self.cur, "events", w1=1250)
        set_positions(self.cur, "receipts/v2", main=300)
        conf = os.path.join(self.out, "..", os.path.basename(self.out) + ".yaml")
        conf = os.path.abspath(conf)
        self.addCleanup(lambda: os.path.exists(conf) and os.unlink(conf))
        import yaml

        with open(conf, "w") as f:
            yaml.safe_dump({"database": {"postgres": self.dsn}, "streams": STREAMS}, f)
        env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=ROOT)
        # The exporter stops itself (SIGSTOP) right after its first partition
        # is written, so the kill lands mid-run whatever the machine's load.
        proc = subprocess.Popen(
            [sys.executable, "-c", STOP_AFTER_FIRST_PARTITION, "-c", conf, "-o", self.out,
             "--master", "local[1]", "--shuffle-partitions", "4", "-q"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.addCleanup(lambda: proc.poll() is None and os.killpg(proc.pid, signal.SIGKILL))
        deadline = time.monotonic() + 600  # JVM start and a partition, on a busy machine
        while time.monotonic() < deadline and proc.poll() is None \
                and _process_state(proc.pid) != "T":
            time.sleep(0.05)
        stopped = proc.poll() is None and _process_state(proc.pid) == "T"
        killed_at = [os.path.join(d, f) for e in os.listdir(self.out) if e.startswith(".staging-")
                     for d, _s, files in os.walk(os.path.join(self.out, e))
                     if "_temporary" not in d for f in files if f.endswith(".parquet")]
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0].decode(errors="replace")
        self.assertTrue(stopped, f"the exporter never stopped after a partition "
                                 f"(exit {proc.returncode}): {output}")
        self.assertTrue(killed_at, "no partition in the staging directory")
        self.assertEqual(proc.returncode, -signal.SIGKILL)
        # The dead run left a staging directory; current is the old export.
        self.assertTrue([e for e in os.listdir(self.out) if e.startswith(".staging-")])
        self.assertEqual(os.readlink(os.path.join(self.out, "current")), link)
        self.assertEqual(read_export(self.out), before)
        self.assertEqual(OutputStore(self.out).load_state().streams["events"].token, 1200)
        # The next run cleans up and exports what the dead one did not.
        r = export(self.db, self.streams, self.out, now_ms=RUN2_MS)
        self.assertTrue(r.changed)
        self.assertEqual([e for e in os.listdir(self.out) if e.startswith(".staging-")], [])
        want = reference(self.cur, self.events, 1250, run2_after(1200))
        want.update(reference(self.cur, self.receipts, 300, run2_after(280)))
        self.assertMatches(read_export(self.out), want)

    def test_until_since_streams_and_plot(self):
        self.load_phase1()
        midnight = 1709337600000  # 2024-03-02T00:00:00Z
        r = export(self.db, self.streams, self.out, now_ms=RUN1_MS, until_ms=midnight,
                   streams=["events"])
        self.assertEqual([x.stream for x in r.reports], ["events"])
        got = read_export(self.out)
        self.assertEqual({k[0] for k in got}, {"events"})
        token = OutputStore(self.out).load_state().streams["events"].token
        # The prefix stops just before the first fact timed at/after midnight.
        self.cur.execute("SELECT min(stream_id) FROM ev WHERE ts >= %s OR ts IS NULL",
                         (midnight,))
        self.assertEqual(token, self.cur.fetchone()[0] - 1)
        self.assertMatches(got, reference(self.cur, self.events, token))
        # Then the rest, and receipts, with a plot.
        png = os.path.join(self.out, "..", os.path.basename(self.out) + ".png")
        self.addCleanup(lambda: os.path.exists(png) and os.unlink(png))
        export(self.db, self.streams, self.out, now_ms=RUN1_MS, plot=png)
        want = reference(self.cur, self.events, 1200)
        want.update(reference(self.cur, self.receipts, 280))
        self.assertMatches(read_export(self.out), want)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertGreater(os.path.getsize(png), 5000)
        # --since on a fresh output starts at the first fact timed at or after
        # midnight (a prefix cut: a later fact timed before it still counts).
        out2 = tempfile.mkdtemp(prefix="export-since-")
        self.addCleanup(shutil.rmtree, out2, True)
        export(self.db, self.streams, out2, now_ms=RUN1_MS, since_ms=midnight,
               streams=["events"])
        got = read_export(out2)
        self.assertEqual(min(v["first_token"] for v in got.values()
                             if v["first_token"] is not None), token + 1)
        self.cur.execute("SELECT stream_id, instance_name, ts FROM ev WHERE stream_id > %s "
                         "AND stream_id <= 1200 ORDER BY 1", (token,))
        agg = Aggregator(2, True, run1).feed(self.cur.fetchall())
        self.assertMatches(got, {("events",) + k: v for k, v in agg.result().items()})


    def test_cli_summary_and_plot(self):
        import contextlib
        import io

        import yaml

        from replicator.export.cli import main

        self.load_phase1()
        conf = os.path.join(self.out, "..", os.path.basename(self.out) + ".yaml")
        png = conf[:-5] + ".png"
        for path in (conf, png):
            self.addCleanup(lambda p=path: os.path.exists(p) and os.unlink(p))
        with open(conf, "w") as f:
            yaml.safe_dump({"database": {"postgres": self.dsn}, "streams": STREAMS,
                            "listen": {"ignored": True}}, f)
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            rc = main(["-c", conf, "-o", self.out, "-q", "--partitions", "2"])
        self.assertEqual(rc, 0)
        lines = stdout.getvalue().splitlines()
        self.assertEqual(lines[0].split(), ["stream", "position", "exported", "facts", "rows",
                                            "rollbacks", "dates", "seconds", "status"])
        n_ev = len([f for f in self.ev1 if f[0] <= 1200])
        ev = lines[2].split()
        self.assertEqual(ev[:5], ["events", "1200", "(start,", "1200]", str(n_ev)])
        self.assertEqual(ev[-1], "exported")
        self.assertTrue(lines[3].startswith("receipts/v2"))
        self.assertTrue(lines[-1].startswith("committed "))
        # Nothing new: the export is unchanged, but the plot is still drawn.
        # The facts without a row time were bucketed at the first run's
        # minute, which the plot leaves out while it is still running: the
        # plot is drawn as if two minutes later, whatever the wall clock says.
        from types import SimpleNamespace

        from replicator.export import plot

        later = time.time() + 120
        self.patch(plot, "time", SimpleNamespace(time=lambda: later))
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            rc = main(["-c", conf, "-o", self.out, "-q", "--plot", png])
        self.assertEqual(rc, 0)
        self.assertIn("nothing new: the export is unchanged", stdout.getvalue())
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertIsNotNone(self.spark.sparkContext._jsc, "the shared session was stopped")


def trim(conn, stream_section, max_facts):
    """One retention pass over ``stream_section``'s table, by the real
    trimmer's batch (:class:`replicator.streams.retention.Batch`), keeping
    the ``max_facts`` newest facts: its new trim boundary."""
    from types import SimpleNamespace

    from replicator.config import parse_stream
    from replicator.storage.schema import RETENTION_DDL
    from replicator.streams.retention import Batch

    config = parse_stream(dict(stream_section, retention={"max_facts": max_facts,
                                                          "batch": 100000}), "streams[0]")
    batch = Batch(config, SimpleNamespace(is_postgres=True, sql=lambda text: text))
    with conn, conn.cursor() as cur:
        cur.execute(RETENTION_DDL)
        result = batch.run(cur, batch.count_bound(cur), None)
    return result[1]


class TrimmedExportTests(ExportTestBase):
    """Retention trims facts an export needs (before the run, or while Spark
    reads): the run is refused with one line naming the range and
    ``--accept-trimmed``, nothing committed; with it, the export goes on
    from what the table keeps and records the range."""

    def setUp(self):
        super().setUp()
        import psycopg2

        self.trimmer = psycopg2.connect(self.dsn)
        self.addCleanup(self.trimmer.close)
        self.load_phase1()
        r1 = export(self.db, self.streams, self.out, now_ms=RUN1_MS, streams=["events"])
        self.assertTrue(r1.changed)
        self.run1 = read_export(self.out)
        self.state1 = OutputStore(self.out).load_state().streams["events"]
        self.inflight.commit()
        set_positions(self.cur, "events", w1=1250, w2=1250)

    def kept(self, above, upto=1250):
        self.cur.execute("SELECT count(DISTINCT stream_id) FROM ev WHERE stream_id > %s AND "
                         "stream_id <= %s", (above, upto))
        return self.cur.fetchone()[0]

    def test_trimmed_before_the_run(self):
        from replicator.export.source import TrimmedError

        boundary = trim(self.trimmer, STREAMS[0], 10)
        self.assertGreater(boundary, 1200)  # facts the export never read are gone
        link = os.readlink(os.path.join(self.out, "current"))
        with self.assertRaises(TrimmedError) as caught:
            export(self.db, self.streams, self.out, now_ms=RUN2_MS, streams=["events"])
        self.assertEqual(str(caught.exception),
                         f"stream events: facts (1200, {boundary}] were trimmed by retention "
                         f"before this export read them (its trim boundary is {boundary}); "
                         f"nothing was committed: to export what the table keeps and record "
                         f"(1200, {boundary}] as trimmed in state.json, run again with "
                         f"--accept-trimmed")
        self.assertEqual(os.readlink(os.path.join(self.out, "current")), link)
        self.assertEqual(OutputStore(self.out).load_state().streams["events"].token, 1200)

        r = export(self.db, self.streams, self.out, now_ms=RUN2_MS, streams=["events"],
                   accept_trimmed=True)
        self.assertTrue(r.changed)
        [report] = r.reports
        # The date re-aggregated (2024-03-02) began with an exported fact,
        # trimmed too: the range recorded reaches down to it.
        first = OutputStore(self.out).load_state().streams["events"]
        [[lo, hi]] = first.trimmed
        self.assertEqual(hi, boundary)
        self.assertEqual(lo, self.state1.dates["2024-03-02"][0] - 1)
        self.assertEqual(report.trimmed, (lo, boundary))
        self.assertEqual((report.status, report.facts), ("exported", self.kept(boundary)))
        self.assertEqual(first.token, 1250)
        from replicator.export.job import format_summary

        self.assertIn(f"exported; ({lo}, {boundary}] trimmed by retention (accepted)",
                      format_summary(r))
        got = read_export(self.out)
        # 2024-03-01 as run 1 exported it; 2024-03-02 from what the table keeps.
        self.assertEqual({k: v for k, v in got.items() if v["date"] == "2024-03-01"},
                         {k: v for k, v in self.run1.items() if v["date"] == "2024-03-01"})
        self.assertMatches({k: v for k, v in got.items() if v["date"] == "2024-03-02"},
                           {k: v for k, v in reference(self.cur, self.events, 1250,
                                                       run2_after(1200)).items()
                            if v["date"] == "2024-03-02"})
        # Trimmed again past the export: accepted again, one range in the state.
        insert_events(self.cur, [(i, "w1", [BASE_MS + 10 ** 7 + i]) for i in range(1251, 1271)])
        set_positions(self.cur, "events", w1=1270, w2=1270)
        again = trim(self.trimmer, STREAMS[0], 10)
        self.assertGreater(again, 1250)
        r = export(self.db, self.streams, self.out, now_ms=RUN2_MS, streams=["events"],
                   accept_trimmed=True)
        self.assertEqual((r.reports[0].trimmed, r.reports[0].facts),
                         ((lo, again), self.kept(again, 1270)))
        self.assertEqual(OutputStore(self.out).load_state().streams["events"].trimmed,
                         [[lo, again]])
        # A first export (here --full) begins after what retention trimmed
        # before it: no gap, nothing recorded.
        r = export(self.db, self.streams, self.out, now_ms=RUN2_MS, streams=["events"],
                   full=True)
        self.assertEqual((r.reports[0].lower, r.reports[0].trimmed, r.reports[0].facts),
                         (again, None, self.kept(again, 1270)))
        self.assertEqual(OutputStore(self.out).load_state().streams["events"].trimmed, [])

    def test_trimmed_while_spark_reads(self):
        from replicator.export import aggregate
        from replicator.export.source import TrimmedError

        real = aggregate.write_partitions
        trimmed = []

        def trim_then_write(df, path):
            if not trimmed:  # the planner read the boundary; Spark reads the facts
                trimmed.append(trim(self.trimmer, STREAMS[0], 10))
            real(df, path)

        self.patch(aggregate, "write_partitions", trim_then_write)
        link = os.readlink(os.path.join(self.out, "current"))
        with self.assertRaises(TrimmedError) as caught:  # (so with --accept-trimmed)
            export(self.db, self.streams, self.out, now_ms=RUN2_MS, streams=["events"])
        [boundary] = trimmed
        message = str(caught.exception)
        self.assertTrue(message.startswith(
            f"stream events: retention trimmed facts up to {boundary} while this export "
            f"read ["), message)
        self.assertTrue(message.endswith(
            ", 1250] (the trim boundary was 0 when it began); nothing was committed: run "
            "again (a run starts from the boundary as it is then, with --accept-trimmed past "
            "a gap; retention that trims faster than an export reads cannot be exported "
            "whole)"), message)
        self.assertEqual(os.readlink(os.path.join(self.out, "current")), link)
        self.assertEqual(OutputStore(self.out).load_state().streams["events"].token, 1200)
        # Run again, retention at rest: the gap is recorded, the rest exported.
        r = export(self.db, self.streams, self.out, now_ms=RUN2_MS, streams=["events"],
                   accept_trimmed=True)
        self.assertEqual(r.reports[0].trimmed[1], boundary)
        self.assertEqual(r.reports[0].facts, self.kept(boundary))


#: Writers whose byte-wise order (Spark's, Python's) is not a linguistic
#: collation's order: "Zed" < "alice" < "zoë" < "Ärne" byte-wise, but
#: "alice" < "Ärne" < "Zed" < "zoë" in ICU's root collation.
COLLATION_WRITERS = ["alice", "Zed", "zoë", "Ärne"]


def collation_facts():
    """Facts whose rows have different writers: (id, [(writer, ts), ...])."""
    out = []
    for i in range(1, 61):
        names = [COLLATION_WRITERS[(i + k) % 4] for k in range(1 + i % 4)]
        out.append((i, [(w, BASE_MS + 1000 * i + k) for k, w in enumerate(names)]))
    return out


class CollationTests(ExportTestBase):
    def test_fact_writer_is_bytewise_smallest_under_any_collation(self):
        """A fact's writer is its smallest writer value in byte-wise order,
        even when the writer column has a linguistic collation."""
        self.cur.execute("SELECT 1 FROM pg_collation WHERE collname = 'und-x-icu'")
        if self.cur.fetchone() is None:
            unavailable("PostgreSQL built without ICU (no und-x-icu collation)")
        self.cur.execute('CREATE TABLE cw (stream_id BIGINT NOT NULL, instance_name TEXT '
                         'COLLATE "und-x-icu" NOT NULL, ts BIGINT)')
        rows = [(i, w, ts) for i, stamps in collation_facts() for w, ts in stamps]
        from psycopg2.extras import execute_values

        execute_values(self.cur, "INSERT INTO cw VALUES %s", rows)
        streams = parse_streams([{"name": "cw", "table": "cw", "writers": COLLATION_WRITERS,
                                  "columns": [{"ts": "bigint?"}], "timestamp_column": "ts"}])
        set_positions(self.cur, "cw", **{w: 60 for w in COLLATION_WRITERS})
        export(self.db, streams, self.out, now_ms=RUN1_MS)
        got = read_export(self.out)
        want = {("cw",) + k: v for k, v in Aggregator(4, True, run1).feed(rows).result().items()}
        self.assertMatches(got, want)


class SqliteExportTests(TestCase):
    def test_sqlite_source(self):
        spark = shared_spark()
        tmp = tempfile.mkdtemp(prefix="export-sqlite-")
        self.addCleanup(shutil.rmtree, tmp, True)
        path = os.path.join(tmp, "db.sqlite")
        conn = sqlite_with_positions(path)
        conn.execute("CREATE TABLE ev (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL, "
                     "body TEXT NOT NULL, ts INTEGER)")
        facts = Generator(3).facts(1, 400, ["w1", "w2"])
        rows = [(i, w, "b", ts) for i, w, stamps in facts for ts in stamps]
        conn.executemany("INSERT INTO ev VALUES (?, ?, ?, ?)", rows)
        conn.executemany("INSERT INTO stream_positions VALUES ('events', ?, ?)",
                         [("w1", 350), ("w2", 390)])
        conn.commit()
        conn.close()
        db = parse_database({"sqlite": path})
        streams = parse_streams(STREAMS[:1])
        out = os.path.join(tmp, "out")
        export(db, streams, out, spark=spark, now_ms=RUN1_MS)
        agg = Aggregator(2, True, run1)
        agg.feed(sorted(((i, w, ts) for i, w, _b, ts in rows if i <= 350), key=lambda r: r[0]))
        want = {("events",) + k: v for k, v in agg.result().items()}
        got = read_export(out)
        self.assertEqual(sorted(got), sorted(want))
        for key in want:
            for metric in METRICS:
                w, g = want[key][metric], got[key][metric]
                if isinstance(w, float):
                    self.assertAlmostEqual(g, w, delta=1e-6 * max(1.0, abs(w)))
                else:
                    self.assertEqual(g, w, (key, metric))

    def test_fact_writer_is_bytewise_smallest_under_nocase(self):
        """The same with SQLite and a ``COLLATE NOCASE`` writer column."""
        tmp = tempfile.mkdtemp(prefix="export-sqlite-")
        self.addCleanup(shutil.rmtree, tmp, True)
        path = os.path.join(tmp, "db.sqlite")
        conn = sqlite_with_positions(path)
        conn.execute("CREATE TABLE cw (stream_id BIGINT NOT NULL, instance_name TEXT "
                     "COLLATE NOCASE NOT NULL, ts INTEGER)")
        rows = [(i, w, ts) for i, stamps in collation_facts() for w, ts in stamps]
        conn.executemany("INSERT INTO cw VALUES (?, ?, ?)", rows)
        conn.executemany("INSERT INTO stream_positions VALUES ('cw', ?, 60)",
                         [(w,) for w in COLLATION_WRITERS])
        conn.commit()
        conn.close()
        streams = parse_streams([{"name": "cw", "table": "cw", "writers": COLLATION_WRITERS,
                                  "columns": [{"ts": "bigint?"}], "timestamp_column": "ts"}])
        out = os.path.join(tmp, "out")
        export(parse_database({"sqlite": path}), streams, out, now_ms=RUN1_MS)
        got = read_export(out)
        want = {("cw",) + k: v for k, v in Aggregator(4, True, run1).feed(rows).result().items()}
        self.assertEqual(sorted(got), sorted(want))
        for key in want:
            self.assertEqual({m: got[key][m] for m in ("facts", "rows", "first_token")},
                             {m: want[key][m] for m in ("facts", "rows", "first_token")}, key)


class CliTests(TestCase):
    """Argument and configuration errors: no Spark needed."""

    def run_cli(self, *args):
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = subprocess.run([sys.executable, "-m", "replicator.export.cli", *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        return proc.returncode, proc.stdout, proc.stderr

    def write(self, text):
        fd, path = tempfile.mkstemp(suffix=".yaml")
        os.write(fd, text.encode())
        os.close(fd)
        self.addCleanup(os.unlink, path)
        return path

    def test_config_error_exits_2(self):
        conf = self.write("database: {sqlite: /nonexistent/x.db}\nstreams:\n  - name: a\n")
        rc, out, err = self.run_cli("-c", conf)
        self.assertEqual(rc, 2)
        self.assertEqual(err.strip().splitlines(), ["config: streams[0].table: missing"])

    def test_unknown_stream_exits_2(self):
        conf = self.write("database: {sqlite: /nonexistent/x.db}\nstreams:\n"
                          "  - {name: a, table: t, writers: [m], columns: [{x: text}]}\n")
        rc, _out, err = self.run_cli("-c", conf, "--streams", "a,b")
        self.assertEqual(rc, 2)
        self.assertIn("unknown stream(s) b", err)

    def test_missing_database_exits_1(self):
        conf = self.write("database: {sqlite: /nonexistent/x.db}\nstreams:\n"
                          "  - {name: a, table: t, writers: [m], columns: [{x: text}]}\n")
        out = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, out, True)
        rc, _out, err = self.run_cli("-c", conf, "-o", out)
        self.assertEqual(rc, 1)
        self.assertIn("/nonexistent/x.db does not exist", err)

    def test_missing_jdbc_jar_is_a_clear_error(self):
        from replicator.export.source import SourceError, find_jdbc_jar

        with self.assertRaises(SourceError) as e:
            find_jdbc_jar("postgres", "/nonexistent/postgresql.jar")
        self.assertIn("does not exist", str(e.exception))

    def test_time_arguments(self):
        from replicator.export.cli import parse_time

        self.assertEqual(parse_time("2024-03-02"), 1709337600000)
        self.assertEqual(parse_time("2024-03-02T01:00:00+01:00"), 1709337600000)
        self.assertEqual(parse_time("1709337600000"), 1709337600000)


class StateTests(TestCase):
    def test_escape_like_spark(self):
        self.assertEqual(escape_partition_value("receipts/v2"), "receipts%2Fv2")
        self.assertEqual(escape_partition_value("a=b:c"), "a%3Db%3Ac")
        self.assertEqual(escape_partition_value("plain-name_1.x"), "plain-name_1.x")

    def test_commit_swaps_and_cleans(self):
        from replicator.export.state import ExportState, StreamState

        out = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, out, True)
        store = OutputStore(out)
        store.lock()
        self.addCleanup(store.unlock)
        other = OutputStore(out)
        with self.assertRaises(Exception):
            other.lock()
        for n in range(1, 4):
            staging = store.begin()
            os.makedirs(staging.stream_dir("minute", "s") + f"/date=2024-01-0{n}")
            st = ExportState(streams={"s": StreamState(token=n)})
            store.commit(staging, st)
            self.assertEqual(store.load_state().streams["s"].token, n)
        gens = sorted(e for e in os.listdir(out) if e.startswith("gen-"))
        self.assertEqual(gens, ["gen-00000002", "gen-00000003"])
        # A dead run's leftovers: a staging dir and a generation never linked.
        os.makedirs(os.path.join(out, ".staging-1-dead/minute"))
        os.makedirs(os.path.join(out, "gen-00000009"))
        self.assertEqual(store.load_state().generation, 3)
        staging = store.begin()
        self.assertEqual(sorted(e for e in os.listdir(out) if not e.startswith(".lock")),
                         sorted(["current", "gen-00000002", "gen-00000003",
                                 os.path.basename(staging.path)]))
        store.abort(staging)

    def test_an_export_of_the_old_column_names_is_refused(self):
        """An export made before ``delay_ms_*`` became ``gap_ms_*`` (state
        version 1): an incremental run would add partitions of the new
        columns beside the old ones, so the store refuses it with one line
        that says what to do."""
        from replicator.export.state import StateError

        out = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, out, True)
        os.makedirs(os.path.join(out, "gen-00000001"))
        with open(os.path.join(out, "gen-00000001", "state.json"), "w") as f:
            f.write('{"version": 1, "generation": 1, "streams": {}}\n')
        os.symlink("gen-00000001", os.path.join(out, "current"))
        with self.assertRaises(StateError) as caught:
            OutputStore(out).load_state()
        self.assertIn("gap_ms_", str(caught.exception))
        self.assertIn("export again", str(caught.exception))
        self.assertNotIn("\n", str(caught.exception))
