"""The HTTP API against hostile and careless clients, over real loopback
sockets: who may read what, answers built off the reactor, slow clients,
malformed requests, absurd bodies.  Every refusal is a JSON 4xx/5xx."""

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
            self.assertEqual(answer, {"acks": {"worker1": 57}})
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
