"""The read API's pages read the table in one transaction and splice each
fact's JSON (built by PostgreSQL for streams of scalar columns, else
encoded in the pool thread) into the answer: the bytes must be exactly
those of encoding the page's values with orjson, page after page, on both
engines, for every kind of value."""

import os
import tempfile

import orjson
from twisted.internet import reactor, task
from twisted.trial.unittest import TestCase

from replicator.config import parse_database, parse_streams
from replicator.http.read.auth import ReaderAuth
from replicator.http.read.pages import fact_object, page_body, read_page
from replicator.http.read.routes import ReadRoutes
from replicator.http.read.tokens import encode
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from tests.servers import PostgresServer

STREAMS = [
    {"name": "scalars", "table": "scalar_stream",
     "columns": [{"t": "text?"}, {"n": "bigint?"}, {"b": "boolean?"}, {"s": "text"}],
     "writers": ["master", "worker1"]},
    {"name": "mixed", "table": "mixed_stream",
     "columns": [{"t": "text"}, {"j": "json?"}, {"n": "bigint"}],
     "writers": ["master"]},
]

TEXTS = ["", "plain", "é ü 日本語", "\U0001F600 emoji", "\x01\x08\t\n\x0c\r\x1f\x7f",
         'quote " backslash \\ slash /', "\u2028\u2029\ufeff\ue000\uffff", "%s %% ' ''",
         "x" * 3000, "<script>&amp;</script>"]
INTS = [0, 1, -1, 2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, -(2 ** 63)]
JSONS = [None, {"a": [1, 2.5, None, True, {"b": "é\n"}]}, [], {}, "text", 0, -2.75, 1.5e-7,
         [[[[1]]]], {"z": 1, "a": 2, "": "empty key", "é": "x"}, 2 ** 63 - 1, False]


def scalar_row(i: int) -> list:
    return [None if i % 7 == 3 else TEXTS[i % len(TEXTS)],
            None if i % 5 == 4 else INTS[i % len(INTS)],
            [True, False, None][i % 3], TEXTS[(i * 3) % len(TEXTS)]]


def mixed_row(i: int) -> list:
    return [TEXTS[i % len(TEXTS)], JSONS[i % len(JSONS)], INTS[(i * 5) % len(INTS)]]


def reference_body(stream, page) -> bytes:
    """The answer as it was encoded before facts were spliced in."""
    columns = list(stream.config.column_names)
    return orjson.dumps({"stream": stream.name,
                         "facts": [fact_object(columns, f) for f in page.facts],
                         "next": encode(stream.name, page.next)}) + b"\n"


class JsonPagesSuite:
    """Shared by both engines; subclasses give the database."""

    def database_config(self, instance):
        raise NotImplementedError

    async def registry(self, instance, config):
        db = Database(config)
        self.addCleanup(db.close)
        registry = StreamRegistry(db, instance, parse_streams(STREAMS), reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        return registry

    async def filled(self, writers):
        """Streams with facts of one to four rows (and some of none) from
        ``writers``, forgotten by memory: pages come from the table."""
        config = self.database_config()
        registries = [await self.registry(w, config) for w in writers]
        n = 0
        for k in range(40):
            for registry in registries:
                for name, make in (("scalars", scalar_row), ("mixed", mixed_row)):
                    if name == "mixed" and registry.instance_name != "master":
                        continue
                    rows = [make(n + r) for r in range(k % 5)]  # k % 5 == 0: no row
                    await registry.get(name).write_facts([rows])
                    n += len(rows)
        for registry in registries:
            for name in ("scalars", "mixed"):
                stream = registry.get(name)
                for w in stream.local_writers:
                    stream.forget(w, stream.id_gen.get_current_token(w))
        return registries[0]

    async def pages(self, stream, limit, columns, bounds=None):
        """Every page from the beginning: ``[(page, body)]``."""
        bounds = bounds or {w: 10 ** 6 for w in stream.config.writers}
        since = {w: 0 for w in stream.config.writers}
        out = []
        while True:
            page = await read_page(stream, since, bounds, limit, final_below=10 ** 6,
                                   columns=columns)
            out.append((page, page_body(stream.name, list(stream.config.column_names), page)))
            if not page.facts:
                return out
            since = page.next

    async def check_stream(self, stream):
        self.assertIsNone(stream.memory_fact_page(stream.config.writers[0], 0, 10, 10))
        columns = list(stream.config.column_names)
        for limit in (1, 2, 3, 7, 1000):
            new = await self.pages(stream, limit, columns)
            old = await self.pages(stream, limit, None)
            self.assertEqual(len(new), len(old), limit)
            for (page, body), (ref_page, _) in zip(new, old):
                self.assertEqual(body, reference_body(stream, ref_page), limit)
                self.assertEqual((page.next, page.full, page.final),
                                 (ref_page.next, ref_page.full, ref_page.final))
            facts = [f for page, _ in new for f in page.facts]
            self.assertEqual(len(facts), len({f[0] for f in facts}))
            self.assertTrue(any(len(orjson.loads(f[3])["rows"]) > 1 for f in facts))

    async def test_spliced_pages_are_the_bytes_of_the_values(self):
        registry = await self.filled(self.writers)
        scalars, mixed = registry.get("scalars"), registry.get("mixed")
        self.assertEqual(scalars.json_rows, self.postgres)  # PostgreSQL built the JSON
        self.assertFalse(mixed.json_rows)  # a json column: encoded in Python
        await self.check_stream(scalars)
        await self.check_stream(mixed)

    async def test_a_page_read_from_memory_is_the_same_bytes(self):
        config = self.database_config()
        registry = await self.registry("master", config)
        stream = registry.get("scalars")
        stream.keep_recent_facts()  # (as the replication handler does)
        for i in range(12):
            await stream.write_facts([[scalar_row(i + r) for r in range(i % 3 + 1)]])
        columns = list(stream.config.column_names)
        self.assertIsNotNone(stream.memory_fact_page("master", 0, 12, 100))
        bounds = {"master": 12, "worker1": 0}
        before = await self.pages(stream, 5, columns, bounds)
        stream.forget("master", 12)
        after = await self.pages(stream, 5, columns, bounds)
        self.assertTrue(all(f[3] is None for page, _ in before for f in page.facts))
        self.assertTrue(all(f[3] is not None for page, _ in after for f in page.facts))
        self.assertEqual([body for _, body in before], [body for _, body in after])

    async def test_a_page_of_many_row_facts_is_one_read(self):
        """A full page of facts of several rows is one read of the table
        (it was one transaction per ``limit`` rows: a page of 5 facts of 3
        rows took five)."""
        registry = await self.registry("master", self.database_config())
        stream = registry.get("scalars")
        for i in range(8):
            await stream.write_facts([[scalar_row(i * 3 + r) for r in range(3)]])
        stream.forget("master", 8)
        reads = []
        run = stream.db.runInteraction

        inside = []  # (SQLite: runReads is a runInteraction)

        def counted(fn, *args, **kwargs):
            if not inside:
                reads.append(getattr(fn, "__name__", repr(fn)))
            return run(fn, *args, **kwargs)

        stream.db.runInteraction = counted
        if hasattr(stream.db, "runReads"):
            reads_run = stream.db.runReads

            def counted_reads(fn, *args):
                reads.append(getattr(fn, "__name__", repr(fn)))
                inside.append(fn)
                try:
                    return reads_run(fn, *args)
                finally:
                    inside.pop()

            stream.db.runReads = counted_reads
        routes = ReadRoutes(registry=None, auth=ReaderAuth("x" * 16), clock=task.Clock())
        page = await routes.page(stream, {"master": 0, "worker1": 0}, 5,
                                 {"master": 8, "worker1": 0})
        self.assertEqual([f[0] for f in page.facts], [1, 2, 3, 4, 5])
        self.assertEqual([r for r in reads if r != "persisted_positions"], ["read"])

    async def test_a_trimmed_range_is_never_a_page(self):
        """Pages below the trim boundary fail (FactsTrimmed) whether the
        boundary came with the page's rows or, with no row, was read after."""
        from replicator.streams.trimmed import FactsTrimmed

        registry = await self.registry("master", self.database_config())
        for name in ("scalars", "mixed"):
            stream = registry.get(name)
            for i in range(10):
                await stream.write_facts([[(scalar_row if name == "scalars" else mixed_row)(i)]])
            stream.forget("master", 10)
            columns = list(stream.config.column_names)
            bounds = {w: 10 for w in stream.config.writers}
            since = {w: 0 for w in stream.config.writers}
            page = await read_page(stream, since, bounds, 3, columns=columns)
            self.assertEqual([f[0] for f in page.facts], [1, 2, 3])

            async def trim(upto):
                def txn(cursor):
                    sql = stream.db.sql
                    cursor.execute(sql(f"DELETE FROM {stream.config.table} "
                                       "WHERE stream_id <= %s"), (upto,))
                    key = stream.config.table
                    cursor.execute(sql("DELETE FROM stream_retention WHERE table_name = %s"),
                                   (key,))
                    cursor.execute(sql("INSERT INTO stream_retention (table_name, "
                                       "trimmed_through) VALUES (%s, %s)"), (key, upto))
                await stream.db.runInteraction(txn)

            await trim(4)  # rows above: the boundary comes with them
            with self.assertRaises(FactsTrimmed):
                await read_page(stream, since, bounds, 3, columns=columns)
            page = await read_page(stream, {w: 4 for w in since}, bounds, 3, columns=columns)
            self.assertEqual([f[0] for f in page.facts], [5, 6, 7])
            await trim(10)  # no row left: the boundary is read after
            with self.assertRaises(FactsTrimmed):
                await read_page(stream, {w: 6 for w in since}, bounds, 3, columns=columns)
            page = await read_page(stream, {w: 10 for w in since}, bounds, 3, columns=columns)
            self.assertEqual(page.facts, [])


class PostgresJsonPagesTests(JsonPagesSuite, TestCase):
    timeout = 120
    postgres = True
    writers = ["master", "worker1"]  # two instances on one database

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()

    def database_config(self):
        return parse_database({"postgres": self.dsn, "pool_max": 4})


class SQLiteJsonPagesTests(JsonPagesSuite, TestCase):
    postgres = False
    writers = ["master"]  # (SQLite: one process writes)

    def setUp(self):
        self.path = os.path.join(tempfile.mkdtemp(), "streams.db")

    def database_config(self):
        return parse_database({"sqlite": self.path})

