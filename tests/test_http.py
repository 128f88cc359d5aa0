"""The HTTP API on a real listening socket, streams on a real PostgreSQL;
what only reads the handler's state (positions, a worker's health) in
memory, on :mod:`tests.harness`.

Every test captures the whole log (``globalLogPublisher``) and checks at the
end that the secret appears in no event, formatted or raw.
"""

import io
import os
import signal
import time
from urllib.parse import unquote, unquote_plus

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY
from twisted.internet import defer, endpoints, reactor, task
from twisted.internet.testing import StringTransport
from twisted.logger import formatEvent
from twisted.web.client import FileBodyProducer, readBody
from twisted.web.http_headers import Headers

import replicator
from replicator.replication.transport.protocol import ServerReplicationProtocol
from tests.http_api import (  # noqa: F401 (tests/test_read_api_ds.py takes AUTH from here)
    AUTH,
    FACTS,
    SECRET,
    STREAMS,
    BlockingConsumer,
    BytesProducer,
    ChunkedProducer,
    HttpTestCase,
    InMemoryHttpTestCase,
    RawClient,
    instance_config,
)
from tests.servers import PostgresServer
from tests.support import sleep


def stop_postgres(server: PostgresServer) -> None:
    """Stop a throwaway server for good.

    ``PostgresServer.stop()`` signals its child, which under root is
    ``runuser``: that does not pass SIGINT on, so the postmaster would keep
    serving open connections.  Signal the postmaster itself first.
    """
    if server.proc.poll() is None:
        try:
            with open(os.path.join(server.datadir, "postmaster.pid")) as f:
                os.kill(int(f.readline()), signal.SIGINT)
        except (OSError, ValueError):
            pass
        server.proc.wait(20)
    server.stop()


class InMemoryHttpTests(InMemoryHttpTestCase):
    """What the API says of the handler's state, in memory."""

    def test_positions(self):
        self.start()
        self.write("caches", {"rows": [["a", None, 1]]})
        self.write("caches", {"rows": []})
        self.assertEqual(self.handler.announced_positions()[("caches", "master")], 2)
        response, answer = self.answer("GET", "/_replicator/v1/positions", headers=AUTH)
        self.assertEqual(response.code, 200)
        # worker1, never heard, holds the linear token of caches at 0.
        holder = answer["streams"]["caches"].pop("linear_holder")
        self.assertEqual((holder["linear"], holder["writers"], holder["in_flight"]),
                         (0, ["worker1"], None))
        self.assertRegex(holder["text"], r"^linear held at 0 by worker1: never heard \(up \d+s\)"
                                         r", for \d+s$")
        self.assertIsNone(answer["streams"]["events"].pop("linear_holder"))  # at the top
        for stream in answer["streams"].values():
            link = stream["writers"]["worker1"].pop("link")
            self.assertRegex(link, r"^never heard \(up \d+s\)$")
        self.assertEqual(answer, {"instance": "master", "streams": {
            "caches": {"linear": 0, "writers": {
                "master": {"position": 2, "local": True, "in_flight": 0, "announced": 2},
                "worker1": {"position": 0, "local": False, "reader_position": None,
                            "lag": 0, "connected": None, "since": None, "heard_age": None},
            }},
            "events": {"linear": 0, "writers": {
                "worker1": {"position": 0, "local": False, "reader_position": None,
                            "lag": 0, "connected": None, "since": None, "heard_age": None},
            }},
        }})

    def test_health_on_worker(self):
        consumer = BlockingConsumer(positions={("caches", "master"): 0})
        clock = task.Clock()
        self.start("worker1", replication={"upstream": "tcp:host=127.0.0.1:port=9"},
                   consumers=[consumer], lag_grace=5.0, clock=clock)
        self.status = (False, f"connecting to 127.0.0.1:9 (password {SECRET})")
        response, answer = self.answer("GET", "/health")
        self.assertEqual((response.code, answer), (503, {
            "status": "unhealthy",
            "reason": "replication not connected: connecting to 127.0.0.1:9 "
                      "(password [redacted])"}))
        self.status = (True, "connected")
        # The master wrote up to 12 (a claim beyond the sequence is refused).
        self.h.sequence_taken("caches", 12)
        proto, _ = self.h.client(self.node)
        proto.dataReceived(b"POSITION caches master 0 0\n"
                           b'RDATA caches master 12 ["a",null,1]\n')
        self.h.flush()
        self.assertTrue(consumer.waiting)
        # A brief lag is normal under load...
        response, answer = self.answer("GET", "/health")
        self.assertEqual(response.code, 200)
        # ... a lag that lasts names the stream that is stuck.
        clock.advance(6)
        response, answer = self.answer("GET", "/health")
        self.assertEqual((response.code, answer), (503, {
            "status": "unhealthy", "reason": "stream caches/master lagging by 12 for 6s"}))
        consumer.waiting.pop().callback(None)
        self.h.settle()
        response, answer = self.answer("GET", "/health")
        self.assertEqual(response.code, 200)
        self.assertEqual(answer["role"], "worker")
        self.assertEqual(answer["connections"], 1)
        self.assertEqual(answer["positions"]["caches"]["master"], 12)
        self.assertEqual(consumer.facts, [("caches", "master", 12, [["a", None, 1]])])


class DuplicateKeyTests(InMemoryHttpTestCase):
    """A body with an object that gives a key twice is refused, naming the
    key, wherever the object is; nothing is written."""

    def test_a_key_given_twice_is_refused(self):
        self.start()
        before = self.snapshot()
        cases = [
            (b'{"rows": [["a", null, 1]], "rows": []}', "rows"),
            (b'{"rows": [], "rows": [["a", null, 1]]}', "rows"),
            # In a json column's object, however deep.
            (b'{"rows": [["a", {"k": 1, "k": 2}, 1]]}', "k"),
            (b'{"rows": [["a", {"k": [{"u": "@a:x", "u": "@b:x"}]}, 1]]}', "u"),
            # Spelled differently, decoded the same: one key.
            (b'{"rows": [["a", {"k\u003a": 1, "k:": 2}, 1]]}', "k:"),
            ('{"rows": [["a", {"\\u00e9": 1, "\u00e9": 2}, 1]]}'.encode(), "\u00e9"),
        ]
        for body, key in cases:
            response, answer = self.answer("POST", FACTS.format("caches"), body, AUTH)
            self.assertEqual((response.code, answer), (400, {
                "error": f"invalid JSON: key {key!r} given twice in an object"}), body)
        self.assertEqual(self.snapshot(), before)
        # The same key in two objects, and colons in strings, are fine.
        rows = [["a:b", {"k": "x:y", "k:": {"k": 1}}, 1], ["c", {"k": 2}, 2]]
        self.assertEqual(self.write("caches", {"rows": rows}), (200, {"stream_id": 1}))


def spelled(secret: str, text: str) -> bool:
    """Whether ``text`` holds ``secret`` as it is or percent-decoded (up to
    three times, a ``+`` as a space or not)."""
    forms = [text]
    for _ in range(3):
        forms += [unquote(forms[-1]), unquote_plus(forms[-1])]
    return any(secret in form for form in forms)


def percent_encoded(text: str) -> str:
    return "".join(f"%{b:02X}" for b in text.encode())


class SecretSpellingTests(InMemoryHttpTestCase):
    """A secret in a request's path is never logged, however it is
    spelled; nor is a credential parameter's value that ends up in the path,
    known secret or not."""

    WRONG = "Not-a-secret-of-this-instance-but-somebodys"

    def request(self, target: bytes, headers: bytes = b"") -> bytes:
        client = self.open(RawClient(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n" + headers
                                     + b"Connection: close\r\n\r\n"))
        return self.h.run(client.closed, settle=False)

    def test_no_spelling_of_a_secret_is_logged(self):
        self.start()
        auth = b"Authorization: Bearer " + SECRET.encode() + b"\r\n"
        cases = [
            ("/x/" + percent_encoded(SECRET), b""),
            ("/x/%48" + SECRET[1:], b""),
            ("/x/%2548" + SECRET[1:], b""),  # encoded twice
            ("/_replicator/v1/streams/" + percent_encoded(SECRET) + "/facts", auth),
            ("/health%3Faccess_token=" + percent_encoded(SECRET), b""),
            ("/health%3F%61ccess_token%3D" + SECRET + "?limit=1", b""),
            ("/health%3Faccess_token=" + self.WRONG, b""),
            ("/health;%73ecret=" + self.WRONG, b""),
            ("/health%3Fx=1%26token%3D" + percent_encoded(self.WRONG), b""),
        ]
        for target, headers in cases:
            received = self.request(target.encode(), headers)
            self.assertTrue(received.startswith(b"HTTP/1.1 4"), (target, received[:200]))
            self.assertFalse(spelled(SECRET, received.decode()), target)
        # A request the channel refuses is logged from its request line.
        self.request(("/x/" + percent_encoded(SECRET)).encode(), b"Bad Name: v\r\n")
        lines = self.access_lines()
        self.assertEqual(len(lines), len(cases) + 1)
        self.assertTrue(all("[redacted]" in line for line in lines), lines)
        self.assertIn('"GET /health%3Faccess_token=[redacted]" 404 ', lines[6])
        self.assertIn('"GET /_replicator/v1/streams/[redacted]/facts" 404 ', lines[3])
        self.assertIn("(unknown stream '[redacted]')", lines[3])
        for event in self.events:
            text = formatEvent(event) + repr(event)
            for secret in (SECRET, self.WRONG):
                self.assertFalse(spelled(secret, text), text)


class HttpApiTests(HttpTestCase):
    # ---------------------------------------------------------------- writes
    async def test_write_fact_is_committed_and_readable(self):
        await self.start()
        before = REGISTRY.get_sample_value("replicator_facts_written_total",
                                           {"stream": "caches"}) or 0
        rows = [["get_user", ["@a:hs"], 1], ["get_room", {"k": [1, 2.5, None]}, 2]]
        code, answer = await self.post("caches", {"rows": rows},
                                       {**AUTH, "Content-Type": "text/plain"})
        self.assertEqual((code, answer), (200, {"stream_id": 1}))
        caches = self.registry.get("caches")
        updates, upto, limited = await caches.updates_since("master", 0, 1)
        self.assertEqual(updates, [(1, rows[0]), (1, rows[1])])
        self.assertEqual(await self.count(), 2)
        self.assertEqual(REGISTRY.get_sample_value("replicator_facts_written_total",
                                                   {"stream": "caches"}), before + 1)
        # A fact without rows advances the position and writes no row.
        code, answer = await self.post("caches", {"rows": []})
        self.assertEqual((code, answer), (200, {"stream_id": 2}))
        self.assertEqual(await self.count(), 2)
        self.assertEqual(caches.id_gen.get_current_token("master"), 2)
        # The stream name is percent-decoded.
        code, answer = await self.post("cach%65s", {"rows": [["b", None, 3]]})
        self.assertEqual((code, answer), (200, {"stream_id": 3}))
        self.assertEqual(len([line for line in self.access_lines()
                              if '"POST /_replicator/v1/streams/cach' in line
                              and '" 200 ' in line]), 3)
        for line in self.access_lines():
            self.assertRegex(line, r'^127\.0\.0\.1 "[A-Z]+ /\S*" \d{3} \d+ \d+\.\dms')

    async def test_auth_errors(self):
        await self.start()
        before = self.snapshot()
        cases = [
            ({}, 401, "missing Authorization header: expected 'Bearer <secret>'"),
            ({"Authorization": f"Basic {SECRET}"}, 401,
             "malformed Authorization header: expected 'Bearer <secret>'"),
            ({"Authorization": "Bearer"}, 401,
             "malformed Authorization header: expected 'Bearer <secret>'"),
            ({"Authorization": "Bearer   "}, 401,
             "malformed Authorization header: expected 'Bearer <secret>'"),
            ({"Authorization": "Bearer wrong-secret-of-some-length"}, 403, "wrong secret"),
            ({"Authorization": f"Bearer {SECRET}x"}, 403, "wrong secret"),
            ({"Authorization": f"Bearer {SECRET[:-1]}"}, 403, "wrong secret"),
            ({"Authorization": f"Bearer {SECRET.upper()}"}, 403, "wrong secret"),
        ]
        for headers, code, error in cases:
            response, answer = await self.json(
                "POST", FACTS.format("caches"), orjson.dumps({"rows": [["a", None, 1]]}),
                headers)
            self.assertEqual((response.code, answer), (code, {"error": error}), headers)
            if code == 401:
                self.assertEqual(response.headers.getRawHeaders(b"www-authenticate"),
                                 [b'Bearer realm="replicator"'])
        # Two Authorization headers are malformed even if one is right.
        h = Headers({b"Authorization": [f"Bearer {SECRET}".encode(), b"Bearer x"]})
        response = await self.agent.request(
            b"POST", f"http://127.0.0.1:{self.port}{FACTS.format('caches')}".encode(), h,
            FileBodyProducer(io.BytesIO(b'{"rows": []}')))
        self.assertEqual(response.code, 401)
        self.assertEqual(orjson.loads(await readBody(response)), {
            "error": "malformed Authorization header: expected 'Bearer <secret>'"})
        # Auth comes before the stream lookup: no probing for names.
        code, answer = await self.post("nope", {"rows": []}, {})
        self.assertEqual(code, 401)
        self.assertEqual(await self.count(), 0)
        self.assertEqual(self.snapshot(), before)
        # The secret in the query string is not logged either.
        response, _ = await self.call("GET", f"/health?token={SECRET}")
        self.assertEqual(response.code, 200)

    async def test_bad_bodies_write_nothing(self):
        await self.start()
        before = self.snapshot()
        cases = [
            (b"", "invalid JSON: "),
            (b"{", "invalid JSON: "),
            (b'{"rows": [NaN]}', "invalid JSON: "),
            (b"\xff\xfe", "invalid JSON: "),
            (b'{"rows": [["a", null, 1e400]]}', "invalid JSON: "),
            (b'[["a", null, 1]]',
             'expected a JSON object {"rows": [[...], ...]}, got array'),
            (b'"rows"', 'expected a JSON object {"rows": [[...], ...]}, got string'),
            (b"{}", 'missing "rows": the body is {"rows": [[...], ...]}'),
            (b'{"rows": [], "extra": 1}',
             "unexpected key 'extra': the body is {\"rows\": [[...], ...]} and nothing "
             "else"),
            (b'{"rows": {"a": 1}}', '"rows" must be an array of rows, got object'),
            (b'{"rows": null}', '"rows" must be an array of rows, got null'),
            (b'{"rows": [["a", null, 1], "b"]}', "row 1: expected a list of 3 values"),
            (b'{"rows": [["a", null]]}', "row 0: expected 3 values, got 2"),
            (b'{"rows": [["a", null, 1, 2]]}', "row 0: expected 3 values, got 4"),
            (b'{"rows": [[1, null, 1]]}', "row 0: column 'cache_func' expects text, got int"),
            (b'{"rows": [["a", null, "1"]]}', "row 0: column 'ts' expects bigint, got str"),
            (b'{"rows": [["a", null, true]]}', "row 0: column 'ts' expects bigint, got bool"),
            (b'{"rows": [["a", null, 9223372036854775808]]}',
             "row 0: column 'ts' expects bigint, got a number out of its range "
             "(-2^63 to 2^63-1)"),
            (b'{"rows": [["a", null, null]]}', "row 0: column 'ts' may not be null"),
            (b'{"rows": [["a\\u0000b", null, 1]]}',
             "row 0: column 'cache_func' contains a NUL character"),
            (b'{"rows": [["a", {"k": ["\\u0000"]}, 1]]}',
             "row 0: column 'keys' contains a NUL character"),
            # A good row before a bad one: the whole fact is refused.
            (b'{"rows": [["ok", null, 1], ["bad", null, "x"]]}',
             "row 1: column 'ts' expects bigint, got str"),
        ]
        for body, error in cases:
            code, answer = await self.post("caches", None, raw=body)
            self.assertEqual(code, 400, body)
            self.assertEqual(list(answer), ["error"])
            if error.endswith(": "):
                self.assertTrue(answer["error"].startswith(error), (body, answer))
            else:
                self.assertEqual(answer["error"], error, body)
        self.assertEqual(await self.count(), 0)
        self.assertEqual(self.snapshot(), before)

    async def test_sqlite(self):
        await self.start(config_overrides={
            "database": {"sqlite": os.path.join(self.mktemp(), "r.db")},
            "streams": [dict(STREAMS[0], writers=["master"])],
        })
        rows = [["a", {"k": [True, None, 1.5]}, 1], ["b", None, 2]]
        code, answer = await self.post("caches", {"rows": rows})
        self.assertEqual((code, answer), (200, {"stream_id": 1}))
        updates, _, _ = await self.registry.get("caches").updates_since("master", 0, 1)
        self.assertEqual(updates, [(1, rows[0]), (1, rows[1])])
        code, answer = await self.post("caches", {"rows": [["a", None, "x"]]})
        self.assertEqual(code, 400)
        self.assertEqual(await self.count(), 2)
        response, answer = await self.json("GET", "/health")
        self.assertEqual(response.code, 200)
        self.assertEqual(answer["positions"], {"caches": {"master": 1}})

    async def test_client_leaving_mid_write_loses_nothing(self):
        await self.start()
        caches = self.registry.get("caches")
        gate, entered, reached = defer.Deferred(), [], defer.Deferred()
        original = caches.write_prepared

        async def slow_write(prepared, hooks=()):
            entered.append(prepared)
            reached.callback(None)
            await gate
            return await original(prepared, hooks)

        caches.write_prepared = slow_write
        body = b'{"rows": [["kept", null, 7]]}'
        client = RawClient(
            b"POST " + FACTS.format("caches").encode() + b" HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + SECRET.encode() + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.port), client)
        await reached  # the write is in the stream
        self.assertEqual(len(entered), 1)
        client.transport.abortConnection()
        await client.closed
        gate.callback(None)
        await self.log.until(lambda: any("(client gone)" in line
                                         for line in self.access_lines()))
        self.assertEqual(await self.count(), 1)
        updates, _, _ = await caches.updates_since("master", 0, 1)
        self.assertEqual(updates, [(1, ["kept", None, 7])])
        self.assertEqual(client.received, b"")
        # Garbage on a connection gets Twisted's 400; nothing else is hurt.
        garbage = RawClient(b"\x00\x01GARBAGE \xff\r\n\r\n")
        await endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.port), garbage)
        self.assertTrue((await garbage.closed).startswith(b"HTTP/1.1 400"))
        response, answer = await self.json("GET", "/_replicator/v1/positions", headers=AUTH)
        self.assertEqual(answer["streams"]["caches"]["writers"]["master"]["position"], 1)

    async def test_rows_that_could_never_be_replicated_are_refused(self):
        await self.start()
        # max_line_length 16384: prefix "RDATA caches master " + 20 digits + " "
        prefix = len("RDATA caches master ") + 21
        room = 16384 - prefix
        fits = "x" * (room - len('["",null,1]'))
        code, answer = await self.post("caches", {"rows": [[fits, None, 1]]})
        self.assertEqual((code, answer), (200, {"stream_id": 1}))
        too_long = fits + "y"
        code, answer = await self.post("caches", {"rows": [["a", None, 1],
                                                           [too_long, None, 1]]})
        self.assertEqual(code, 400)
        self.assertEqual(answer, {"error": (
            "row 1: its RDATA line would be 16385 bytes, more than "
            "replication.max_line_length (16384): it could never be replicated")})
        self.assertEqual(await self.count(), 1)
        self.assertEqual(self.registry.get("caches").id_gen.get_current_token("master"), 1)

    async def test_routing_errors(self):
        await self.start()
        cases = [
            ("POST", FACTS.format("nope"), 404, {"error": "unknown stream 'nope'"}, None),
            ("POST", FACTS.format("%ff%fe"), 404,
             {"error": "unknown stream: the name is not percent-encoded UTF-8"}, None),
            ("POST", FACTS.format("cach%65s%2Fx"), 404, {"error": "unknown stream 'caches/x'"},
             None),
            ("POST", FACTS.format("events"), 409,
             {"error": "not a writer of stream events on this instance (master)"}, None),
            ("DELETE", FACTS.format("caches"), 405, {"error": "method DELETE not allowed"},
             [b"GET, OPTIONS, POST, HEAD"]),
            ("PUT", FACTS.format("caches"), 405, {"error": "method PUT not allowed"},
             [b"GET, OPTIONS, POST, HEAD"]),
            ("POST", "/_replicator/v1/streams/caches/events", 405,
             {"error": "method POST not allowed"}, [b"GET, OPTIONS, HEAD"]),
            ("POST", "/health", 405, {"error": "method POST not allowed"},
             [b"GET, HEAD"]),
            ("DELETE", "/_replicator/v1/positions", 405,
             {"error": "method DELETE not allowed"}, [b"GET, HEAD"]),
            ("POST", "/", 405, {"error": "method POST not allowed"}, [b"GET, HEAD"]),
            ("GET", "/index.html", 404, {"error": "no such endpoint"}, None),
            ("GET", "/health/", 404, {"error": "no such endpoint"}, None),
            ("GET", "/_replicator/v1/streams/caches", 404, {"error": "no such endpoint"},
             None),
            ("POST", "/_replicator/v1/streams//facts", 404, {"error": "no such endpoint"},
             None),
            ("GET", "/_replicator/v2/positions", 404, {"error": "no such endpoint"}, None),
        ]
        for method, path, code, error, allow in cases:
            response, answer = await self.json(method, path, b'{"rows": []}', AUTH)
            self.assertEqual((response.code, answer), (code, error), (method, path))
            self.assertEqual(response.headers.getRawHeaders(b"allow"), allow)
        self.assertEqual(await self.count(), 0)
        self.assertEqual(await self.count("event_stream"), 0)
        # HEAD goes with GET: headers, no body.
        response, data = await self.call("HEAD", "/_replicator/v1/positions", headers=AUTH)
        self.assertEqual((response.code, data), (200, b""))

    async def test_body_size_limit(self):
        await self.start()
        before = self.snapshot()
        limit = 1 << 20
        # Valid JSON (trailing spaces), one byte over the limit.
        over = b'{"rows": []' + b" " * (limit - len(b'{"rows": []}') + 1) + b"}"
        self.assertEqual(len(over), limit + 1)
        error = {"error": f"request body larger than {limit} bytes"}
        # Declared length over the limit (read and thrown away).
        code, answer = await self.post("caches", None, raw=over)
        self.assertEqual((code, answer), (413, error))
        # Chunked, no declared length.
        response, answer = await self.json("POST", FACTS.format("caches"), headers=AUTH,
                                           producer=ChunkedProducer(over))
        self.assertEqual((response.code, answer), (413, error))
        self.assertEqual(self.snapshot(), before)
        # A body of exactly the limit is fine (and big: checked in a thread).
        exact = b'{"rows": []' + b" " * (limit - len(b'{"rows": []}')) + b"}"
        self.assertEqual(len(exact), limit)
        code, answer = await self.post("caches", None, raw=exact)
        self.assertEqual((code, answer), (200, {"stream_id": 1}))
        self.assertEqual(await self.count(), 0)
        self.assertNotEqual(self.snapshot(), before)
        # Far too large, or waiting for 100 Continue: answered before the
        # body, and the connection closed.
        for extra in (b"", b"Expect: 100-continue\r\n"):
            length = 10 ** 12 if not extra else 2 * limit
            client = RawClient(
                b"POST " + FACTS.format("caches").encode() + b" HTTP/1.1\r\n"
                b"Host: x\r\nAuthorization: Bearer " + SECRET.encode() + b"\r\n" + extra +
                b"Content-Length: %d\r\n\r\n" % length + b'{"rows": [')
            await endpoints.connectProtocol(
                endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.port), client)
            received = await client.closed
            head, _, answer = received.partition(b"\r\n\r\n")
            self.assertTrue(head.startswith(b"HTTP/1.1 413 "), received)
            self.assertNotIn(b"100 Continue", received)
            self.assertEqual(orjson.loads(answer), error)
        self.assertEqual(await self.count(), 0)
        self.assertEqual(len([line for line in self.access_lines() if line.startswith(
            '127.0.0.1 "POST /_replicator/v1/streams/caches/facts" 413 51 ')]), 4)

    async def test_database_down_gives_503_quickly(self):
        server = PostgresServer()
        self.addCleanup(stop_postgres, server)
        await self.start(dsn=server.create_database(), stop_registry=False, db_timeout=2.0)
        response, answer = await self.json("GET", "/health")
        self.assertEqual(response.code, 200)
        stop_postgres(server)
        started = time.monotonic()
        response, answer = await self.json("GET", "/health")
        self.assertLess(time.monotonic() - started, 3.0)
        self.assertEqual(response.code, 503)
        self.assertEqual(answer["status"], "unhealthy")
        self.assertTrue(answer["reason"].startswith("database unreachable: "), answer)
        self.assertEqual(list(answer), ["status", "reason"])
        code, answer = await self.post("caches", {"rows": [["a", None, 1]]})
        self.assertEqual((code, answer), (503, {"error": "database write failed"}))
        failures = [e for e in self.events if "Writing a fact of caches failed"
                    in formatEvent(e)]
        self.assertEqual(len(failures), 1)
        self.assertIsNotNone(failures[0].get("log_failure"))
        self.flushLoggedErrors()
        # The reactor was never blocked: other requests are answered.
        response, _ = await self.json("GET", "/_replicator/v1/positions", headers=AUTH)
        self.assertEqual(response.code, 200)

    async def test_failed_writes_of_an_outage_log_one_traceback(self):
        """Every failed write answers 503, but an outage logs one traceback
        per stream and one line when writes succeed again, not one
        CRITICAL traceback per request (2,900 in one chaos run)."""
        server = PostgresServer()
        self.addCleanup(stop_postgres, server)
        await self.start(dsn=server.create_database(), stop_registry=False)
        code, _ = await self.post("caches", {"rows": [["a", None, 1]]})
        self.assertEqual(code, 200)
        server.halt("fast")
        for i in range(3):
            code, answer = await self.post("caches", {"rows": [["b", None, i]]})
            self.assertEqual((code, answer), (503, {"error": "database write failed"}))
        failures = [e for e in self.events if "Writing a fact of caches failed"
                    in formatEvent(e)]
        self.assertEqual(len(failures), 1, [formatEvent(e) for e in failures])
        self.flushLoggedErrors()
        server.start()
        # The pool opens a new connection for the next write (the first
        # may still meet the old one's death): writes succeed again.
        async def succeeded():
            code, _ = await self.post("caches", {"rows": [["c", None, 1]]})
            return code == 200
        while not await succeeded():
            await sleep(0.2)
        self.flushLoggedErrors()
        back = [formatEvent(e) for e in self.events if "succeed again" in formatEvent(e)]
        self.assertEqual(len(back), 1, back)
        self.assertRegex(back[0], r"writes of caches succeed again after \d+ failed")

    async def test_hung_database_times_out_with_one_probe(self):
        await self.start(db_timeout=0.3)
        hung = defer.Deferred()
        calls = []

        def run_query(sql, *args):
            calls.append(sql)
            return hung

        self.db.runQuery = run_query
        answers = await defer.gatherResults([
            defer.ensureDeferred(self.json("GET", "/health")) for _ in range(3)])
        for response, answer in answers:
            self.assertEqual((response.code, answer), (503, {
                "status": "unhealthy",
                "reason": "database unreachable: no answer within 0.3s"}))
        self.assertEqual(calls, ["SELECT 1"])
        hung.callback([(1,)])
        response, _ = await self.json("GET", "/health")
        self.assertEqual(response.code, 200)
        self.assertEqual(len(calls), 2)

    # ------------------------------------------------------------- reading
    async def test_health_on_master(self):
        await self.start()
        await self.post("caches", {"rows": [["a", None, 1]]})
        self.status = (False, "no worker connected")  # a master does not care
        response, answer = await self.json("GET", "/health")
        self.assertEqual(response.code, 200)
        self.assertEqual(answer, {
            "status": "ok", "instance": "master", "role": "master",
            "version": replicator.__version__,
            "replication": {"connected": False, "detail": "no worker connected"},
            "connections": 0,
            "positions": {"caches": {"master": 1, "worker1": 0}, "events": {"worker1": 0}},
        })

    async def test_user_syncs_federation_acks_user_ips_and_their_metrics(self):
        await self.start()
        proto = ServerReplicationProtocol(self.handler, "hs.test", clock=task.Clock())
        proto.makeConnection(StringTransport())
        proto.dataReceived(
            b"NAME worker1\n"
            b"USER_SYNC worker1 @u:hs DEV start 1000\n"
            b"USER_SYNC worker1 @v:hs None start 1001\n"
            b"FEDERATION_ACK worker1 57\n"
            b'USER_IP @u:hs ["tok", "10.0.0.1", "Element/1.0", "DEV", 1234]\n')
        # Each instance acks for itself, on its own connection.
        proto2 = ServerReplicationProtocol(self.handler, "hs.test", clock=task.Clock())
        proto2.makeConnection(StringTransport())
        self.addCleanup(proto2.connectionLost, None)
        proto2.dataReceived(b"NAME worker2\nFEDERATION_ACK worker2 3\n")
        for path in ("/_replicator/v1/user_syncs", "/_replicator/v1/user_ips"):
            response, answer = await self.json("GET", path)
            self.assertEqual((response.code, answer), (401, {
                "error": "missing Authorization header: expected 'Bearer <secret>'"}))
        response, answer = await self.json("GET", "/_replicator/v1/user_syncs", headers=AUTH)
        self.assertEqual((response.code, answer), (200, {"user_syncs": {"worker1": [
            {"user_id": "@u:hs", "device_id": "DEV", "last_sync_ms": 1000},
            {"user_id": "@v:hs", "device_id": None, "last_sync_ms": 1001},
        ]}, "next": None}))
        response, answer = await self.json("GET", "/_replicator/v1/federation_acks",
                                           headers=AUTH)
        self.assertEqual((response.code, answer),
                         (200, {"acks": {"worker1": 57, "worker2": 3}, "next": None}))
        response, answer = await self.json("GET", "/_replicator/v1/user_ips", headers=AUTH)
        self.assertEqual((response.code, answer), (200, {"user_ips": [
            {"user_id": "@u:hs", "device_id": "DEV", "ip": "10.0.0.1",
             "user_agent": "Element/1.0", "last_seen": 1234}], "next": None}))
        self.assertNotIn("tok", orjson.dumps(answer).decode())
        response, text = await self.call("GET", "/metrics")
        self.assertIn(b'replicator_user_syncs{instance="worker1"} 2.0\n', text)
        self.assertIn(b'replicator_federation_ack_position{instance="worker1"} 57.0\n', text)
        # worker2 is no configured name: labelled "other".
        self.assertIn(b'replicator_federation_ack_position{instance="other"} 3.0\n', text)
        self.assertNotIn(b'instance="worker2"', text)
        # The syncs expire with the connection, and so does the series.
        proto.connectionLost(None)
        response, answer = await self.json("GET", "/_replicator/v1/user_syncs", headers=AUTH)
        self.assertEqual(answer, {"user_syncs": {}, "next": None})
        response, text = await self.call("GET", "/metrics")
        self.assertNotIn(b"replicator_user_syncs{", text)
        self.assertIn(b'replicator_federation_ack_position{instance="worker1"} 57.0\n', text)

    async def test_metrics(self):
        await self.start()
        await self.post("caches", {"rows": [["a", None, 1]]})
        value = REGISTRY.get_sample_value("replicator_facts_written_total",
                                          {"stream": "caches"})
        response, text = await self.call("GET", "/metrics")
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders(b"content-type"),
                         [CONTENT_TYPE_LATEST.encode()])
        self.assertIn(b'replicator_facts_written_total{stream="caches"} %r\n' % value, text)
        self.assertIn(b'replicator_stream_position{stream="caches",writer="master"} 1.0\n',
                      text)

    async def test_unexpected_errors_are_500_and_logged(self):
        await self.start()

        def boom():
            raise RuntimeError("boom")

        self.handler.announced_positions = boom
        response, answer = await self.json("GET", "/_replicator/v1/positions", headers=AUTH)
        self.assertEqual((response.code, answer), (500, {"error": "internal error"}))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

        def leaky():
            raise RuntimeError(f"boom {SECRET}")

        self.handler.announced_positions = leaky
        response, answer = await self.json("GET", "/_replicator/v1/positions", headers=AUTH)
        self.assertEqual((response.code, answer), (500, {"error": "internal error"}))
        logged = [formatEvent(e) for e in self.events
                  if "Unexpected error answering GET" in formatEvent(e)]
        self.assertEqual(len(logged), 2)
        self.assertIn("RuntimeError: boom [redacted]", logged[1])
        self.assertIn("Traceback", logged[1])
        # The daemon goes on.
        del self.handler.announced_positions
        response, _ = await self.json("GET", "/_replicator/v1/positions", headers=AUTH)
        self.assertEqual(response.code, 200)
