"""Independent transactions batched per thread hop, on a real PostgreSQL."""

import psycopg2
from twisted.internet import defer
from twisted.trial.unittest import TestCase

from replicator.config import parse_database
from replicator.storage.database import Database
from tests.servers import PostgresServer


class TransactionQueueTests(TestCase):
    timeout = 60

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        conn = psycopg2.connect(self.dsn)
        conn.cursor().execute("CREATE TABLE t (n int PRIMARY KEY)")
        conn.commit()
        conn.close()
        self.db = Database(parse_database({"postgres": self.dsn, "pool_max": 2}))
        self.addCleanup(self.db.close)

    def rows(self):
        conn = psycopg2.connect(self.dsn)
        cur = conn.cursor()
        cur.execute("SELECT n FROM t ORDER BY n")
        out = [r[0] for r in cur.fetchall()]
        conn.close()
        return out

    @staticmethod
    def insert(cursor, n):
        cursor.execute("INSERT INTO t VALUES (%s)", (n,))
        if n % 7 == 3:
            cursor.execute("INSERT INTO t VALUES (%s)", (n,))  # duplicate key: rolls back
        return n * 10

    async def test_each_job_commits_or_rolls_back_alone(self):
        queue = self.db.transactions
        results = await defer.DeferredList(
            [queue.run(self.insert, n) for n in range(40)], consumeErrors=True)
        ok = [(n, r[1]) for n, r in enumerate(results) if r[0]]
        failed = [n for n, r in enumerate(results) if not r[0]]
        self.assertEqual(failed, [n for n in range(40) if n % 7 == 3])
        self.assertEqual(ok, [(n, n * 10) for n in range(40) if n % 7 != 3])
        self.assertEqual(self.rows(), [n for n in range(40) if n % 7 != 3])
        self.assertEqual(queue.queued, 0)

    async def test_a_broken_connection_fails_only_its_jobs(self):
        queue = self.db.transactions
        await queue.run(self.insert, 100)

        def kill_own_backend(cursor, n):
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")

        outcomes = await defer.DeferredList(
            [queue.run(kill_own_backend, 0)] + [queue.run(self.insert, n) for n in (101, 102)],
            consumeErrors=True)
        self.assertFalse(outcomes[0][0])
        # Jobs after the broken one either ran on a fresh connection or
        # failed with it; none is lost silently, and the queue goes on.
        for n in (103, 104):
            self.assertEqual(await queue.run(self.insert, n), n * 10)
        done = {101, 102} & set(self.rows())
        self.assertEqual(done, {n for (ok, _), n in zip(outcomes[1:], (101, 102)) if ok})
        self.assertTrue({100, 103, 104} <= set(self.rows()))
        self.flushLoggedErrors()

    async def test_an_unreachable_database_fails_the_queued_jobs(self):
        server = PostgresServer()
        self.addCleanup(server.stop)
        db = Database(parse_database({"postgres": server.create_database(), "pool_max": 2}))
        self.addCleanup(db.close)
        await db.runQuery("SELECT 1")
        server.stop()
        outcomes = await defer.DeferredList(
            [db.transactions.run(self.insert, n) for n in range(5)], consumeErrors=True)
        self.assertEqual([ok for ok, _ in outcomes], [False] * 5)
        self.assertEqual(db.transactions.queued, 0)
        self.flushLoggedErrors()
