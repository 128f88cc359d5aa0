"""The read API (docs/read-api.md) on a real socket, streams on a real
PostgreSQL: pages, long-poll, Server-Sent Events, credentials, bad input."""

import os
import socket

import orjson
from twisted.internet import defer, endpoints, protocol, reactor

from replicator.http.read import tokens
from tests.support import until
from tests.test_http import AUTH, SECRET, HttpTestCase

READER_SECRET = "reader-one-secret-0123456789"
PAGES = "/_replicator/v1/streams/{}/facts"
EVENTS = "/_replicator/v1/streams/{}/events"


async def until_deferred(read, predicate, timeout: float = 10.0) -> None:
    """Until ``predicate(await read())``."""
    from tests.support import sleep

    for _ in range(int(timeout / 0.05)):
        if predicate(await read()):
            return
        await sleep(0.05)
    raise AssertionError("condition not reached in time")


class ReadTestCase(HttpTestCase):
    """An API with a reader ``one`` of ``events`` (no tests)."""

    async def start_reading(self, **http):
        secret_dir = self.mktemp()
        os.makedirs(secret_dir)
        path = os.path.join(secret_dir, "reader")
        with open(path, "w") as f:
            f.write(READER_SECRET + "\n")
        from replicator.config import validate

        readers = [{"name": "one", "secret_file": path, "streams": ["events"]}]
        overrides = {"http": {"listen": "tcp:0:interface=127.0.0.1", "secret": SECRET,
                              "readers": readers, **http}}
        from tests.servers import PostgresServer
        from tests.test_http import instance_config

        dsn = PostgresServer.shared().create_database()
        self.dsn = dsn
        config = validate(instance_config("worker1", dsn, **overrides), reactor)
        return await self.start(name="worker1", dsn=dsn, config=config)

    async def page(self, stream, query="", headers=AUTH):
        response, data = await self.call("GET", PAGES.format(stream) + query, headers=headers)
        return response, (orjson.loads(data) if data else None)

    async def write(self, stream, n, rows=1):
        ids = []
        for i in range(n):
            code, answer = await self.post(stream, {"rows": [[f"$e{i}.{r}"] if stream == "events"
                                                             else ["f", None, i]
                                                             for r in range(rows)]})
            self.assertEqual(code, 200, answer)
            ids.append(answer["stream_id"])
        return ids



class ReadApiTests(ReadTestCase):
    async def test_pages_in_order_with_next(self):
        await self.start_reading()
        ids = await self.write("events", 5)
        response, doc = await self.page("events", "?limit=2")
        self.assertEqual(response.code, 200)
        self.assertEqual([f["stream_id"] for f in doc["facts"]], ids[:2])
        self.assertEqual(doc["facts"][0], {"stream_id": ids[0], "writer": "worker1",
                                           "rows": [{"event_id": "$e0.0"}]})
        got = [f["stream_id"] for f in doc["facts"]]
        while True:
            response, doc = await self.page("events", f"?limit=2&from={doc['next']}")
            if not doc["facts"]:
                break
            got += [f["stream_id"] for f in doc["facts"]]
        self.assertEqual(got, ids)

    async def test_errors_name_the_parameter(self):
        await self.start_reading()
        await self.write("events", 2)
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
            response, doc = await self.page("events", query)
            self.assertEqual((response.code, doc.get("parameter")), (code, parameter), query)
            self.assertIn("error", doc)
        response, doc = await self.page("nosuch")
        self.assertEqual((response.code, doc["parameter"]), (404, "stream"))

    async def test_credentials_and_scope(self):
        await self.start_reading()
        await self.write("events", 1)
        response, doc = await self.page("events", headers={})
        self.assertEqual(response.code, 401)
        response, doc = await self.page("events", headers={"Authorization": "Bearer wrong-one"})
        self.assertEqual(response.code, 403)
        reader = {"Authorization": f"Bearer {READER_SECRET}"}
        response, doc = await self.page("events", headers=reader)
        self.assertEqual((response.code, len(doc["facts"])), (200, 1))
        response, doc = await self.page("caches", headers=reader)
        self.assertEqual(response.code, 403)
        response, doc = await self.page("events", headers={
            "Cookie": f"replicator_reader={READER_SECRET}"})
        self.assertEqual(response.code, 200)
        response, doc = await self.page("events", f"?access_token={READER_SECRET}", headers={})
        self.assertEqual(response.code, 200)
        lines = "\n".join(self.access_lines())
        self.assertIn("/facts", lines)
        self.assertNotIn(READER_SECRET, lines)
        for event in self.events:
            self.assertNotIn(READER_SECRET, repr(event))

    async def test_a_page_is_immutable_only_below_the_persisted_positions(self):
        """In memory the linear token may be ahead of stream_positions: an
        ID there that was rolled back could be handed out again after a
        crash of the database and a restart, and change the page."""
        await self.start_reading()
        ids = await self.write("events", 3)
        rows = lambda: self.db.runQuery(  # noqa: E731
            "SELECT stream_id FROM stream_positions WHERE stream_name = 'events'")
        await until_deferred(lambda: rows(), lambda r: r == [(ids[-1],)])
        await self.db.runOperation(
            "UPDATE stream_positions SET stream_id = %s WHERE stream_name = 'events'",
            (ids[0],))
        self.api.reads.persisted.max_age = 0  # every request reads the table
        response, doc = await self.page("events", "?limit=2")
        self.assertEqual(len(doc["facts"]), 2)
        self.assertEqual(response.headers.getRawHeaders(b"cache-control"), [b"no-store"])
        response, doc = await self.page("events", "?limit=1")
        self.assertEqual(response.headers.getRawHeaders(b"cache-control"),
                         [b"public, max-age=31536000, immutable"])

    async def test_cross_origin_reads(self):
        await self.start_reading()
        response, data = await self.call("OPTIONS", PAGES.format("events"), headers={
            "Origin": "http://app.test", "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization"})
        self.assertEqual(response.code, 204)
        self.assertEqual(response.headers.getRawHeaders(b"access-control-allow-origin"), [b"*"])
        self.assertIn(b"Authorization",
                      response.headers.getRawHeaders(b"access-control-allow-headers")[0])
        for headers in ({}, AUTH):  # the refusal too, so that a page can tell why
            response, _ = await self.page("events", headers=headers)
            self.assertEqual(response.headers.getRawHeaders(b"access-control-allow-origin"),
                             [b"*"])

    async def test_full_pages_below_linear_are_cacheable(self):
        await self.start_reading()
        await self.write("events", 3)
        response, doc = await self.page("events", "?limit=2")
        self.assertEqual(response.headers.getRawHeaders(b"cache-control"),
                         [b"public, max-age=31536000, immutable"])
        (tag,) = response.headers.getRawHeaders(b"etag")
        response, data = await self.call("GET", PAGES.format("events") + "?limit=2",
                                         headers={**AUTH, "If-None-Match": tag.decode()})
        self.assertEqual((response.code, data), (304, b""))
        response, doc = await self.page("events", f"?limit=2&from={doc['next']}")
        self.assertEqual(len(doc["facts"]), 1)
        self.assertEqual(response.headers.getRawHeaders(b"cache-control"), [b"no-store"])
        self.assertIsNone(response.headers.getRawHeaders(b"etag"))
        # The newest (empty) page, and from=now, are never cacheable.
        response, now = await self.page("events", "?from=now")
        self.assertEqual((now["facts"], now["next"]), ([], doc["next"]))

    async def test_readers_on_the_status_page_and_in_metrics(self):
        from prometheus_client import REGISTRY

        await self.start_reading()
        ids = await self.write("events", 3)
        reader = {"Authorization": f"Bearer {READER_SECRET}"}
        await self.page("events", "?limit=1", headers=reader)
        response, data = await self.call("GET", "/status.json")
        (row,) = [r for r in orjson.loads(data)["readers"] if r["reader"] == "one"]
        self.assertEqual((row["stream"], row["connected"], row["position"], row["lag"]),
                         ("events", 0, ids[0], ids[2] - ids[0]))
        response, html = await self.call("GET", "/")
        self.assertIn(b'<table id="readers">', html)
        self.assertIn(b">one<", html)
        samples = self.api.reads.metric_samples()
        self.assertIn(("replicator_http_reader_lag", ("one", "events"), ids[2] - ids[0]),
                      [(g.name, l, v) for g, l, v in samples])
        self.assertIsNotNone(REGISTRY)

    async def test_multi_writer_token_names_every_writer(self):
        await self.start_reading()
        ids = await self.write("caches", 2)
        response, doc = await self.page("caches")
        # master (another instance) has announced nothing: position 0, its
        # facts are not read past it; worker1's are.
        self.assertEqual([f["stream_id"] for f in doc["facts"]], ids)
        self.assertEqual(tokens.parse(doc["next"]), ("caches", {"master": 0,
                                                                "worker1": ids[-1]}))

    async def test_long_poll_answers_when_a_fact_arrives(self):
        await self.start_reading()
        response, doc = await self.page("events", "?from=now")
        start = doc["next"]
        d = defer.ensureDeferred(self.page("events", f"?from={start}&wait=30"))
        await until(lambda: self.api.reads.slots.open == 1)
        ids = await self.write("events", 1)
        response, doc = await d
        self.assertEqual([f["stream_id"] for f in doc["facts"]], ids)
        self.assertEqual(self.api.reads.slots.open, 0)

    async def test_a_long_poll_whose_client_goes_gives_its_slot_back(self):
        await self.start_reading()
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(f"GET {PAGES.format('events')}?from=now&wait=30 HTTP/1.1\r\n"
                     f"Host: x\r\nAuthorization: Bearer {SECRET}\r\n\r\n".encode())
        await until(lambda: self.api.reads.slots.open == 1)
        sock.close()
        await until(lambda: self.api.reads.slots.open == 0)
        await until(lambda: any("client gone" in line for line in self.access_lines()))

    async def test_long_poll_deadline_gives_the_same_next(self):
        await self.start_reading()
        await self.write("events", 1)
        response, doc = await self.page("events", "?from=now")
        response, again = await self.page("events", f"?from={doc['next']}&wait=0.3")
        self.assertEqual((again["facts"], again["next"]), ([], doc["next"]))


class SseSocket(protocol.Protocol):
    """A raw HTTP/1.0 event-stream client: keeps the events it parsed."""

    def __init__(self, path: str, headers: dict):
        self.request = (f"GET {path} HTTP/1.0\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
        self.buffer = b""
        self.head = None
        self.events = []
        self.comments = 0
        self.closed = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.buffer += data
        if self.head is None:
            head, sep, rest = self.buffer.partition(b"\r\n\r\n")
            if not sep:
                return
            self.head, self.buffer = head, rest
        while b"\n\n" in self.buffer:
            block, _, self.buffer = self.buffer.partition(b"\n\n")
            fields = {}
            for line in block.split(b"\n"):
                if line.startswith(b":"):
                    self.comments += 1
                    continue
                name, _, value = line.partition(b": ")
                fields[name.decode()] = value.decode()
            if fields.get("event") == "fact":
                self.events.append((fields["id"], orjson.loads(fields["data"])))
            elif fields:
                self.events.append(("meta", fields))

    def connectionLost(self, reason):
        self.closed.callback(None)

    def facts(self):
        return [e for e in self.events if e[0] != "meta"]


class EventStreamTests(ReadTestCase):
    async def connect(self, stream="events", query="", headers=None):
        client = SseSocket(EVENTS.format(stream) + query, {**AUTH, **(headers or {})})
        endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        await endpoints.connectProtocol(endpoint, client)
        self.addCleanup(lambda: client.transport.loseConnection() or client.closed)
        return client

    async def test_events_catch_up_then_live_then_resume(self):
        await self.start_reading()
        ids = await self.write("events", 3)
        client = await self.connect()
        await until(lambda: len(client.facts()) == 3)
        self.assertIn(b"text/event-stream", client.head)
        self.assertEqual(client.events[0], ("meta", {"retry": "2000"}))
        more = await self.write("events", 2)
        await until(lambda: len(client.facts()) == 5)
        got = [f["stream_id"] for _, f in client.facts()]
        self.assertEqual(got, ids + more)
        self.assertEqual(client.facts()[0][1]["rows"], [{"event_id": "$e0.0"}])
        # Every id is the token after its fact: resuming from the third
        # gives the fourth and fifth, nothing lost, nothing twice.
        third = client.facts()[2][0]
        self.assertEqual(tokens.parse(third)[1], {"worker1": ids[2]})
        client.transport.loseConnection()
        await client.closed
        again = await self.connect(headers={"Last-Event-ID": third})
        await until(lambda: len(again.facts()) == 2)
        self.assertEqual([f["stream_id"] for _, f in again.facts()], more)
        last = await self.write("events", 1)
        await until(lambda: len(again.facts()) == 3)
        self.assertEqual(again.facts()[-1][1]["stream_id"], last[0])

    async def test_live_facts_come_from_memory_not_the_table(self):
        await self.start_reading()
        client = await self.connect()
        await until(lambda: self.api.reads.slots.open == 1)
        stream = self.registry.get("events")
        reads = []
        table_read = stream._pages.read
        stream._pages.read = lambda *a: reads.append(a[2:]) or table_read(*a)
        ids = await self.write("events", 5)
        await until(lambda: len(client.facts()) == 5)
        self.assertEqual([f["stream_id"] for _, f in client.facts()], ids)
        self.assertEqual(reads, [])  # what the fan-out had in memory, before it forgot

    async def test_bad_last_event_id_is_400_naming_it(self):
        await self.start_reading()
        response, data = await self.call("GET", EVENTS.format("events"),
                                         headers={**AUTH, "Last-Event-ID": "v1.nope"})
        doc = orjson.loads(data)
        self.assertEqual((response.code, doc["parameter"]), (400, "Last-Event-ID"))

    async def test_heartbeat_comments(self):
        await self.start_reading(heartbeat_interval=0.1)
        client = await self.connect()
        await until(lambda: client.comments >= 2)

    async def test_cap_on_event_streams_is_503_and_health_still_answers(self):
        await self.start_reading(max_waiting_reads=2)
        first = await self.connect()
        second = await self.connect()
        await until(lambda: self.api.reads.slots.open == 2)
        response, data = await self.call("GET", EVENTS.format("events"), headers=AUTH)
        self.assertEqual(response.code, 503)
        self.assertIn("too many", orjson.loads(data)["error"])
        response, _ = await self.call("GET", "/health")
        self.assertEqual(response.code, 200)
        ids = await self.write("events", 1)
        await until(lambda: len(first.facts()) == 1 and len(second.facts()) == 1)
        self.assertEqual(first.facts()[0][1]["stream_id"], ids[0])

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
        await until(lambda: len(fast.facts()) == 60)
        await until(lambda: client.switched >= 1)
        self.assertFalse(client.live)
        buffered = len(client.request.channel.transport.dataBuffer) + sum(
            len(d) for d in client.request.channel.transport._tempDataBuffer)
        # At most the transport's bound, the live round that crossed it (a
        # fact or a few) and one write of catch-up, not the 2.4 MB of the
        # 60 facts.
        self.assertLess(buffered, 600_000)
        slow.transport.resumeProducing()
        await until(lambda: len(slow.facts()) == 60)
        self.assertEqual([f["stream_id"] for _, f in slow.facts()], ids)
        await until(lambda: client.live)
        more = await self.write("events", 1)
        await until(lambda: len(slow.facts()) == 61)
        self.assertEqual(slow.facts()[-1][1]["stream_id"], more[0])
