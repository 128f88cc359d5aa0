"""A fact of any size: the work a large fact makes on the reactor thread is
done in slices between reactor turns, or bounded by the batch limits.

* a library write checks and encodes its rows ``PREPARE_SLICE`` at a time,
  other calls running between the slices (a clock the test turns);
* the fan-out never encodes the rows of a fact over ``max_batch_rows``
  (it goes out as ``POSITION t t`` whatever its size);
* on PostgreSQL the rows go in statements of ``INSERT_ROWS`` rows (the
  driver holds the GIL while it formats one), and a page is taken from
  the driver ``FETCH_SLICE`` rows at a time (it holds the GIL converting
  what one fetch takes);
* a reader decodes a fact's ``batch`` lines ``DECODE_SLICE`` at a time;
* the ``jsonl`` consumer encodes a fact's line ``ENCODE_SLICE`` rows at a
  time, the same bytes as in one go; the ``log`` consumer's preview encodes
  the rows it shows, not the fact.
"""

import os
import tempfile

from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator import jsontext
from replicator.config import parse_database, parse_streams
from replicator.consumers import jsonl_lines
from replicator.consumers import log as log_module
from replicator.consumers.file_thread import run_inline
from replicator.consumers.jsonl import JsonlConsumer
from replicator.jsontext import encode_json_line
from replicator.replication.core import fanout as fanout_module
from replicator.replication.core import reader as reader_module
from replicator.replication.core.fanout import Fanout
from replicator.replication.core.reader import Reader
from replicator.replication.wire.encoding import (
    MAX_LINE_LENGTH,
    encode_position_line,
    encode_rdata_lines,
)
from replicator.storage.database import Database
from replicator.streams import pages as pages_module
from replicator.streams import stream as stream_module
from replicator.streams import writes as writes_module
from replicator.streams.recent import EncodedPage
from replicator.streams.registry import StreamRegistry
from replicator.streams.rows import RowError
from tests.fakes import FakeConnection
from tests.harness import Harness
from tests.servers import PostgresServer
from tests.support import table_facts

CACHES = {"name": "caches", "table": "cache_big", "writers": ["master"],
          "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}]}
BIG = 100_000


def rows_of(n, start=0):
    return [[f"f{i}", [f"@u{i}:hs"], i] for i in range(start, start + n)]


class LibraryWriteSliceTests(SynchronousTestCase):
    def setUp(self):
        self.h = Harness(parse_streams([CACHES]), self.addCleanup)
        self.node = self.h.instance("master")
        self.stream = self.node.stream("caches")
        self.prepared = []  # rows checked and encoded, per call
        codec = self.stream._codec
        real = codec.prepare

        def prepare(facts, *args, **kwargs):
            self.prepared.append(sum(map(len, facts)))
            return real(facts, *args, **kwargs)
        codec.prepare = prepare

    def test_a_large_write_is_prepared_in_slices_with_other_work_between(self):
        n = 5 * stream_module.PREPARE_SLICE
        d = defer.ensureDeferred(self.stream.write_fact(rows_of(n)))
        # The first turn took one slice; the write waits for the next turns.
        self.assertEqual(sum(self.prepared), stream_module.PREPARE_SLICE)
        self.assertFalse(d.called)
        seen = []
        self.h.clock.callLater(0, lambda: seen.append(sum(self.prepared)))
        token = self.h.run(d)
        # Another call ran between two slices, not after all of them.
        self.assertEqual(len(seen), 1)
        self.assertLess(seen[0], n)
        self.assertEqual(max(self.prepared), stream_module.PREPARE_SLICE)
        self.assertEqual(sum(self.prepared), n)
        # The fact is whole in the table, one ID for every row, in order.
        rows = self.h.connection.execute(
            "SELECT stream_id, cache_func FROM cache_big ORDER BY rowid").fetchall()
        self.assertEqual(rows, [(token, f"f{i}") for i in range(n)])

    def test_slices_give_what_one_pass_gives(self):
        slice_ = stream_module.PREPARE_SLICE
        facts = [rows_of(3), [], rows_of(2 * slice_ + 7, 3), rows_of(slice_ - 1, 9000), [],
                 rows_of(1, 20000)]
        at_once = self.stream.prepare(facts)
        d = defer.ensureDeferred(self.stream._prepare_sliced(facts, None))
        self.assertEqual(self.h.run(d), at_once)

    def test_a_bad_row_in_a_later_slice_is_named_by_its_place_in_the_fact(self):
        n = 3 * stream_module.PREPARE_SLICE
        rows = rows_of(n)
        bad = 2 * stream_module.PREPARE_SLICE + 5
        rows[bad] = ["f", None, "not a number"]
        d = defer.ensureDeferred(self.stream.write_fact(rows))
        with self.assertRaises(RowError) as e:
            self.h.run(d)
        self.assertTrue(str(e.exception).startswith(f"row {bad}:"), str(e.exception))
        self.assertEqual(self.h.connection.execute("SELECT count(*) FROM cache_big").fetchone(),
                         (0,))


class FanoutOfTooLargeFactsTests(SynchronousTestCase):
    """A fact of ``BIG`` rows with ``max_batch_rows`` 100: ``POSITION t t``,
    and none of its rows encoded (the encoders are counted)."""

    def setUp(self):
        self.sent = []
        self.fanout = Fanout(lambda lines, name: self.sent.extend(lines), Clock(),
                             max_line_length=MAX_LINE_LENGTH, max_batch_rows=100)
        self.encoded = []
        for name in ("encode_written", "encode_written_fact", "encode_rdata_lines"):
            self.patch(fanout_module, name, self.counting(getattr(fanout_module, name)))

    def counting(self, real):
        def encode(stream, writer, *args, **kwargs):
            rows = args[1] if real.__name__ in ("encode_written", "encode_written_fact") \
                else args[0]
            self.encoded.append(len(rows))
            return real(stream, writer, *args, **kwargs)
        return encode

    def expected(self):
        return [encode_position_line("caches", "master", 5, 5),
                b'RDATA caches master batch ["a",null,1]\n',
                b'RDATA caches master 6 ["b",null,2]\n']

    def test_from_memory(self):
        tokens = [5] * BIG + [6, 6]
        lines = [b'["x",null,0]\n'] * BIG + [b'["a",null,1]\n', b'["b",null,2]\n']
        self.fanout.send_written("caches", "master", 4, EncodedPage(tokens, lines, 2, 6, False))
        self.assertEqual(b"".join(self.sent), b"".join(self.expected()))
        self.assertEqual(self.encoded, [2])
        self.assertEqual(self.fanout.announced[("caches", "master")], 6)

    def test_from_the_table(self):
        updates = [(5, ["x", None, 0])] * BIG + [(6, ["a", None, 1]), (6, ["b", None, 2])]
        self.fanout.send_updates("caches", "master", 4, updates, 6)
        self.assertEqual(b"".join(self.sent), b"".join(self.expected()))
        self.assertEqual(self.encoded, [2])

    def test_a_fact_of_exactly_max_batch_rows_still_goes_as_rdata(self):
        tokens = [5] * 100
        lines = [b'["x",null,0]\n'] * 100
        self.fanout.send_written("caches", "master", 4, EncodedPage(tokens, lines, 1, 5, False))
        self.assertEqual(len(self.sent), 100)
        self.assertTrue(self.sent[-1].startswith(b"RDATA caches master 5 "))


class _Recording:
    """A cursor that records what it executes (the real one does it)."""

    def __init__(self, txn, executed):
        self._txn = txn
        self._executed = executed

    def execute(self, sql, params=None):
        self._executed.append(sql)
        return self._txn.execute(sql, params)

    def fetchall(self):
        self._executed.append("fetchall")
        return self._txn.fetchall()

    def fetchmany(self, size):
        self._executed.append(f"fetchmany {size}")
        return self._txn.fetchmany(size)

    def __getattr__(self, name):
        return getattr(self._txn, name)


class PostgresSliceTests(TestCase):
    timeout = 120

    async def stream(self):
        self.dsn = PostgresServer.shared().create_database()
        self.db = Database(parse_database({"postgres": self.dsn}))
        self.addCleanup(self.db.close)
        registry = StreamRegistry(self.db, "master", parse_streams([CACHES]), reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        return registry.get("caches")

    async def test_a_page_of_one_large_fact_is_fetched_in_slices(self):
        stream = await self.stream()
        n = 2 * pages_module.FETCH_SLICE + 10
        rows = rows_of(n)
        small = await stream.write_fact(rows_of(1))
        token = await stream.write_fact(rows)
        # (The first read looks at the table's columns, once.)
        await self.db.runInteraction(stream._pages.read_facts, "master", 0, small, 1000)
        calls = []
        page = await self.db.runInteraction(
            lambda txn: stream._pages.read_facts(_Recording(txn, calls), "master", small,
                                                 token, 1000))
        self.assertEqual(page, ([(token, rows)], token, True))
        fetches = [c for c in calls if c.startswith("fetch")]
        self.assertNotIn("fetchall", fetches)
        self.assertEqual(set(fetches), {f"fetchmany {pages_module.FETCH_SLICE}"})
        # The fact is more than a page: its rows were taken by a second
        # SELECT of that one fact, in slices too.
        self.assertGreaterEqual(len(fetches), 3)

    async def test_rows_go_in_statements_of_insert_rows(self):
        stream = await self.stream()
        dsn = self.dsn
        executed = []
        real = stream._txn.write
        stream._txn.write = lambda txn, *args: real(_Recording(txn, executed), *args)
        n = 2 * writes_module.INSERT_ROWS + 500
        token = await stream.write_fact(rows_of(n))
        inserts = [sql.split("; ")[0] for sql in executed if sql.startswith("INSERT INTO")]
        self.assertEqual([sql.count("(%s") for sql in inserts],
                         [writes_module.INSERT_ROWS, writes_module.INSERT_ROWS, 500])
        facts = table_facts(dsn, [("caches", "cache_big", "cache_func, keys, invalidation_ts")])
        self.assertEqual(facts, {("caches", "master"): [(token, [
            [f"f{i}", [f"@u{i}:hs"], i] for i in range(n)])]})
        # A small write is still one statement, with the position.
        executed.clear()
        await stream.write_fact(rows_of(3))
        self.assertEqual(len([sql for sql in executed if sql.startswith("INSERT INTO")]), 1)


class ReaderDecodeSliceTests(SynchronousTestCase):
    def test_a_fact_of_many_batch_lines_is_decoded_in_slices(self):
        clock = Clock()
        delivered = []
        reader = Reader("caches", "master", 0, source=None,
                        deliver=lambda token, rows: delivered.append((token, rows)),
                        clock=clock)
        decoded = []
        real = reader_module.rdata_row

        def rdata_row(line):
            decoded.append(line)
            return real(line)
        self.patch(reader_module, "rdata_row", rdata_row)
        conn = FakeConnection("master")
        reader.position_line(conn, 0, 0)
        n = 3 * reader_module.DECODE_SLICE + 10
        rows = rows_of(n)
        lines = encode_rdata_lines("caches", "master", [(1, row) for row in rows])
        for line in lines[:-1]:
            reader.rdata(conn, None, line)  # batch rows are kept as their lines
        reader.rdata(conn, 1, rows[-1])
        # One turn decoded one slice; nothing was handed on yet.
        self.assertEqual(len(decoded), reader_module.DECODE_SLICE)
        self.assertEqual(delivered, [])
        seen = []
        clock.callLater(0, lambda: seen.append(len(decoded)))
        for _ in range(10):
            clock.advance(0)
        self.assertEqual(seen, [2 * reader_module.DECODE_SLICE])
        # Whole and in order, once.
        self.assertEqual(delivered, [(1, rows)])
        self.assertEqual(reader.position, 1)


class JsonlEncodeSliceTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.path = os.path.join(tempfile.mkdtemp(prefix="big-facts-"), "facts.jsonl")
        self.consumer = JsonlConsumer(self.path, self.clock, run_io=run_inline)
        self.addCleanup(self.consumer.close)
        self.encoded = []  # rows per encoder call
        real = jsonl_lines._dumps

        def dumps(value, *args):
            if type(value) is list:
                self.encoded.append(len(value))
            elif type(value) is tuple:  # a page's facts' rows
                self.encoded.append(sum(map(len, value)))
            elif type(value) is dict and value.get("rows"):
                self.encoded.append(len(value["rows"]))
            return real(value, *args)
        self.patch(jsonl_lines, "_dumps", dumps)
        self.patch(jsontext, "_dumps", dumps)

    def lines(self):
        self.consumer.close()
        with open(self.path, "rb") as f:
            return f.read().splitlines(keepends=True)

    def turns(self, d, seen):
        self.clock.callLater(0, lambda: seen.append(sum(self.encoded)))
        for _ in range(20):
            self.clock.advance(0)
        self.assertTrue(d.called)

    def test_a_large_fact_is_encoded_in_slices_with_other_work_between(self):
        n = 3 * jsonl_lines.ENCODE_SLICE + 1
        rows = rows_of(n)
        d = self.consumer.on_facts("caches", "master", 7, rows)
        self.assertEqual(self.encoded, [jsonl_lines.ENCODE_SLICE])
        self.assertFalse(d.called)
        seen = []
        self.turns(d, seen)
        self.assertEqual(seen, [2 * jsonl_lines.ENCODE_SLICE])
        self.assertEqual(self.lines(), [encode_json_line(
            {"stream": "caches", "writer": "master", "token": 7, "rows": rows})])
        self.assertEqual(self.consumer.positions(), {("caches", "master"): 7})

    def test_a_catch_up_page_with_a_large_fact_gives_the_same_lines(self):
        big = rows_of(2 * jsonl_lines.ENCODE_SLICE + 3)
        facts = [(3, rows_of(2)), (5, big), (6, []), (8, [["\ud800", 2 ** 70, None]])]
        d = self.consumer.on_facts_many("caches", "master", facts)
        self.assertLessEqual(sum(self.encoded), jsonl_lines.ENCODE_SLICE + 2)
        self.turns(d, [])
        self.assertEqual(self.lines(), [encode_json_line(
            {"stream": "caches", "writer": "master", "token": t, "rows": r}) for t, r in facts])

    def test_what_orjson_refuses_in_a_slice_makes_the_whole_line_as_in_one_go(self):
        rows = rows_of(2 * jsonl_lines.ENCODE_SLICE)
        rows[-1] = ["f", [2 ** 70], 1]
        d = self.consumer.on_facts("caches", "master", 9, rows)
        self.turns(d, [])
        self.assertEqual(self.lines(), [encode_json_line(
            {"stream": "caches", "writer": "master", "token": 9, "rows": rows})])


class LogPreviewTests(SynchronousTestCase):
    def test_the_preview_of_a_large_fact_encodes_only_what_it_shows(self):
        encoded = []
        real = log_module.preview_json

        def preview_json(value):
            encoded.append(len(value))
            return real(value)
        self.patch(log_module, "preview_json", preview_json)
        events = []
        consumer = log_module.LogConsumer(logger=Logger(observer=events.append))
        rows = rows_of(BIG)
        consumer.on_facts("caches", "master", 3, rows)
        self.assertEqual(encoded, [200])
        whole = real(rows)
        self.assertEqual(events[0]["preview"], whole[:199] + "…")
        self.assertEqual(events[0]["count"], BIG)
        # Fewer rows than characters: all of them, as before.
        encoded.clear()
        self.assertEqual(log_module.preview(rows_of(2)), real(rows_of(2)))
        self.assertEqual(encoded, [2])
