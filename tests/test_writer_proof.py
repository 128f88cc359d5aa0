"""A writer's proof of its NAME (``replication.writer_secrets`` on the master,
``replication.secret_file`` on the worker; docs/protocol.md, "Proof of a
writer's identity").

Without it, a connection saying ``NAME worker1`` while worker1's link is
down could send ``POSITION caches worker1 0 2`` while worker1's fact 2 is in
flight, and every reader would skip fact 2 for good.  The handshake runs in
memory (StringTransport, iosim, a Clock); the attack runs over real sockets
against a master and a worker daemon on PostgreSQL.
"""

import os
import shutil
import tempfile

from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import ConfigError, parse_instance, validate
from replicator.daemon.checking import unbound_writers
from replicator.observe import metrics
from replicator.replication.transport import proof
from replicator.replication.transport.peers import PeerPolicy
from replicator.replication.transport.protocol import ClientReplicationProtocol
from replicator.replication.transport.tcp import ReplicationServerFactory
from tests.handlers import MasterHandler, RecordingHandler
from tests.harness import Harness
from tests.support import T0

SECRET = "worker1-secret-0123456789abcdef"
POLICY = PeerPolicy(reserved=frozenset({"master"}), writer_secrets={"worker1": SECRET})


def refused(reason):
    return metrics.CONNECTIONS_REFUSED.labels(reason)._value.get()


class ClientHandler(RecordingHandler):
    """A worker's handler: records when its writes are let go."""

    def writes_released(self, conn):
        self.events.append(("writes_released", conn.transport.value()))


class ServerSideTests(SynchronousTestCase):
    """The master's side, one StringTransport per connection."""

    def setUp(self):
        self.handler = MasterHandler()
        self.clock = Clock()
        self.factory = ReplicationServerFactory(self.handler, "hs.example", clock=self.clock,
                                                policy=POLICY, identify_timeout=10.0)

    def connect(self, port=4001):
        address = IPv4Address("TCP", "127.0.0.1", port)
        proto = self.factory.buildProtocol(address)
        transport = StringTransport(peerAddress=address)
        proto.makeConnection(transport)
        transport.clear()
        return proto, transport

    def challenge(self, transport):
        line = transport.value().decode().split("\n")[0]
        self.assertTrue(line.startswith("AUTH_CHALLENGE "), transport.value())
        return line.split(" ", 1)[1]

    def test_an_impostor_cannot_move_a_bound_writer(self):
        before = refused("unproven")
        impostor, transport = self.connect()
        impostor.dataReceived(b"NAME worker1\nPING 1\nPOSITION caches worker1 0 2\n")
        nonce = self.challenge(transport)
        self.assertRegex(nonce, "^[0-9a-f]{32}$")
        self.assertEqual(transport.value().decode().split("\n")[1:],
                         ["ERROR POSITION of caches/worker1 refused: worker1 has not proven "
                          "its NAME (AUTH)", ""])
        self.assertTrue(transport.disconnecting)
        # The handler heard neither the NAME nor the POSITION.
        self.assertEqual([e[0] for e in self.handler.commands()], ["PING"])
        self.assertEqual(refused("unproven"), before + 1)
        # An unproven connection held no name.
        self.assertNotIn("worker1", self.factory.holders)

    def test_the_right_proof_identifies_the_writer(self):
        proto, transport = self.connect()
        proto.dataReceived(b"NAME worker1\nPING 1\nREPLICATE\n")
        nonce = self.challenge(transport)
        self.assertFalse(proto.identified)
        # An unproven connection is sent nothing: its REPLICATE waits.
        self.assertEqual([e[0] for e in self.handler.commands()], ["PING"])
        answer = proof.proof(SECRET, "hs.example", "worker1", nonce)
        proto.dataReceived(f"AUTH {answer}\nPOSITION caches worker1 0 1\n".encode())
        self.assertFalse(transport.disconnecting, transport.value())
        self.assertTrue(proto.proven)
        self.assertEqual(proto.instance_name, "worker1")
        self.assertIs(self.factory.holders["worker1"], proto)
        self.assertEqual([e[0] for e in self.handler.commands()],
                         ["PING", "NAME", "REPLICATE", "POSITION"])

    def test_a_recorded_proof_is_worth_nothing_on_another_connection(self):
        first, first_t = self.connect(4001)
        first.dataReceived(b"NAME worker1\n")
        recorded = proof.proof(SECRET, "hs.example", "worker1", self.challenge(first_t))
        first.connectionLost(None)
        before = refused("bad_proof")
        replay, replay_t = self.connect(4002)
        replay.dataReceived(f"NAME worker1\nAUTH {recorded}\n".encode())
        self.assertEqual(replay_t.value().decode().split("\n")[1],
                         "ERROR AUTH for worker1 refused: wrong proof")
        self.assertTrue(replay_t.disconnecting)
        self.assertFalse(replay.proven)
        self.assertEqual(refused("bad_proof"), before + 1)
        self.assertNotIn("NAME", [e[0] for e in self.handler.commands()])

    def test_an_unproven_connection_is_timed_out_and_locks_nobody_out(self):
        squatter, squatter_t = self.connect(4001)
        squatter.dataReceived(b"NAME worker1\nREPLICATE\n")
        real, real_t = self.connect(4002)
        real.dataReceived(b"NAME worker1\n")
        real.dataReceived(("AUTH " + proof.proof(SECRET, "hs.example", "worker1",
                                                 self.challenge(real_t)) + "\n").encode())
        self.assertTrue(real.proven)
        self.assertFalse(real_t.disconnecting)
        self.clock.advance(10.1)
        self.assertIn(b"ERROR AUTH not received within 10s\n", squatter_t.value())
        self.assertEqual(squatter.close_reason, "identify_timeout")
        self.assertFalse(real_t.disconnecting)

    def test_unasked_auth_is_refused(self):
        proto, transport = self.connect()
        proto.dataReceived(b"NAME reader\nAUTH " + b"ab" * 32 + b"\n")
        self.assertEqual(transport.value(), b"ERROR AUTH not asked for\n")
        self.assertTrue(transport.disconnecting)

    def test_names_without_a_secret_see_synapses_wire(self):
        # A Synapse worker (a reader, or a writer given no secret) is sent
        # nothing it does not know.
        for port, lines in ((4001, b"NAME synapse-worker\nPING 1\nREPLICATE\n"),
                            (4002, b"REPLICATE\n")):
            proto, transport = self.connect(port)
            proto.dataReceived(lines)
            self.assertNotIn(b"AUTH", transport.value())
            self.assertFalse(transport.disconnecting)

    def test_a_reload_that_binds_a_writer_closes_its_unproven_connection(self):
        self.factory.policy = PeerPolicy(reserved=frozenset({"master"}))
        proto, transport = self.connect()
        proto.dataReceived(b"NAME worker1\n")
        self.assertEqual(transport.value(), b"")
        self.assertEqual(self.factory.set_policy(POLICY), 1)
        self.assertEqual(transport.value(),
                         b"ERROR NAME worker1 must now prove itself (AUTH)\n")
        proto.connectionLost(None)
        # One in the middle of proving itself is left to finish.
        proving, proving_t = self.connect(4002)
        proving.dataReceived(b"NAME worker1\n")
        nonce = self.challenge(proving_t)
        self.assertEqual(self.factory.set_policy(POLICY), 0)
        proving.dataReceived(f"AUTH {proof.proof(SECRET, 'hs.example', 'worker1', nonce)}\n"
                             .encode())
        self.assertTrue(proving.proven)
        self.assertFalse(proving_t.disconnecting)


class ClientSideTests(SynchronousTestCase):
    """The worker's side: it holds its writes until it knows whether a
    proof is asked for, and sends AUTH only when asked."""

    def client(self, secret=SECRET):
        clock = Clock()
        clock.advance(T0)
        handler = ClientHandler()
        proto = ClientReplicationProtocol(handler, "worker1", "hs.example", clock=clock,
                                          secret=secret)
        transport = StringTransport()
        proto.makeConnection(transport)
        proto.dataReceived(b"SERVER hs.example\nPING 1\n")
        transport.clear()
        return proto, transport, clock, handler

    def released(self, handler):
        return [e for e in handler.events if e[0] == "writes_released"]

    def test_a_challenge_is_answered_and_the_writes_go_after_it(self):
        proto, transport, clock, handler = self.client()
        self.assertTrue(proto.writes_held)
        self.assertEqual(self.released(handler), [])
        nonce = "0123456789abcdef" * 2
        proto.dataReceived(f"AUTH_CHALLENGE {nonce}\n".encode())
        expected = proof.proof(SECRET, "hs.example", "worker1", nonce)
        self.assertEqual(transport.value(), f"AUTH {expected}\n".encode())
        # Released once AUTH is on the wire: our writes follow it.
        self.assertEqual(self.released(handler), [("writes_released", transport.value())])
        self.assertFalse(proto.writes_held)

    def test_a_server_that_does_not_ask_gets_the_writes_at_its_first_position(self):
        # A Synapse master (or ours, giving worker1 no secret) answers
        # REPLICATE without a challenge: nothing new is sent to it.
        proto, transport, clock, handler = self.client()
        proto.dataReceived(b"POSITION caches master 5 5\n")
        self.assertEqual(len(self.released(handler)), 1)
        self.assertEqual(transport.value(), b"")
        proto.dataReceived(b"POSITION caches master 5 6\n")
        self.assertEqual(len(self.released(handler)), 1)

    def test_a_server_that_says_nothing_gets_the_writes_after_ping_interval(self):
        proto, transport, clock, handler = self.client()
        clock.advance(proto._ping_interval - 0.1)
        self.assertEqual(self.released(handler), [])
        clock.advance(0.2)
        self.assertEqual(len(self.released(handler)), 1)

    def test_without_a_secret_nothing_is_held_nor_answered(self):
        proto, transport, clock, handler = self.client(secret=None)
        self.assertFalse(proto.writes_held)
        proto.dataReceived(b"AUTH_CHALLENGE " + b"ab" * 16 + b"\n")
        self.assertEqual(transport.value(), b"")
        self.assertEqual(self.released(handler), [])

    def test_a_challenge_that_is_no_nonce_is_not_signed(self):
        proto, transport, clock, handler = self.client()
        proto.dataReceived(b"AUTH_CHALLENGE not-a-nonce\n")
        self.assertEqual(transport.value(), b"ERROR AUTH_CHALLENGE: not a nonce\n")
        self.assertEqual(self.released(handler), [])


STREAMS = [
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": ["master", "worker1"]},
]


class HandlersTests(SynchronousTestCase):
    """Both handlers over iosim: the worker proves its NAME and its writes
    reach the master; an impostor's POSITION moves nothing."""

    def test_the_impostors_position_hides_no_fact(self):
        from replicator.config import parse_streams
        from replicator.consumers import MemoryConsumer

        harness = Harness(parse_streams(STREAMS), self.addCleanup)
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})  # it has read all
        master = harness.instance("master", consumers=[consumer])
        worker = harness.instance("worker1")
        # worker1 writes while its link is down: the master has not heard.
        token = harness.run(worker.stream("caches").write_fact([["f", None, 1]]))
        impostor, impostor_t = harness.serve(master, policy=POLICY)
        impostor.dataReceived(f"NAME worker1\nPOSITION caches worker1 0 {token}\n".encode())
        harness.settle()
        self.assertIn(b"has not proven its NAME", impostor_t.value())
        self.assertEqual(master.handler.reader_positions()[("caches", "worker1")], 0)
        # worker1 comes back and proves its NAME: the master catches up.
        factory = ReplicationServerFactory(master.handler, harness.server_name,
                                           clock=harness.clock, policy=POLICY)
        client = ClientReplicationProtocol(worker.handler, "worker1", harness.server_name,
                                           clock=harness.clock, secret=SECRET)
        link = harness.accept(factory, client)
        harness.settle()
        self.assertTrue(link.server.proven)
        self.assertEqual([f for f in consumer.facts if f[1] == "worker1"],
                         [("caches", "worker1", token, [["f", None, 1]])])


class ConfigTests(SynchronousTestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir, True)

    def secret_file(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def config(self, **replication):
        return parse_instance({
            "server_name": "hs.test", "instance_name": replication.pop("instance", "master"),
            "database": {"postgres": "dbname=x"},
            "replication": replication, "streams": STREAMS + [
                {"name": "events", "table": "event_stream", "columns": [{"e": "text"}],
                 "writers": ["master", "worker2"]}],
        })

    def error(self, **replication):
        with self.assertRaises(ConfigError) as e:
            validate(self.config(**replication), None)
        return str(e.exception)

    def test_secrets_are_read(self):
        path = self.secret_file("w1", SECRET + "\n")
        config = validate(self.config(listen="tcp:9092:interface=127.0.0.1",
                                      writer_secrets={"worker1": path}), None)
        self.assertEqual([(w.name, w.secret) for w in config.replication.writer_secrets],
                         [("worker1", SECRET)])
        self.assertNotIn(SECRET, repr(config))
        worker = validate(self.config(instance="worker1", upstream="tcp:host=m:port=9092",
                                      secret_file=path), None)
        self.assertEqual(worker.replication.secret, SECRET)

    def test_mistakes_are_one_line_naming_the_key(self):
        short = self.secret_file("short", "too-short\n")
        w1 = self.secret_file("w1", SECRET)
        same = self.secret_file("same", SECRET)
        listen = "tcp:9092:interface=127.0.0.1"
        for kwargs, key in (
                (dict(writer_secrets={"worker1": w1}), "replication.writer_secrets"),
                (dict(listen=listen, writer_secrets={"nobody": w1}),
                 "replication.writer_secrets.nobody"),
                (dict(listen=listen, writer_secrets={"master": w1}),
                 "replication.writer_secrets.master"),
                (dict(listen=listen, writer_secrets={"worker1": short}),
                 "replication.writer_secrets.worker1"),
                (dict(listen=listen, writer_secrets={"worker1": os.path.join(self.dir, "no")}),
                 "replication.writer_secrets.worker1"),
                (dict(listen=listen, writer_secrets={"worker1": w1, "worker2": same}),
                 "replication.writer_secrets.worker2"),
                (dict(listen=listen, writer_secrets=["worker1"]), "replication.writer_secrets"),
                (dict(listen=listen, writer_secrets={}), "replication.writer_secrets"),
                (dict(listen=listen, secret_file=w1), "replication.secret_file"),
                (dict(instance="worker1", upstream="tcp:host=m:port=9092", secret_file=short),
                 "replication.secret_file")):
            text = self.error(**kwargs)
            self.assertTrue(text.startswith(f"config: {key}: "), (kwargs, text))
            self.assertNotIn("\n", text)

    def test_check_names_each_unbound_remote_writer(self):
        w1 = self.secret_file("w1", SECRET)
        listen = "tcp:9092:interface=127.0.0.1"
        lines = unbound_writers(validate(self.config(listen=listen), None))
        self.assertEqual([line.split("'")[1] for line in lines], ["worker1", "worker2"])
        lines = unbound_writers(validate(self.config(listen=listen,
                                                     writer_secrets={"worker1": w1}), None))
        self.assertEqual(len(lines), 1)
        self.assertIn("remote writer 'worker2' (of events) proves nothing", lines[0])
        # A worker takes no writes: nothing to say.
        self.assertEqual(unbound_writers(self.config(instance="worker1",
                                                     upstream="tcp:host=m:port=9092")), [])


class AwayWriterTests(SynchronousTestCase):
    """The attack over real sockets: a master daemon giving worker1 a
    secret, an impostor, then a worker1 daemon proving its NAME."""

    def test_an_impostor_while_the_writer_is_away_hides_no_fact(self):
        from tests.fuzz import peers
        from tests.fuzz.results import PhaseResult
        from tests.servers import PostgresServer

        directory = tempfile.mkdtemp(prefix="away-writer-")
        self.addCleanup(shutil.rmtree, directory, True)
        result = PhaseResult("away")
        peers.away_writer(directory, PostgresServer.shared().create_database(), result)
        self.assertEqual(result.describe(), "")
        self.assertIs(result.figures["away_writer.impostor_refused"], True)
        self.assertIs(result.figures["away_writer.fact_delivered"], True)
        self.assertEqual(result.figures["away_writer.unproven_refusals"], 1.0)
