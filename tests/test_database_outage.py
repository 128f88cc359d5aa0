"""A PostgreSQL restart, seen from the connection pool.

Every pooled connection dies with the server.  Each transaction that meets
a dead connection fails (its caller sees the database's error and retries
as it does for any failed write), the connection is dropped from the pool,
and the next transaction opens a fresh one.  What the operator reads is one
warning per dropped connection: not a CRITICAL "Rollback failed" traceback
for every failed transaction (twice each, as the pool logged it), which
buried the one line that mattered during an outage.
"""

import psycopg2
from twisted.internet import threads
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import TestCase

from replicator.config import parse_database
from replicator.storage.database import Database
from tests.servers import PostgresServer


class PoolThroughRestartTests(TestCase):
    timeout = 120

    def setUp(self):
        self.server = PostgresServer()
        self.addCleanup(self.server.stop)
        self.db = Database(parse_database({"postgres": self.server.create_database("outage"),
                                           "pool_min": 3, "pool_max": 3}))
        self.addCleanup(self.db.close)
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    async def _open_every_connection(self):
        # Three interactions at once: each holds its own pooled connection.
        def hold(txn):
            txn.execute("SELECT pg_sleep(0.3), pg_backend_pid()")
            return txn.fetchone()[1]
        from twisted.internet import defer
        pids = await defer.gatherResults([self.db.runInteraction(hold) for _ in range(3)])
        self.assertEqual(len(set(pids)), 3)

    async def test_restart_is_one_warning_per_dead_connection(self):
        await self._open_every_connection()
        await threads.deferToThread(self.server.crash_restart)
        failures = 0
        for _ in range(10):
            try:
                self.assertEqual(await self.db.runQuery("SELECT 1"), [(1,)])
                break
            except psycopg2.Error:
                failures += 1
        else:
            self.fail("no query succeeded after the restart")
        self.assertGreaterEqual(failures, 1)
        # Nothing logged as an error (trial fails a test that leaves one).
        self.assertEqual(self.flushLoggedErrors(), [])
        critical = [e for e in self.events if e.get("log_level") in (LogLevel.error,
                                                                     LogLevel.critical)
                    or e.get("isError")]
        self.assertEqual(critical, [])
        lost = [e for e in self.events if e.get("log_namespace") == "replicator.storage.database"
                and e.get("log_level") == LogLevel.warn]
        self.assertEqual(len(lost), failures)
        self.assertIn("connection lost", lost[0]["log_format"])
