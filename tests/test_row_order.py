"""The rows of a fact read back in the order they were written.

A stream's table holds a multi-row fact as several rows under one ID.  The
heap order of those rows (PostgreSQL's ``ctid``) is not the order they were
inserted in once space freed by deletions is filled again: retention trims
the oldest facts, VACUUM records their space as free, and a writer whose
current page fills up goes back to it, so the later rows of a fact land on
an earlier page than its first rows.  Every read of an owned table orders a
fact's rows by its ``row_index`` instead (:mod:`replicator.storage.schema`);
a table made by an older release gets the column at its writer's start.
"""

import os
import shutil
import sqlite3
import tempfile

import psycopg2
from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator.config import ConfigError, parse_database, parse_streams
from replicator.config.streams import parse_stream
from replicator.storage import schema
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from tests.daemon import CACHES
from tests.release_020 import FIXTURES, RELEASE_FACTS, postgres_copy
from tests.servers import PostgresServer
from tests.support import LogWatch

PLAIN = {"name": "plain", "table": "plain_stream", "writers": ["master"],
         "columns": [{"body": "text"}, {"n": "bigint"}]}


def fact_ids(rows):
    """The ``n`` column of each row of each fact of a page."""
    return [[row[1] for row in fact_rows] for _, fact_rows in rows]


class HeapOrderTests(TestCase):
    """On a real PostgreSQL, a fact whose rows the heap holds in another
    order than they were written is read in written order by every path
    that reads facts from the table."""

    timeout = 120

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()

    def sql(self, text):
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        try:
            cur = conn.cursor()
            cur.execute(text)
            return cur.fetchall() if cur.description else None
        finally:
            conn.close()

    async def registry(self, instance="master", streams=(PLAIN,)):
        # One connection: the writer keeps filling the page it last wrote
        # to, as a writer under steady load does.
        db = Database(parse_database({"postgres": self.dsn, "pool_max": 1}))
        self.addCleanup(db.close)
        registry = StreamRegistry(db, instance, parse_streams(list(streams)), reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        return registry

    async def test_rows_in_written_order_after_trimmed_space_is_reused(self):
        plain = (await self.registry()).get("plain")
        text = "x".__mul__
        # Page 0: a small fact, then one of four rows; page 1: three rows.
        await plain.write_fact([[text(700), 0]])
        await plain.write_facts([[[text(1900), 0], [text(1900), 1], [text(1900), 2],
                                  [text(1000), 3]],
                                 [[text(1900), 0], [text(1900), 1], [text(1900), 2]]])
        # Retention trims the oldest fact; (auto)vacuum frees its space.
        self.sql("DELETE FROM plain_stream WHERE stream_id = 1")
        self.sql("VACUUM plain_stream")
        # The first row fits page 1, the second only page 0's freed space.
        async with plain.writer() as fact:
            fact.add_row([text(1900), 0])
            fact.add_row([text(800), 1])
        token = fact.stream_id
        heap = self.sql(f"SELECT n FROM plain_stream WHERE stream_id = {token} ORDER BY ctid")
        self.assertEqual(heap, [(1,), (0,)], "the heap holds the rows in another order")

        # The catch-up's pages (and the fan-out's, read from the table).
        facts, upto, limited = await plain.facts_since("master", token - 1, token)
        self.assertEqual((fact_ids(facts), upto, limited), ([[0, 1]], token, False))
        rows, _, _ = await plain.updates_since("master", token - 1, token)
        self.assertEqual([row[1] for _, row in rows], [0, 1])
        # A fact bigger than the limit: read alone, by its ID.
        facts, upto, limited = await plain.facts_since("master", token - 1, token, 1)
        self.assertEqual((fact_ids(facts), upto, limited), ([[0, 1]], token, True))
        # The read API's pages, with rows as values and as PostgreSQL's JSON.
        ranges = [("master", token - 1, token, 10)]
        for json_rows in (False, True):
            pages = await plain.db.runInteraction(plain._pages.read_fact_pages, ranges,
                                                  json_rows)
            rows = pages[0][0][0][1]
            if json_rows:
                rows = [[None, int(r.rsplit(":", 1)[1].rstrip("}"))] for r in rows]
            self.assertEqual([r[1] for r in rows], [0, 1], json_rows)
        # A reader of another instance (read ahead), from a table it does not write.
        other = (await self.registry("reader")).get("plain")
        facts, _, _ = await other.facts_since("master", 0, token)
        self.assertEqual(fact_ids(facts), [[0, 1, 2, 3], [0, 1, 2], [0, 1]])

    async def test_rows_in_written_order_after_an_update(self):
        """An operator's UPDATE of a row (a value redacted) moves its tuple
        to the end of the heap; the fact still reads in written order."""
        plain = (await self.registry()).get("plain")
        token = await plain.write_fact([["a", 0], ["b", 1], ["c", 2]])
        self.sql(f"UPDATE plain_stream SET body = 'redacted' "
                 f"WHERE stream_id = {token} AND n = 0")
        heap = self.sql(f"SELECT n FROM plain_stream WHERE stream_id = {token} ORDER BY ctid")
        self.assertEqual(heap, [(1,), (2,), (0,)])
        facts, _, _ = await plain.facts_since("master", 0, token)
        self.assertEqual(facts, [(token, [["redacted", 0], ["b", 1], ["c", 2]])])

    async def test_group_commit_writes_each_facts_row_index(self):
        """Facts committed together in one INSERT: each fact's rows are
        numbered from 0 in the order given."""
        plain = (await self.registry()).get("plain")
        ids = await plain.write_facts([[["a", 10], ["b", 11], ["c", 12]], [], [["d", 13]],
                                       [["e", 14], ["f", 15]]])
        self.assertEqual(self.sql("SELECT stream_id, row_index, n FROM plain_stream "
                                  "ORDER BY n"),
                         [(ids[0], 0, 10), (ids[0], 1, 11), (ids[0], 2, 12), (ids[2], 0, 13),
                          (ids[3], 0, 14), (ids[3], 1, 15)])


class UpgradeTests(TestCase):
    """A table made by release 0.2.0 (the committed fixtures) gets the
    column at its writer's start, once; its rows hold 0 and read as
    before; facts written after are numbered."""

    timeout = 120

    async def check_upgrade(self, config, columns, execute):
        watch = LogWatch(self)
        streams = parse_streams([CACHES])
        for attempt in range(2):
            db = Database(config)
            registry = StreamRegistry(db, "master", streams, reactor=reactor)
            await registry.start()
            caches = registry.get("caches")
            facts, _, _ = await caches.facts_since("master", 0, 4)
            self.assertEqual(facts[:3], RELEASE_FACTS)
            if attempt == 0:
                token = await caches.write_fact([["a", None, 1], ["b", None, 2]])
            await registry.stop()
            db.close()
        added = [e for e in watch.events if "added column" in e.get("log_format", "")]
        self.assertEqual(len(added), 1, "added once, at the first start")
        self.assertEqual(columns().count("row_index"), 1)
        self.assertEqual(execute("SELECT stream_id, cache_func, row_index "
                                 "FROM cache_invalidation_stream ORDER BY stream_id, row_index"),
                         [(1, "get_user", 0), (2, "get_user", 0), (2, "get_rooms", 0),
                          (4, "get_room", 0), (token, "a", 0), (token, "b", 1)])

    async def test_sqlite(self):
        directory = tempfile.mkdtemp(prefix="replicator-roworder-")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "state.db")
        shutil.copyfile(os.path.join(FIXTURES, "sqlite.db"), path)

        def execute(text):
            conn = sqlite3.connect(path)
            try:
                return [tuple(r) for r in conn.execute(text).fetchall()]
            finally:
                conn.close()

        def columns():
            return [r[1] for r in execute("PRAGMA table_info(cache_invalidation_stream)")]

        self.assertNotIn("row_index", columns())
        await self.check_upgrade(parse_database({"sqlite": path}), columns, execute)

    async def test_postgres(self):
        dsn = postgres_copy()

        def execute(text):
            conn = psycopg2.connect(dsn)
            try:
                cur = conn.cursor()
                cur.execute(text)
                return cur.fetchall()
            finally:
                conn.close()

        def columns():
            return [r[0] for r in execute(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_name = 'cache_invalidation_stream'")]

        self.assertNotIn("row_index", columns())
        await self.check_upgrade(parse_database({"postgres": dsn}), columns, execute)

    async def test_a_reader_of_an_older_writers_table(self):
        """An instance that only reads the stream, on a table its writer
        (an older release) has not given the column: heap order, no error;
        it adds nothing (a reader runs no DDL)."""
        dsn = postgres_copy()
        db = Database(parse_database({"postgres": dsn}))
        self.addCleanup(db.close)
        registry = StreamRegistry(db, "worker1", parse_streams([CACHES]), reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        facts, _, _ = await registry.get("caches").facts_since("master", 0, 4)
        self.assertEqual(facts, RELEASE_FACTS)
        self.assertEqual(registry.get("caches")._pages.order, "ctid")
        self.assertFalse(await db.runInteraction(
            schema.has_row_index, registry.get("caches").config, True))


class ConfigTests(SynchronousTestCase):
    def test_a_column_named_row_index_in_a_table_it_creates(self):
        for changed, key in ((dict(columns=[{"row_index": "bigint"}]), "columns[0]"),
                             (dict(id_column="ROW_INDEX"), "id_column"),
                             (dict(writer_column="row_index"), "writer_column")):
            with self.assertRaises(ConfigError) as caught:
                parse_stream(dict(PLAIN, **changed), "streams[0]")
            self.assertEqual(str(caught.exception).split(": ", 2)[1], f"streams[0].{key}")
        # Someone else's table may have one: the replicator adds none there.
        stream = parse_stream(dict(PLAIN, create=False, columns=[{"row_index": "bigint"}]),
                              "streams[0]")
        self.assertFalse(stream.owns_table)
