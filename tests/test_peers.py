"""Who may connect and which NAME a peer may take (replication.peers), on
StringTransport and a Clock; the TLS binding over real sockets is in
tests/test_tls.py."""

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from OpenSSL import crypto
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import ConfigError, parse_replication
from replicator.replication.interfaces import OTHER, metrics_label
from replicator.replication.transport.peers import PeerPolicy, policy_from_config
from replicator.replication.transport.protocol import ServerReplicationProtocol
from replicator.replication.transport.tcp import ReplicationServerFactory
from tests.handlers import MasterHandler


class CertTransport(StringTransport):
    """A transport whose peer presented ``cert`` (None: no certificate)."""

    def __init__(self, cert=None, **kwargs):
        super().__init__(**kwargs)
        self._cert = crypto.X509.from_cryptography(cert) if cert is not None else None

    def getPeerCertificate(self):
        return self._cert


def certificate(cn, san=()):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1)))
    if san:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in san]), critical=False)
    return builder.sign(key, hashes.SHA256())


def serve(policy=None, transport=None, factory=False):
    handler = MasterHandler()
    clock = Clock()
    if factory:
        proto = ReplicationServerFactory(handler, "hs.example", clock=clock,
                                         policy=policy).buildProtocol(None)
    else:
        proto = ServerReplicationProtocol(handler, "hs.example", policy=policy, clock=clock)
    transport = transport if transport is not None else StringTransport()
    proto.makeConnection(transport)
    transport.clear()
    return proto, transport, handler


class NameTests(SynchronousTestCase):
    def assertRefused(self, proto, transport, handler, error):
        self.assertEqual(transport.value(), b"ERROR " + error + b"\n")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(proto.close_reason, "refused")
        self.assertNotIn("NAME", [e[0] for e in handler.commands()])

    def test_no_peer_takes_the_name_of_this_instance(self):
        # The factory's default policy knows the handler's own names.
        proto, transport, handler = serve(factory=True)
        proto.dataReceived(b"NAME master\nUSER_SYNC master @u:hs None start 1\n")
        self.assertRefused(proto, transport, handler, b"NAME is taken by the server")
        self.assertEqual(handler.commands(), [])
        self.assertIsNone(proto.instance_name)

    def test_a_name_is_set_once(self):
        proto, transport, handler = serve(factory=True)
        proto.dataReceived(b"NAME worker2\nNAME worker2\nPING 1\n")
        self.assertEqual(transport.value(), b"")
        proto.dataReceived(b"NAME worker1\nRDATA caches worker1 1 [\"forged\"]\n")
        self.assertEqual(transport.value(), b"ERROR NAME already given\n")
        self.assertEqual(proto.close_reason, "refused")
        self.assertEqual(proto.instance_name, "worker2")
        self.assertEqual([e[0] for e in handler.commands()], ["NAME", "NAME", "PING"])

    def test_without_settings_synapse_peers_are_unchanged(self):
        proto, transport, handler = serve(factory=True)
        proto.dataReceived(b"PING 1\nREPLICATE \nNAME worker1\n"
                           b'RDATA caches worker1 1 ["row"]\nPOSITION caches worker1 1 1\n')
        self.assertEqual(transport.value(), b"")
        self.assertEqual([e[0] for e in handler.commands()],
                         ["PING", "REPLICATE", "NAME", "RDATA", "POSITION"])

    def test_rdata_only_for_the_peer_itself_and_only_after_name(self):
        for lines in (b'RDATA caches worker1 1 ["forged"]\n',
                      b'NAME worker2\nRDATA caches worker1 1 ["forged"]\n',
                      b"NAME worker2\nPOSITION caches worker1 0 1\n"):
            proto, transport, handler = serve(factory=True)
            proto.dataReceived(lines)
            self.assertIn(b" refused: ", transport.value(), lines)
            self.assertEqual([e[0] for e in handler.commands() if e[0] != "NAME"], [])

    def test_allowed_peers(self):
        policy = PeerPolicy(reserved=frozenset({"master"}), allowed_peers=frozenset({"worker1"}))
        proto, transport, handler = serve(policy)
        proto.dataReceived(b"NAME worker9\n")
        self.assertRefused(proto, transport, handler, b"NAME not allowed")
        # Nothing but PING and NAME before NAME: no unnamed reader.
        proto, transport, handler = serve(policy)
        proto.dataReceived(b"PING 1\nREPLICATE \n")
        self.assertEqual(transport.value(), b"ERROR NAME required\n")
        self.assertEqual([e[0] for e in handler.commands()], ["PING"])
        proto, transport, handler = serve(policy)
        proto.dataReceived(b"PING 1\nNAME worker1\nREPLICATE \n")
        self.assertEqual(transport.value(), b"")
        self.assertEqual([e[0] for e in handler.commands()], ["PING", "NAME", "REPLICATE"])

    def test_allowed_networks_checked_at_connect(self):
        policy = policy_from_config(parse_replication(
            {"allowed_networks": ["10.0.0.0/8", "fd00::/8"]}), {"master"})
        handler = MasterHandler()
        for host, cls, allowed in (("10.1.2.3", IPv4Address, True),
                                   ("192.168.1.1", IPv4Address, False),
                                   ("::ffff:10.1.2.3", IPv6Address, True),
                                   ("fd00::1", IPv6Address, True),
                                   ("::1", IPv6Address, False)):
            proto = ServerReplicationProtocol(handler, "hs.example", policy=policy, clock=Clock())
            transport = StringTransport(peerAddress=cls("TCP", host, 4000))
            proto.makeConnection(transport)
            if allowed:
                self.assertTrue(transport.value().startswith(b"SERVER hs.example\n"), host)
                self.assertFalse(transport.disconnecting)
            else:
                # Refused before the handshake: not even our SERVER name.
                self.assertEqual(transport.value(), b"ERROR address not allowed\n", host)
                self.assertTrue(transport.disconnecting)
                self.assertEqual(proto.close_reason, "refused")
                proto.connectionLost(None)
        self.assertEqual([e for e in handler.events if e[0] == "new_connection"].__len__(), 3)

    def test_name_bound_to_the_client_certificate(self):
        policy = PeerPolicy(reserved=frozenset({"master"}), certificate_names=True)
        cert = certificate("worker1", san=["worker1.example", "worker3"])
        for name, ok in ((b"worker1", True), (b"worker3", True), (b"worker1.example", True),
                         (b"worker2", False), (b"master", False)):
            proto, transport, handler = serve(policy, CertTransport(cert))
            proto.dataReceived(b"NAME " + name + b"\n")
            self.assertEqual(transport.disconnecting, not ok, name)
            self.assertEqual(proto.instance_name, name.decode() if ok else None)
        proto, transport, handler = serve(policy, CertTransport(None))
        proto.dataReceived(b"NAME worker1\n")
        self.assertRefused(proto, transport, handler,
                           b"NAME does not match the client certificate")

    def test_metrics_label(self):
        known = frozenset({"master", "worker1"})
        self.assertEqual([metrics_label(n, known) for n in ("worker1", "worker99", None)],
                         ["worker1", OTHER, OTHER])


class OneConnectionPerNameTests(SynchronousTestCase):
    """A configured writer's NAME is held by one live connection at a time
    (issue 20 item 3): a second connection borrowing it while the first
    lives could hide that writer's facts with a POSITION of its own."""

    def listener(self, policy=None):
        self.handler = MasterHandler()
        self.clock = Clock()
        self.factory = ReplicationServerFactory(self.handler, "hs.example", clock=self.clock,
                                                policy=policy)

    def connect(self, port):
        address = IPv4Address("TCP", "127.0.0.1", port)
        proto = self.factory.buildProtocol(address)
        transport = StringTransport(peerAddress=address)
        proto.makeConnection(transport)
        transport.clear()
        return proto, transport

    def check_borrowed_name_refused(self):
        real, real_t = self.connect(4001)
        real.dataReceived(b"NAME worker1\nPING 1\n")
        self.assertFalse(real_t.disconnecting)
        borrower, borrower_t = self.connect(4002)
        borrower.dataReceived(b"NAME worker1\nPOSITION caches worker1 0 2\n")
        self.assertEqual(borrower_t.value(),
                         b"ERROR NAME worker1 is held by a live connection\n")
        self.assertTrue(borrower_t.disconnecting)
        self.assertEqual(borrower.close_reason, "refused")
        self.assertIsNone(borrower.instance_name)
        self.assertNotIn("POSITION", [e[0] for e in self.handler.commands()])
        # The holder is PINGed at once: a peer host that restarted answers
        # a reset, which ends the stale connection without waiting for the
        # ping timeout.
        self.assertTrue(real_t.value().startswith(b"PING "), real_t.value())
        self.assertFalse(real_t.disconnecting)
        borrower.connectionLost(None)
        # Once the holder is gone (closed, or timed out), the name is free.
        real.connectionLost(None)
        back, back_t = self.connect(4003)
        back.dataReceived(b"NAME worker1\nPOSITION caches worker1 0 1\n")
        self.assertEqual(back_t.value(), b"")
        self.assertEqual(back.instance_name, "worker1")
        self.assertEqual([e[0] for e in self.handler.commands()][-1], "POSITION")

    def test_a_writers_name_is_held_by_one_live_connection(self):
        self.listener()
        self.check_borrowed_name_refused()

    def test_also_with_allowed_peers(self):
        self.listener(PeerPolicy(reserved=frozenset({"master"}),
                                 allowed_peers=frozenset({"worker1", "reader"})))
        self.check_borrowed_name_refused()

    def test_the_holder_timing_out_frees_the_name(self):
        self.listener()
        real, real_t = self.connect(4001)
        real.dataReceived(b"NAME worker1\nPING 1\n")
        # A half-open link: nothing more arrives; the ping timeout closes it.
        self.clock.advance(real._ping_timeout + 0.1)
        self.assertEqual(real.close_reason, "ping_timeout")
        real.connectionLost(None)
        back, back_t = self.connect(4002)
        back.dataReceived(b"NAME worker1\n")
        self.assertEqual(back.instance_name, "worker1")
        self.assertFalse(back_t.disconnecting)

    def test_names_the_configuration_does_not_know_may_repeat(self):
        self.listener()
        for port in (4001, 4002):
            proto, transport = self.connect(port)
            proto.dataReceived(b"NAME some-reader\nREPLICATE\n")
            self.assertFalse(transport.disconnecting)


class ConfigTests(SynchronousTestCase):
    def error(self, section):
        with self.assertRaises(ConfigError) as e:
            parse_replication(section)
        self.assertNotIn("\n", str(e.exception))
        return str(e.exception)

    def test_allow_lists(self):
        config = parse_replication({"allowed_peers": ["worker1"],
                                    "allowed_networks": ["127.0.0.0/8", "::1/128"]})
        self.assertEqual((config.allowed_peers, config.allowed_networks),
                         (("worker1",), ("127.0.0.0/8", "::1/128")))
        self.assertEqual(self.error({"allowed_peers": ["a b"]}),
                         "config: replication.allowed_peers[0]: 'a b' is not an instance name")
        self.assertEqual(self.error({"allowed_peers": ["worker1\n"]}),
                         "config: replication.allowed_peers[0]: 'worker1\\n' is not an "
                         "instance name")
        self.assertEqual(self.error({"allowed_peers": []}),
                         "config: replication.allowed_peers: an empty list would refuse every "
                         "peer")
        self.assertEqual(self.error({"allowed_networks": ["10.0.0.1/8"]}),
                         "config: replication.allowed_networks[0]: 10.0.0.1/8 has host bits set")
        self.assertIn("config: replication.allowed_networks[0]: ",
                      self.error({"allowed_networks": ["nowhere"]}))
        self.assertEqual(self.error({"listen": "unix:/tmp/r.sock",
                                     "allowed_networks": ["10.0.0.0/8"]}),
                         "config: replication.allowed_networks: needs a tcp: or ssl: listener")

    def test_bookkeeping_bounds(self):
        config = parse_replication({})
        self.assertEqual((config.max_user_syncs, config.max_user_ips, config.max_federation_acks,
                          config.bookkeeping_max_age), (50_000, 20_000, 1_000, 86_400.0))
        self.assertEqual(self.error({"max_user_ips": 0}),
                         "config: replication.max_user_ips: must be an integer from 1 to "
                         "10000000, got 0")
        self.assertEqual(self.error({"max_user_syncs": 10**12}),
                         "config: replication.max_user_syncs: must be an integer from 1 to "
                         "10000000, got 1000000000000")
        self.assertEqual(self.error({"bookkeeping_max_age": float("inf")}),
                         "config: replication.bookkeeping_max_age: must be a number from 60 to "
                         "3.1536e+07, got inf")
        self.assertIn("replication.bookkeeping_max_age",
                      self.error({"bookkeeping_max_age": float("nan")}))


class ReloadedPolicyTests(SynchronousTestCase):
    """A reload's new policy (``ReplicationServerFactory.set_policy``): open
    connections it allows stay untouched, the others get ``ERROR`` and close,
    new connections are checked by it."""

    def connect(self, factory, host, name):
        proto = factory.buildProtocol(None)
        transport = StringTransport(peerAddress=IPv4Address("TCP", host, 4000))
        proto.makeConnection(transport)
        proto.dataReceived(b"NAME " + name + b"\n")
        transport.clear()
        return proto, transport

    def test_only_connections_no_longer_allowed_are_closed(self):
        factory = ReplicationServerFactory(MasterHandler(), "hs.example", clock=Clock())
        kept, kept_transport = self.connect(factory, "10.0.0.1", b"worker1")
        named_out, named_out_transport = self.connect(factory, "10.0.0.2", b"worker2")
        outside, outside_transport = self.connect(factory, "192.168.0.1", b"worker3")
        policy = policy_from_config(parse_replication(
            {"allowed_peers": ["worker1", "worker3"], "allowed_networks": ["10.0.0.0/8"]}),
            {"master"})
        self.assertEqual(factory.set_policy(policy), 2)
        self.assertEqual(kept_transport.value(), b"")
        self.assertFalse(kept_transport.disconnecting)
        self.assertEqual(named_out_transport.value(), b"ERROR NAME not allowed\n")
        self.assertEqual(outside_transport.value(), b"ERROR address not allowed\n")
        self.assertEqual((named_out.close_reason, outside.close_reason), ("refused", "refused"))
        # A new connection is checked by the new policy.
        proto, transport = self.connect(factory, "10.0.0.3", b"worker9")
        self.assertTrue(transport.disconnecting)
