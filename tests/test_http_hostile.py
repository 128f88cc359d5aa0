"""The HTTP API against hostile and careless clients, over real loopback
sockets: who may read what, answers built off the reactor, slow clients,
malformed requests, absurd bodies.  Every refusal is a JSON 4xx/5xx."""

import threading

import orjson
from twisted.internet import defer, task
from twisted.internet.testing import StringTransport

from replicator.replication.protocol import ServerReplicationProtocol
from tests.test_http import AUTH, SECRET, HttpTestCase

READ_PATHS = ("/_replicator/v1/positions", "/_replicator/v1/federation_acks",
              "/_replicator/v1/user_syncs", "/_replicator/v1/user_ips")


class AccessTests(HttpTestCase):
    def test_bookkeeping_and_positions_need_the_secret(self):
        async def go():
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
        return defer.ensureDeferred(go())


class BadBodyTests(HttpTestCase):
    def test_deeply_nested_json_is_the_clients_fault(self):
        async def go():
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
        return defer.ensureDeferred(go())

    def test_an_integer_out_of_the_bigint_range_says_so(self):
        async def go():
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
        return defer.ensureDeferred(go())


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
            if i < 50:
                lines.append(b"FEDERATION_ACK fed%03d %d\n" % (i, i))
        proto.dataReceived(b"".join(lines))
        return proto

    def test_user_ips_pages_visit_every_entry_once_in_order(self):
        async def go():
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
            self.assertEqual(seen, [("@u%05d:hs" % i, "D%d" % (i % 2)) for i in range(2500)])
            # The bookkeeping of the other tables pages the same way.
            response, answer = await self.json(
                "GET", "/_replicator/v1/user_syncs?limit=2000", headers=AUTH)
            self.assertEqual(len(answer["user_syncs"]["worker1"]), 2000)
            response, rest = await self.json(
                "GET", "/_replicator/v1/user_syncs?from=" + answer["next"], headers=AUTH)
            self.assertEqual(len(rest["user_syncs"]["worker1"]), 500)
            self.assertIsNone(rest["next"])
            self.assertEqual(rest["user_syncs"]["worker1"][0], {
                "user_id": "@u02000:hs", "device_id": "D", "last_sync_ms": 3000})
            response, answer = await self.json(
                "GET", "/_replicator/v1/federation_acks?limit=40", headers=AUTH)
            self.assertEqual(list(answer["acks"]), ["fed%03d" % i for i in range(40)])
            response, answer = await self.json(
                "GET", "/_replicator/v1/federation_acks?from=" + answer["next"], headers=AUTH)
            self.assertEqual(answer, {"acks": {"fed%03d" % i: i for i in range(40, 50)},
                                      "next": None})
        return defer.ensureDeferred(go())

    def test_bad_page_arguments_are_400(self):
        async def go():
            await self.start()
            for query, error in [
                    ("limit=0", "limit must be an integer from 1 to 10000"),
                    ("limit=10001", "limit must be an integer from 1 to 10000"),
                    ("limit=-1", "limit must be an integer from 1 to 10000"),
                    ("limit=" + "9" * 400, "limit must be an integer from 1 to 10000"),
                    ("from=bm90IGpzb24", "from is not a cursor from a previous page's next"),
                    ("from=WzEsMl0", "from is not a cursor from a previous page's next"),
                    ("from=%ff%fe", "from is not a cursor from a previous page's next"),
                    ("from=" + "A" * 5000, "from is not a cursor from a previous page's next")]:
                for path in ("user_ips", "user_syncs", "federation_acks"):
                    response, answer = await self.json(
                        "GET", f"/_replicator/v1/{path}?{query}", headers=AUTH)
                    self.assertEqual((response.code, answer), (400, {"error": error}),
                                     (path, query))
        return defer.ensureDeferred(go())

    def test_answers_are_built_off_the_reactor_thread(self):
        async def go():
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
            # /metrics on the HTTP listener: its refresh and its text too.
            refreshed = []
            refresh = self.api.refresh_metrics

            def watched_refresh():
                refreshed.append(threading.get_ident())
                refresh()

            self.api.refresh_metrics = watched_refresh
            response, text = await self.call("GET", "/metrics")
            self.assertEqual(response.code, 200)
            self.assertIn(b'replicator_user_syncs{instance="worker1"} 10.0\n', text)
            self.assertTrue(refreshed)
            self.assertNotIn(reactor_thread, refreshed)
        return defer.ensureDeferred(go())
