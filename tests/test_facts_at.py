"""``Stream.facts_at``: the audit's sample of facts read back from a real
PostgreSQL in one trip to a pool thread, each fact whole, in written order;
an ID with no fact left out; retention's trim raised, not passed over."""

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from replicator.config import parse_database, parse_streams
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from replicator.streams.trimmed import FactsTrimmed
from tests.servers import PostgresServer

PLAIN = {"name": "plain", "table": "plain_stream", "writers": ["master"],
         "columns": [{"body": "text"}, {"n": "bigint"}]}


class FactsAtTests(TestCase):
    timeout = 120

    async def registries(self):
        dsn = PostgresServer.shared().create_database()
        out = []
        for instance in ("master", "worker1"):
            db = Database(parse_database({"postgres": dsn}))
            self.addCleanup(db.close)
            registry = StreamRegistry(db, instance, parse_streams([PLAIN]), reactor=reactor)
            await registry.start()
            self.addCleanup(registry.stop)
            out.append(registry)
        return out

    async def test_the_facts_of_the_ids_in_one_trip(self):
        master, worker = await self.registries()
        written = master.get("plain")
        await written.write_facts([[["a", i], ["b", i]] for i in range(1, 6)])
        stream = worker.get("plain")  # another instance: memory has none of them
        trips = []
        run_reads = stream.db.runReads

        def counted(fn, *args):
            trips.append(fn)
            return run_reads(fn, *args)

        stream.db.runReads = counted
        found = await stream.facts_at("master", [1, 3, 5, 99])
        self.assertEqual(found, {1: [["a", 1], ["b", 1]], 3: [["a", 3], ["b", 3]],
                                 5: [["a", 5], ["b", 5]]})
        self.assertEqual(len(trips), 1)

    async def test_a_trimmed_fact_is_raised(self):
        master, worker = await self.registries()
        written = master.get("plain")
        await written.write_facts([[["a", i]] for i in range(1, 4)])
        stream = worker.get("plain")

        def trimmed(txn):
            txn.execute("INSERT INTO stream_retention (table_name, trimmed_through) "
                        "VALUES (%s, 2) ON CONFLICT (table_name) DO UPDATE "
                        "SET trimmed_through = 2", (stream.config.table,))
            txn.execute("DELETE FROM plain_stream WHERE stream_id <= 2")
        await stream.db.runInteraction(trimmed)
        with self.assertRaises(FactsTrimmed):
            await stream.facts_at("master", [1, 3])
        self.assertEqual(await stream.facts_at("master", [3]), {3: [["a", 3]]})
