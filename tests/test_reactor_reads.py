"""Short reads on the reactor thread (:mod:`replicator.storage.reactor_reads`),
on a real PostgreSQL: the admission's read of a stream's sequence takes no
trip to a pool thread; a connection lost while idle is replaced for the
next read; a database out of reach fails the read; reads run in the order
asked; closing fails what waits."""

import psycopg2
import psycopg2.extensions
from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase

from replicator.config import parse_database, parse_streams
from replicator.storage.database import Database
from replicator.storage.reactor_reads import ConnectionClosed, ReactorReads
from replicator.streams.registry import StreamRegistry
from tests.servers import PostgresServer

PLAIN = {"name": "plain", "table": "plain_stream", "writers": ["master"],
         "columns": [{"n": "bigint"}]}


class ReactorReadsTests(TestCase):
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

    async def registry(self, instance):
        db = Database(parse_database({"postgres": self.dsn}))
        self.addCleanup(db.close)
        registry = StreamRegistry(db, instance, parse_streams([PLAIN]), reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        return registry

    async def test_the_sequence_is_read_without_a_trip_to_the_pool(self):
        """The read a worker makes for every fact it admits: it used to be a
        transaction in a pool thread (three statements and the thread's
        hand-over both ways, most of a worker's CPU at 40 facts/s)."""
        master = (await self.registry("master")).get("plain")
        stream = (await self.registry("worker1")).get("plain")
        for _ in range(3):
            await master.write_fact([[1]])
        trips = []  # every trip to a pool thread goes through one of these
        for name in ("runInteraction", "runWithConnection"):
            original = getattr(stream.db.pool, name)

            def counted(*args, _original=original, _name=name, **kwargs):
                trips.append(_name)
                return _original(*args, **kwargs)

            setattr(stream.db.pool, name, counted)
        self.assertEqual(await stream.sequence_value(), 3)
        await master.write_fact([[1]])
        self.assertEqual(await stream.sequence_value(), 4)
        self.assertEqual(trips, [])

    async def test_a_connection_lost_while_idle_is_replaced_for_the_next_read(self):
        reads = ReactorReads(reactor, self.dsn)
        self.addCleanup(reads.close)
        (pid,), = await reads.fetchall("SELECT pg_backend_pid()")
        self.sql(f"SELECT pg_terminate_backend({pid})")
        (other,), = await reads.fetchall("SELECT pg_backend_pid()")
        self.assertNotEqual(other, pid)

    async def test_a_database_that_cannot_be_reached_fails_the_read(self):
        from tests.servers import free_port

        reads = ReactorReads(reactor, f"host=127.0.0.1 port={free_port()} dbname=x")
        self.addCleanup(reads.close)
        with self.assertRaises(psycopg2.OperationalError):
            await reads.fetchall("SELECT 1")
        with self.assertRaises(psycopg2.OperationalError):
            await reads.fetchall("SELECT 1")

    async def test_reads_run_in_order_and_a_failed_one_harms_none_after_it(self):
        reads = ReactorReads(reactor, self.dsn)
        self.addCleanup(reads.close)
        first = reads.fetchall("SELECT %s::int", (1,))
        bad = reads.fetchall("SELECT no_such_column")
        last = reads.fetchall("SELECT %s::int", (3,))
        self.assertEqual(await first, [(1,)])
        with self.assertRaises(psycopg2.Error):
            await bad
        self.assertEqual(await last, [(3,)])

    async def test_close_fails_what_waits(self):
        reads = ReactorReads(reactor, self.dsn)
        under_way = reads.fetchall("SELECT pg_sleep(5)")
        waiting = reads.fetchall("SELECT 1")
        reads.close()
        for d in (under_way, waiting):
            with self.assertRaises(ConnectionClosed):
                await d
        with self.assertRaises(ConnectionClosed):
            await reads.fetchall("SELECT 1")
        await defer.succeed(None)


class AnsweredAtOnce:
    """A psycopg2 asynchronous connection whose answer is already there at
    the first ``poll()`` (the server answered before the reactor looked:
    a loaded machine)."""

    closed = False

    def poll(self):
        return psycopg2.extensions.POLL_OK

    def fileno(self):
        return 0


class PollerTests(TestCase):
    def test_an_answer_there_at_the_first_poll_is_waited_for_like_any(self):
        """``wait()`` used to return None then (the Deferred was already
        fired and forgotten), and the read failed with a TypeError: every
        fact of a worker under load waited for a retry of its sequence read."""
        from replicator.storage.reactor_reads import _Poller

        waited = _Poller(reactor, AnsweredAtOnce()).wait()
        self.assertIsInstance(waited, defer.Deferred)
        self.assertIsNone(self.successResultOf(waited))
