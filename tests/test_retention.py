"""Retention: the ``retention`` config, the trim rule (only strictly below the
persisted linear position, a prefix in ID order, bounded batches: a
hypothesis test over a real SQLite table), readers that stop at a gap
instead of skipping (in memory), the trimmer under live writes on
PostgreSQL, and a worker stopped while its facts are trimmed refusing to
skip them when it comes back (real processes)."""

import json
import os
import re
import shlex
import signal
import sqlite3
import tempfile
import threading
import urllib.error

import psycopg2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator.config import ConfigError, parse_database, parse_stream, parse_streams
from replicator.consumers import MemoryConsumer
from replicator.consumers.file_thread import run_inline
from replicator.consumers.jsonl import JsonlConsumer
from replicator.observe import metrics
from replicator.observe.health import HealthMonitor
from replicator.replication.core.accepted import accepting
from replicator.replication.core.delivery import delivery_for
from replicator.replication.core.gaps import TrimGaps
from replicator.replication.core.reader import Reader
from replicator.storage import schema
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from replicator.streams.retention import Batch, RetentionService, Trimmer, trimmers_for
from replicator.streams.trimmed import FactsTrimmed
from tests.daemon import SECRET, Daemon, base_config, cli, http
from tests.fakes import FakeConnection, FakeView
from tests.servers import PostgresServer, free_port, wait_for
from tests.support import until

EVENTS = {
    "name": "events", "table": "events_stream",
    "columns": [{"what": "text"}, {"ts": "bigint"}], "timestamp_column": "ts",
    "writers": ["master", "worker1"],
}


def events(**retention):
    return dict(EVENTS, retention=retention)


class RetentionConfigTests(SynchronousTestCase):
    def parse(self, stream):
        return parse_stream(stream, "streams[0]")

    def test_age_and_count(self):
        r = self.parse(events(max_age="7d", max_facts=1000)).retention
        self.assertEqual((r.max_age, r.max_facts, r.interval, r.batch),
                         (7 * 86_400.0, 1000, 60.0, 1000))
        for text, seconds in (("12h", 43_200), ("90m", 5400), ("30s", 30), ("2w", 1_209_600),
                              (3600, 3600)):
            self.assertEqual(self.parse(events(max_age=text)).retention.max_age, seconds)
        self.assertIsNone(self.parse(EVENTS).retention)
        self.assertIsNone(self.parse(dict(EVENTS, retention=None)).retention)

    def test_each_mistake_is_one_line_naming_the_key(self):
        limit = 1 << 62
        cases = [
            (events(), "streams[0].retention: give max_age (e.g. '7d') and/or max_facts "
                       "(e.g. 1000000)"),
            (events(max_facts=0), "streams[0].retention.max_facts: must be an integer from 1 "
                                  f"to {limit}, got 0"),
            (events(max_facts=-3), "streams[0].retention.max_facts: must be an integer from 1 "
                                   f"to {limit}, got -3"),
            (events(max_facts=1 << 70), "streams[0].retention.max_facts: must be an integer "
                                        f"from 1 to {limit}, got {1 << 70}"),
            (events(max_facts=True), "streams[0].retention.max_facts: expected an integer, "
                                     "got bool"),
            (events(max_facts="10"), "streams[0].retention.max_facts: expected an integer, "
                                     "got str"),
            (events(max_age="0d"), "streams[0].retention.max_age: must be more than 0 and at "
                                   "most 36500d, got '0d'"),
            (events(max_age=0), "streams[0].retention.max_age: must be more than 0 and at most "
                                "36500d, got 0"),
            (events(max_age="999999999d"), "streams[0].retention.max_age: must be more than 0 "
                                           "and at most 36500d, got '999999999d'"),
            (events(max_age="7 days"), "streams[0].retention.max_age: '7 days' is not a "
                                       "duration (a whole number and one of s, m, h, d, w: "
                                       "'7d', '12h')"),
            (events(max_age="-1h"), "streams[0].retention.max_age: '-1h' is not a duration (a "
                                    "whole number and one of s, m, h, d, w: '7d', '12h')"),
            (events(max_age=1.5), "streams[0].retention.max_age: expected a duration like "
                                  "'7d' or '12h', got float"),
            (events(max_facts=5, batch=0), "streams[0].retention.batch: must be an integer "
                                           "from 1 to 100000, got 0"),
            (events(max_facts=5, interval=0), "streams[0].retention.interval: must be a number "
                                              "from 1 to 86400, got 0"),
            (events(max_rows=5), "streams[0].retention.max_rows: unknown key"),
            (dict(events(max_age="7d"), timestamp_column=None),
             "streams[0].retention.max_age: needs the stream's timestamp_column (a bigint "
             "column of milliseconds since the epoch): a fact's age is read from it"),
            (dict(events(max_age="7d"), columns=[{"what": "text"}, {"ts": "bigint?"}]),
             "streams[0].retention.max_age: needs a NOT NULL timestamp_column ('ts' is "
             "nullable: a fact without a time has no age)"),
            ({"preset": "synapse/caches", "retention": {"max_facts": 5}},
             "streams[0].retention: 'synapse/caches' is Synapse's table: Synapse decides what "
             "it keeps"),
            (dict(EVENTS, table="stream_retention"),
             "streams[0].table: 'stream_retention' is the replicator's own table"),
        ]
        for stream, message in cases:
            with self.assertRaises(ConfigError, msg=message) as caught:
                self.parse(stream)
            self.assertEqual(str(caught.exception), f"config: {message}")

    def test_a_retention_change_needs_a_restart(self):
        from replicator.config import parse_instance
        from replicator.daemon.reload import plan

        def config(stream):
            return parse_instance({"server_name": "hs.test", "instance_name": "master",
                                   "database": {"postgres": "dbname=a"}, "streams": [stream]})

        running = config(events(max_facts=5))
        p = plan(running, config(events(max_facts=50)))
        self.assertEqual(p.restart, ["streams[0]"])
        self.assertEqual(p.config, running)

    def test_one_instance_trims_a_stream_its_first_writer(self):
        """Two instances configured with the same retention: only the
        stream's first writer trims it; a reader-only instance never does."""
        streams = parse_streams([events(max_facts=5), dict(
            EVENTS, name="other", table="other_stream", writers=["worker1"],
            retention={"max_facts": 5}), dict(EVENTS, name="kept", table="kept_stream")])

        class Registry(list):
            pass

        registry = Registry(type("S", (), {"config": s})() for s in streams)
        db = Database(parse_database({"sqlite": os.path.join(tempfile.mkdtemp(), "x.db")}))
        self.addCleanup(db.close)
        self.assertEqual([t.name for t in trimmers_for("master", registry, db, Clock())],
                         ["events"])
        self.assertEqual([t.name for t in trimmers_for("worker1", registry, db, Clock())],
                         ["other"])
        self.assertEqual(trimmers_for("reader", registry, db, Clock()), [])


# ------------------------------------------------------------- the rule
@st.composite
def tables(draw):
    """Facts of two writers (IDs from one sequence, holes included), each
    with 1-3 rows and a time; the writers' persisted positions (possibly
    missing); a retention; the time now."""
    n = draw(st.integers(0, 60))
    ids = sorted(draw(st.sets(st.integers(1, 200), min_size=n, max_size=n)))
    facts = []
    for stream_id in ids:
        writer = draw(st.sampled_from(["master", "worker1"]))
        times = draw(st.lists(st.integers(0, 10_000), min_size=1, max_size=3))
        facts.append((stream_id, writer, times))
    positions = {}
    for writer in ("master", "worker1"):
        if draw(st.booleans()) or draw(st.booleans()):
            positions[writer] = draw(st.integers(0, 220))
    retention = {}
    if draw(st.booleans()):
        retention["max_facts"] = draw(st.integers(1, 70))
    if draw(st.booleans()) or not retention:
        retention["max_age"] = draw(st.integers(1, 10))
    retention["batch"] = draw(st.integers(1, 12))
    now = draw(st.integers(0, 20))  # seconds; times are milliseconds
    return facts, positions, retention, now


class TrimRuleTests(SynchronousTestCase):
    """:class:`Batch` over a real SQLite table, every batch checked."""

    def setUp(self):
        path = os.path.join(tempfile.mkdtemp(), "rule.db")
        self.db = Database(parse_database({"sqlite": path}))
        self.addCleanup(self.db.close)

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(tables())
    def test_only_a_prefix_strictly_below_the_persisted_linear_position(self, drawn):
        facts, positions, retention, now = drawn
        config = parse_stream(dict(EVENTS, retention=retention), "streams[0]")
        conn = sqlite3.connect(":memory:")
        txn = conn.cursor()
        for statement in schema.table_ddl(config, postgres=False):
            txn.execute(statement)
        txn.execute(schema.POSITIONS_DDL)
        txn.execute(schema.RETENTION_DDL)
        for stream_id, writer, times in facts:
            for t in times:
                txn.execute("INSERT INTO events_stream (stream_id, instance_name, what, ts) "
                            "VALUES (?, ?, 'x', ?)",
                            (stream_id, writer, t))
        for writer, position in positions.items():
            txn.execute("INSERT INTO stream_positions VALUES ('events', ?, ?)",
                        (writer, position))
        linear = min(positions.get(w, 0) for w in config.writers)
        batch = Batch(config, self.db)
        count_bound = batch.count_bound(txn)
        clock = Clock()
        clock.advance(now)
        trimmer = Trimmer(config, self.db, clock)
        age_bound = trimmer.age_bound()
        newest = sorted((f[0] for f in facts), reverse=True)
        boundary = 0
        for _ in range(200):
            result = batch.run(txn, count_bound, age_bound)
            deleted, new_boundary, seen_linear = result
            self.assertEqual(seen_linear, linear)
            self.assertLessEqual(deleted, retention["batch"])
            self.assertGreaterEqual(new_boundary, boundary)
            boundary = new_boundary
            if deleted < retention["batch"]:
                break
        conn.commit()
        left = {r[0] for r in txn.execute("SELECT stream_id FROM events_stream")}
        gone = {f[0] for f in facts} - left
        # Only strictly below the persisted linear position.
        self.assertTrue(all(i < linear for i in gone), (gone, linear))
        # A prefix: everything at or below the boundary gone, nothing above.
        self.assertEqual(gone, {f[0] for f in facts if f[0] <= boundary})
        self.assertEqual(txn.execute("SELECT trimmed_through FROM stream_retention").fetchall(),
                         [(boundary,)])
        # Each fact gone was trimmable: beyond the newest max_facts, or old.
        kept_by_count = set(newest[:retention.get("max_facts", len(newest))])
        for stream_id, _, times in facts:
            if stream_id in gone:
                old = "max_age" in retention and max(times) < (now - retention["max_age"]) * 1000
                self.assertTrue(stream_id not in kept_by_count or old, (stream_id, times))
        # And the pass went as far as it may: the first fact kept above the
        # boundary is below the linear position only if it is not trimmable.
        above = sorted(f for f in facts if f[0] > boundary)
        if above and above[0][0] < linear:
            stream_id, _, times = above[0]
            old = "max_age" in retention and max(times) < (now - retention["max_age"]) * 1000
            self.assertFalse(stream_id not in kept_by_count or old, (above[0], boundary))
        conn.close()


# ------------------------------------------------------------- readers
class GapReaderTests(SynchronousTestCase):
    """A reader whose catch-up meets a trim stops there for good."""

    def setUp(self):
        self.clock = Clock()
        self.delivered = []
        self.gaps = []
        # facts 1..10 exist; 1..6 were trimmed (boundary 6)
        self.boundary = 6

    def source(self, writer, since, until, limit):
        if self.boundary > since:
            return defer.fail(FactsTrimmed("events", writer, since, self.boundary))
        facts = [(t, [["x", t]]) for t in range(since + 1, min(until, since + limit) + 1)]
        return defer.succeed((facts, facts[-1][0] if facts else until, False))

    def reader(self, position):
        return Reader("events", "master", position, source=self.source,
                      deliver=lambda t, rows: self.delivered.append(t), clock=self.clock,
                      fetch_limit=2, on_gap=self.gaps.append)

    def test_a_reader_below_the_boundary_stops_and_skips_nothing(self):
        reader = self.reader(2)
        conn = FakeConnection()
        reader.position_line(conn, 10, 10)
        self.assertEqual(self.delivered, [])
        self.assertEqual(reader.position, 2)
        self.assertEqual(len(self.gaps), 1)
        self.assertEqual((self.gaps[0].since, self.gaps[0].boundary), (2, 6))
        self.assertIs(reader.gap, self.gaps[0])
        # Later lines change nothing: no retry, no delivery past the gap.
        reader.rdata(conn, 11, ["x", 11])
        reader.position_line(conn, 12, 12)
        self.clock.advance(60)
        self.assertEqual(self.delivered, [])
        self.assertEqual(reader.position, 2)
        self.assertEqual(len(self.gaps), 1)
        self.assertTrue(reader.idle())

    def test_a_trim_in_the_middle_of_a_catch_up(self):
        """Pages before the trim are whole and delivered; the one that met
        it is not, and nothing after it is."""
        self.boundary = 0
        reader = self.reader(0)
        pages = []
        source = self.source

        def trimming_source(writer, since, until, limit):
            pages.append(since)
            if len(pages) == 2:
                self.boundary = 5  # the trimmer ran meanwhile
            return source(writer, since, until, limit)

        reader._source = trimming_source
        reader.position_line(FakeConnection(), 10, 10)
        for _ in range(3):
            self.clock.advance(0)
        self.assertEqual(self.delivered, [1, 2])
        self.assertEqual(reader.position, 2)
        self.assertEqual((reader.gap.since, reader.gap.boundary), (2, 5))

    def test_a_reader_at_the_boundary_goes_on(self):
        reader = self.reader(6)
        reader.position_line(FakeConnection(), 10, 10)
        for _ in range(3):
            self.clock.advance(0)  # the reactor's turn between pages
        self.assertEqual(self.delivered, [7, 8, 9, 10])
        self.assertIsNone(reader.gap)


class AcceptedGapTests(SynchronousTestCase):
    """A gap below a consumer whose position a ``--skip-to boundary`` set,
    nothing delivered since, is skipped to the boundary for it (a skip
    line), once per trim, until a fact is delivered; a consumer that did
    not accept keeps the stream stopping (in memory, a real file)."""

    def setUp(self):
        self.clock = Clock()
        self.boundary = 6  # facts 1..20 exist; up to the boundary trimmed
        self.gaps = []
        self.path = os.path.join(tempfile.mkdtemp(), "facts.jsonl")

    def source(self, writer, since, until, limit):
        if self.boundary > since:
            return defer.fail(FactsTrimmed("events", writer, since, self.boundary))
        facts = [(t, [["x", t]]) for t in range(since + 1, min(until, since + limit) + 1)]
        return defer.succeed((facts, facts[-1][0] if facts else until, False))

    def consumer(self):
        consumer = JsonlConsumer(self.path, self.clock, run_io=run_inline)
        self.addCleanup(consumer.close)
        return consumer

    def pasted(self, to, boundary=True):
        """What ``replicator rewind --skip-to`` does to the file."""
        consumer = JsonlConsumer(self.path, self.clock, run_io=run_inline)
        note = {"from": 2, "facts": 0, "trimmed_through": to, "at": "T",
                **({"to": "boundary"} if boundary else {})}
        consumer.skip({("events", "master"): to}, {("events", "master"): note})
        consumer.close()

    def reader(self, consumers, position):
        deliver, deliver_many, reached = delivery_for("events", "master", consumers)
        return Reader("events", "master", position,
                      source=accepting(self.source, "events", "master", lambda: consumers),
                      deliver=deliver, deliver_many=deliver_many, reached=reached,
                      clock=self.clock, fetch_limit=3, on_gap=self.gaps.append)

    def lines(self):
        with open(self.path) as f:
            return [json.loads(line) for line in f]

    def turns(self):
        for _ in range(10):
            self.clock.advance(0)

    def test_the_gap_met_after_a_pasted_skip_to_boundary_is_skipped(self):
        first = self.consumer()
        first.on_facts("events", "master", 2, [["x", 2]])
        first.close()
        self.pasted(4)  # the boundary when pasted; the trimmer went on to 6
        consumer = self.consumer()  # (a restart: the state file says so)
        self.assertEqual(consumer.accepted_gap("events", "master"), 4)
        reader = self.reader([consumer], 4)
        reader.position_line(FakeConnection(), 10, 10)
        self.turns()
        self.assertEqual((self.gaps, reader.position), ([], 10))
        consumer.flush()
        lines = self.lines()
        self.assertEqual(lines[-5], {"stream": "events", "writer": "master", "position": 6,
                                     "skip": {"from": 4, "facts": 0, "trimmed_through": 6,
                                              "at": "1970-01-01T00:00:00Z",
                                              "to": "boundary"}})
        self.assertEqual([e["token"] for e in lines[-4:]], [7, 8, 9, 10])
        # Spent: a fact was delivered after it; the next gap stops the stream.
        self.assertIsNone(consumer.accepted_gap("events", "master"))
        self.boundary = 15
        reader.position_line(FakeConnection(), 20, 20)
        self.turns()
        self.assertEqual([(g.since, g.boundary) for g in self.gaps], [(10, 15)])
        self.assertEqual(reader.position, 10)

    def test_each_trim_before_a_fact_is_skipped_again(self):
        self.pasted(4)
        consumer = self.consumer()
        sources = []

        def trimming(writer, since, until, limit):
            sources.append(since)
            if len(sources) <= 2:
                self.boundary += 3  # the trimmer passes every position read
            return self.source(writer, since, until, limit)

        reader = self.reader([consumer], 4)
        reader._source = accepting(trimming, "events", "master", lambda: [consumer])
        reader.position_line(FakeConnection(), 20, 20)
        self.turns()
        self.assertEqual(self.gaps, [])
        consumer.flush()
        skips = [(e["skip"]["from"], e["position"]) for e in self.lines() if "skip" in e]
        self.assertEqual(skips, [(2, 4), (4, 9), (9, 12)])
        facts = [e["token"] for e in self.lines() if "rows" in e]
        self.assertEqual(facts, list(range(13, 21)))

    def test_a_consumer_that_did_not_accept_keeps_the_gap(self):
        self.pasted(4, boundary=False)  # --skip-to 4: that loss only
        consumer = self.consumer()
        self.assertIsNone(consumer.accepted_gap("events", "master"))
        reader = self.reader([consumer], 4)
        reader.position_line(FakeConnection(), 10, 10)
        self.turns()
        self.assertEqual([(g.since, g.boundary) for g in self.gaps], [(4, 6)])
        self.assertEqual([e for e in self.lines() if "rows" in e], [])
        # Nor one accepted beside one behind that did not.
        self.gaps.clear()
        consumer.close()
        self.pasted(5)
        accepted = self.consumer()
        other = MemoryConsumer({("events", "master"): 3})
        reader = self.reader([accepted, other], 3)
        reader.position_line(FakeConnection(), 10, 10)
        self.turns()
        self.assertEqual([(g.since, g.boundary) for g in self.gaps], [(3, 6)])
        self.assertEqual(accepted.accepted_gap("events", "master"), 5)
        self.assertEqual(other.facts, [])

    def test_a_position_spends_it_and_a_restart_keeps_that(self):
        self.pasted(4)
        consumer = self.consumer()
        consumer.on_position("events", "master", 5)
        self.assertIsNone(consumer.accepted_gap("events", "master"))
        consumer.close()
        self.assertIsNone(self.consumer().accepted_gap("events", "master"))


class GapHealthTests(SynchronousTestCase):
    def test_the_finding_names_the_consumer_and_the_gap(self):
        gaps = TrimGaps("/etc/replicator/worker1.yaml")
        behind = MemoryConsumer({("events", "master"): 120})
        behind.path = "/var/lib/replicator/facts.jsonl"
        ahead = MemoryConsumer({("events", "master"): 900})
        text = gaps.report(FactsTrimmed("events", "master", 120, 500), [behind, ahead])
        self.assertEqual(text, "stream events: consumer /var/lib/replicator/facts.jsonl needs "
                               "facts of writer master after 120 but facts up to 500 were "
                               "trimmed by retention; the stream is stopped here: to accept "
                               "the loss, stop this instance, run `replicator rewind -c "
                               "/etc/replicator/worker1.yaml /var/lib/replicator/facts.jsonl "
                               "--stream events --skip-to boundary`, then start it (or restore the "
                               "facts: docs/operations.md, \"Retention gaps\")")
        self.assertTrue(gaps.stopped("events"))
        self.assertFalse(gaps.stopped("other"))
        # Reported once.
        self.assertEqual(gaps.report(FactsTrimmed("events", "master", 130, 600), []), text)
        [finding] = gaps.findings()
        self.assertEqual((finding.kind, finding.stream, finding.writer, finding.fails_health),
                         ("trimmed", "events", "master", True))
        sample = metrics.REGISTRY.get_sample_value(
            "replicator_retention_gap", {"stream": "events", "writer": "master"})
        self.assertEqual(sample, 1)
        # Without a consumer behind: this instance's own reader.
        text = gaps.report(FactsTrimmed("events", "worker1", 7, 9), [])
        self.assertTrue(text.startswith("stream events: the reader of writer worker1 needs "
                                        "facts after 7 but facts up to 9 were trimmed"), text)

    def test_health_fails_first_with_the_gap(self):
        gaps = TrimGaps()
        gaps.report(FactsTrimmed("events", "master", 1, 2), [])

        core = FakeView()
        core.core_findings = gaps.findings()
        monitor = HealthMonitor(registry=[], handler=core, db=None, clock=Clock())
        self.assertIn("facts up to 2 were trimmed by retention",
                      monitor.problem(True, "connected"))


# ------------------------------------------------------ PostgreSQL, in process
def _pg(dsn, *statements):
    """Run ``statements`` (SQL, params) in one transaction; the last one's rows."""
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            rows = None
            for sql, params in statements:
                cur.execute(sql, params)
                rows = cur.fetchall() if cur.description else None
            return rows
    finally:
        conn.close()


class PostgresRetentionTests(TestCase):
    """The trimmer and the readers over a real PostgreSQL."""

    timeout = 120

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()

    async def registry(self, instance, streams):
        db = Database(parse_database({"postgres": self.dsn, "pool_max": 4}))
        self.addCleanup(db.close)
        registry = StreamRegistry(db, instance, parse_streams(streams), reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        return registry

    def ids(self):
        return [r[0] for r in _pg(self.dsn, ("SELECT DISTINCT stream_id FROM events_stream "
                                             "ORDER BY 1", ()))]

    def snapshot(self):
        """(trim boundary, persisted linear position), read in one snapshot."""
        rows = _pg(self.dsn, ("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", ()),
                   ("SELECT (SELECT COALESCE(MAX(trimmed_through), 0) FROM stream_retention), "
                    "(SELECT MIN(stream_id) FROM stream_positions WHERE stream_name = 'events' "
                    "AND instance_name IN ('master', 'worker1')), (SELECT COUNT(*) FROM "
                    "stream_positions WHERE stream_name = 'events')", ()))
        boundary, linear, writers = rows[0]
        return boundary, (linear if writers == 2 else 0)

    async def test_trimming_under_live_writes(self):
        """Two writers (two instances) write while the trimmer runs pass
        after pass: no fact at or above the persisted linear position is
        ever deleted, every batch is bounded, and every committed fact above
        the final boundary is in the table."""
        streams = [events(max_facts=15, batch=7)]
        master = (await self.registry("master", streams)).get("events")
        worker = (await self.registry("worker1", streams)).get("events")
        trimmer = Trimmer(master.config, master.db, reactor)
        written = []
        done = []
        trims_seen = []  # passes that deleted something while both wrote

        async def write(stream):
            # On until two passes deleted facts while it wrote, and 20 more.
            i = 0
            while len(trims_seen) < 2 or i < 20:
                written.extend(await stream.write_facts([[["x", i]], [["y", i], ["z", i]]]))
                i = i + 1 if trims_seen else 0
            done.append(stream)

        writers = [defer.ensureDeferred(write(master)), defer.ensureDeferred(write(worker))]
        passes = deleted = 0
        while len(done) < 2 or passes < 2:
            before_boundary, _ = self.snapshot()
            present = set(self.ids())
            trimmed = await trimmer.trim()
            deleted += trimmed
            if trimmed and not done:
                trims_seen.append(trimmed)
            passes += 1
            for n, boundary, linear in trimmer.last_pass:
                self.assertLessEqual(n, 7)
                self.assertLess(boundary, linear)
            boundary, linear = self.snapshot()
            # Nothing at or above the linear position read before the pass
            # (every fact a writer could still complete is above it) went.
            gone = present - set(self.ids())
            self.assertTrue(all(i <= boundary < linear for i in gone), (gone, boundary, linear))
            self.assertGreaterEqual(boundary, before_boundary)
        await defer.gatherResults(writers)
        await master.flush_positions()
        await worker.flush_positions()
        await trimmer.trim()
        boundary, linear = self.snapshot()
        self.assertGreater(boundary, 0)
        self.assertLess(boundary, linear)
        left = set(self.ids())
        self.assertEqual({i for i in written if i > boundary}, left)
        self.assertFalse(any(i <= boundary for i in left))
        self.assertGreaterEqual(len(left), 15)  # max_facts
        self.assertGreaterEqual(len(trims_seen), 2)

    async def test_a_reader_below_the_boundary_stops_and_delivers_nothing_past_it(self):
        """A reader (another instance's) catching up from below facts that
        were deleted stops; facts above the gap are not delivered."""
        streams = [dict(EVENTS, writers=["master"])]
        master = (await self.registry("master", streams)).get("events")
        for i in range(30):
            await master.write_fact([["x", i]])
        # Retention ran up to 20 (here by hand: the table and its boundary).
        _pg(self.dsn, (schema.RETENTION_DDL, ()),
            ("DELETE FROM events_stream WHERE stream_id <= 20", ()),
            ("INSERT INTO stream_retention VALUES ('events_stream', 20)", ()))
        reader_side = (await self.registry("worker1", streams)).get("events")
        from replicator.background import Background
        from replicator.replication.core.delivery import make_reader

        consumer = MemoryConsumer({("events", "master"): 5})
        reader = make_reader(reader_side, "master", 5, [consumer], clock=reactor,
                             fetch_limit=4, retry_delay=0.1, background=Background())
        reader.position_line(FakeConnection(), 30, 30)
        await until(reader.idle)
        self.assertEqual(consumer.facts, [])
        self.assertEqual(reader.position, 5)
        self.assertEqual((reader.gap.since, reader.gap.boundary), (5, 20))
        # A reader at the boundary reads on.
        consumer = MemoryConsumer({("events", "master"): 20})
        reader = make_reader(reader_side, "master", 20, [consumer], clock=reactor,
                             fetch_limit=4, retry_delay=0.1, background=Background())
        reader.position_line(FakeConnection(), 30, 30)
        await until(reader.idle)
        self.assertEqual([f[2] for f in consumer.facts], list(range(21, 31)))

    async def test_two_trimmers_never_delete_at_once(self):
        """A second instance configured as the trimmer (by mistake) finds
        the stream's row locked while the first trims, and deletes nothing."""
        streams = [dict(events(max_facts=2), writers=["master"])]
        master = (await self.registry("master", streams)).get("events")
        for i in range(10):
            await master.write_fact([["x", i]])
        await master.flush_positions()
        first = Trimmer(master.config, master.db, reactor)
        await first.trim()
        second = Trimmer(master.config, master.db, reactor)
        for i in range(10):
            await master.write_fact([["x", i]])
        await master.flush_positions()
        before = self.ids()
        lock = psycopg2.connect(self.dsn)
        self.addCleanup(lock.close)
        with lock.cursor() as cur:  # the first trimmer, mid-batch
            cur.execute("SELECT 1 FROM stream_retention WHERE table_name = 'events_stream' "
                        "FOR UPDATE")
            self.assertEqual(await second.trim(), 0)
            self.assertEqual(second.last_pass, [])
            self.assertEqual(self.ids(), before)
        lock.commit()
        self.assertEqual(await second.trim(), 10)
        self.assertEqual(len(self.ids()), 2)

    async def test_two_deployments_one_stream_name_two_tables(self):
        """Two deployments share one database, each with a stream named
        ``events`` in a table of its own: the trim boundary is the table's.
        Trimming one leaves the other's boundary and facts alone, its
        readers read on, and both trimmers run, even at once.  (Different
        instance names: ``stream_positions`` rows are keyed by stream name.)"""
        ours = [dict(events(max_facts=3), writers=["master"])]
        theirs = [dict(events(max_facts=3), table="revents_stream", writers=["rmaster"])]
        a = (await self.registry("master", ours)).get("events")
        b = (await self.registry("rmaster", theirs)).get("events")
        for stream in (a, b):
            for i in range(10):
                await stream.write_fact([["x", i]])
            await stream.flush_positions()
        self.assertEqual(await Trimmer(a.config, a.db, reactor).trim(), 7)
        facts, _, _ = await b.facts_since("rmaster", 0, 10, 100)  # no gap
        self.assertEqual([t for t, _ in facts], list(range(1, 11)))
        lock = psycopg2.connect(self.dsn)  # the first deployment's trimmer, mid-batch
        self.addCleanup(lock.close)
        with lock.cursor() as cur:
            cur.execute("SELECT 1 FROM stream_retention WHERE table_name = 'events_stream' "
                        "FOR UPDATE")
            self.assertEqual(await Trimmer(b.config, b.db, reactor).trim(), 7)
        lock.commit()
        self.assertEqual(_pg(self.dsn, ("SELECT table_name, trimmed_through FROM "
                                        "stream_retention ORDER BY 1", ())),
                         [("events_stream", 7), ("revents_stream", 7)])
        self.assertEqual(self.ids(), [8, 9, 10])
        facts, _, _ = await a.facts_since("master", 7, 10, 100)
        self.assertEqual([t for t, _ in facts], [8, 9, 10])

    async def test_a_fan_out_below_the_boundary_announces_it(self):
        """A fan-out whose unannounced facts were trimmed sends ``POSITION b
        b`` first (a reader below ``b`` reads the table and stops there),
        then the facts above ``b``: never a later fact as if it were next."""
        from replicator.replication.core.fanout import Fanout

        streams = [dict(events(max_facts=4), writers=["master"])]
        master = (await self.registry("master", streams)).get("events")
        for i in range(10):
            await master.write_fact([["x", i]])
        await master.flush_positions()
        await Trimmer(master.config, master.db, reactor).trim()  # 1..6 go
        sent = []
        fanout = Fanout(lambda lines, name: sent.extend(lines), reactor)
        fanout.add_writer(master, "master")
        fanout.announced[("events", "master")] = 2  # it fell behind, before the trim
        fanout.advanced(master, "master")
        await until(fanout.idle)
        self.assertEqual(sent[0], b"POSITION events master 6 6\n")
        self.assertEqual([line.split()[3] for line in sent[1:]], [b"7", b"8", b"9", b"10"])
        self.assertEqual(fanout.announced[("events", "master")], 10)

    async def test_clock_jumps(self):
        """max_age against a clock that jumps: forward, it trims what is
        below the linear position and no more; back, nothing."""
        streams = [dict(events(max_age="1h"), writers=["master"])]
        master = (await self.registry("master", streams)).get("events")
        now_ms = int(reactor.seconds() * 1000)
        for i in range(10):
            await master.write_fact([["x", now_ms]])
        await master.flush_positions()
        clock = Clock()
        clock.advance(reactor.seconds())
        trimmer = Trimmer(master.config, master.db, clock)
        self.assertEqual(await trimmer.trim(), 0)  # an hour has not passed
        clock.advance(100 * 365 * 86_400)  # a clock set a century ahead
        self.assertEqual(await trimmer.trim(), 9)  # all but the linear position's fact
        self.assertEqual(self.ids(), [10])
        back = Clock()  # and back to 1970
        trimmer = Trimmer(master.config, master.db, back)
        await master.write_fact([["x", now_ms]])
        await master.flush_positions()
        self.assertEqual(await trimmer.trim(), 0)
        self.assertEqual(self.ids(), [10, 11])

    async def test_the_service_trims_on_its_clock_and_stops_cleanly(self):
        streams = [dict(events(max_facts=3, interval=5), writers=["master"])]
        master = (await self.registry("master", streams)).get("events")
        for i in range(8):
            await master.write_fact([["x", i]])
        await master.flush_positions()
        clock = Clock()
        service = RetentionService([Trimmer(master.config, master.db, reactor)], clock)
        service.startService()
        self.assertEqual(len(self.ids()), 8)  # not before the first interval
        clock.advance(5)
        await service.stopService()  # waits for the pass under way
        self.assertEqual(self.ids(), [6, 7, 8])



class SQLiteRetentionTests(TestCase):
    """The trimmer and the page check on SQLite (the embedded default)."""

    async def test_trim_and_read_back(self):
        path = os.path.join(tempfile.mkdtemp(), "ret.db")
        db = Database(parse_database({"sqlite": path}))
        self.addCleanup(db.close)
        registry = StreamRegistry(db, "master", parse_streams(
            [dict(events(max_facts=4, batch=2), writers=["master"])]), reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        stream = registry.get("events")
        for i in range(10):
            await stream.write_fact([["x", i]])
        await stream.flush_positions()
        trimmer = Trimmer(stream.config, db, reactor)
        self.assertEqual(await trimmer.trim(), 6)  # 1..6: 7..10 are the 4 newest
        self.assertEqual([n for n, _, _ in trimmer.last_pass], [2, 2, 2, 0])
        with self.assertRaises(FactsTrimmed) as caught:
            await stream.facts_since("master", 2, 10, 100)
        self.assertEqual((caught.exception.since, caught.exception.boundary), (2, 6))
        facts, upto, _ = await stream.facts_since("master", 6, 10, 100)
        self.assertEqual([t for t, _ in facts], [7, 8, 9, 10])


# ------------------------------------------------------------ real processes
def _status(daemon):
    try:
        return http(daemon.http_base + "/health")[0]
    except urllib.error.HTTPError as e:
        return e.code


class StoppedReaderTests(SynchronousTestCase):
    """A master that trims, a worker with a JSON-lines consumer: the worker
    is stopped, the master writes on and trims past the worker's position,
    and the worker, started again, refuses to skip: its /health says the
    gap, its file gets nothing past it, its other stream carries on; the
    command the gap names, pasted while the master writes and trims on,
    skips only facts already trimmed, and verify says what it skipped."""

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()

    def write(self, daemon, stream, rows):
        status, body = http(f"{daemon.http_base}/_replicator/v1/streams/{stream}/facts",
                            json.dumps({"rows": rows}).encode(), SECRET)
        return json.loads(body)["stream_id"]

    @staticmethod
    def tokens(daemon, stream):
        path = os.path.join(daemon.dir, "facts.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [e["token"] for e in map(json.loads, f)
                    if "rows" in e and e["stream"] == stream]

    def snapshot(self):
        rows = _pg(self.dsn, ("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", ()),
                   ("SELECT (SELECT COALESCE(MAX(trimmed_through), 0) FROM stream_retention "
                    "WHERE table_name = 'events_stream'), (SELECT MIN(stream_id) FROM "
                    "stream_positions WHERE stream_name = 'events')", ()))
        return rows[0]

    def test_a_stopped_worker_comes_back_and_refuses_to_skip(self):
        rep_port = free_port()
        streams = [
            dict(events(max_facts=5, interval=1, batch=3), writers=["master"]),
            {"name": "notes", "table": "notes_stream", "columns": [{"text": "text"}],
             "writers": ["master"]},
        ]
        master = Daemon(self, base_config(
            "master", free_port(), streams, database={"postgres": self.dsn},
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"}), "master").start()
        worker_config = base_config(
            "worker1", free_port(), streams, database={"postgres": self.dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            consumers=[{"type": "jsonl", "path": "facts.jsonl"}])
        worker = Daemon(self, worker_config, "worker1").start()
        first = [self.write(master, "events", [["before", i]]) for i in range(4)]
        wait_for(lambda: self.tokens(worker, "events") == first, 60, "the worker has them")
        worker.kill(signal.SIGTERM)
        self.assertEqual(worker.proc.returncode, 0, worker.output()[-2000:])
        position = first[-1]

        # The master writes on; its trimmer runs meanwhile (every second).
        later = []
        for i in range(25):
            later.append(self.write(master, "events", [["after", i]]))
            boundary, linear = self.snapshot()
            self.assertLess(boundary, linear)
        wait_for(lambda: self.snapshot()[0] > position, 60, "a trim past the worker")
        wait_for(lambda: "retention trimmed" in master.output(), 60, "the pass's log line")
        # The table and its boundary in one snapshot (the trimmer runs on).
        boundary, left = _pg(self.dsn, ("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", ()), (
            "SELECT (SELECT trimmed_through FROM stream_retention WHERE table_name = "
            "'events_stream'),"
            " ARRAY(SELECT stream_id FROM events_stream ORDER BY 1)", ()))[0]
        self.assertEqual(left, [i for i in first + later if i > boundary])

        # The worker comes back: it stops the stream instead of skipping.
        worker.start()  # its directory, its file, its config

        def unhealthy():
            try:
                http(worker.http_base + "/health")
            except urllib.error.HTTPError as e:
                return e.code == 503 and "trimmed by retention" in e.read().decode()
            return False

        wait_for(unhealthy, 60, "the worker's /health says the gap")
        try:
            http(worker.http_base + "/health")
        except urllib.error.HTTPError as e:
            reason = json.loads(e.read())["reason"]
        trimmed = self.snapshot()[0]
        self.assertTrue(reason.startswith(
            f"stream events: consumer {os.path.join(worker.dir, 'facts.jsonl')} needs facts "
            f"of writer master after {position} but facts up to "), reason)
        command = re.search(r"run `replicator (rewind [^`]*)`", reason)
        self.assertIsNotNone(command, reason)
        self.assertEqual(shlex.split(command.group(1))[:5],
                         ["rewind", "-c", worker.path, os.path.join(worker.dir, "facts.jsonl"),
                          "--stream"], reason)
        self.assertLessEqual(int(reason.split("facts up to ")[1].split()[0]), trimmed)
        status = json.loads(http(worker.http_base + "/status.json")[1])
        self.assertIn("trimmed", [f["kind"] for f in status["findings"]])
        metrics_text = http(worker.http_base + "/metrics")[1].decode()
        self.assertIn('replicator_retention_gap{stream="events",writer="master"} 1.0',
                      metrics_text)
        # Nothing past the gap, then or later; the other stream carries on.
        note = self.write(master, "notes", [["still here"]])
        last = self.write(master, "events", [["even later", 0]])
        wait_for(lambda: self.tokens(worker, "notes") == [note], 60, "notes flow")
        self.assertEqual(self.tokens(worker, "events"), first)
        self.assertEqual(http(master.http_base + "/health")[0], 200)
        wait_for(lambda: "trimmed by retention" in worker.output(), 60, "the gap's log line")
        self.assertEqual(worker.output().count("trimmed by retention"), 1, worker.output())

        # The operator accepts the loss (docs/operations.md, "Retention gaps"):
        # the worker stopped, the command its gap names pasted while the
        # master writes on and trims every second, so the boundary moves on
        # past the gap's and while the command runs.  It skips to the
        # boundary as it is when the skip is made: only facts already gone.
        worker.kill(signal.SIGTERM)
        args = shlex.split(command.group(1))
        self.assertEqual(args[-2:], ["--skip-to", "boundary"], reason)
        gap_boundary = int(reason.split("facts up to ")[1].split()[0])
        stop, racing = threading.Event(), []

        def write_on():
            while not stop.is_set():
                racing.append(self.write(master, "events", [["racing", len(racing)]]))

        writes = threading.Thread(target=write_on)
        writes.start()
        try:
            wait_for(lambda: self.snapshot()[0] > gap_boundary, 60, "a trim past the gap's")
            before = self.snapshot()[0]
            done = cli(*args, cwd=worker.dir)
            after = self.snapshot()[0]
        finally:
            stop.set()
            writes.join()
        self.assertEqual((done.returncode, done.stderr), (0, ""), done.stdout)
        skipped = re.fullmatch(
            rf"rewind: events/master: position {position} -> (\d+): skipped facts "
            rf"{position + 1} to (\d+) \(0 of them in the table; facts up to (\d+) were "
            rf"trimmed by retention\)\n", done.stdout)
        self.assertIsNotNone(skipped, done.stdout)
        to = int(skipped.group(1))
        self.assertEqual({int(g) for g in skipped.groups()}, {to})
        # At or above the boundary when it began, at or below it when it was
        # done: every fact it skipped was trimmed, none it skipped was kept.
        self.assertGreaterEqual(to, before)
        self.assertLessEqual(to, after)
        with open(os.path.join(worker.dir, "facts.jsonl")) as f:
            skip_line = [json.loads(line) for line in f][-1]
        at = skip_line["skip"]["at"]
        self.assertEqual(skip_line, {"stream": "events", "writer": "master", "position": to,
                                     "skip": {"from": position, "facts": 0,
                                              "trimmed_through": to, "at": at,
                                              "to": "boundary"}})

        # No more writes: the trimmer settles with the 5 newest facts kept,
        # past where the skip went; the same command, pasted again, works
        # again, and the worker goes on from the boundary.
        settled = sorted(first + later + [last] + racing)[-6]
        wait_for(lambda: self.snapshot()[0] == settled, 60, "the last trim")
        self.assertGreater(settled, to)
        done = cli(*args, cwd=worker.dir)
        self.assertEqual((done.returncode, done.stderr), (0, ""), done.stdout)
        self.assertEqual(done.stdout, f"rewind: events/master: position {to} -> {settled}: "
                                      f"skipped facts {to + 1} to {settled} (0 of them in the "
                                      f"table; facts up to {settled} were trimmed by "
                                      f"retention)\n")
        with open(os.path.join(worker.dir, "facts.jsonl")) as f:
            at2 = [json.loads(line) for line in f][-1]["skip"]["at"]
        worker.start()
        left = [r[0] for r in _pg(self.dsn, ("SELECT stream_id FROM events_stream ORDER BY 1",
                                             ()))]
        wait_for(lambda: self.tokens(worker, "events") == first + left, 60, "the rest")
        wait_for(lambda: _status(worker) == 200, 60, "the worker healthy again")
        for d in (master, worker):
            d.kill(signal.SIGTERM)
            self.assertEqual(d.proc.returncode, 0, d.output()[-2000:])
        # verify: the facts before the skip are trimmed (not compared), the
        # rest equal; it says where each skip went and how many facts of the
        # table each skipped (none: --skip-to boundary).
        done = cli("verify", "-c", worker.path, "0", cwd=worker.dir)
        self.assertEqual((done.returncode, done.stderr), (0, ""), done.stdout)
        self.assertIn(f"  events/master: {len(first + left)} facts, checked from token 0 of "
                      f"writer master to {left[-1]}: {len(left)} matched; no differences; "
                      f"{len(first)} trimmed from the table (not compared)\n"
                      f"    skipped by rewind --skip-to at {at}: facts {position + 1} to {to}, "
                      f"0 of them in the table then (facts up to {to} were trimmed by "
                      f"retention)\n"
                      f"    skipped by rewind --skip-to at {at2}: facts {to + 1} to {settled}, "
                      f"0 of them in the table then (facts up to {settled} were trimmed by "
                      f"retention)\n", done.stdout)
        self.assertIn(f"verify: EQUAL: {len(left) + 1} facts, each exactly once, in order, "
                      f"whole ({len(first)} trimmed from the table, not compared; 0 facts "
                      f"skipped by rewind --skip-to at {at}, {at2})", done.stdout)

    def test_a_pasted_skip_to_boundary_converges_however_fast_retention_runs(self):
        """Retention keeps a fraction of a second of facts, writes go on:
        the worker, held stopped after the pasted ``--skip-to boundary``
        until the trimmer passed its new position, comes back without a new
        gap: the daemon skips to the boundary again (the operator accepted
        what retention trims before the reader reads), one log line and one
        skip line say so, verify reports it, and every fact above the
        boundaries skipped to is in the file exactly once, in order."""
        rep_port = free_port()
        streams = [dict(events(max_facts=20, interval=1, batch=10), writers=["master"])]
        master = Daemon(self, base_config(
            "master", free_port(), streams, database={"postgres": self.dsn},
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"}), "master").start()
        worker = Daemon(self, base_config(
            "worker1", free_port(), streams, database={"postgres": self.dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            consumers=[{"type": "jsonl", "path": "facts.jsonl"}]), "worker1").start()
        path = os.path.join(worker.dir, "facts.jsonl")
        written, stop = [], threading.Event()

        def write_on():
            while not stop.is_set():
                written.append(self.write(master, "events", [["w", len(written)]]))
                stop.wait(0.02)

        writes = threading.Thread(target=write_on)
        writes.start()

        def stop_writing():
            stop.set()
            writes.join()
        self.addCleanup(stop_writing)
        wait_for(lambda: len(self.tokens(worker, "events")) >= 5, 60, "the worker reads")
        worker.kill(signal.SIGTERM)
        first = self.tokens(worker, "events")
        wait_for(lambda: self.snapshot()[0] > first[-1], 60, "a trim past the worker")

        # The gap and the command it names.
        worker.start()
        wait_for(lambda: _status(worker) == 503, 60, "the gap")
        try:
            http(worker.http_base + "/health")
        except urllib.error.HTTPError as e:
            reason = json.loads(e.read())["reason"]
        args = shlex.split(re.search(r"run `replicator (rewind [^`]*)`", reason).group(1))
        self.assertEqual(args[-2:], ["--skip-to", "boundary"], reason)
        worker.kill(signal.SIGTERM)
        done = cli(*args, cwd=worker.dir)
        self.assertEqual((done.returncode, done.stderr), (0, ""), done.stdout)
        pasted = int(re.search(r"position \d+ -> (\d+):", done.stdout).group(1))
        # Held stopped while the trimmer passes the new position.
        wait_for(lambda: self.snapshot()[0] > pasted, 60, "a trim past the pasted skip")
        worker.start()
        accepted = "had accepted that loss"
        wait_for(lambda: accepted in worker.output() or _status(worker) == 503, 60,
                 "the worker skips again or stops")
        self.assertIn(accepted, worker.output(), worker.output()[-3000:])
        wait_for(lambda: _status(worker) == 200, 60, "the worker healthy")
        # verify beside the running worker, retention trimming on: never a
        # false difference (a fact just appended, or just trimmed).
        for _ in range(3):
            done = cli("verify", "-c", worker.path, "0", cwd=worker.dir)
            self.assertEqual((done.returncode, done.stderr), (0, ""), done.stdout)
            self.assertIn("verify: EQUAL: ", done.stdout)
        stop_writing()
        last = written[-1]
        wait_for(lambda: self.tokens(worker, "events")[-1:] == [last], 60, "caught up")
        self.assertEqual(_status(worker), 200)
        for d in (master, worker):
            d.kill(signal.SIGTERM)
            self.assertEqual(d.proc.returncode, 0, d.output()[-2000:])
        self.assertNotIn("the stream is stopped here", worker.output().split(accepted)[-1])

        with open(path) as f:
            lines = [json.loads(line) for line in f]
        skips = [line for line in lines if "skip" in line]
        self.assertEqual(skips[0]["position"], pasted)
        self.assertGreaterEqual(len(skips), 2, skips)
        boundaries = {int(b) for b in re.findall(r"the trim boundary is (\d+)", master.output())}
        for before, skip in zip(skips, skips[1:]):
            # Each automatic skip: from where the previous one went to a
            # boundary the trimmer had made (every fact up to it gone).
            at = skip["skip"]["at"]
            self.assertEqual(skip, {"stream": "events", "writer": "master",
                                    "position": skip["position"],
                                    "skip": {"from": before["position"], "facts": 0,
                                             "trimmed_through": skip["position"], "at": at,
                                             "to": "boundary"}})
            self.assertGreater(skip["position"], before["position"])
            self.assertIn(skip["position"], boundaries)
        self.assertEqual(worker.output().count(accepted), len(skips) - 1)
        # Nothing after the first automatic skip but facts above the last one.
        after = lines[lines.index(skips[1]):]
        self.assertEqual([e["position"] for e in after if "skip" in e],
                         [s["position"] for s in skips[1:]])
        to = skips[-1]["position"]
        self.assertEqual(self.tokens(worker, "events"),
                         first + [i for i in sorted(written) if i > to])

        done = cli("verify", "-c", worker.path, "0", cwd=worker.dir)
        self.assertEqual((done.returncode, done.stderr), (0, ""), done.stdout)
        for before, skip in zip(skips, skips[1:]):
            self.assertIn(f"    skipped by rewind --skip-to at {skip['skip']['at']}: facts "
                          f"{before['position'] + 1} to {skip['position']}, 0 of them in the "
                          f"table then (facts up to {skip['position']} were trimmed by "
                          f"retention)\n", done.stdout)
        self.assertIn("verify: EQUAL: ", done.stdout)
