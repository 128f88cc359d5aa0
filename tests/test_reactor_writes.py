"""Stream writes on PostgreSQL run on the reactor thread
(replicator.storage.reactor_transactions): no pool thread is needed for
them, and they go on across a server restart."""

import threading

from twisted.internet import defer, reactor, threads
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import TestCase

from replicator.config import parse_database, parse_streams
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from tests.servers import PostgresServer

STREAMS = parse_streams([{
    "name": "caches", "table": "cache_stream", "writers": ["master"],
    "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}],
}])


class ReactorWritesTests(TestCase):
    timeout = 120

    async def registry(self, dsn, **database):
        db = Database(parse_database({"postgres": dsn, **database}))
        self.addCleanup(db.close)
        registry = StreamRegistry(db, "master", STREAMS, reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        return db, registry

    def watch_log(self):
        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        return events

    async def test_a_write_commits_while_every_pool_thread_is_busy(self):
        db, registry = await self.registry(
            PostgresServer.shared().create_database("reactorwrites"), pool_max=1)
        caches = registry.get("caches")
        entered, release = threading.Event(), threading.Event()
        self.addCleanup(release.set)

        def hold(txn):
            entered.set()
            release.wait(60)

        held = db.runInteraction(hold)  # the pool's one connection and thread
        self.assertTrue(await threads.deferToThread(entered.wait, 60))
        written = await defer.ensureDeferred(caches.write_facts([[["a", None, 1]], [["b", [2], 2]]]))
        self.assertEqual(written, [1, 2])
        self.assertFalse(held.called)
        release.set()
        await held
        updates, upto, _ = await caches.updates_since("master", 0, 2)
        self.assertEqual(updates, [(1, ["a", None, 1]), (2, ["b", [2], 2])])
        self.assertEqual(caches.id_gen.get_current_token("master"), 2)
        self.assertEqual(caches.id_gen.in_flight(), 0)

    async def test_writes_after_a_restart_run_on_a_new_connection(self):
        server = PostgresServer(synchronous_commit=True)  # (the restart loses no commit)
        self.addCleanup(server.stop)
        db, registry = await self.registry(server.create_database("reactorrestart"),
                                           pool_max=2)
        caches = registry.get("caches")
        self.assertEqual(await caches.write_fact([["before", None, 0]]), 1)
        events = self.watch_log()
        await threads.deferToThread(server.crash_restart)
        # The idle connection died with the server: found dead before it
        # is used, so no write fails for it.
        ids = await defer.gatherResults([defer.ensureDeferred(
            caches.write_fact([[f"after{i}", None, i]])) for i in range(3)])
        self.assertEqual(len(set(ids)), 3)
        self.assertTrue(all(i > 1 for i in ids))
        top = caches.id_gen.get_current_token("master")
        self.assertEqual(top, max(ids))
        updates, _, _ = await caches.updates_since("master", 0, top)
        self.assertEqual([row[0] for _, row in updates], ["before", "after0", "after1", "after2"])
        self.assertEqual(caches.id_gen.in_flight(), 0)
        self.assertEqual(self.flushLoggedErrors(), [])
        self.assertEqual([e for e in events if e.get("log_level") in (LogLevel.error,
                                                                     LogLevel.critical)
                          or e.get("isError")], [])
