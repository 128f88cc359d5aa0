"""Busy connections must not lock out ``/health`` and writes, and an answer
being flushed before its close is never given a second one.

In memory (StringTransport and a Clock): the HTTP site with every ordinary
slot busy (requests being answered, more pipelined behind them), then
health probes, writers and others on the reserved slots.  Over real
sockets, against a ``replicator run`` process: every ordinary slot held by
event streams from four addresses and a fifth pipelining ``/health``, then
``/health``, a write and a page.
"""

import json
import os
import re
import shutil
import socket
import tempfile

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from replicator.http.site import Site
from tests.http_api import SiteApi
from tests.support import recv_until

SECRET = b"write-secret-0123456789"
GET = b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n"


def get(path: bytes, headers: bytes = b"") -> bytes:
    return GET % (path, headers)


AUTH = b"Authorization: Bearer " + SECRET + b"\r\n"


class _Root(Resource):
    """``/health`` and ``/write`` answer at once (unless ``hold``); ``/slow``
    never (until told)."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.slow = []
        self.hold = False

    def render_GET(self, request):
        if request.path == b"/slow" or self.hold:
            self.slow.append(request)
            return NOT_DONE_YET
        return b'{"ok": true}\n'

    render_POST = render_GET


def answers(transport: StringTransport) -> list:
    """The status lines of the answers ``transport`` was given, in order."""
    return re.findall(rb"(?:^|\n)(HTTP/1\.[01] [^\r\n]*)", transport.value())


class SlotTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.port = 6000

    def site(self, **limits):
        limits.setdefault("write_secret", SECRET)
        self.api = SiteApi(**limits)
        self.root = _Root()
        return Site(self.root, self.api, 1 << 20, 60, self.clock)

    def connect(self, site, host="127.0.0.1"):
        self.port += 1
        channel = site.buildProtocol(IPv4Address("TCP", host, self.port))
        transport = StringTransport(peerAddress=IPv4Address("TCP", host, self.port))
        channel.makeConnection(transport)
        return channel, transport

    def busy(self, site, n, hosts):
        """``n`` connections spread over ``hosts``, each with ``/slow``
        being answered and three more pipelined behind it."""
        out = []
        for i in range(n):
            channel, transport = self.connect(site, hosts[i % len(hosts)])
            channel.dataReceived(get(b"/slow") * 4)
            out.append((channel, transport))
        return out

    def test_a_health_probe_and_a_writer_get_in_past_busy_connections(self):
        site = self.site(max_connections=4, max_connections_per_address=2,
                         reserved_for_health=1, reserved_for_writers=1)
        busy = self.busy(site, 4, ["127.0.0.2", "127.0.0.3"])
        # From an address over its cap, and from a new one.
        probe, transport = self.connect(site, "127.0.0.2")
        probe.dataReceived(get(b"/health") + get(b"/health"))
        # One answer, and the connection closes: the pipelined one is dropped.
        self.assertEqual(answers(transport), [b"HTTP/1.1 200 OK"])
        self.assertIn(b"Connection: close", transport.value())
        self.assertTrue(transport.disconnecting)
        writer, wt = self.connect(site, "127.0.0.4")
        writer.dataReceived(get(b"/write", AUTH))
        writer.dataReceived(get(b"/write", AUTH))
        # A writer's connection stays open for its next request.
        self.assertEqual(answers(wt), [b"HTTP/1.1 200 OK"] * 2)
        self.assertFalse(wt.disconnecting)
        # The busy connections were never touched.
        self.assertEqual([t.value() for _, t in busy], [b""] * 4)
        self.assertFalse(any(t.disconnecting for _, t in busy))
        self.assertEqual(len(self.root.slow), 4)

    def test_the_reserved_slots_take_only_health_and_writers(self):
        site = self.site(max_connections=2, reserved_for_health=1, reserved_for_writers=1)
        self.busy(site, 2, ["127.0.0.2"])
        other, transport = self.connect(site, "127.0.0.3")
        other.dataReceived(get(b"/slow", b"Authorization: Bearer wrong-secret\r\n"))
        self.assertEqual(answers(transport), [b"HTTP/1.1 503 Service Unavailable"])
        self.assertIn(b'"error":"too many HTTP connections: the spare ones are for /health and '
                      b'requests with the write secret"', transport.value())
        self.assertEqual(len(self.root.slow), 2)  # never processed
        # A writer's connection carries only the writer's requests.
        writer, wt = self.connect(site, "127.0.0.3")
        writer.dataReceived(get(b"/write", AUTH) + get(b"/slow"))
        self.assertEqual(answers(wt), [b"HTTP/1.1 200 OK", b"HTTP/1.1 503 Service Unavailable"])
        self.assertEqual(self.api.refusals[-1][0], 503)

    def test_each_reserve_has_its_own_bound(self):
        site = self.site(max_connections=2, reserved_for_health=1, reserved_for_writers=2)
        self.busy(site, 2, ["127.0.0.2"])
        self.root.hold = True  # the health answers and writes take their time
        first, t1 = self.connect(site, "127.0.0.2")
        first.dataReceived(get(b"/health"))
        second, t2 = self.connect(site, "127.0.0.2")
        second.dataReceived(get(b"/health"))
        self.assertEqual(answers(t1), [])
        self.assertEqual(answers(t2), [b"HTTP/1.1 503 Service Unavailable"])
        self.assertIn(b"the 1 reserved for /health are busy", t2.value())
        # The writers' reserve is not the probes' to take.
        writers = [self.connect(site, "127.0.0.5") for _ in range(2)]
        for channel, _ in writers:
            channel.dataReceived(get(b"/write", AUTH))
        self.assertEqual([answers(t) for _, t in writers], [[], []])
        self.assertEqual(len(self.root.slow), 5)
        # All held: a newcomer is refused before anything of it is parsed.
        late, t3 = self.connect(site, "127.0.0.6")
        self.assertIn(b"too many HTTP connections (2) and the 3 reserved for /health and "
                      b"writers busy: try again later", t3.value())
        # Once answered, a writer's connection is idle: a newcomer closes it (quietly).
        self.root.slow[3].write(b"{}")
        self.root.slow[3].finish()
        newcomer, t4 = self.connect(site, "127.0.0.6")
        self.assertEqual(t4.value(), b"")
        self.assertTrue(writers[0][1].disconnecting)
        self.assertEqual(answers(writers[0][1]), [b"HTTP/1.1 200 OK"])
        self.assertFalse(writers[1][1].disconnecting)

    def test_a_fresh_reserved_connection_is_closed_before_an_idle_writer(self):
        site = self.site(max_connections=1, reserved_for_health=1, reserved_for_writers=1)
        self.busy(site, 1, ["127.0.0.2"])
        writer, wt = self.connect(site, "127.0.0.3")
        writer.dataReceived(get(b"/write", AUTH))
        silent, st = self.connect(site, "127.0.0.4")
        probe, pt = self.connect(site, "127.0.0.4")
        # The silent one made room (anybody's); the writer's stays open.
        self.assertEqual(answers(st), [b"HTTP/1.1 503 Service Unavailable"])
        self.assertFalse(wt.disconnecting)
        probe.dataReceived(get(b"/health"))
        self.assertEqual(answers(pt), [b"HTTP/1.1 200 OK"])
        writer.dataReceived(get(b"/write", AUTH))
        self.assertEqual(answers(wt), [b"HTTP/1.1 200 OK"] * 2)
        # A refused one goes without trouble.
        silent.connectionLost(Failure(ConnectionDone()))
        self.assertNotIn(silent, site.slots)

    def test_an_idle_connection_is_closed_before_a_fresh_one(self):
        site = self.site(max_connections=3)
        fresh, ft = self.connect(site)
        idle, it = self.connect(site)
        idle.dataReceived(get(b"/health"))
        self.busy(site, 1, ["127.0.0.1"])
        newcomer, nt = self.connect(site)
        # The idle one went (quietly: it was answered); the one that has not
        # sent its request yet stays.
        self.assertTrue(it.disconnecting)
        self.assertEqual(answers(it), [b"HTTP/1.1 200 OK"])
        self.assertFalse(ft.disconnecting)
        fresh.dataReceived(get(b"/health"))
        self.assertEqual(answers(ft), [b"HTTP/1.1 200 OK"])

    def test_an_answer_being_flushed_is_never_given_a_second_one(self):
        for version in (b"HTTP/1.1", b"HTTP/1.0"):
            site = self.site(max_connections=2)
            closing, ct = self.connect(site)
            closing.dataReceived(b"POST /write %s\r\nHost: x\r\nConnection: close\r\n"
                                 b"Content-Length: 2\r\n\r\n{}" % version)
            self.assertTrue(ct.disconnecting)  # flushing, then closed
            self.busy(site, 1, ["127.0.0.1"])
            newcomers = [self.connect(site)[1] for _ in range(3)]
            self.assertEqual([line.split(b" ")[1] for line in answers(ct)], [b"200"], version)
            # Refused instead: no other connection had room to make.
            self.assertEqual([answers(t) for t in newcomers],
                             [[b"HTTP/1.1 503 Service Unavailable"]] * 3)
            # Gone: its slot is free again.
            closing.connectionLost(None)
            newcomer, nt = self.connect(site)
            self.assertEqual(nt.value(), b"")


READER = "slots-reader-secret-0123456789"


class LockoutTests(TestCase):
    """Over real sockets, against a ``replicator run`` master (SQLite): 16
    ordinary slots, 4 from one address, held by event streams from four
    addresses, and a fifth address pipelining ``/health``."""

    timeout = 120

    def setUp(self):
        from tests.fuzz.daemon import Daemon

        self.dir = tempfile.mkdtemp(prefix="slots-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.daemon = Daemon(self.dir)
        secret_file = os.path.join(self.dir, "reader.secret")
        with open(secret_file, "w") as f:
            f.write(READER)
        self.daemon.config["http"].update(
            max_connections=16, max_connections_per_address=4, max_waiting_reads=16,
            max_waiting_reads_per_address=4,
            readers=[{"name": "flood", "secret_file": secret_file, "streams": ["caches"]}])
        self.addCleanup(self.daemon.kill)
        self.daemon.start()
        self.sockets = []
        self.addCleanup(lambda: [s.close() for s in self.sockets])

    def connect(self, host: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.daemon.http_port), timeout=30,
                                        source_address=(host, 0))
        self.sockets.append(sock)
        return sock

    def test_health_and_writes_get_in_past_busy_connections(self):
        from tests.fuzz.daemon import SECRET

        stream = (b"GET /_replicator/v1/streams/caches/events HTTP/1.1\r\nHost: x\r\n"
                  b"Authorization: Bearer %s\r\n\r\n" % READER.encode())
        floods = []
        for i in range(16):
            sock = self.connect(f"127.0.0.{2 + i % 4}")
            # The event stream, and /metrics pipelined behind it.
            sock.sendall(stream + b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
            floods.append(sock)
        for sock in floods:  # each stream is open: its slot is busy
            head = recv_until(sock, b"retry: 2000")
            self.assertTrue(head.startswith(b"HTTP/1.1 200 "), head)
        # A fifth address pipelining /health: one answer per connection, closed.
        for _ in range(3):
            sock = self.connect("127.0.0.6")
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
            received = recv_until(sock, b"\0never")
            self.assertEqual(received.count(b"HTTP/1.1 "), 1, received)
            self.assertTrue(received.startswith(b"HTTP/1.1 200 "), received)
        # From an address already over its cap: /health, a write, a page.
        sock = self.connect("127.0.0.2")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        received = recv_until(sock, b"\0never")
        self.assertTrue(received.startswith(b"HTTP/1.1 200 "), received)
        self.assertIn(b'"status":"ok"', received)
        body = json.dumps({"rows": [["f", [1], 1]]}).encode()
        sock = self.connect("127.0.0.3")
        sock.sendall(b"POST /_replicator/v1/streams/caches/facts HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (SECRET.encode(), len(body), body))
        received = recv_until(sock, b"\0never")
        self.assertTrue(received.startswith(b"HTTP/1.1 200 "), received)
        self.assertIn(b'"stream_id":', received)
        sock = self.connect("127.0.0.7")
        sock.sendall(b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n")
        received = recv_until(sock, b"\0never")
        self.assertTrue(received.startswith(b"HTTP/1.1 503 "), received)
        self.assertIn(b"the spare ones are for /health and requests with the write secret",
                      received)
        # Every event stream is still open, and saw the write.
        for sock in floods:
            self.assertIn(b"event: fact", recv_until(sock, b"event: fact"))


class ConfigTests(SynchronousTestCase):
    def test_reserved_keys(self):
        from replicator.config import ConfigError
        from replicator.config.instance import parse_http

        base = {"listen": "tcp:0:interface=127.0.0.1", "secret": "s" * 16}
        config = parse_http(base)
        self.assertEqual((config.reserved_for_health, config.reserved_for_writers), (4, 16))
        self.assertEqual(parse_http(dict(base, reserved_for_health=0)).reserved_for_health, 0)
        for key, value in (("reserved_for_health", -1), ("reserved_for_writers", 1001)):
            with self.assertRaises(ConfigError) as e:
                parse_http(dict(base, **{key: value}))
            self.assertEqual(str(e.exception), f"config: http.{key}: must be an integer from "
                                               f"0 to 1000, got {value}")
