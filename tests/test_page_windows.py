"""Pages read in windows of IDs (replicator.streams.table_pages.windows):
the same rows as one statement over the whole range, and a bounded scan
per page on a table PostgreSQL has no statistics for (real PostgreSQL)."""

import random

import psycopg2
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import parse_database
from replicator.config.streams import parse_stream
from replicator.storage import schema
from replicator.storage.database import Database
from replicator.streams.table_pages import PageQuery, windows

from .servers import PostgresServer

CACHES = {"name": "caches", "table": "cache_invalidation_stream",
          "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}],
          "writers": ["master", "worker1"]}


class WindowsTests(SynchronousTestCase):
    def test_they_cover_the_range_in_order_growing(self):
        got = list(windows(10, 10_000, 4))
        self.assertEqual(got[0], (10, 74))
        self.assertEqual(got[1], (74, 330))
        self.assertEqual(got[-1][1], 10_000)
        self.assertEqual([lo for lo, _ in got[1:]], [hi for _, hi in got[:-1]])

    def test_an_empty_range_is_one_window(self):
        self.assertEqual(list(windows(5, 5, 100)), [(5, 5)])
        self.assertEqual(list(windows(6, 5, 100)), [(6, 5)])


class _Table(SynchronousTestCase):
    def setUp(self):
        self.dsn = PostgresServer.shared().create_database("windows")
        self.config = parse_stream(dict(CACHES), "streams[0]")
        self.conn = psycopg2.connect(self.dsn)
        self.addCleanup(self.conn.close)
        cur = self.conn.cursor()
        for statement in schema.table_ddl(self.config, True):
            cur.execute(statement)
        # No statistics, ever: as after a fast fill, or restarts that kept
        # autovacuum from running.
        cur.execute("ALTER TABLE cache_invalidation_stream SET (autovacuum_enabled = false)")
        self.conn.commit()
        self.db = Database(parse_database({"postgres": self.dsn, "pool_max": 1}))
        self.addCleanup(self.db.close)
        self.query = PageQuery(self.config, self.db)


class UnanalyzedTableTests(_Table):
    ROWS = 200_000

    def setUp(self):
        super().setUp()
        cur = self.conn.cursor()
        cur.execute("INSERT INTO cache_invalidation_stream (stream_id, instance_name, "
                    "cache_func, keys, invalidation_ts) SELECT i, CASE WHEN i %% 10 = 0 "
                    "THEN 'worker1' ELSE 'master' END, 'f', NULL, i "
                    "FROM generate_series(1, %s) i", (self.ROWS,))
        self.conn.commit()

    def rows_fetched(self, cur) -> int:
        """Rows the transaction's scans of the table fetched (by an index,
        a bitmap or a sequential scan)."""
        cur.execute("SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_xact_user_tables "
                    "WHERE relname = 'cache_invalidation_stream'")
        return int(cur.fetchone()[0])

    def test_a_catch_up_page_far_behind_reads_a_window_not_the_range(self):
        cur = self.conn.cursor()
        facts, upto, limited = self.query.read_facts(cur, "master", 1000, self.ROWS, 100)
        want = [i for i in range(1001, self.ROWS) if i % 10][:100]
        self.assertEqual([t for t, _ in facts], want)
        self.assertEqual((upto, limited), (want[-1], True))
        # One statement over the whole range fetched every row of it
        # (179,000, in a bitmap scan) and sorted them.
        self.assertLess(self.rows_fetched(cur), 5_000)
        self.conn.rollback()

    def test_a_read_api_page_far_behind_reads_a_window_not_the_range(self):
        cur = self.conn.cursor()
        [(facts, upto, limited)] = self.query.read_fact_pages(
            cur, [("master", 1000, self.ROWS, 100)])
        want = [i for i in range(1001, self.ROWS) if i % 10][:100]
        self.assertEqual([t for t, _ in facts], want)
        self.assertEqual((upto, limited), (want[-1], True))
        self.assertLess(self.rows_fetched(cur), 5_000)
        self.conn.rollback()


class SameAsOneStatementTests(_Table):
    """Random tables of several writers (sparse, dense, facts of several
    rows), random ranges and limits: the windowed pages are the rows one
    statement over the whole range gives."""

    def test_same_pages(self):
        rng = random.Random(7)
        cur = self.conn.cursor()
        rows = []
        stream_id = 0
        for _ in range(3_000):
            stream_id += rng.choice((1, 1, 1, 2, 7, 300))
            writer = rng.choice(("master",) * 8 + ("worker1",))
            for n in range(rng.choice((1, 1, 1, 3, 12))):
                rows.append((stream_id, writer, f"f{n}", None, n))
        cur.executemany("INSERT INTO cache_invalidation_stream (stream_id, instance_name, "
                        "cache_func, keys, invalidation_ts) VALUES (%s, %s, %s, %s, %s)", rows)
        self.conn.commit()
        top = stream_id + 10
        for _ in range(300):
            writer = rng.choice(("master", "worker1"))
            lo = rng.randrange(0, top)
            hi = rng.randrange(lo, top + 1)
            limit = rng.choice((1, 2, 5, 13, 100, 1000))
            cur.execute("SELECT stream_id, cache_func, keys, invalidation_ts FROM "
                        "cache_invalidation_stream WHERE instance_name = %s AND stream_id > %s "
                        "AND stream_id <= %s ORDER BY stream_id, row_index, ctid",
                        (writer, lo, hi))
            everything = cur.fetchall()
            got_rows, upto, limited = self.query._select(cur, writer, lo, hi, limit)
            ids = [r[0] for r in got_rows]
            if not limited:
                self.assertEqual([tuple(r) for r in got_rows], everything)
                self.assertEqual(upto, hi)
            else:
                self.assertEqual([tuple(r) for r in got_rows], everything[:len(got_rows)])
                self.assertEqual(upto, ids[-1])
                self.assertNotEqual(everything[len(got_rows)][0], ids[-1])  # a fact whole
            [(facts, fupto, flimited)] = self.query.read_fact_pages(cur, [(writer, lo, hi, limit)])
            fact_ids = sorted({r[0] for r in everything})
            self.assertEqual([t for t, _ in facts], fact_ids[:limit])
            self.assertEqual(flimited, len(fact_ids) >= limit)
            self.assertEqual(fupto, fact_ids[limit - 1] if flimited else hi)
        self.conn.rollback()
