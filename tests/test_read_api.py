"""The read API (docs/read-api.md) on a real socket, streams on a real
PostgreSQL: pages, long-poll, Server-Sent Events, credentials, bad input."""

import os

import orjson
from twisted.internet import defer, reactor

from replicator.readapi import tokens
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
