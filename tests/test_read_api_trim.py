"""The read API and retention (docs/read-api.md, "Trimmed facts"): a token
below a stream's trim boundary is a JSON 410 naming the parameter and the
boundary (pages, and event streams before they start), ``from`` absent
starts at the boundary, and an event stream the boundary passes while it
reads pages ends with an ``error`` event, counted, with no traceback.
Real PostgreSQL, the trim done as retention does it (rows deleted and the
boundary moved in one transaction)."""

import orjson

from replicator.http.read import tokens
from tests.http_api import AUTH
from tests.read_api_cases import EVENTS, ReadTestCase, SseSocket
from tests.support import until


class TrimmedReadTests(ReadTestCase):
    async def trim(self, upto: int) -> None:
        """Trim ``events`` up to ``upto`` as retention does, and make memory
        forget it (pages come from the table)."""
        stream = self.registry.get("events")

        def txn(cursor):
            cursor.execute("DELETE FROM event_stream WHERE stream_id <= %s", (upto,))
            cursor.execute("DELETE FROM stream_retention WHERE table_name = 'event_stream'")
            cursor.execute("INSERT INTO stream_retention (table_name, trimmed_through) "
                           "VALUES ('event_stream', %s)", (upto,))
        await self.db.runInteraction(txn)
        stream.forget("worker1", stream.id_gen.get_current_token("worker1"))

    def critical(self):
        return [e for e in self.events if e.get("log_failure") is not None
                or str(e.get("log_level", "")).endswith("critical")]

    async def connect(self, query="", headers=None):
        client = SseSocket(EVENTS.format("events") + query, {**AUTH, **(headers or {})})
        from twisted.internet import endpoints, reactor

        endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        await endpoints.connectProtocol(endpoint, client)
        self.addCleanup(lambda: client.transport.loseConnection() or client.closed)
        return client

    async def test_a_page_below_the_boundary_is_410_naming_from(self):
        await self.start_reading()
        ids = await self.write("events", 6)
        await self.trim(ids[3])
        below = tokens.encode("events", {"worker1": ids[1]})
        response, doc = await self.page("events", f"?from={below}")
        self.assertEqual(response.code, 410, doc)
        self.assertEqual((doc["parameter"], doc["trimmed_through"]), ("from", ids[3]))
        self.assertIn(f"facts after {ids[1]} of writer worker1 were trimmed by retention "
                      f"(up to {ids[3]})", doc["error"])
        # At the boundary: the facts after it.
        at = tokens.encode("events", {"worker1": ids[3]})
        response, doc = await self.page("events", f"?from={at}")
        self.assertEqual([f["stream_id"] for f in doc["facts"]], ids[4:])
        # A long-poll below it too (and it holds no slot).
        response, doc = await self.page("events", f"?from={below}&wait=5")
        self.assertEqual(response.code, 410)
        self.assertEqual(self.api.reads.slots.open, 0)
        self.assertEqual(self.critical(), [])

    async def test_from_absent_starts_at_the_oldest_retained_fact(self):
        await self.start_reading()
        ids = await self.write("events", 6)
        await self.trim(ids[2])
        response, doc = await self.page("events", "?limit=2")
        self.assertEqual(response.code, 200, doc)
        self.assertEqual([f["stream_id"] for f in doc["facts"]], ids[3:5])
        response, doc = await self.page("events", f"?from={doc['next']}")
        self.assertEqual([f["stream_id"] for f in doc["facts"]], ids[5:])
        client = await self.connect()
        await client.until(lambda: len(client.facts()) == 3)
        self.assertEqual([f["stream_id"] for _, f in client.facts()], ids[3:])
        self.assertEqual(self.critical(), [])

    async def test_an_event_stream_below_the_boundary_is_410_before_it_starts(self):
        await self.start_reading()
        ids = await self.write("events", 4)
        await self.trim(ids[2])
        below = tokens.encode("events", {"worker1": ids[0]})
        response, data = await self.call("GET", EVENTS.format("events"),
                                         headers={**AUTH, "Last-Event-ID": below})
        doc = orjson.loads(data)
        self.assertEqual(response.code, 410, doc)
        self.assertEqual((doc["parameter"], doc["trimmed_through"]),
                         ("Last-Event-ID", ids[2]))
        response, data = await self.call("GET", EVENTS.format("events") + f"?from={below}",
                                         headers=AUTH)
        doc = orjson.loads(data)
        self.assertEqual((response.code, doc["parameter"]), (410, "from"))
        self.assertEqual(self.api.reads.slots.open, 0)
        self.assertEqual(self.critical(), [])

    async def test_the_boundary_passing_a_reader_ends_its_stream_with_an_error_event(self):
        await self.start_reading()
        ids = await self.write("events", 6)
        stream = self.registry.get("events")
        stream.forget("worker1", ids[-1])
        # The stream starts (its start checked, its first page read), then
        # the boundary passes it before its next page: as a reader that
        # fell behind.
        reads = []
        routes = self.api.reads
        page = routes.page

        async def slow_page(*args, **kw):
            reads.append(args)
            if len(reads) == 3:
                await self.trim(ids[4])
            return await page(*args, **kw)

        routes.page = slow_page
        from replicator.http.read import sse

        self.patch(sse, "CATCH_UP_PAGE", 2)
        client = await self.connect()
        await client.closed
        self.assertEqual([f["stream_id"] for _, f in client.facts()], ids[:2])
        (error,) = [fields for kind, fields in client.events
                    if kind == "meta" and fields.get("event") == "error"]
        doc = orjson.loads(error["data"])
        self.assertEqual((doc["parameter"], doc["trimmed_through"]), ("from", ids[4]))
        self.assertIn(f"facts after {ids[1]} of writer worker1", doc["error"])
        self.assertEqual(routes.slots.open, 0)
        self.assertEqual(routes.trimmed_streams, 1)
        lines = [e for e in self.events if "trim boundary" in str(e.get("log_format", ""))]
        self.assertEqual(len(lines), 1, lines)
        self.assertEqual(self.critical(), [])

    async def test_open_reads_are_counted_until_they_end(self):
        """Every stream that answered 200 is in the caps and the readers
        until it ends, whatever ended it."""
        await self.start_reading(max_waiting_reads=1)
        ids = await self.write("events", 3)
        await self.trim(ids[1])
        below = tokens.encode("events", {"worker1": ids[0]})
        for _ in range(3):  # none of them stays open (or holds the one slot)
            response, _ = await self.call("GET", EVENTS.format("events"),
                                          headers={**AUTH, "Last-Event-ID": below})
            self.assertEqual(response.code, 410)
        client = await self.connect()
        await client.until(lambda: len(client.facts()) == 1)
        self.assertEqual(self.api.reads.slots.open, 1)
        response, data = await self.call("GET", "/status.json")
        (row,) = [r for r in orjson.loads(data)["readers"] if r["stream"] == "events"]
        self.assertEqual(row["connected"], 1)
        client.transport.loseConnection()
        await client.closed
        await until(lambda: self.api.reads.slots.open == 0)
