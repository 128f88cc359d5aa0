"""Idle sockets must not lock real peers out (issue 20 item 5).

In memory (StringTransport and a Clock): the replication listener and the
HTTP site under many silent connections from one address.  Over real
sockets, against a ``replicator run`` process: 300 silent replication
connections and then a worker; 300 silent HTTP connections and then
``/health``.
"""

import shutil
import socket
import tempfile

from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from replicator.http.site import Site
from replicator.replication.transport.tcp import ReplicationServerFactory
from tests.handlers import MasterHandler
from tests.http_api import SiteApi
from tests.servers import PostgresServer
from tests.support import recv_until


def address(port: int, host: str = "127.0.0.1") -> IPv4Address:
    return IPv4Address("TCP", host, port)


class ReplicationListenerTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.factory = ReplicationServerFactory(MasterHandler(), "hs.example", clock=self.clock,
                                                max_connections=4)
        self.port = 4000

    def connect(self, host="127.0.0.1"):
        self.port += 1
        proto = self.factory.buildProtocol(address(self.port, host))
        transport = StringTransport(peerAddress=address(self.port, host))
        proto.makeConnection(transport)
        return proto, transport

    def test_silent_connections_do_not_keep_a_known_writer_out(self):
        silent = [self.connect() for _ in range(4)]
        worker, transport = self.connect()
        self.assertTrue(transport.value().startswith(b"SERVER hs.example\n"), transport.value())
        worker.dataReceived(b"NAME worker1\nPING 1\nREPLICATE\n")
        self.assertFalse(transport.disconnecting)
        self.assertEqual(worker.instance_name, "worker1")
        # The silent ones have a short deadline of their own.
        self.clock.advance(10.1)
        for proto, t in silent:
            self.assertTrue(t.disconnecting)
            self.assertEqual(proto.close_reason, "identify_timeout")
            self.assertIn(b"ERROR NAME not received within 10s\n", t.value())
        self.assertFalse(transport.disconnecting)

    def test_unidentified_connections_have_a_cap_of_their_own(self):
        self.factory = ReplicationServerFactory(MasterHandler(), "hs.example", clock=self.clock,
                                                max_unidentified=3)
        silent = [self.connect() for _ in range(5)]
        # The oldest made room for the newest.
        for proto, t in silent[:2]:
            self.assertTrue(t.disconnecting)
            self.assertIn(b"ERROR too many unidentified connections\n", t.value())
        for proto, t in silent[2:]:
            self.assertFalse(t.disconnecting)
        worker, transport = self.connect()
        worker.dataReceived(b"NAME worker1\nREPLICATE\n")
        self.assertFalse(transport.disconnecting)
        self.assertTrue(silent[2][1].disconnecting)

    def test_peers_the_configuration_does_not_know_are_capped_per_address(self):
        self.factory = ReplicationServerFactory(MasterHandler(), "hs.example", clock=self.clock)
        readers = []
        for i in range(33):
            proto, t = self.connect()
            proto.dataReceived(b"NAME reader-%d\nREPLICATE\n" % i)
            readers.append((proto, t))
        for proto, t in readers[:32]:
            self.assertFalse(t.disconnecting)
        proto, t = readers[32]
        self.assertTrue(t.disconnecting)
        self.assertIn(b"ERROR too many connections from 127.0.0.1\n", t.value())
        # Another address, and a known writer from this one, still get in.
        other, other_t = self.connect("127.0.0.2")
        other.dataReceived(b"NAME reader-x\nREPLICATE\n")
        self.assertFalse(other_t.disconnecting)
        worker, transport = self.connect()
        worker.dataReceived(b"NAME worker1\nREPLICATE\n")
        self.assertFalse(transport.disconnecting)


class _Health(Resource):
    """``/health`` answers at once; ``/slow`` never (until told)."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.slow = []

    def render_GET(self, request):
        if request.path == b"/slow":
            self.slow.append(request)
            return NOT_DONE_YET
        return b'{"healthy": true}\n'


class HttpSiteTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.port = 5000

    def site(self, **limits):
        self.api = SiteApi(**limits)
        self.root = _Health()
        return Site(self.root, self.api, 1 << 20, 60, self.clock)

    def connect(self, site):
        self.port += 1
        channel = site.buildProtocol(address(self.port))
        transport = StringTransport(peerAddress=address(self.port))
        channel.makeConnection(transport)
        return channel, transport

    def test_a_health_check_gets_in_past_silent_connections(self):
        site = self.site(max_connections=4)
        silent = [self.connect(site) for _ in range(4)]
        probe, transport = self.connect(site)
        probe.dataReceived(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 200 "), transport.value())
        # The oldest silent connection made room, with a 503 of its own.
        self.assertTrue(silent[0][1].value().startswith(b"HTTP/1.1 503 "))
        self.assertEqual(sum(not t.disconnecting for _, t in silent), 3)

    def test_requests_being_answered_are_never_closed_to_make_room(self):
        site = self.site(max_connections=2)
        busy = [self.connect(site) for _ in range(2)]
        for channel, _ in busy:
            channel.dataReceived(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        refused, transport = self.connect(site)
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 503 "), transport.value())
        self.assertIn(b"too many HTTP connections (2)", transport.value())
        self.assertFalse(any(t.disconnecting for _, t in busy))
        # Once answered, a connection is idle again: it makes room.
        self.root.slow[0].write(b"{}")
        self.root.slow[0].finish()
        probe, transport = self.connect(site)
        probe.dataReceived(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 200 "), transport.value())
        self.assertTrue(busy[0][1].disconnecting)
        self.assertFalse(busy[1][1].disconnecting)

    def test_no_cap_per_address_without_an_ip_address(self):
        from twisted.internet.address import UNIXAddress

        site = self.site()
        channels = []
        for _ in range(70):
            channel = site.buildProtocol(UNIXAddress(None))
            transport = StringTransport()
            channel.makeConnection(transport)
            channels.append(transport)
        self.assertFalse(any(t.disconnecting for t in channels))

    def test_connections_are_capped_per_address(self):
        site = self.site()
        silent = [self.connect(site) for _ in range(70)]
        open_ = [t for _, t in silent if not t.disconnecting]
        self.assertEqual(len(open_), 64)
        self.assertEqual(open_, [t for _, t in silent[6:]])


class LockoutTests(TestCase):
    """The same over real sockets, against a master process on PostgreSQL
    (``caches`` written by ``master`` and ``worker1``)."""

    timeout = 180

    def setUp(self):
        from tests.fuzz.daemon import Daemon

        self.dir = tempfile.mkdtemp(prefix="crowding-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.daemon = Daemon(self.dir, PostgresServer.shared().create_database())
        self.addCleanup(self.daemon.kill)
        self.daemon.start()
        self.sockets = []
        self.addCleanup(lambda: [s.close() for s in self.sockets])

    def silent(self, port: int, n: int) -> None:
        for _ in range(n):
            self.sockets.append(socket.create_connection(("127.0.0.1", port), timeout=10))

    def test_a_worker_gets_in_past_300_silent_connections(self):
        self.silent(self.daemon.rep_port, 300)
        worker = socket.create_connection(("127.0.0.1", self.daemon.rep_port), timeout=10)
        self.sockets.append(worker)
        worker.sendall(b"NAME worker1\nPING 1\nREPLICATE\n")
        received = recv_until(worker, b"POSITION caches master", b"ERROR")
        self.assertNotIn(b"ERROR", received)
        self.assertIn(b"POSITION caches master", received)

    def test_health_answers_past_300_silent_http_connections(self):
        from tests.fuzz.daemon import SECRET, http_get

        self.silent(self.daemon.http_port, 300)
        status, body = http_get(self.daemon.http_port, "/health")
        # The health endpoint's own answer, not the connection cap's.
        self.assertNotIn(b"too many HTTP connections", body)
        self.assertEqual(status, 200, body)
        self.assertIn(b'"status":"ok"', body)
        status, body = http_get(self.daemon.http_port, "/_replicator/v1/positions", SECRET)
        self.assertEqual(status, 200, body)


class ConfigTests(SynchronousTestCase):
    def error(self, parse, section):
        from replicator.config import ConfigError

        with self.assertRaises(ConfigError) as e:
            parse(section)
        self.assertNotIn("\n", str(e.exception))
        return str(e.exception)

    def test_replication_keys(self):
        from replicator.config import parse_replication

        config = parse_replication({})
        self.assertEqual((config.max_connections_per_address, config.max_unidentified,
                          config.identify_timeout), (32, 64, 10.0))
        self.assertEqual(parse_replication({"max_connections": 8}).max_connections_per_address,
                         8)
        self.assertEqual(self.error(parse_replication, {"max_connections_per_address": 300}),
                         "config: replication.max_connections_per_address: must be an integer "
                         "from 1 to 256, got 300")
        self.assertEqual(self.error(parse_replication, {"max_unidentified": 0}),
                         "config: replication.max_unidentified: must be an integer from 1 to "
                         "65536, got 0")
        self.assertIn("config: replication.identify_timeout: ",
                      self.error(parse_replication, {"identify_timeout": "soon"}))

    def test_http_key(self):
        from replicator.config.instance import parse_http

        base = {"listen": "tcp:0:interface=127.0.0.1", "secret": "s" * 16}
        self.assertEqual(parse_http(base).max_connections_per_address, 64)
        self.assertEqual(self.error(parse_http, dict(base, max_connections=10,
                                                     max_connections_per_address=11)),
                         "config: http.max_connections_per_address: must be an integer from 1 "
                         "to 10, got 11")
