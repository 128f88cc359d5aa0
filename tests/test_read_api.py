"""The read API (docs/read-api.md): pages, long-poll, Server-Sent Events,
credentials, bad input.

Its logic in memory (:class:`InMemoryReadTestCase`, on
:class:`tests.http_api.InMemoryHttpTestCase`: twisted.web's server and
Agent joined in memory, streams on SQLite, a clock the test moves); on a
real socket and PostgreSQL only what the kernel's buffers decide (a slow
reader's backlog).  The cases they run on are in
:mod:`tests.read_api_cases`."""

import socket

import orjson
from twisted.internet import endpoints, reactor

from replicator.http.read import tokens
from tests.http_api import AUTH, SECRET, RawClient
from tests.read_api_cases import (  # noqa: F401 (test_read_api_ds imports some)
    EVENTS,
    PAGES,
    READER_SECRET,
    InMemoryReadTestCase,
    ReadTestCase,
    SseSocket,
    until_deferred,
)
from tests.support import until


class ReadApiTests(InMemoryReadTestCase):
    def test_pages_in_order_with_next(self):
        self.start_reading()
        ids = self.write("events", 5)
        self.assertEqual(ids, [1, 2, 3, 4, 5])
        response, doc = self.page("events", "?limit=2")
        self.assertEqual(response.code, 200)
        self.assertEqual([f["stream_id"] for f in doc["facts"]], ids[:2])
        self.assertEqual(doc["facts"][0], {"stream_id": ids[0], "writer": "worker1",
                                           "rows": [{"event_id": "$e0.0"}]})
        got = [f["stream_id"] for f in doc["facts"]]
        pages = 1
        while True:
            response, doc = self.page("events", f"?limit=2&from={doc['next']}")
            if not doc["facts"]:
                break
            pages += 1
            got += [f["stream_id"] for f in doc["facts"]]
        self.assertEqual((got, pages), (ids, 3))

    def test_errors_name_the_parameter(self):
        self.start_reading()
        self.write("events", 2)
        other = tokens.encode("caches", {"master": 0, "worker1": 0})
        stranger = tokens.encode("events", {"worker1": 0, "nobody": 3})
        beyond = tokens.encode("events", {"worker1": 10 ** 9})
        cases = [("?from=garbage", 400, "from"), (f"?from={other}", 400, "from"),
                 (f"?from={stranger}", 400, "from"), (f"?from={beyond}", 400, "from"),
                 ("?limit=0", 400, "limit"), ("?limit=1001", 400, "limit"),
                 ("?limit=x", 400, "limit"), ("?wait=31", 400, "wait"),
                 ("?wait=-1", 400, "wait"), ("?wait=30.5", 400, "wait"),
                 ("?wait=1e3", 400, "wait"), ("?wait=nan", 400, "wait"),
                 ("?limit=1&limit=2", 400, "limit"), ("?from=now&from=now", 400, "from"),
                 ("?limit=%ff", 400, "limit")]
        for query, code, parameter in cases:
            response, doc = self.page("events", query)
            self.assertEqual((response.code, doc.get("parameter")), (code, parameter), query)
            self.assertIn("error", doc)
        response, doc = self.page("nosuch")
        self.assertEqual((response.code, doc["parameter"]), (404, "stream"))

    def test_credentials_and_scope(self):
        self.start_reading()
        self.write("events", 1)
        response, doc = self.page("events", headers={})
        self.assertEqual(response.code, 401)
        response, doc = self.page("events", headers={"Authorization": "Bearer wrong-one"})
        self.assertEqual(response.code, 403)
        reader = {"Authorization": f"Bearer {READER_SECRET}"}
        response, doc = self.page("events", headers=reader)
        self.assertEqual((response.code, len(doc["facts"])), (200, 1))
        response, doc = self.page("caches", headers=reader)
        self.assertEqual(response.code, 403)
        response, doc = self.page("events", headers={
            "Cookie": f"replicator_reader={READER_SECRET}"})
        self.assertEqual(response.code, 200)
        response, doc = self.page("events", f"?access_token={READER_SECRET}", headers={})
        self.assertEqual(response.code, 200)
        lines = "\n".join(self.access_lines())
        self.assertIn("/facts", lines)
        self.assertNotIn(READER_SECRET, lines)
        for event in self.events:
            self.assertNotIn(READER_SECRET, repr(event))

    def test_a_page_is_immutable_only_below_the_persisted_positions(self):
        """In memory the linear token may be ahead of stream_positions: an
        ID there that was rolled back could be handed out again after a
        crash of the database and a restart, and change the page."""
        self.start_reading()
        ids = self.write("events", 3)
        self.h.advance(5)  # the positions' persist
        rows = self.h.run(self.db.runQuery(
            "SELECT stream_id FROM stream_positions WHERE stream_name = 'events'"))
        self.assertEqual(rows, [(ids[-1],)])
        self.h.run(self.db.runOperation(
            "UPDATE stream_positions SET stream_id = ? WHERE stream_name = 'events'",
            (ids[0],)))
        self.api.reads.persisted.max_age = 0  # every request reads the table
        response, doc = self.page("events", "?limit=2")
        self.assertEqual(len(doc["facts"]), 2)
        self.assertEqual(response.headers.getRawHeaders(b"cache-control"), [b"no-store"])
        response, doc = self.page("events", "?limit=1")
        self.assertEqual(response.headers.getRawHeaders(b"cache-control"),
                         [b"public, max-age=31536000, immutable"])

    def test_cross_origin_reads(self):
        self.start_reading()
        response, data = self.h.run(self.call("OPTIONS", PAGES.format("events"), headers={
            "Origin": "http://app.test", "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization"}), settle=False)
        self.assertEqual(response.code, 204)
        self.assertEqual(response.headers.getRawHeaders(b"access-control-allow-origin"), [b"*"])
        self.assertIn(b"Authorization",
                      response.headers.getRawHeaders(b"access-control-allow-headers")[0])
        for headers in ({}, AUTH):  # the refusal too, so that a page can tell why
            response, _ = self.page("events", headers=headers)
            self.assertEqual(response.headers.getRawHeaders(b"access-control-allow-origin"),
                             [b"*"])

    def test_full_pages_below_linear_are_cacheable(self):
        self.start_reading()
        self.write("events", 3)
        response, doc = self.page("events", "?limit=2")
        self.assertEqual(response.headers.getRawHeaders(b"cache-control"),
                         [b"public, max-age=31536000, immutable"])
        (tag,) = response.headers.getRawHeaders(b"etag")
        response, data = self.get(PAGES.format("events") + "?limit=2",
                                  headers={**AUTH, "If-None-Match": tag.decode()})
        self.assertEqual((response.code, data), (304, b""))
        response, doc = self.page("events", f"?limit=2&from={doc['next']}")
        self.assertEqual(len(doc["facts"]), 1)
        self.assertEqual(response.headers.getRawHeaders(b"cache-control"), [b"no-store"])
        self.assertIsNone(response.headers.getRawHeaders(b"etag"))
        # The newest (empty) page, and from=now, are never cacheable.
        response, now = self.page("events", "?from=now")
        self.assertEqual((now["facts"], now["next"]), ([], doc["next"]))

    def test_readers_on_the_status_page_and_in_metrics(self):
        self.start_reading()
        ids = self.write("events", 3)
        reader = {"Authorization": f"Bearer {READER_SECRET}"}
        self.page("events", "?limit=1", headers=reader)
        response, data = self.get("/status.json")
        (row,) = [r for r in orjson.loads(data)["readers"] if r["reader"] == "one"]
        self.assertEqual((row["stream"], row["connected"], row["position"], row["lag"]),
                         ("events", 0, ids[0], ids[2] - ids[0]))
        response, html = self.get("/")
        self.assertIn(b'<table id="readers">', html)
        self.assertIn(b">one<", html)
        samples = self.api.reads.metric_samples()
        self.assertIn(("replicator_http_reader_lag", ("one", "events"), ids[2] - ids[0]),
                      [(g.name, l, v) for g, l, v in samples])

    def test_multi_writer_token_names_every_writer(self):
        self.start_reading()
        ids = self.write("caches", 2)
        response, doc = self.page("caches")
        # master (another instance) has announced nothing: position 0, its
        # facts are not read past it; worker1's are.
        self.assertEqual([f["stream_id"] for f in doc["facts"]], ids)
        self.assertEqual(tokens.parse(doc["next"]), ("caches", {"master": 0,
                                                                "worker1": ids[-1]}))

    def test_long_poll_answers_when_a_fact_arrives(self):
        self.start_reading()
        response, doc = self.page("events", "?from=now")
        d = self.page_later("events", f"?from={doc['next']}&wait=30")
        self.assertEqual(self.api.reads.slots.open, 1)
        self.assertFalse(d.called)
        ids = self.write("events", 1)
        response, doc = self.h.run(d, settle=False)
        self.assertEqual([f["stream_id"] for f in doc["facts"]], ids)
        self.assertEqual(self.api.reads.slots.open, 0)

    def test_a_long_poll_whose_client_goes_gives_its_slot_back(self):
        self.start_reading()
        client = RawClient(f"GET {PAGES.format('events')}?from=now&wait=30 HTTP/1.1\r\n"
                           f"Host: x\r\nAuthorization: Bearer {SECRET}\r\n\r\n".encode())
        self.open(client)
        self.h.flush()
        self.assertEqual(self.api.reads.slots.open, 1)
        client.transport.loseConnection()
        self.h.flush()
        self.assertEqual(self.api.reads.slots.open, 0)
        self.assertEqual(len([line for line in self.access_lines() if "client gone" in line]), 1)

    def test_long_poll_deadline_gives_the_same_next(self):
        self.start_reading()
        self.write("events", 1)
        response, doc = self.page("events", "?from=now")
        start = self.h.clock.seconds()
        response, again = self.page("events", f"?from={doc['next']}&wait=0.3")
        self.assertEqual((again["facts"], again["next"]), ([], doc["next"]))
        self.assertGreaterEqual(self.h.clock.seconds() - start, 0.3)


class EventStreamTests(InMemoryReadTestCase):
    def test_events_catch_up_then_live_then_resume(self):
        self.start_reading()
        ids = self.write("events", 3)
        client = self.connect()
        self.assertEqual(len(client.facts()), 3)
        self.assertIn(b"text/event-stream", client.head)
        self.assertEqual(client.events[0], ("meta", {"retry": "2000"}))
        more = self.write("events", 2)
        got = [f["stream_id"] for _, f in client.facts()]
        self.assertEqual(got, ids + more)
        self.assertEqual(client.facts()[0][1]["rows"], [{"event_id": "$e0.0"}])
        # Every id is the token after its fact: resuming from the third
        # gives the fourth and fifth, nothing lost, nothing twice.
        third = client.facts()[2][0]
        self.assertEqual(tokens.parse(third)[1], {"worker1": ids[2]})
        self.close(client)
        again = self.connect(headers={"Last-Event-ID": third})
        self.assertEqual([f["stream_id"] for _, f in again.facts()], more)
        last = self.write("events", 1)
        self.assertEqual([f["stream_id"] for _, f in again.facts()], more + last)

    def test_live_facts_come_from_memory_not_the_table(self):
        self.start_reading()
        client = self.connect()
        self.assertEqual(self.api.reads.slots.open, 1)
        pages = self.registry.get("events")._pages
        reads = []
        for name in ("read", "read_facts", "read_fact_pages"):
            def counted(*a, _read=getattr(pages, name), _name=name):
                reads.append(_name)
                return _read(*a)
            setattr(pages, name, counted)
        ids = self.write("events", 5)
        self.assertEqual([f["stream_id"] for _, f in client.facts()], ids)
        self.assertEqual(reads, [])  # what the fan-out had in memory, before it forgot

    def test_bad_last_event_id_is_400_naming_it(self):
        self.start_reading()
        response, data = self.get(EVENTS.format("events"),
                                  headers={**AUTH, "Last-Event-ID": "v1.nope"})
        doc = orjson.loads(data)
        self.assertEqual((response.code, doc["parameter"]), (400, "Last-Event-ID"))

    def test_heartbeat_comments(self):
        self.start_reading(heartbeat_interval=0.1)
        client = self.connect()
        self.assertEqual(client.comments, 0)
        self.h.advance(0.25)
        self.assertEqual(client.comments, 2)

    def test_cap_on_event_streams_is_503_and_health_still_answers(self):
        self.start_reading(max_waiting_reads=2)
        first = self.connect()
        second = self.connect()
        self.assertEqual(self.api.reads.slots.open, 2)
        response, data = self.get(EVENTS.format("events"), headers=AUTH)
        self.assertEqual(response.code, 503)
        self.assertIn("too many", orjson.loads(data)["error"])
        response, _ = self.get("/health")
        self.assertEqual(response.code, 200)
        ids = self.write("events", 1)
        self.assertEqual([f["stream_id"] for _, f in first.facts()], ids)
        self.assertEqual([f["stream_id"] for _, f in second.facts()], ids)


class SlowReaderTests(ReadTestCase):
    """What a slow reader's backlog is, on real sockets: the kernel's
    buffers decide when the server's transport backs up."""

    async def connect(self, stream="events", query="", headers=None):
        client = SseSocket(EVENTS.format(stream) + query, {**AUTH, **(headers or {})})
        endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        await endpoints.connectProtocol(endpoint, client)
        self.addCleanup(lambda: client.transport.loseConnection() or client.closed)
        return client

    async def test_slow_reader_is_switched_to_the_table_and_stays_bounded(self):
        await self.start_reading()
        big = "x" * 4000
        slow = await self.connect()
        slow.transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        fast = await self.connect()
        await until(lambda: self.api.reads.slots.open == 2)
        slow.transport.pauseProducing()  # it stops reading its socket
        (client,) = [c for c in self.api.reads.book.streams[("secret", "events")]
                     if c.request.getClientAddress().port == slow.transport.getHost().port]
        # Small kernel buffers on both sides: the backlog is the server's.
        client.request.channel.transport.socket.setsockopt(socket.SOL_SOCKET,
                                                           socket.SO_SNDBUF, 65536)
        ids = []
        for _ in range(60):
            rows = [[f"{big}{i}"] for i in range(10)]
            code, answer = await self.post("events", {"rows": rows})
            ids.append(answer["stream_id"])
        await fast.until(lambda: len(fast.facts()) == 60)
        await until(lambda: client.switched >= 1)
        self.assertFalse(client.live)
        buffered = len(client.request.channel.transport.dataBuffer) + sum(
            len(d) for d in client.request.channel.transport._tempDataBuffer)
        # At most the transport's bound, the live round that crossed it (a
        # fact or a few) and one write of catch-up, not the 2.4 MB of the
        # 60 facts.
        self.assertLess(buffered, 600_000)
        slow.transport.resumeProducing()
        await slow.until(lambda: len(slow.facts()) == 60)
        self.assertEqual([f["stream_id"] for _, f in slow.facts()], ids)
        await until(lambda: client.live)
        more = await self.write("events", 1)
        await slow.until(lambda: len(slow.facts()) == 61)
        self.assertEqual(slow.facts()[-1][1]["stream_id"], more[0])
