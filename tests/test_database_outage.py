"""A PostgreSQL restart, seen from the connection pool.

Every pooled connection dies with the server.  A connection that sat idle
through the restart is found dead before it is used and replaced, so no
transaction fails for it; one that dies under a transaction fails that
transaction (its caller sees the database's error and retries as it does
for any failed write), is dropped from the pool, and the next transaction
opens a fresh one.  What the operator reads is one warning per dead
connection: not a CRITICAL "Rollback failed" traceback for every failed
transaction (twice each, as the pool logged it), which buried the one line
that mattered during an outage.
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
        # Commits durable before acknowledged: with synchronous_commit off an
        # immediate restart may lose the test's own CREATE TABLE (seen under
        # load: "relation t does not exist").
        self.server = PostgresServer(synchronous_commit=True)
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
        # Every thread's connection is dead: each is replaced before use.
        self.assertEqual(await self.db.runQuery("SELECT 1"), [(1,)])
        await self._open_every_connection()
        # One that dies under its transaction fails that transaction only.
        with self.assertRaises(psycopg2.OperationalError):
            await self.db.runQuery("SELECT pg_terminate_backend(pg_backend_pid())")
        self.assertEqual(await self.db.runQuery("SELECT 1"), [(1,)])
        # Nothing logged as an error (trial fails a test that leaves one).
        self.assertEqual(self.flushLoggedErrors(), [])
        self.assertEqual(self._errors(), [])
        lost = self._lost()
        self.assertEqual(len(lost), 4)
        self.assertTrue(all("connection lost" in e["log_format"] for e in lost))

    def _errors(self):
        return [e for e in self.events if e.get("log_level") in (LogLevel.error,
                                                                 LogLevel.critical)
                or e.get("isError")]

    def _lost(self):
        return [e for e in self.events if e.get("log_namespace") == "replicator.storage.database"
                and e.get("log_level") == LogLevel.warn]

    async def test_writes_after_restart_all_run_on_live_connections(self):
        # The write path (TransactionQueue) after every pooled connection
        # died: no write fails without being tried, none is failed by a
        # dead connection that sat idle in the pool, and nothing is logged
        # as CRITICAL ("Rollback failed ... wrong connection for thread").
        await self.db.runOperation("CREATE TABLE t (n int)")
        await self._open_every_connection()
        await threads.deferToThread(self.server.crash_restart)

        def write(cursor, n):
            cursor.execute("SELECT pg_sleep(0.1)")  # keep the hops overlapping
            cursor.execute("INSERT INTO t VALUES (%s)", (n,))
            return n

        from twisted.internet import defer
        results = await defer.DeferredList(
            [self.db.transactions.run(write, n) for n in range(4)], consumeErrors=True)
        self.assertEqual([(ok, value if ok else value.value) for ok, value in results],
                         [(True, n) for n in range(4)])
        self.assertEqual(sorted(r[0] for r in await self.db.runQuery("SELECT n FROM t")),
                         [0, 1, 2, 3])
        self.assertEqual(self.flushLoggedErrors(), [])
        self.assertEqual(self._errors(), [])
        self.assertLessEqual(len(self._lost()), 3)


class ConnectionLostMidHopTests(TestCase):
    """A job whose connection dies under it fails; the jobs queued behind
    it in the same thread hop run on a new connection."""

    timeout = 60

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database("midhop")
        # pool_max 2: one writer, so queued jobs wait for the running hop.
        self.db = Database(parse_database({"postgres": self.dsn, "pool_max": 2}))
        self.addCleanup(self.db.close)
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    async def test_next_job_in_the_hop_runs_on_a_new_connection(self):
        import threading

        queued = threading.Event()

        def dies(cursor):
            self.assertTrue(queued.wait(30))
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")

        def pid(cursor):
            cursor.execute("SELECT pg_backend_pid()")
            return cursor.fetchone()[0]

        first = self.db.transactions.run(pid)
        old_pid = await first
        dying = self.db.transactions.run(dies)
        after = self.db.transactions.run(pid)
        queued.set()
        with self.assertRaises(psycopg2.OperationalError):
            await dying
        new_pid = await after
        self.assertNotEqual(new_pid, old_pid)
        self.assertEqual(self.flushLoggedErrors(), [])
        errors = [e for e in self.events if e.get("log_level") in (LogLevel.error,
                                                                   LogLevel.critical)
                  or e.get("isError")]
        self.assertEqual(errors, [])
        lost = [e for e in self.events if e.get("log_namespace") == "replicator.storage.database"
                and e.get("log_level") == LogLevel.warn]
        self.assertEqual(len(lost), 1)


class ReadsWithoutTransactionTests(TestCase):
    """``Database.runReads``: statements without a transaction around them,
    and the connection as it was for the next transaction."""

    timeout = 120

    def setUp(self):
        self.server = PostgresServer.shared()
        self.db = Database(parse_database({"postgres": self.server.create_database(),
                                           "pool_min": 1, "pool_max": 1}))
        self.addCleanup(self.db.close)

    async def test_reads_then_a_transaction_that_fails_leaves_nothing(self):
        def reads(cursor):
            cursor.execute("SELECT 1")
            return cursor.connection.autocommit
        self.assertTrue(await self.db.runReads(reads))

        def fails(txn):
            txn.execute("CREATE TEMP TABLE made (x int)")
            raise ValueError("rolled back")
        with self.assertRaises(ValueError):
            await self.db.runInteraction(fails)
        # One connection: had it stayed in autocommit, the table would exist.
        self.assertEqual(await self.db.runQuery("SELECT to_regclass('pg_temp.made')"),
                         [(None,)])

    async def test_a_read_whose_connection_dies_fails_alone(self):
        def dies(cursor):
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        with self.assertRaises(psycopg2.OperationalError):
            await self.db.runReads(dies)
        self.assertEqual(await self.db.runReads(lambda c: (c.execute("SELECT 2"),
                                                           c.fetchall())[1]), [(2,)])
        self.assertEqual(self.flushLoggedErrors(), [])
