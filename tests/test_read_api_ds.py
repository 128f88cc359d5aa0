"""Every stream as a Durable Stream (docs/read-api.md, "Durable Streams"):
``/_replicator/v1/ds/{stream}`` on a real socket, streams on a real
PostgreSQL: offsets, catch-up, long-poll, SSE with control events, HEAD,
ETag, 410 below the trim boundary, credentials, bad input."""

import socket

import orjson
from twisted.internet import defer
from twisted.trial.unittest import SynchronousTestCase

from replicator.http.read import durable
from tests import test_read_api_trim
from tests.support import until
from tests.test_http import AUTH
from tests.test_read_api import READER_SECRET, ReadTestCase

DS = "/_replicator/v1/ds/{}"


def offset(n: int) -> str:
    return f"{n:019d}"


class DurableStreamTests(ReadTestCase):
    async def get(self, stream, query="", headers=AUTH, method="GET"):
        response, data = await self.call(method, DS.format(stream) + query, headers=headers)
        return response, data

    @staticmethod
    def header(response, name):
        values = response.headers.getRawHeaders(name.encode())
        return values[0].decode() if values else None

    async def test_catch_up_in_stream_id_order_with_offsets(self):
        await self.start_reading()
        ids = await self.write("events", 5)
        response, data = await self.get("events", "?offset=-1")
        self.assertEqual(response.code, 200)
        self.assertEqual(self.header(response, "content-type"), "application/json")
        messages = orjson.loads(data)
        self.assertEqual(messages, [{"stream_id": i, "writer": "worker1",
                                     "rows": [{"event_id": f"$e{n}.0"}]}
                                    for n, i in enumerate(ids)])
        self.assertEqual(self.header(response, "stream-next-offset"), offset(ids[-1]))
        self.assertEqual(self.header(response, "stream-up-to-date"), "true")
        self.assertEqual(self.header(response, "x-content-type-options"), "nosniff")
        self.assertEqual(self.header(response, "cross-origin-resource-policy"), "cross-origin")
        self.assertIn("Stream-Next-Offset", self.header(response,
                                                        "access-control-expose-headers"))
        # No offset is the same as -1; from an offset, what follows it.
        response, same = await self.get("events")
        self.assertEqual(same, data)
        response, rest = await self.get("events", f"?offset={offset(ids[1])}")
        self.assertEqual([m["stream_id"] for m in orjson.loads(rest)], ids[2:])
        response, empty = await self.get("events", f"?offset={offset(ids[-1])}")
        self.assertEqual((response.code, empty), (200, b"[]"))
        self.assertEqual(self.header(response, "stream-next-offset"), offset(ids[-1]))
        # Offsets sort as the positions they name.
        self.assertEqual(sorted([offset(10), offset(9), offset(100)]),
                         [offset(9), offset(10), offset(100)])

    async def test_now_head_and_etag(self):
        await self.start_reading()
        ids = await self.write("events", 2)
        response, data = await self.get("events", "?offset=now")
        self.assertEqual((response.code, data), (200, b"[]"))
        self.assertEqual(self.header(response, "stream-next-offset"), offset(ids[-1]))
        self.assertEqual(self.header(response, "stream-up-to-date"), "true")
        self.assertIsNone(self.header(response, "etag"))
        response, data = await self.get("events", method="HEAD")
        self.assertEqual((response.code, data), (200, b""))
        self.assertEqual(self.header(response, "stream-next-offset"), offset(ids[-1]))
        self.assertEqual(self.header(response, "cache-control"), "no-store")
        self.assertEqual(self.header(response, "x-content-type-options"), "nosniff")
        response, data = await self.get("events", "?offset=-1")
        tag = self.header(response, "etag")
        response, again = await self.get("events", "?offset=-1",
                                         headers={**AUTH, "If-None-Match": tag})
        self.assertEqual((response.code, again), (304, b""))
        response, again = await self.get("events", "?offset=-1",
                                         headers={**AUTH, "If-None-Match": '"other"'})
        self.assertEqual((response.code, again), (200, data))
        await self.write("events", 1)
        response, more = await self.get("events", "?offset=-1",
                                        headers={**AUTH, "If-None-Match": tag})
        self.assertEqual(response.code, 200)
        self.assertNotEqual(self.header(response, "etag"), tag)
        self.assertEqual(len(orjson.loads(more)), 3)

    async def test_a_full_answer_below_the_persisted_position_is_immutable(self):
        from tests.test_read_api import until_deferred

        await self.start_reading(max_page_bytes=1024)  # about a dozen facts an answer
        ids = await self.write("events", 30)
        await until_deferred(lambda: self.db.runQuery(
            "SELECT stream_id FROM stream_positions WHERE stream_name = 'events'"),
            lambda r: r == [(ids[-1],)])
        self.api.reads.persisted.max_age = 0
        offsets, got = ["-1"], []
        while True:
            response, data = await self.get("events", f"?offset={offsets[-1]}")
            got += orjson.loads(data)
            offsets.append(self.header(response, "stream-next-offset"))
            if self.header(response, "stream-up-to-date") == "true":
                break
            self.assertEqual(self.header(response, "cache-control"),
                             "public, max-age=31536000, immutable")
        self.assertGreaterEqual(len(offsets), 3)  # (a full answer, then the tail)
        self.assertEqual(self.header(response, "cache-control"), "no-store")  # the tail
        self.assertEqual([m["stream_id"] for m in got], ids)
        self.assertEqual(offsets[1:], sorted(offsets[1:]))

    async def test_long_poll_answers_a_fact_or_204_with_the_tail(self):
        await self.start_reading()
        ids = await self.write("events", 1)
        tail = offset(ids[0])
        response, data = await self.get("events", f"?offset={tail}&live=long-poll&timeout=0.2")
        self.assertEqual((response.code, data), (204, b""))
        self.assertEqual(self.header(response, "stream-next-offset"), tail)
        self.assertEqual(self.header(response, "stream-up-to-date"), "true")
        first = self.header(response, "stream-cursor")
        self.assertTrue(first.isdigit())
        # An echoed cursor at or past the current interval: a greater one.
        response, _ = await self.get("events", f"?offset={tail}&live=long-poll&timeout=0"
                                               f"&cursor={int(first) + 5}")
        self.assertGreater(int(self.header(response, "stream-cursor")), int(first) + 5)
        d = defer.ensureDeferred(self.get("events", "?offset=now&live=long-poll"))
        await until(lambda: self.api.reads.slots.open == 1)
        more = await self.write("events", 1)
        response, data = await d
        self.assertEqual(response.code, 200)
        self.assertEqual([m["stream_id"] for m in orjson.loads(data)], more)
        self.assertEqual(self.header(response, "stream-next-offset"), offset(more[0]))
        self.assertIsNotNone(self.header(response, "stream-cursor"))
        self.assertEqual(self.api.reads.slots.open, 0)

    async def test_sse_data_and_control_events(self):
        await self.start_reading()
        ids = await self.write("events", 3)
        sock = socket.create_connection(("127.0.0.1", self.port))
        self.addCleanup(sock.close)
        sock.sendall(f"GET {DS.format('events')}?offset={offset(ids[0])}&live=sse HTTP/1.0\r\n"
                     f"Authorization: Bearer {READER_SECRET}\r\n\r\n".encode())
        sock.setblocking(False)
        got = bytearray()

        def received(n):
            try:
                got.extend(sock.recv(65536))
            except BlockingIOError:
                pass
            return got.count(b"event: control") >= n

        await until(lambda: received(1))
        more = await self.write("events", 1)
        await until(lambda: received(2))
        head, _, body = bytes(got).partition(b"\r\n\r\n")
        self.assertIn(b"content-type: text/event-stream", head.lower())
        from tests.read_api import parse_events

        events = [e for e in parse_events(body.decode()) if "event" in e]
        self.assertEqual([e["event"] for e in events], ["data", "control", "data", "control"])
        self.assertEqual([m["stream_id"] for m in orjson.loads(events[0]["data"])], ids[1:])
        self.assertEqual(orjson.loads(events[1]["data"])["streamNextOffset"], offset(ids[-1]))
        self.assertTrue(orjson.loads(events[1]["data"])["upToDate"])
        self.assertEqual([m["stream_id"] for m in orjson.loads(events[2]["data"])], more)
        self.assertEqual(orjson.loads(events[3]["data"])["streamNextOffset"], offset(more[0]))
        self.assertEqual(self.api.reads.slots.open, 1)
        # Idle, it waits for the stream to move: no page read, nothing
        # written (the heartbeat is 15 s away), the reactor free.
        reads = []
        page = self.api.reads.page
        self.patch(self.api.reads, "page", lambda *a, **k: reads.append(a) or page(*a, **k))
        await self.write("events", 1)
        await until(lambda: received(3))
        self.assertEqual((len(reads), got.count(b": ping")), (1, 0))
        sock.close()
        await until(lambda: self.api.reads.slots.open == 0)

    async def test_multi_writer_stream_reads_up_to_the_linear_token(self):
        """``caches``: master (another instance) announced nothing, so its
        position is 0: facts of worker1 are not given until every writer
        is past them (one could still come below them from master)."""
        await self.start_reading()
        ids = await self.write("caches", 2)
        response, data = await self.get("caches", "?offset=-1")
        self.assertEqual((response.code, data), (200, b"[]"))
        self.assertEqual(self.header(response, "stream-next-offset"), offset(0))
        stream = self.registry.get("caches")
        stream.id_gen.advance("master", ids[-1])
        response, data = await self.get("caches", "?offset=-1")
        self.assertEqual([m["stream_id"] for m in orjson.loads(data)], ids)

    async def test_refusals_are_json_naming_the_parameter(self):
        await self.start_reading()
        await self.write("events", 1)
        cases = [("?offset=garbage", 400, "offset"), ("?offset=12", 400, "offset"),
                 ("?offset=" + "9" * 19, 400, "offset"), ("?offset=" + "1" * 5000, 400, "offset"),
                 ("?offset=0000000010000000000", 400, "offset"),  # beyond the sequence
                 ("?offset=-1&offset=-1", 400, "offset"), ("?live=poll&offset=-1", 400, "live"),
                 ("?live=sse", 400, "offset"), ("?live=long-poll&offset=-1&timeout=31", 400,
                                                "timeout"),
                 ("?offset=%ff", 400, "offset"), ("?timeout=1e9", 400, "timeout")]
        for query, code, parameter in cases:
            response, data = await self.get("events", query)
            doc = orjson.loads(data)
            self.assertEqual((response.code, doc.get("parameter")), (code, parameter), query)
            self.assertEqual(self.header(response, "x-content-type-options"), "nosniff")
        response, data = await self.get("nosuch")
        self.assertEqual((response.code, orjson.loads(data)["parameter"]), (404, "stream"))
        response, _ = await self.get("events", headers={})
        self.assertEqual(response.code, 401)
        response, _ = await self.get("caches", headers={
            "Authorization": f"Bearer {READER_SECRET}"})
        self.assertEqual(response.code, 403)
        for method in ("PUT", "POST", "DELETE"):
            response, data = await self.get("events", method=method)
            self.assertEqual(response.code, 405, method)
            self.assertIn("read-only", orjson.loads(data)["error"])
        response, _ = await self.call("OPTIONS", DS.format("events"), headers={
            "Origin": "http://app.test", "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "if-none-match"})
        self.assertEqual(response.code, 204)
        self.assertIn("If-None-Match", self.header(response, "access-control-allow-headers"))


class DurableTrimTests(ReadTestCase):
    trim = test_read_api_trim.TrimmedReadTests.trim

    async def test_below_the_trim_boundary_is_410_and_minus_one_starts_there(self):
        await self.start_reading()
        ids = await self.write("events", 4)
        await self.trim(ids[1])
        response, data = await self.call("GET", DS.format("events") + f"?offset={offset(ids[0])}",
                                         headers=AUTH)
        doc = orjson.loads(data)
        self.assertEqual((response.code, doc["parameter"], doc["trimmed_through"]),
                         (410, "offset", ids[1]))
        response, data = await self.call("GET", DS.format("events") + "?offset=-1",
                                         headers=AUTH)
        self.assertEqual([m["stream_id"] for m in orjson.loads(data)], ids[2:])


class CursorTests(SynchronousTestCase):
    def test_cursor_is_the_interval_and_passes_an_echo(self):
        now = durable.CURSOR_EPOCH + 20 * 1000 + 5
        self.assertEqual(durable.cursor(now, None), "1000")
        self.assertEqual(durable.cursor(now, "999"), "1000")
        self.assertEqual(durable.cursor(now, "1000", rand=lambda a, b: 7), "1007")
        self.assertEqual(durable.cursor(now, "1200", rand=lambda a, b: 1), "1201")
        self.assertEqual(durable.cursor(now, "x" * 100), "1000")
