"""Durable Streams created over HTTP (docs/read-api.md, "Streams created
over HTTP"): ``PUT``/``POST``/``DELETE`` and the reads of
``/_replicator/v1/ds/{stream}/{path}`` on a real socket, a
``durable_streams: true`` stream on a real PostgreSQL; the encodings and
checks in memory."""

import base64
import os

import orjson
from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import validate
from replicator.http.answers import HttpError
from replicator.http.read import durable_paths as dp
from replicator.http.read.pages import Page
from tests.test_http import AUTH, SECRET, STREAMS
from tests.test_read_api import READER_SECRET, ReadTestCase

DS_STREAM = {"name": "ds", "table": "ds_operations", "durable_streams": True,
             "writers": ["worker1"]}
BASE = "/_replicator/v1/ds/ds/"
READER = {"Authorization": f"Bearer {READER_SECRET}"}


class EncodingTests(SynchronousTestCase):
    def test_json_bodies_are_message_arrays(self):
        self.assertEqual(dp.encode_body("application/json", b'[{"a":1},2]', True),
                         '[{"a":1},2]')
        self.assertEqual(dp.encode_body("Application/JSON; charset=utf-8", b'{"a":1}', True),
                         '[{"a":1}]')
        self.assertIsNone(dp.encode_body("application/json", b"[]", False))
        for body, why in ((b"[]", "empty JSON array"), (b"", "needs a body"),
                          (b"{", "invalid JSON"), (b'{"a":1,"a":2}', "given twice")):
            with self.assertRaisesRegex(HttpError, why):
                dp.encode_body("application/json", body, True)

    def test_byte_bodies_round_trip(self):
        raw = bytes(range(256))
        text = dp.encode_body("application/octet-stream", raw, True)
        self.assertEqual(dp.decode_body("application/octet-stream", text), raw)
        self.assertIsNone(dp.encode_body("text/plain", b"", False))
        with self.assertRaisesRegex(HttpError, "non-empty"):
            dp.encode_body("text/plain", b"", True)

    def test_paths(self):
        self.assertEqual(dp.check_path("v1/stream/a-1"), "v1/stream/a-1")
        for bad in (None, "", "a//b", "a/", "a b", "a\nb", "x" * (dp.MAX_PATH + 1)):
            with self.assertRaises(HttpError) as e:
                dp.check_path(bad)
            self.assertEqual(e.exception.code, 400)

    def test_sse_data_keeps_event_boundaries_out(self):
        paths = dp.DurablePaths.__new__(dp.DurablePaths)

        def event(content_type, pieces):
            view = dp.PathView(None, "p", 1, content_type)
            page = Page([(i + 1, "w", [], p) for i, p in enumerate(pieces)], {"w": 2}, False,
                        False)
            return paths.sse_data(view, page)

        self.assertEqual(event("text/plain", [b"a\r\n\nevent: control", b"\rb"]),
                         b"event: data\ndata:a\ndata:\ndata:event: control\ndata:b\n\n")
        self.assertEqual(event("application/json", [b'{"n":1}', b"", b"2"]),
                         b'event: data\ndata:[{"n":1},2]\n\n')
        self.assertEqual(event("image/png", [b"\x00\n", b"\xff"]),
                         b"event: data\ndata:" + base64.b64encode(b"\x00\n\xff") + b"\n\n")


class DurablePathTests(ReadTestCase):
    async def start_paths(self, **http):
        secret_dir = self.mktemp()
        os.makedirs(secret_dir)
        path = os.path.join(secret_dir, "reader")
        with open(path, "w") as f:
            f.write(READER_SECRET + "\n")
        readers = [{"name": "one", "secret_file": path, "streams": ["ds"]}]
        from tests.servers import PostgresServer
        from tests.test_http import instance_config

        self.dsn = PostgresServer.shared().create_database()
        config = validate(instance_config(
            "worker1", self.dsn, streams=[*STREAMS, DS_STREAM],
            http={"listen": "tcp:0:interface=127.0.0.1", "secret": SECRET, "readers": readers,
                  **http}), reactor)
        return await self.start(name="worker1", dsn=self.dsn, config=config)

    async def ds(self, method, path, body=None, headers=AUTH, query=""):
        return await self.call(method, BASE + path + query, body, headers)

    @staticmethod
    def header(response, name):
        values = response.headers.getRawHeaders(name.encode())
        return values[0].decode() if values else None

    async def test_create_append_read_delete_in_byte_mode(self):
        await self.start_paths()
        text = {**AUTH, "Content-Type": "text/plain"}
        response, _ = await self.ds("PUT", "v1/a", b"old", text)
        self.assertEqual(response.code, 201)
        created = self.header(response, "stream-next-offset")
        response, _ = await self.ds("PUT", "v1/a", None, text)
        self.assertEqual(response.code, 200)  # the same configuration again
        response, data = await self.ds("PUT", "v1/a", None,
                                       {**AUTH, "Content-Type": "application/json"})
        self.assertEqual(response.code, 409)
        response, _ = await self.ds("POST", "v1/a", b" data", text)
        self.assertEqual(response.code, 204)
        appended = self.header(response, "stream-next-offset")
        self.assertGreater(appended, created)
        # Readable at once (the answer came once it was), by a reader too.
        response, data = await self.ds("GET", "v1/a", headers=READER)
        self.assertEqual((response.code, data), (200, b"old data"))
        self.assertEqual(self.header(response, "content-type"), "text/plain")
        self.assertEqual(self.header(response, "stream-next-offset"), appended)
        self.assertEqual(self.header(response, "stream-up-to-date"), "true")
        response, data = await self.ds("GET", "v1/a", headers=READER, query=f"?offset={created}")
        self.assertEqual(data, b" data")
        # The table holds one fact per operation, in order.
        rows = await self.db.runQuery("SELECT ds_path, ds_op, content_type, body FROM "
                                      "ds_operations ORDER BY stream_id")
        self.assertEqual(rows, [("v1/a", "create", "text/plain", "b2xk"),
                                ("v1/a", "append", None, "IGRhdGE=")])
        # Stream-Seq: each after the last, bytewise.
        for seq, code in (("2", 204), ("10", 409), ("2", 409), ("3", 204), ("a", 204),
                          ("A", 409)):
            response, data = await self.ds("POST", "v1/a", b"s", {**text, "Stream-Seq": seq})
            self.assertEqual(response.code, code, (seq, data))
        response, data = await self.ds("GET", "v1/a")
        self.assertEqual(data, b"old datasss")
        response, _ = await self.ds("DELETE", "v1/a")
        self.assertEqual(response.code, 204)
        for method in ("GET", "POST", "DELETE"):
            response, _ = await self.ds(method, "v1/a", b"x" if method == "POST" else None,
                                        text)
            self.assertEqual(response.code, 404, method)
        # Created again: only what came after (an old offset reads from it).
        response, _ = await self.ds("PUT", "v1/a", b"new", text)
        self.assertEqual(response.code, 201)
        response, data = await self.ds("GET", "v1/a", query=f"?offset={created}")
        self.assertEqual(data, b"new")

    async def test_json_mode_and_sse(self):
        await self.start_paths()
        js = {**AUTH, "Content-Type": "application/json"}
        response, _ = await self.ds("PUT", "j", b'[{"n":1}]', js)
        self.assertEqual(response.code, 201)
        response, _ = await self.ds("POST", "j", b'[{"n":2},{"n":3}]', js)
        self.assertEqual(response.code, 204)
        response, _ = await self.ds("POST", "j", b'"four"', js)
        response, data = await self.ds("GET", "j")
        self.assertEqual(orjson.loads(data), [{"n": 1}, {"n": 2}, {"n": 3}, "four"])
        response, _ = await self.ds("POST", "j", b"x", {**AUTH, "Content-Type": "text/plain"})
        self.assertEqual(response.code, 409)
        response, data = await self.ds("GET", "j", query="?offset=now")
        self.assertEqual(data, b"[]")
        response, data = await self.ds("HEAD", "j")
        self.assertEqual((response.code, data), (200, b""))
        self.assertEqual(self.header(response, "content-type"), "application/json")
        self.api.ds_paths.sse_seconds = 0.5
        response, data = await self.ds("GET", "j", query="?offset=-1&live=sse")
        self.assertEqual(self.header(response, "content-type"), "text/event-stream")
        self.assertIn("no-cache", self.header(response, "cache-control"))
        events = [e for e in data.split(b"\n\n") if e.startswith(b"event: data")]
        self.assertEqual(events, [b'event: data\ndata:[{"n":1},{"n":2},{"n":3},"four"]'])

    async def test_refusals(self):
        await self.start_paths()
        text = {**AUTH, "Content-Type": "text/plain"}
        cases = [
            ("PUT", "x", None, READER, 403),  # a reader may not write
            ("PUT", "x", None, {}, 401),
            ("PUT", "x", None, {**text, "Stream-TTL": "60"}, 400),  # not supported
            ("POST", "x", b"a", {**text, "Producer-Id": "p"}, 400),
            ("PUT", "a%20b/", None, text, 400),
            ("PUT", "x", None, {**AUTH, "Content-Type": "text/\x01"}, 400),
            ("GET", "missing", None, AUTH, 404),
            ("POST", "x", b"a", AUTH, 400),  # no Content-Type
            ("POST", "missing", b"a", text, 404),
        ]
        for method, path, body, headers, code in cases:
            response, data = await self.ds(method, path, body, headers)
            self.assertEqual(response.code, code, (method, path, headers, data))
            self.assertIn(b'"error"', data)
            self.assertEqual(self.header(response, "x-content-type-options"), "nosniff")
        # A stream not declared durable_streams: true has no paths.
        response, data = await self.call("PUT", "/_replicator/v1/ds/events/x", None, text)
        self.assertEqual(response.code, 404)
        response, _ = await self.ds("PUT", "x", b"y" * ((1 << 20) + 1), text)
        self.assertEqual(response.code, 413)  # the write API's body limit
        response, data = await self.ds("PUT", "x", b"y" * (1 << 20), text)
        self.assertEqual(response.code, 400)  # its fact's line over the replication limit
        self.assertIn(b"line", data)
        response, _ = await self.ds("GET", "x")
        self.assertEqual(response.code, 404)  # nothing refused was written
        rows = await self.db.runQuery("SELECT count(*) FROM ds_operations")
        self.assertEqual(rows, [(0,)])

    async def test_not_the_writer_is_409(self):
        await self.start_paths()
        self.registry.find("ds").local_writers.remove("worker1")
        response, data = await self.ds("PUT", "x", None, {**AUTH, "Content-Type": "text/plain"})
        self.assertEqual(response.code, 409)
        self.assertIn(b"not a writer of stream ds", data)

    async def test_full_answers_are_never_immutable(self):
        """A path deleted and created again answers the same URL with the
        new stream: no answer of a path is cached for ever."""
        from tests.test_read_api import until_deferred

        await self.start_paths(max_page_bytes=1024)
        text = {**AUTH, "Content-Type": "text/plain"}
        await self.ds("PUT", "p", b"a" * 600, text)
        for _ in range(3):
            await self.ds("POST", "p", b"b" * 600, text)
        await until_deferred(lambda: self.db.runQuery(
            "SELECT stream_id FROM stream_positions WHERE stream_name = 'ds'"),
            lambda r: r and r[0][0] >= 4)
        self.api.reads.persisted.max_age = 0
        response, data = await self.ds("GET", "p", query="?offset=-1")
        self.assertEqual(data, b"a" * 600 + b"b" * 600)  # a full answer: 1024 bytes reached
        self.assertIsNone(self.header(response, "stream-up-to-date"))
        self.assertEqual(self.header(response, "cache-control"), "no-store")
        first = self.header(response, "stream-next-offset")
        await self.ds("DELETE", "p")
        await self.ds("PUT", "p", b"new", text)
        response, data = await self.ds("GET", "p", query="?offset=-1")
        self.assertEqual(data, b"new")
        self.assertLess(first, self.header(response, "stream-next-offset"))
