"""Streams on real databases: writing facts, reading updates, restarts.

The same suite runs on SQLite (the embedded default) and on a real
PostgreSQL started by the tests; PostgreSQL adds concurrent writers and two
instances writing one multi-writer stream.
"""

import os
import random
import sqlite3
import tempfile
import threading

import orjson
import psycopg2
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from twisted.enterprise import adbapi
from twisted.internet import defer, reactor, threads
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator.config import ConfigError, parse_database, parse_streams
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from replicator.streams.rows import RowCodec, RowError, WireRowCheck, check_rows
from tests.servers import PostgresServer
from tests.support import sleep, until

STREAMS = [
    {
        "name": "caches", "table": "cache_stream",
        "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}],
        "writers": ["master", "worker1"],
    },
    {
        "name": "flags", "table": "flag_stream", "writer_column": None,
        "columns": [{"user_id": "text"}, {"enabled": "boolean"}, {"extra": "json"}],
        "writers": ["master"],
    },
]


def db_params(columns, row):
    """The reference a row's statement parameters are checked against: the
    row as given, JSON columns as JSON text."""
    params = list(row)
    for i, column in enumerate(columns):
        if column.type == "json" and params[i] is not None:
            params[i] = orjson.dumps(params[i]).decode()
    return params



def expected_page(facts, start, to, limit):
    """The page ``(facts, upto, limited)`` of ``(token, rows)`` facts with
    ``start < token <= to``: whole facts up to ``limit`` rows (at least one)."""
    inside = [(t, rows) for t, rows in facts if start < t <= to]
    taken, count = [], 0
    for t, rows in inside:
        if taken and count + len(rows) > limit:
            break
        taken.append((t, rows))
        count += len(rows)
    limited = sum(len(rows) for _, rows in inside) > limit
    return taken, (taken[-1][0] if limited else to), limited

class StreamSuite:
    """Tests shared by both engines; subclasses say how to get a database."""

    def database_config(self):
        raise NotImplementedError

    def raw_rows(self, sql):
        raise NotImplementedError

    def one_connection_config(self, group_max):
        """This database with one write connection and ``write_group_max``."""
        raise NotImplementedError

    def add_check(self):
        """Make the database refuse cache_stream rows with a negative
        invalidation_ts (a constraint the row checks know nothing of)."""
        raise NotImplementedError

    async def registry(self, instance="master", streams=STREAMS, config=None):
        db = Database(config or self.db_config)
        self.addCleanup(db.close)
        registry = StreamRegistry(db, instance, parse_streams(streams), reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        return registry

    def setUp(self):
        self.db_config = self.database_config()

    async def test_tallies_and_probes_say_what_the_table_holds(self):
        """What a reader's checked POSITION and the delivery audit ask the
        table (one statement each; the modulo once read as a placeholder)."""
        from replicator.streams.tally import tally_of

        caches = (await self.registry()).get("caches")
        ids = await caches.write_facts([[["a", None, 1], ["b", None, 2]], [["c", None, 3]]])
        self.assertEqual(await caches.tally("master", 0, ids[-1]),
                         (tally_of([(ids[0], 2), (ids[1], 1)]), 0))
        self.assertEqual(await caches.first_fact_in("master", ids[0], ids[-1]), ids[1])
        self.assertIsNone(await caches.first_fact_in("master", ids[-1], ids[-1] + 5))
        self.assertEqual(await caches.fact_sizes("master", 0, ids[-1] + 5),
                         [(ids[0], 2), (ids[1], 1)])

    async def test_write_and_read(self):
        reg = await self.registry()
        caches = reg.get("caches")
        async with caches.writer() as fact:
            fact.add_row(["get_user", ["@a:hs"], 1000])
        self.assertEqual(fact.stream_id, 1)
        ids = await caches.write_facts([
            [["f", None, 1], ["g", {"k": [1, "x y"]}, 2]],
            [],                       # a fact with no rows
            [["h", ["é", "\n"], 3]],
        ])
        self.assertEqual(ids, [2, 3, 4])
        self.assertEqual(caches.id_gen.get_current_token(caches.instance_name), 4)
        updates, upto, limited = await caches.updates_since("master", 0, 4)
        self.assertEqual(updates, [
            (1, ["get_user", ["@a:hs"], 1000]),
            (2, ["f", None, 1]), (2, ["g", {"k": [1, "x y"]}, 2]),
            (4, ["h", ["é", "\n"], 3]),
        ])
        self.assertEqual((upto, limited), (4, False))
        self.assertEqual(await caches.updates_since("worker1", 0, 4), ([], 4, False))
        self.assertEqual(await caches.updates_since("master", 4, 4), ([], 4, False))

        flags = reg.get("flags")
        await flags.write_fact([["@u:hs", True, {"a": None}], ["@v:hs", False, []]])
        updates, _, _ = await flags.updates_since("master", 0, 10)
        self.assertEqual(updates, [(1, ["@u:hs", True, {"a": None}]),
                                   (1, ["@v:hs", False, []])])

    async def test_limit_never_splits_a_fact(self):
        reg = await self.registry()
        caches = reg.get("caches")
        await caches.write_facts([
            [["a", None, 1]],
            [["b", None, 1], ["b", None, 2], ["b", None, 3]],
            [["c", None, 1]],
        ])
        updates, upto, limited = await caches.updates_since("master", 0, 3, limit=2)
        self.assertEqual([t for t, _ in updates], [1])
        self.assertEqual((upto, limited), (1, True))
        # A fact bigger than the limit comes whole.
        updates, upto, limited = await caches.updates_since("master", 1, 3, limit=2)
        self.assertEqual([t for t, _ in updates], [2, 2, 2])
        self.assertEqual((upto, limited), (2, True))
        updates, upto, limited = await caches.updates_since("master", 2, 3, limit=2)
        self.assertEqual([t for t, _ in updates], [3])
        self.assertEqual((upto, limited), (3, False))

    async def test_pages_of_facts_say_what_the_table_holds(self):
        """``facts_since`` (the catch-up's pages, whole facts) and
        ``updates_since`` (rows) read from the table agree with what was
        written, for every start and limit: values exactly (nested JSON,
        64-bit integers, floats, escapes), facts whole, the same page ends."""
        plain = {"name": "plain", "table": "plain_stream", "writers": ["master"],
                 "columns": [{"body": "text"}, {"n": "bigint?"}, {"ok": "boolean?"}]}
        reg = await self.registry(streams=STREAMS + [plain])
        caches, flags = reg.get("caches"), reg.get("flags")
        written = [
            [["a", {"big": 2**62, "neg": -(2**63), "f": 1.5, "n": [None, True, {}]}, 2**63 - 1]],
            [["b\"\\", ["é", "\u2028", "\x01", "\n", "😀"], -(2**63)],
             ["b2", None, 0], ["b3", [[[]]], 7]],
            [],
            [["d", "a string", 1], ["d2", 12345678901234, 2]],
            [["e", 0.1, 3]],
            [["f1", None, 4], ["f2", None, 5], ["f3", None, 6], ["f4", None, 7]],
            [["g", False, 8]],
        ]
        ids = await caches.write_facts(written)
        facts = [(t, rows) for t, rows in zip(ids, written) if rows]
        top = ids[-1]
        await flags.write_facts([[["@u:hs", True, {"x": [1, 2]}], ["@v:hs", False, []]],
                                 [["@w:hs", True, "s"]]])

        for start in range(top + 1):
            for limit in range(1, 8):
                want = expected_page(facts, start, top, limit)
                got = await caches.facts_since("master", start, top, limit)
                self.assertEqual(got, want, (start, limit))
                rows = await caches.updates_since("master", start, top, limit)
                self.assertEqual(rows, ([(t, r) for t, rs in want[0] for r in rs],
                                        want[1], want[2]), (start, limit))
        self.assertEqual(await caches.facts_since("worker1", 0, top), ([], top, False))
        self.assertEqual(await caches.facts_since("master", top, top), ([], top, False))
        self.assertEqual(await flags.facts_since("master", 0, 5, 2), (
            [(1, [["@u:hs", True, {"x": [1, 2]}], ["@v:hs", False, []]])], 1, True))
        self.assertEqual(await flags.facts_since("master", 1, 5), (
            [(2, [["@w:hs", True, "s"]])], 5, False))
        # Without JSON columns (decoded another way on PostgreSQL).
        plain_facts = [[["q\"\\\x01é😀\u2028", 2**63 - 1, True], ["", -(2**63), None]],
                       [["x", None, False]], [["y", 0, True], ["z", 1, None], ["w", 2, False]]]
        plain_ids = await reg.get("plain").write_facts(plain_facts)
        for limit in (1, 2, 3, 6):
            self.assertEqual(await reg.get("plain").facts_since("master", 0, 3, limit),
                             expected_page(list(zip(plain_ids, plain_facts)), 0, 3, limit), limit)

    async def test_catch_up_pages_of_another_instances_writer(self):
        """A reader's pages of another instance's writer (read ahead on
        PostgreSQL): page after page, or from anywhere, with any limit, the
        same pages as one read each; facts written meanwhile are seen."""
        master = (await self.registry()).get("caches")
        written = [[[f"f{i}", None, i]] * (1 + i % 4) for i in range(1, 40)]
        ids = await master.write_facts(written)
        facts = list(zip(ids, written))
        caches = (await self.registry(instance="reader")).get("caches")

        def expect(start, to, limit):
            return expected_page(facts, start, to, limit)

        async def catch_up(start, to, limit):
            pages = []
            while start < to:
                page = await caches.facts_since("master", start, to, limit)
                self.assertEqual(page, expect(start, to, limit), (start, to, limit))
                pages.append(page)
                start = page[1]
            return pages

        top = ids[-1]
        for limit in (1, 3, 5, 1000):
            pages = await catch_up(0, top, limit)
            self.assertEqual([f for page in pages for f in page[0]], facts)
        for start in (0, 7, 3, 20, 19, 38):  # jumps: a new run each
            self.assertEqual(await caches.facts_since("master", start, top, 4),
                             expect(start, top, 4))
        await catch_up(0, 10, 2)  # the run stops halfway ...
        if caches._read_ahead is not None:  # (PostgreSQL: pages read ahead in runs)
            run = caches._read_ahead._runs["master"]
            await until(lambda: run.ended)  # ... and ends, waiting for a reader gone away
        await catch_up(10, top, 2)
        more = await master.write_facts([[["late", None, 1]], [["later", None, 2]]])
        facts.extend(zip(more, [[["late", None, 1]], [["later", None, 2]]]))
        await catch_up(top, more[-1], 1)

    async def test_failed_write_rolls_back_and_completes(self):
        reg = await self.registry()
        caches = reg.get("caches")
        await caches.write_fact([["a", None, 1]])

        def boom(txn, stream_id):
            raise RuntimeError("application failure")

        with self.assertRaises(RuntimeError):
            async with caches.writer() as fact:
                fact.add_row(["lost", None, 1])
                fact.also(boom)
        await caches.write_fact([["c", None, 3]])
        self.assertEqual(caches.id_gen.get_current_token(caches.instance_name), 3)
        self.assertEqual(caches.id_gen.in_flight(), 0)
        updates, _, _ = await caches.updates_since("master", 0, 3)
        self.assertEqual(updates, [(1, ["a", None, 1]), (3, ["c", None, 3])])
        # An exception in the block itself reserves nothing.
        with self.assertRaises(KeyError):
            async with caches.writer() as fact:
                fact.add_row(["never", None, 1])
                raise KeyError("x")
        self.assertEqual(await caches.write_fact([]), 4)

    async def test_sequence_value_is_the_last_id_handed_out(self):
        reg = await self.registry()
        caches = reg.get("caches")
        self.assertEqual(await caches.sequence_value(), 0)
        await caches.write_facts([[["a", None, 1]], []])

        def boom(txn, stream_id):
            raise RuntimeError("application failure")

        with self.assertRaises(RuntimeError):
            async with caches.writer() as fact:
                fact.add_row(["lost", None, 1])
                fact.also(boom)
        # A rolled-back ID was handed out all the same.
        self.assertEqual(await caches.sequence_value(), 3)
        self.assertEqual(await reg.get("flags").sequence_value(), 0)

    async def test_bad_rows_are_refused_before_reserving(self):
        reg = await self.registry()
        caches = reg.get("caches")
        for bad in (["a", None], ["a", None, "x"], [None, None, 1], ["a", None, True], "row"):
            with self.assertRaises(RowError):
                await caches.write_fact([bad])
        with self.assertRaises(ValueError):
            await caches.write_fact([["a", None, 1]], writer="worker1")
        self.assertEqual(caches.id_gen.get_current_token(caches.instance_name), 0)
        self.assertEqual(await caches.write_fact([["a", None, 1]]), 1)

    async def test_restart_recovers_positions(self):
        reg = await self.registry()
        caches = reg.get("caches")
        for i in range(5):
            await caches.write_fact([["a", None, i]] * (i % 3))
        await reg.stop()
        reg2 = await self.registry()
        again = reg2.get("caches")
        self.assertEqual(again.id_gen.get_current_token(again.instance_name), 5)
        self.assertEqual(again.id_gen.in_flight(), 0)
        self.assertEqual(await again.write_fact([["b", None, 9]]), 6)
        await again.flush_positions()
        persisted = self.raw_rows(
            "SELECT instance_name, stream_id FROM stream_positions "
            "WHERE stream_name = 'caches'")
        self.assertEqual(dict(persisted)["master"], 6)

    async def test_positions_persist_in_the_writing_transaction(self):
        reg = await self.registry()
        caches = reg.get("caches")
        await caches.write_fact([["a", None, 1]])
        await caches.write_fact([["b", None, 1]])

        def persisted():
            return dict((r[0], r[1]) for r in self.raw_rows(
                "SELECT instance_name, stream_id FROM stream_positions "
                "WHERE stream_name = 'caches'"))["master"]

        # Written with the fact: a lower bound, never past the current token.
        self.assertIn(persisted(), (1, 2))
        await caches.flush_positions()
        self.assertEqual(persisted(), 2)

    async def test_config_errors_name_the_key(self):
        with self.assertRaises(ConfigError) as e:
            parse_streams(STREAMS + [dict(STREAMS[0], table="other")])
        self.assertEqual(str(e.exception),
                         "config: streams[2].name: duplicate stream 'caches' (also streams[0])")
        with self.assertRaises(ConfigError) as e:
            parse_streams([dict(STREAMS[1], writers=[])])
        self.assertEqual(str(e.exception),
                         "config: streams[0].writers: a stream needs at least one writer")
        with self.assertRaises(ConfigError) as e:
            parse_streams([dict(STREAMS[0], columns=[{"a": "float"}])])
        self.assertIn("streams[0].columns[0].a: unknown type 'float'", str(e.exception))
        await self.registry()  # creates the tables
        bad = [dict(STREAMS[0], create=False,
                    columns=STREAMS[0]["columns"] + [{"missing": "text"}])]
        with self.assertRaises(ConfigError) as e:
            await self.registry(streams=bad)
        self.assertEqual(
            str(e.exception),
            "config: streams[0].columns[3]: unknown column 'missing' in table 'cache_stream'")


    # ------------------------------------------------------- group commit
    async def held_write(self, caches):
        """A write whose transaction holds the one write connection until
        the returned ``release`` is called; returns (its Deferred, release)."""
        entered, release = threading.Event(), threading.Event()
        self.addCleanup(release.set)

        def hold(txn, stream_id):
            entered.set()
            release.wait(60)

        first = defer.ensureDeferred(caches.write_facts([[["held", None, 0]]], hooks=[hold]))
        self.assertTrue(await threads.deferToThread(entered.wait, 60))
        return first, release.set

    @staticmethod
    def group_sizes(le=None):
        """(count, sum) of the caches stream's group-size histogram, or the
        count of its bucket ``le``."""
        def sample(name, **labels):
            return REGISTRY.get_sample_value(name, {"stream": "caches", **labels}) or 0.0
        if le is not None:
            return sample("replicator_write_group_size_bucket", le=le)
        return (sample("replicator_write_group_size_count"),
                sample("replicator_write_group_size_sum"))

    async def test_waiting_writes_go_together_into_the_next_transaction(self):
        reg = await self.registry(config=self.one_connection_config(256))
        caches = reg.get("caches")
        count0, sum0 = self.group_sizes()
        one0 = self.group_sizes(le="1.0")
        first, release = await self.held_write(caches)
        waiting = [defer.ensureDeferred(caches.write_fact([[f"w{i}", None, i]]))
                   for i in range(9)]
        release()
        self.assertEqual(await first, [1])
        self.assertEqual(await defer.gatherResults(waiting), list(range(2, 11)))
        # One transaction for the held write, one for the nine.
        self.assertEqual(self.group_sizes(), (count0 + 2, sum0 + 10))
        self.assertEqual(self.group_sizes(le="1.0"), one0 + 1)
        self.assertEqual(caches.id_gen.get_current_token("master"), 10)
        updates, _, _ = await caches.updates_since("master", 0, 10)
        self.assertEqual(updates, [(1, ["held", None, 0])]
                         + [(i + 2, [f"w{i}", None, i]) for i in range(9)])

    async def test_group_size_is_bounded(self):
        reg = await self.registry(config=self.one_connection_config(4))
        caches = reg.get("caches")
        count0, sum0 = self.group_sizes()
        two0, four0 = self.group_sizes(le="2.0"), self.group_sizes(le="4.0")
        first, release = await self.held_write(caches)
        waiting = [defer.ensureDeferred(caches.write_fact([[f"w{i}", None, i]]))
                   for i in range(10)]
        release()
        await first
        self.assertEqual(await defer.gatherResults(waiting), list(range(2, 12)))
        # 1 (held), then 4, 4, 2: never more than write_group_max.
        self.assertEqual(self.group_sizes(), (count0 + 4, sum0 + 11))
        self.assertEqual(self.group_sizes(le="4.0"), four0 + 4)
        self.assertEqual(self.group_sizes(le="2.0"), two0 + 2)
        self.assertEqual(caches.id_gen.in_flight(), 0)

    async def test_a_bad_fact_fails_alone_in_its_group(self):
        """The group's transaction fails on one fact's row; its writes are
        retried one by one: only that one gets the error, the others commit,
        and readers get every committed fact in order, nothing in flight."""
        reg = await self.registry(config=self.one_connection_config(256))
        caches = reg.get("caches")
        self.add_check()
        count0, sum0 = self.group_sizes()
        first, release = await self.held_write(caches)
        values = [1, 2, -3, 4, 5]
        waiting = [defer.ensureDeferred(caches.write_fact([[f"w{v}", None, v]]))
                   for v in values]
        release()
        await first
        results = await defer.DeferredList(waiting, consumeErrors=True)
        committed = {}
        for v, (ok, result) in zip(values, results):
            if v < 0:
                self.assertFalse(ok)
                result.trap(psycopg2.IntegrityError, sqlite3.IntegrityError)
            else:
                self.assertTrue(ok, result)
                committed[result] = [[f"w{v}", None, v]]
        self.assertEqual(len(committed), 4)
        # The held write, the group of five (failed), five alone.
        self.assertEqual(self.group_sizes(), (count0 + 7, sum0 + 11))
        top = await caches.sequence_value()
        self.assertEqual(top, 11)
        self.assertEqual(caches.id_gen.get_current_token("master"), top)
        self.assertEqual(caches.id_gen.in_flight(), 0)
        updates, _, _ = await caches.updates_since("master", 1, top)
        self.assertEqual(updates, [(t, row) for t in sorted(committed)
                                   for row in committed[t]])
        self.assertEqual(self.raw_rows("SELECT count(*) FROM cache_stream"), [(5,)])
        # The writer goes on.
        self.assertEqual(await caches.write_fact([["after", None, 6]]), 12)


class SQLiteStreamTests(StreamSuite, TestCase):
    def database_config(self):
        self.tmp = tempfile.mkdtemp()
        return parse_database({"sqlite": os.path.join(self.tmp, "streams.db")})

    def one_connection_config(self, group_max):
        return parse_database({"sqlite": self.db_config.path, "write_group_max": group_max})

    def add_check(self):
        conn = sqlite3.connect(self.db_config.path)
        try:
            conn.execute("CREATE TRIGGER nonnegative BEFORE INSERT ON cache_stream "
                         "WHEN NEW.invalidation_ts < 0 "
                         "BEGIN SELECT RAISE(ABORT, 'negative invalidation_ts'); END")
            conn.commit()
        finally:
            conn.close()

    def raw_rows(self, sql):
        conn = sqlite3.connect(self.db_config.path)
        try:
            return conn.execute(sql).fetchall()
        finally:
            conn.close()


    async def test_reissued_id_fails_with_its_own_error(self):
        """An ID handed out again (PostgreSQL's sequence after a crash) is
        refused with an error that says so; nothing stays in flight and
        nothing commits at or below the writer's position."""
        reg = await self.registry()
        caches = reg.get("caches")
        await caches.write_facts([[["a", None, 1]]] * 3)
        caches._txn.sqlite_last = 2  # the sequence went back
        with self.assertRaises(ValueError) as e:
            await caches.write_fact([["b", None, 1]])
        self.assertEqual(str(e.exception),
                         "stream caches: reserved ID 3 is not above master's position 3")
        self.assertEqual(caches.id_gen.in_flight(), 0)
        self.assertEqual(self.raw_rows("SELECT count(*) FROM cache_stream"), [(3,)])
        self.assertEqual(await caches.write_fact([["c", None, 1]]), 4)
        self.assertEqual(caches.id_gen.get_current_token(caches.instance_name), 4)


class PostgresStreamTests(StreamSuite, TestCase):
    timeout = 120

    def database_config(self):
        self.dsn = PostgresServer.shared().create_database()
        return parse_database({"postgres": self.dsn, "pool_max": 6})

    async def test_read_ahead_is_bounded_and_hands_on_a_failed_read(self):
        """The pages of a run: at most ``ahead`` read beyond what was asked
        for; a run nobody asks from ends (its connection given back); a read
        that fails fails the request it was for, and the next request reads
        again."""
        master = (await self.registry()).get("caches")
        ids = await master.write_facts([[[f"f{i}", None, i]] for i in range(1, 30)])
        caches = (await self.registry(instance="reader")).get("caches")
        ahead = caches._read_ahead
        self.assertIsNotNone(ahead)
        reads = []
        real_read = ahead._read

        def read(cursor, writer, since, until, limit):
            reads.append(since)
            if since == 20 and reads.count(20) == 1:
                raise psycopg2.OperationalError("the read of page 20 fails")
            return real_read(cursor, writer, since, until, limit)
        ahead._read = read
        page = await caches.facts_since("master", 0, ids[-1], 2)
        self.assertEqual((page[1], page[2]), (2, True))
        run = ahead._runs["master"]
        await until(lambda: run.ended)  # the run waits for the reader, then ends
        self.assertEqual(reads, [0, 2, 4])  # the page asked for and `ahead` more
        since = 2
        while since < 20:
            since = (await caches.facts_since("master", since, ids[-1], 2))[1]
        with self.assertRaises(psycopg2.OperationalError):
            await caches.facts_since("master", 20, ids[-1], 2)
        page = await caches.facts_since("master", 20, ids[-1], 2)
        self.assertEqual([t for t, _ in page[0]], [21, 22])

    async def test_read_ahead_after_its_connection_died(self):
        """A run whose connection dies (a server restart, a cut link) fails
        the request waiting for it, quietly (no unhandled error); the next
        request reads on a new connection."""
        master = (await self.registry()).get("caches")
        ids = await master.write_facts([[[f"f{i}", None, i]] for i in range(1, 30)])
        caches = (await self.registry(instance="reader")).get("caches")
        page = await caches.facts_since("master", 0, ids[-1], 2)
        self.assertEqual(page[1], 2)
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        cursor = conn.cursor()
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE pid <> pg_backend_pid() AND datname = current_database() "
                       "AND (query LIKE %s OR query LIKE %s)",
                       ("%FROM cache_stream WHERE%ctid LIMIT%",
                        "%trimmed_through FROM stream_retention%"))  # a page's last statement
        self.assertEqual(cursor.fetchall(), [(True,)])  # the reader's connection
        conn.close()
        since, failures = 2, 0
        while since < ids[-1]:
            try:
                since = (await caches.facts_since("master", since, ids[-1], 2))[1]
            except psycopg2.Error:
                failures += 1
                self.assertLess(failures, 10)
        self.assertEqual(since, ids[-1])

    def one_connection_config(self, group_max):
        # pool_max 2: one connection writes, one is left for reads.
        return parse_database({"postgres": self.dsn, "pool_max": 2,
                               "write_group_max": group_max})

    def add_check(self):
        conn = psycopg2.connect(self.dsn)
        try:
            conn.cursor().execute("ALTER TABLE cache_stream ADD CONSTRAINT nonnegative "
                                  "CHECK (invalidation_ts >= 0)")
            conn.commit()
        finally:
            conn.close()

    def raw_rows(self, sql):
        conn = psycopg2.connect(self.dsn)
        try:
            cur = conn.cursor()
            cur.execute(sql)
            return cur.fetchall()
        finally:
            conn.close()

    async def test_sequence_behind_table_is_moved_forward(self):
        reg = await self.registry()
        await reg.get("caches").write_facts([[["a", None, 1]]] * 3)
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        conn.cursor().execute("SELECT setval('cache_stream_seq', 1)")
        conn.close()
        reg2 = await self.registry()
        self.assertEqual(await reg2.get("caches").write_fact([["b", None, 1]]), 4)
        self.flushLoggedErrors()

    async def test_rows_of_writers_not_configured_are_not_positions(self):
        """``stream_positions`` rows of instances the stream does not name
        (another deployment sharing the database and the stream's name, a
        writer long removed) move neither the sequence nor any token: a red
        team saw a restart move a sequence to another deployment's
        position."""
        reg = await self.registry()
        caches = reg.get("caches")
        await caches.write_facts([[["a", None, 1]]] * 3)
        await reg.stop()
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        conn.cursor().execute("INSERT INTO stream_positions (stream_name, instance_name, "
                              "stream_id) VALUES (%s, 'elsewhere', 500)",
                              (caches.config.positions_key,))
        conn.close()
        reg2 = await self.registry()
        caches2 = reg2.get("caches")
        self.assertEqual(caches2.id_gen.get_current_token(caches2.instance_name), 3)
        self.assertEqual(self.raw_rows("SELECT last_value FROM cache_stream_seq")[0][0], 3)
        self.assertEqual(await caches2.write_fact([["b", None, 1]]), 4)

    async def test_concurrent_writers(self):
        """Many transactions at once on separate connections, some failing."""
        reg = await self.registry()
        caches = reg.get("caches")
        rng = random.Random(7)
        committed = {}
        seen_tokens = []
        caches.id_gen.add_listener(lambda w, old, new: seen_tokens.append((old, new)))

        async def one(i):
            rows = [[f"f{i}", [i, j], i] for j in range(rng.choice([0, 1, 1, 2, 5]))]
            fail = rng.random() < 0.15
            if rng.random() < 0.2:
                ids = await caches.write_facts([rows, rows[:1]])
                committed[ids[0]] = rows
                committed[ids[1]] = rows[:1]
                return

            def maybe_fail(txn, stream_id):
                if fail:
                    raise RuntimeError("rolled back")

            try:
                async with caches.writer() as fact:
                    fact.add_rows(rows)
                    fact.also(maybe_fail)
                committed[fact.stream_id] = rows
            except RuntimeError:
                pass

        await defer.gatherResults(
            [defer.ensureDeferred(one(i)) for i in range(300)], consumeErrors=True)
        top = self.raw_rows("SELECT last_value FROM cache_stream_seq")[0][0]
        self.assertEqual(caches.id_gen.get_current_token(caches.instance_name), top)
        self.assertEqual(caches.id_gen.in_flight(), 0)
        # Tokens only ever moved forward, one step after another.
        for (o1, n1), (o2, n2) in zip(seen_tokens, seen_tokens[1:]):
            self.assertEqual(n1, o2)
            self.assertLess(o2, n2)
        updates, upto, limited = await caches.updates_since("master", 0, top, limit=100000)
        expected = [(t, row) for t in sorted(committed) for row in committed[t]]
        self.assertEqual(sorted(updates), sorted(expected))
        self.assertEqual([t for t, _ in updates], sorted(t for t, _ in updates))
        self.assertEqual(len(updates), self.raw_rows("SELECT count(*) FROM cache_stream")[0][0])

    async def test_sequence_value_sees_other_instances_writes(self):
        master = (await self.registry("master")).get("caches")
        worker = (await self.registry("worker1")).get("caches")
        await worker.write_facts([[["w", None, i]] for i in range(4)])
        self.assertEqual(master.id_gen.get_max_known(), 0)
        self.assertEqual(await master.sequence_value(), 4)

    async def test_two_instances_share_a_multi_writer_stream(self):
        master = (await self.registry("master")).get("caches")
        worker = (await self.registry("worker1")).get("caches")
        a = await master.write_facts([[["m", None, i]] for i in range(3)])
        b = await worker.write_facts([[["w", None, i]] for i in range(2)])
        c = await master.write_fact([["m", None, 9]])
        self.assertEqual(a + b + [c], [1, 2, 3, 4, 5, 6])
        self.assertEqual(master.id_gen.get_linear_token(), 0)
        for _ in range(2):  # exchange positions both ways
            worker.id_gen.advance("master", master.id_gen.get_current_token("master"))
            master.id_gen.advance("worker1", worker.id_gen.get_current_token("worker1"))
        self.assertEqual(master.id_gen.get_linear_token(), 6)
        self.assertEqual(worker.id_gen.get_linear_token(), 6)
        updates, _, _ = await master.updates_since("worker1", 0, 6)
        self.assertEqual([t for t, _ in updates], [4, 5])
        # A restarted worker resumes from its persisted position; an idle
        # writer's position follows the linear token, which was 6.
        await worker.flush_positions()
        await master.flush_positions()
        again = (await self.registry("worker1")).get("caches")
        self.assertEqual(again.id_gen.get_current_token("worker1"), 6)
        self.assertEqual(again.id_gen.get_current_token("master"), 6)
        # A writer new to the stream has nothing in flight: it is idle, at
        # the largest persisted position; the linear token stays at the
        # smallest, never ahead of facts others may have in flight.
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        conn.cursor().execute(
            "UPDATE stream_positions SET stream_id = 3 WHERE instance_name = 'master'")
        conn.close()
        streams = [dict(STREAMS[0], writers=["master", "worker1", "worker2"])]
        fresh = (await self.registry("worker2", streams=streams)).get("caches")
        self.assertEqual(fresh.id_gen.get_current_token("worker2"), 6)
        self.assertEqual(fresh.id_gen.get_linear_token(), 3)

    async def test_writer_starting_ahead_of_its_row_persists_it(self):
        """An idle writer starts at the largest persisted position, ahead of
        its own row (here: none yet); that start is persisted without any
        write or advance, or the export's bound (the smallest row) stays
        behind until the writer next moves."""
        master = (await self.registry("master")).get("caches")
        await master.write_facts([[["m", None, i]] for i in range(3)])
        await master.flush_positions()
        worker = (await self.registry("worker1")).get("caches")
        self.assertEqual(worker.id_gen.get_current_token("worker1"), 3)
        rows = None
        deadline = reactor.seconds() + 30
        while rows != [("worker1", 3)]:
            self.assertLess(reactor.seconds(), deadline, f"worker1's row: {rows}")
            await sleep(0.05)
            rows = await worker.db.runQuery(
                "SELECT instance_name, stream_id FROM stream_positions "
                "WHERE stream_name = 'caches' AND instance_name = 'worker1'")
            rows = [tuple(r) for r in rows]


class RecentFactsTests(TestCase):
    """The fan-out reads just-written facts from memory; it must say exactly
    what the table says (values, order, limits), and fall back when it can't."""

    timeout = 120
    setUp = StreamSuite.setUp
    registry = StreamSuite.registry
    database_config = PostgresStreamTests.database_config

    async def test_memory_answers_like_the_table(self):
        reg = await self.registry()
        caches = reg.get("caches")
        caches.keep_recent_facts()  # as the replication handler does
        await caches.write_facts([
            [["a", {"z": 1, "a": [True, None]}, 1]],
            [["b", None, 1], ["b", None, 2], ["b", None, 3]],
            [],
            [["d", ["é"], 4]],
        ])

        def boom(txn, stream_id):
            raise RuntimeError("rolled back")
        with self.assertRaises(RuntimeError):
            async with caches.writer() as fact:
                fact.add_row(["lost", None, 0])
                fact.also(boom)
        top = caches.id_gen.get_current_token(caches.instance_name)
        self.assertEqual(top, 5)
        # A failed write may have committed (a lost COMMIT answer): only
        # the table can say; memory answers only ranges without one.
        self.assertIsNone(caches._recent_updates("master", 0, top, 1000))
        self.assertIsNotNone(caches._recent_updates("master", 0, 4, 1000))
        top = 4
        for start, limit in ((0, 1000), (0, 2), (1, 2), (1, 3), (2, 1)):
            from_memory = caches._recent_updates("master", start, top, limit)
            from_table = caches.db.runInteraction(
                caches._pages.read, "master", start, top, limit)
            self.assertIsNotNone(from_memory)
            self.assertEqual(from_memory, await from_table, (start, limit))
        caches.forget("master", 3)
        self.assertIsNone(caches._recent_updates("master", 0, top, 100))
        self.assertEqual(caches._recent_updates("master", 3, top, 100),
                         ([(4, ["d", ["é"], 4])], 4, False))
        caches.forget("master", 5)
        # Beyond what has completed, only the table can answer.
        self.assertIsNone(caches._recent_updates("master", 5, 6, 100))
        # Nobody fanning out: nothing is kept.
        caches.recent.active = False
        await caches.write_fact([["e", None, 5]])
        self.assertEqual(caches.recent.facts["master"], {})


class RowCodecTests(SynchronousTestCase):
    """The one-pass codec agrees with the general checks on every row."""

    COLUMNS = parse_streams([dict(STREAMS[0], columns=[
        {"t": "text"}, {"n": "bigint?"}, {"b": "boolean"}, {"j": "json?"}])])[0].columns

    @given(st.lists(st.lists(st.one_of(
        st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.text(max_size=5),
        st.lists(st.integers(), max_size=2), st.floats(allow_nan=False)), min_size=3, max_size=5),
        max_size=4))
    @settings(max_examples=300, deadline=None)
    def test_same_verdict_and_values_as_check_rows(self, rows):
        codec = RowCodec(self.COLUMNS)
        try:
            expected = [check_rows(self.COLUMNS, [r])[0] for r in rows]
        except RowError:
            expected = None
        if expected is None:
            with self.assertRaises(RowError):
                codec.prepare([rows])
            return
        wire, params, _ = codec.prepare([rows])
        self.assertEqual(wire, [expected])
        self.assertEqual(params, [[db_params(self.COLUMNS, r) for r in expected]])

    @given(st.lists(st.one_of(
        st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.text(max_size=5),
        st.lists(st.integers(), max_size=2), st.floats(allow_nan=False)), min_size=3, max_size=5))
    @settings(max_examples=500, deadline=None)
    def test_wire_check_agrees_with_check_rows(self, row):
        """A received row fits iff it could have been written, except that a
        boolean may also be 0 or 1 (as Synapse sends them)."""
        check = WireRowCheck(self.COLUMNS)
        try:
            check_rows(self.COLUMNS, [row])
            writable = True
        except RowError:
            writable = False
        lenient = list(row)
        if len(row) == 4 and type(row[2]) is int and row[2] in (0, 1):
            lenient[2] = bool(row[2])
            try:
                check_rows(self.COLUMNS, [lenient])
                writable = True
            except RowError:
                pass
        problem = check.check(row)
        self.assertEqual(problem is None, writable, (row, problem))
        self.assertEqual(check.check(tuple(row)), "expected a list of 4 values")

    def test_messages_name_the_row(self):
        codec = RowCodec(self.COLUMNS)
        with self.assertRaises(RowError) as e:
            codec.prepare([[["a", 1, True, None], ["b", "x", True, None]]])
        self.assertEqual(str(e.exception), "row 1: column 'n' expects bigint, got str")

    def test_nan_and_infinity_in_a_json_column_are_refused(self):
        # JSON cannot carry them; stored, they would become null (a
        # different value) in the table and on the wire.
        codec = RowCodec(self.COLUMNS)
        for bad in (float("nan"), float("inf"), float("-inf")):
            for value in (bad, [1, {"a": [bad]}]):
                with self.assertRaises(RowError) as e:
                    codec.prepare([[["a", 1, True, value]]])
                self.assertEqual(str(e.exception),
                                 "row 0: column 'j' holds NaN or Infinity, which JSON cannot carry")
        _, params, _ = codec.prepare([[["a", 1, True, {"f": 1.5}]]])
        self.assertEqual(params, [[["a", 1, True, '{"f":1.5}']]])


class PostgresCrashTests(TestCase):
    """A PostgreSQL crash restart (``pg_ctl restart -m immediate``) under a
    writer, on a cluster of this test's own."""

    timeout = 180

    def setUp(self):
        self.server = PostgresServer()
        self.addCleanup(self.server.stop)
        self.dsn = self.server.create_database()
        self.db_config = parse_database({"postgres": self.dsn, "pool_max": 3})

    registry = StreamSuite.registry

    def sql(self, text):
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        try:
            cur = conn.cursor()
            cur.execute(text)
            return cur.fetchall() if cur.description else None
        finally:
            conn.close()

    async def test_sequence_handing_out_an_id_again_after_a_crash(self):
        """The crash loses the sequence's advance for a transaction that
        never committed, and PostgreSQL hands that ID out again; our writer
        had already moved its position past it (the rolled-back write
        completed).  The next writes must neither fail for it nor commit
        at or below the position."""
        caches = (await self.registry()).get("caches")
        await caches.write_facts([[["a", None, i]] for i in range(3)])
        await caches.flush_positions()
        # The next nextval is WAL-logged afresh after a checkpoint; no
        # commit flushes that record before the crash.
        self.sql("CHECKPOINT")

        def stall(txn, stream_id):
            txn.execute("SELECT pg_sleep(60)")

        async def stalled_write():
            async with caches.writer() as fact:
                fact.add_row(["lost", None, 0])
                fact.also(stall)

        write = defer.ensureDeferred(stalled_write())
        while not self.sql("SELECT 1 FROM pg_stat_activity WHERE query LIKE '%pg_sleep(60)%' "
                           "AND pid <> pg_backend_pid()"):
            await sleep(0.02)
        await threads.deferToThread(self.server.crash_restart)
        with self.assertRaises(Exception) as e:
            await write
        self.assertNotIsInstance(e.exception, ValueError)
        position = caches.id_gen.get_current_token(caches.instance_name)
        self.assertEqual(position, 4)  # the rolled-back 4 completed
        # The crash did send the sequence back (what this test is about).
        self.assertEqual(self.sql("SELECT last_value FROM cache_stream_seq"), [(3,)])
        new_id = None
        for _ in range(20):  # pooled connections die one use at a time
            try:
                new_id = await caches.write_fact([["after", None, 1]])
                break
            except ValueError:
                raise
            except Exception:
                await sleep(0.1)
        self.flushLoggedErrors()
        self.assertGreater(new_id, position)
        self.assertEqual(caches.id_gen.in_flight(), 0)
        self.assertEqual(caches.id_gen.get_current_token(caches.instance_name), new_id)
        self.assertEqual(
            self.sql("SELECT stream_id, cache_func FROM cache_stream ORDER BY stream_id"),
            [(1, "a"), (2, "a"), (3, "a"), (new_id, "after")])
        # The position persisted after the crash is the new one.  The
        # background persist may meet a pooled connection the crash
        # killed (logged, and done again on the next flush).
        query = ("SELECT stream_id FROM stream_positions WHERE stream_name = 'caches' "
                 f"AND instance_name = '{caches.instance_name}'")
        for _ in range(20):
            await caches.flush_positions()
            if self.sql(query) == [(new_id,)]:
                break
        self.assertEqual(self.sql(query), [(new_id,)])
        self.flushLoggedErrors(psycopg2.Error, adbapi.ConnectionLost)
