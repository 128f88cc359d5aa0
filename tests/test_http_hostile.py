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
