"""The read API (docs/read-api.md) on a real socket, streams on a real
PostgreSQL: pages, long-poll, Server-Sent Events, credentials, bad input."""

import os

import orjson
from twisted.internet import defer, reactor

from replicator.readapi import tokens
from tests.support import until
from tests.test_http import AUTH, SECRET, STREAMS, HttpTestCase

READER_SECRET = "reader-one-secret-0123456789"
PAGES = "/_replicator/v1/streams/{}/facts"
EVENTS = "/_replicator/v1/streams/{}/events"


class ReadApiTests(HttpTestCase):
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
        from tests.test_http import instance_config
        from tests.servers import PostgresServer

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
                 ("?wait=-1", 400, "wait"), ("?limit=1&limit=2", 400, "limit")]
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

    async def test_long_poll_deadline_gives_the_same_next(self):
        await self.start_reading()
        await self.write("events", 1)
        response, doc = await self.page("events", "?from=now")
        response, again = await self.page("events", f"?from={doc['next']}&wait=1")
        self.assertEqual((again["facts"], again["next"]), ([], doc["next"]))
