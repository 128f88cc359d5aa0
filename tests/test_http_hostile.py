"""The HTTP API against hostile and careless clients, over real loopback
sockets (the connection cap in memory, :mod:`tests.harness`): who may read
what, answers built off the reactor, slow clients, malformed requests,
absurd bodies.  Every refusal is a JSON 4xx/5xx."""

import json
import socket
import threading

import orjson
from twisted.internet import defer, endpoints, protocol, reactor, task, threads
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from replicator.http.channel import Channel
from replicator.observe import metrics
from replicator.replication.transport.protocol import ServerReplicationProtocol
from tests.http_api import AUTH, SECRET, HttpTestCase, InMemoryHttpTestCase, RawClient
from tests.servers import PostgresServer

READ_PATHS = ("/_replicator/v1/positions", "/_replicator/v1/federation_acks",
              "/_replicator/v1/user_syncs", "/_replicator/v1/user_ips")


class AccessTests(HttpTestCase):
    async def test_bookkeeping_and_positions_need_the_secret(self):
        await self.start()
        proto = ServerReplicationProtocol(self.handler, "hs.test", clock=task.Clock())
        proto.makeConnection(StringTransport())
        self.addCleanup(proto.connectionLost, None)
        proto.dataReceived(b"NAME worker1\nFEDERATION_ACK worker1 57\n")
        for path in READ_PATHS:
            response, answer = await self.json("GET", path)
            self.assertEqual((response.code, answer), (401, {
                "error": "missing Authorization header: expected 'Bearer <secret>'"}), path)
            self.assertEqual(response.headers.getRawHeaders(b"www-authenticate"),
                             [b'Bearer realm="replicator"'])
            response, answer = await self.json(
                "GET", path, headers={"Authorization": "Bearer " + "x" * len(SECRET)})
            self.assertEqual((response.code, answer), (403, {"error": "wrong secret"}), path)
            response, answer = await self.json("GET", path, headers=AUTH)
            self.assertEqual(response.code, 200, path)
        response, answer = await self.json("GET", "/_replicator/v1/federation_acks",
                                           headers=AUTH)
        self.assertEqual(answer, {"acks": {"worker1": 57}, "next": None})
        # Health and metrics stay open (probes and Prometheus).
        response, _ = await self.json("GET", "/health")
        self.assertEqual(response.code, 200)
        response, text = await self.call("GET", "/metrics")
        self.assertEqual(response.code, 200)
        self.assertIn(b"replicator_", text)


class BadBodyTests(HttpTestCase):
    async def test_deeply_nested_json_is_the_clients_fault(self):
        await self.start()
        before = self.snapshot()
        for depth in (101, 300, 1000):
            nested = "[" * depth + "]" * depth
            body = b'{"rows": [["f", ' + nested.encode() + b", 1]]}"
            code, answer = await self.post("caches", None, raw=body)
            self.assertEqual((code, answer), (400, {
                "error": "row 0: column 'keys' is nested deeper than 100 levels"}), depth)
        # Deeper than any JSON parser here goes: still a 400.
        nested = "[" * 5000 + "]" * 5000
        code, answer = await self.post("caches", None,
                                       raw=b'{"rows": [["f", ' + nested.encode() + b", 1]]}")
        self.assertEqual(code, 400)
        self.assertTrue(answer["error"].startswith("invalid JSON: "), answer)
        self.assertEqual(self.snapshot(), before)
        self.assertEqual(await self.count(), 0)
        # 100 levels is fine.
        nested = [[]]
        for _ in range(98):
            nested = [nested]
        code, answer = await self.post("caches", {"rows": [["f", nested, 1]]})
        self.assertEqual((code, answer), (200, {"stream_id": 1}))
        self.assertEqual(self.flushLoggedErrors(), [])

    async def test_an_integer_out_of_the_bigint_range_says_so(self):
        await self.start()
        for number in (b"1" + b"0" * 29, b"-" + b"9" * 30, b"%d" % 2 ** 63,
                       b"%d" % (2 ** 64 - 1), b"%d" % (-(2 ** 63) - 1), b"1e30"):
            body = b'{"rows": [["f", null, ' + number + b"]]}"
            code, answer = await self.post("caches", None, raw=body)
            self.assertEqual((code, answer), (400, {
                "error": "row 0: column 'ts' expects bigint, got a number out of its "
                         "range (-2^63 to 2^63-1)"}), number)
        code, answer = await self.post("caches", None, raw=b'{"rows": [["f", null, 1.5]]}')
        self.assertEqual((code, answer), (400, {
            "error": "row 0: column 'ts' expects bigint, got float"}))
        for number in (2 ** 63 - 1, -(2 ** 63)):
            code, answer = await self.post("caches", {"rows": [["f", None, number]]})
            self.assertEqual(code, 200, answer)


class Watched(dict):
    """A bookkeeping table that notes which thread lists its keys."""

    def __init__(self, data, seen):
        super().__init__(data)
        self.seen = seen

    def __iter__(self):
        self.seen.append(threading.get_ident())
        return super().__iter__()

    def items(self):
        self.seen.append(threading.get_ident())
        return super().items()


class BigAnswerTests(HttpTestCase):
    """Big answers are paged and built in a thread: the reactor thread only
    dispatches and writes."""

    async def flood(self, users=2500):
        proto = ServerReplicationProtocol(self.handler, "hs.test", clock=task.Clock())
        proto.makeConnection(StringTransport())
        self.addCleanup(proto.connectionLost, None)
        lines = [b"NAME worker1\n"]
        for i in range(users):
            lines.append(b'USER_IP @u%05d:hs ["tok", "10.0.%d.%d", "UA", "D%d", %d]\n'
                         % (i, i // 256, i % 256, i % 2, 1000 + i))
            lines.append(b"USER_SYNC worker1 @u%05d:hs D start %d\n" % (i, 1000 + i))
        proto.dataReceived(b"".join(lines))
        # Each instance acks on its own connection (no one acks for another).
        for i in range(min(users, 50)):
            fed = ServerReplicationProtocol(self.handler, "hs.test", clock=task.Clock())
            fed.makeConnection(StringTransport())
            self.addCleanup(fed.connectionLost, None)
            fed.dataReceived(b"NAME fed%03d\nFEDERATION_ACK fed%03d %d\n" % (i, i, i))
        return proto

    async def test_user_ips_pages_visit_every_entry_once_in_order(self):
        await self.start()
        await self.flood()
        path = "/_replicator/v1/user_ips"
        response, answer = await self.json("GET", path, headers=AUTH)
        self.assertEqual(response.code, 200)
        self.assertEqual(len(answer["user_ips"]), 1000)  # the default page
        seen, cursor, pages = [], None, 0
        while True:
            query = "?limit=700" + (f"&from={cursor}" if cursor else "")
            response, answer = await self.json("GET", path + query, headers=AUTH)
            self.assertEqual(response.code, 200)
            pages += 1
            seen += [(e["user_id"], e["device_id"]) for e in answer["user_ips"]]
            cursor = answer["next"]
            if cursor is None:
                break
        self.assertEqual(pages, 4)
        self.assertEqual(seen, sorted(seen))
        self.assertEqual(seen, [(f"@u{i:05d}:hs", f"D{i % 2}") for i in range(2500)])
        # The bookkeeping of the other tables pages the same way.
        response, answer = await self.json(
            "GET", "/_replicator/v1/user_syncs?limit=1000", headers=AUTH)
        self.assertEqual(len(answer["user_syncs"]["worker1"]), 1000)
        response, rest = await self.json(
            "GET", "/_replicator/v1/user_syncs?from=" + answer["next"], headers=AUTH)
        self.assertEqual(len(rest["user_syncs"]["worker1"]), 1000)
        self.assertEqual(rest["user_syncs"]["worker1"][0], {
            "user_id": "@u01000:hs", "device_id": "D", "last_sync_ms": 2000})
        response, rest = await self.json(
            "GET", "/_replicator/v1/user_syncs?from=" + rest["next"], headers=AUTH)
        self.assertEqual(len(rest["user_syncs"]["worker1"]), 500)
        self.assertIsNone(rest["next"])
        response, answer = await self.json(
            "GET", "/_replicator/v1/federation_acks?limit=40", headers=AUTH)
        self.assertEqual(list(answer["acks"]), [f"fed{i:03d}" for i in range(40)])
        response, answer = await self.json(
            "GET", "/_replicator/v1/federation_acks?from=" + answer["next"], headers=AUTH)
        self.assertEqual(answer, {"acks": {f"fed{i:03d}": i for i in range(40, 50)},
                                  "next": None})

    async def test_bad_page_arguments_are_400(self):
        await self.start()
        for query, error in [
                ("limit=0", "limit must be an integer from 1 to 1000"),
                ("limit=1001", "limit must be an integer from 1 to 1000"),
                ("limit=-1", "limit must be an integer from 1 to 1000"),
                ("limit=" + "9" * 400, "limit must be an integer from 1 to 1000"),
                ("from=bm90IGpzb24", "from is not a cursor from a previous page's next"),
                ("from=WzEsMl0", "from is not a cursor from a previous page's next"),
                ("from=%ff%fe", "from is not a cursor from a previous page's next"),
                ("from=" + "A" * 5000, "from is not a cursor from a previous page's next")]:
            for path in ("user_ips", "user_syncs", "federation_acks"):
                response, answer = await self.json(
                    "GET", f"/_replicator/v1/{path}?{query}", headers=AUTH)
                self.assertEqual((response.code, answer), (400, {"error": error}),
                                 (path, query))

    async def test_answers_are_built_off_the_reactor_thread(self):
        await self.start()
        await self.flood(10)
        reactor_thread = threading.get_ident()
        seen = []
        books = self.handler.bookkeeping
        books.user_ips = Watched(books.user_ips, seen)
        books.user_syncs = Watched(books.user_syncs, seen)
        books.federation_acks = Watched(books.federation_acks, seen)
        for path in ("user_ips", "user_syncs", "federation_acks"):
            del seen[:]
            response, answer = await self.json("GET", f"/_replicator/v1/{path}",
                                               headers=AUTH)
            self.assertEqual(response.code, 200)
            self.assertTrue(seen, path)
            self.assertNotIn(reactor_thread, seen, path)
        # /metrics on the HTTP listener: its live samples (the
        # bookkeeping's, as an instance registers them) and its text too.
        refreshed = []

        def watched_samples():
            refreshed.append(threading.get_ident())
            return books.metric_samples()

        metrics.add_source(watched_samples)
        self.addCleanup(metrics.remove_source, watched_samples)
        response, text = await self.call("GET", "/metrics")
        self.assertEqual(response.code, 200)
        self.assertIn(b'replicator_user_syncs{instance="worker1"} 10.0\n', text)
        self.assertTrue(refreshed)
        self.assertNotIn(reactor_thread, refreshed)


class SlowClient(protocol.Protocol):
    """Sends ``head`` at once, then one byte of ``drip`` at a time every
    ``interval`` seconds until the server closes; keeps what comes back."""

    def __init__(self, head: bytes, drip: bytes = b"", interval: float = 0.2):
        self.head, self.drip, self.interval = head, drip, interval
        self.received = b""
        self.closed = defer.Deferred()
        self._call = None

    def connectionMade(self):
        self.transport.write(self.head)
        self._next()

    def _next(self):
        if self.drip:
            byte, self.drip = self.drip[:1], self.drip[1:]
            self.transport.write(byte)
            self._call = reactor.callLater(self.interval, self._next)

    def dataReceived(self, data):
        self.received += data

    def connectionLost(self, reason):
        if self._call is not None and self._call.active():
            self._call.cancel()
        self.closed.callback(self.received)


def parse_answer(test, received: bytes, code: int) -> dict:
    """The one JSON answer of a refused request: status, type, body."""
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    test.assertTrue(lines[0].startswith(b"HTTP/1.1 %d " % code), received[:300])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    test.assertEqual(headers.get(b"content-type"), b"application/json", received[:300])
    test.assertEqual(headers.get(b"connection"), b"close")
    test.assertEqual(int(headers[b"content-length"]), len(body))
    test.assertTrue(body.endswith(b"\n"))
    return orjson.loads(body)


class ClientConnection:
    """Connect a protocol to the API's port over loopback."""

    @staticmethod
    async def open(test, proto):
        await endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", test.port), proto)
        test.addCleanup(lambda: proto.transport.abortConnection()
                        if proto.transport.connected else None)
        return proto


class SlowClientTests(HttpTestCase):
    """Slowloris: headers and bodies have deadlines; connections are capped."""

    async def start_limited(self, **http):
        await self.start(dsn=PostgresServer.shared().create_database(), config_overrides={
            "http": {"listen": "tcp:0:interface=127.0.0.1", "secret": SECRET, **http}})

    async def test_headers_sent_a_byte_at_a_time_meet_a_deadline(self):
        await self.start_limited(header_timeout=1)
        # Far more bytes than the deadline lets through: the server must
        # close first, whatever the machine's speed.
        client = await ClientConnection.open(
            self, SlowClient(b"GET /health HTTP/1.1\r\n", b"X-Slow: " + b"a" * 600))
        received = await client.closed
        self.assertTrue(client.drip, "the server never closed the connection")
        self.assertEqual(parse_answer(self, received, 408), {
            "error": "request headers not received within 1s"})

    async def test_a_body_sent_a_byte_at_a_time_meets_a_deadline(self):
        await self.start_limited(body_timeout=1)
        body = b'{"rows": [' + b" " * 600 + b"]}"
        client = await ClientConnection.open(self, SlowClient(
            b"POST /_replicator/v1/streams/caches/facts HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + SECRET.encode() + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body), body))
        received = await client.closed
        self.assertTrue(client.drip, "the server never closed the connection")
        self.assertEqual(parse_answer(self, received, 408), {
            "error": "request body not received within 1s"})
        self.assertEqual(await self.count(), 0)


class ConnectionCapTests(InMemoryHttpTestCase):
    """The cap on connections, in memory (:mod:`tests.harness`)."""

    def test_a_newcomer_over_the_cap_closes_the_oldest_idle_connection(self):
        self.start(config_overrides={"http": {"listen": "tcp:0:interface=127.0.0.1",
                                              "secret": SECRET, "max_connections": 3,
                                              "header_timeout": 3600}})
        held = [self.open(SlowClient(b"GET /health HTTP/1.1\r\n")) for _ in range(3)]
        self.h.flush()
        self.assertEqual(self.api.open_connections, 3)
        # A fourth gets in: the oldest half-sent request makes room, with a
        # JSON 503 saying why.
        newcomer = self.open(SlowClient(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        received = self.h.run(held[0].closed, settle=False)
        self.assertEqual(parse_answer(self, received, 503), {
            "error": "too many HTTP connections: closing the oldest idle one"})
        self.h.flush()
        self.assertTrue(newcomer.received.startswith(b"HTTP/1.1 200 "), newcomer.received)
        # Those left are still served.
        held[1].transport.write(b"Host: x\r\n\r\n")
        self.h.flush()
        self.assertTrue(held[1].received.startswith(b"HTTP/1.1 200 "), held[1].received)
        for client in held[1:] + [newcomer]:
            client.transport.loseConnection()
        for client in held[1:] + [newcomer]:
            self.h.run(client.closed, settle=False)
        self.assertEqual(self.api.open_connections, 0)
        response, _ = self.answer("GET", "/health")
        self.assertEqual(response.code, 200)


class IdleTimeoutTests(InMemoryHttpTestCase):
    """twisted.web's idle timeout (no byte for a while) shorter than the
    deadlines, in memory: a request half received is answered 408 like a
    deadline, with its access line; an idle connection between requests
    is closed quietly."""

    def test_silence_mid_request_is_a_json_408(self):
        self.start(config_overrides={"http": {"listen": "tcp:0:interface=127.0.0.1",
                                              "secret": SECRET, "header_timeout": 3600,
                                              "body_timeout": 3600}}, idle_timeout=5)
        started = self.h.clock.seconds()
        half_headers = self.open(RawClient(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a"))
        half_body = self.open(RawClient(
            b"POST /_replicator/v1/streams/caches/facts HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 100\r\n\r\n{\"rows\": ["))
        self.assertEqual(parse_answer(self, self.h.run(half_headers.closed, settle=False),
                                      408),
                         {"error": "request headers not received: nothing sent for 5s"})
        self.assertEqual(parse_answer(self, self.h.run(half_body.closed, settle=False), 408),
                         {"error": "request body not received: nothing sent for 5s"})
        self.assertLess(self.h.clock.seconds() - started, 60)
        lines = self.access_lines()
        self.assertEqual(len(lines), 2, lines)
        self.assertRegex(lines[0], r'^127\.0\.0\.1 "GET /health" 408 \d+ 0\.0ms \(request '
                                   r"headers not received: nothing sent for 5s\)$")
        self.assertRegex(lines[1], r'^127\.0\.0\.1 "POST /_replicator/v1/streams/caches/facts" '
                                   r"408 \d+ 0\.0ms \(request body not received: nothing sent "
                                   r"for 5s\)$")
        # Idle after an answer: closed without a word (nothing is owed).
        idle = self.open(RawClient(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        received = self.h.run(idle.closed, settle=False)
        self.assertTrue(received.startswith(b"HTTP/1.1 200 "), received[:100])
        self.assertEqual(received.count(b"HTTP/1.1 "), 1)


class MalformedRequestTests(HttpTestCase):
    """What twisted.web answers with a bare 400 or a silent close is a JSON
    4xx like every other error."""

    CASES = [
        (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400,
         "invalid Content-Length header"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
         400, "more than one Content-Length or Transfer-Encoding header"),
        (b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400,
         "more than one Content-Length or Transfer-Encoding header"),
        (b"POST /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 400,
         "unsupported Transfer-Encoding (only chunked)"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400,
         "a header value contains NUL, CR or LF"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400,
         "malformed header line"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n", 400,
         "invalid header name"),
        (b"GARBAGE\r\n\r\n", 400, "malformed request line"),
        (b"GET /health HTTP/1.1\n\n", 400, "header lines must end with CRLF"),
        (b"GET /health HTTP/1.1\r\nHost: x\nX-A: b\r\n\r\n", 400,
         "header lines must end with CRLF"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-H: v\r\n" * 501 + b"\r\n", 431,
         "more than 500 header lines"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-H: " + b"v" * 8000 + b"\r\n"
         + b"X-I: " + b"v" * 9000 + b"\r\n\r\n", 431, "request headers larger than 16384 bytes"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 100_000 + b"\r\n\r\n", 431,
         "request headers larger than 16384 bytes"),
        (b"POST /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400,
         "malformed chunked body"),
    ]

    async def test_each_is_a_json_4xx(self):
        await self.start()
        for request, code, error in self.CASES:
            client = await ClientConnection.open(self, RawClient(request))
            received = await client.closed
            self.assertEqual(parse_answer(self, received, code), {"error": error}, error)
        # Twisted answers "*" itself (405, no body); here it is a path
        # like any other.
        client = await ClientConnection.open(self, RawClient(
            b"GET * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        head, _, body = (await client.closed).partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 404 "), head)
        self.assertEqual(orjson.loads(body), {"error": "no such endpoint"})
        # A body may hold bare LFs.
        body = b'{"rows":\n[]}'
        client = await ClientConnection.open(self, RawClient(
            b"POST /_replicator/v1/streams/caches/facts HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + SECRET.encode() + b"\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body))
        head, _, body = (await client.closed).partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 200 "), head)
        # The server goes on.
        response, _ = await self.json("GET", "/health")
        self.assertEqual(response.code, 200)
        refusals = [line for line in self.access_lines() if '" 4' in line]
        self.assertEqual(len(refusals), len(self.CASES) + 1)


class BareLineFeedTests(SynchronousTestCase):
    """The bare-LF check sees a request the same however it is split."""

    def feed(self, request: bytes, cuts) -> bool:
        channel = Channel()
        bounds = [0, *cuts, len(request)]
        return any([channel._bare_lf(request[a:b]) for a, b in zip(bounds, bounds[1:])])

    def test_every_split(self):
        good = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n{\n}"
        bad = b"GET / HTTP/1.1\r\nA: b\nC: d\r\n\r\n"
        for request, expected in ((good, False), (bad, True)):
            for i in range(1, len(request)):
                for j in range(i, len(request), 3):
                    self.assertEqual(self.feed(request, [i, j]), expected, (request, i, j))
            self.assertEqual(self.feed(request, list(range(1, len(request)))), expected)


class SurrogateTests(HttpTestCase):
    async def test_a_lone_surrogate_in_the_bookkeeping_is_still_answered(self):
        await self.start()
        proto = ServerReplicationProtocol(self.handler, "hs.test", clock=task.Clock())
        proto.makeConnection(StringTransport())
        self.addCleanup(proto.connectionLost, None)
        proto.dataReceived(b'NAME worker1\nUSER_IP @u:hs ["t", "10.0.0.1", "UA\\ud800", '
                           b'"D", 5]\n')
        # The answer escapes it (\ud800: JSON's grammar allows it; orjson's
        # strict parser would not, the standard library's does).
        response, data = await self.call("GET", "/_replicator/v1/user_ips",
                                         headers=AUTH)
        self.assertEqual((response.code, json.loads(data)), (200, {"user_ips": [
            {"user_id": "@u:hs", "device_id": "D", "ip": "10.0.0.1",
             "user_agent": "UA\ud800", "last_seen": 5}], "next": None}))


class TlsRefusalTests(HttpTestCase):
    """Over TLS too, a refused request gets its JSON answer (the half-close
    after it goes through the TLS layer)."""

    async def test_malformed_and_slow_over_tls(self):
        import ssl
        import tempfile

        from tests.pki import make_pki

        pki = make_pki(tempfile.mkdtemp())
        listen = (f"ssl:0:interface=127.0.0.1:privateKey={pki['server.key']}"
                  f":certKey={pki['server.crt']}")
        await self.start(dsn=PostgresServer.shared().create_database(), config_overrides={
            "http": {"listen": listen, "secret": SECRET, "header_timeout": 1}})
        context = ssl.create_default_context(cafile=pki["ca.crt"])

        def exchange(data: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", self.port), timeout=30) as raw:
                with context.wrap_socket(raw, server_hostname="localhost") as s:
                    s.sendall(data)
                    received = b""
                    while True:
                        try:
                            chunk = s.recv(65536)
                        except ssl.SSLError:
                            break
                        if not chunk:
                            break
                        received += chunk
                    return received

        received = await threads.deferToThread(
            exchange, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
        self.assertEqual(parse_answer(self, received, 400),
                         {"error": "invalid Content-Length header"})
        received = await threads.deferToThread(exchange, b"GET /health HTTP/1.1\r\n")
        self.assertEqual(parse_answer(self, received, 408),
                         {"error": "request headers not received within 1s"})
