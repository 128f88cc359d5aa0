"""TLS replication with a throwaway CA made by the test: client certificates
required by the master, hostname verification by the worker."""

import socket
import ssl as stdlib_ssl
import tempfile

from twisted.internet import reactor, task
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent
from twisted.trial.unittest import TestCase

from replicator.config import ConfigError, parse_replication, validate_replication
from replicator.consumers import MemoryConsumer
from replicator.net.tls import server_endpoint
from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.transport.tcp import ReplicationServerFactory, upstream_service
from tests.pki import make_pki
from tests.servers import free_port
from tests.support import LogWatch, Waits, WatchedConsumer


class TlsTests(TestCase):
    timeout = 60

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.pki = make_pki(self.tmp)
        self.port = free_port()
        self.listen = (f"ssl:{self.port}:interface=127.0.0.1:privateKey={self.pki['server.key']}"
                       f":certKey={self.pki['server.crt']}")

    def test_config_checks_client_ca(self):
        with self.assertRaises(ConfigError) as e:
            parse_replication({"listen": "tcp:9092", "client_ca": self.pki["ca.crt"]})
        self.assertEqual(str(e.exception),
                         "config: replication.client_ca: needs an ssl: listener in "
                         "replication.listen")
        missing = parse_replication({"listen": self.listen, "client_ca": "/nonexistent/ca.pem"})
        with self.assertRaises(ConfigError) as e:
            validate_replication(missing, reactor)
        self.assertIn("config: replication.client_ca:", str(e.exception))
        config = parse_replication({"listen": self.listen, "client_ca": self.pki["ca.crt"]})
        validate_replication(config, reactor)
        self.assertEqual(config.client_ca, self.pki["ca.crt"])

    def _raw_tls(self, cert=None, key=None, send=b"NAME probe\nREPLICATE\n", until=b"POSITION"):
        """A plain TLS client; returns what the server sent, up to ``until``
        or the close, or the error."""
        context = stdlib_ssl.create_default_context(cafile=self.pki["ca.crt"])
        if cert:
            context.load_cert_chain(cert, key)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=30) as raw:
                with context.wrap_socket(raw, server_hostname="localhost") as s:
                    s.sendall(send)
                    data = b""
                    while until not in data:
                        chunk = s.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    return data
        except (stdlib_ssl.SSLError, OSError) as e:
            return e

    async def test_client_certificates_required_and_hostname_verified(self):
        from replicator.config import parse_database, parse_streams
        from replicator.storage.database import Database
        from replicator.streams.registry import StreamRegistry
        from tests.servers import PostgresServer

        dsn = PostgresServer.shared().create_database()
        streams = parse_streams([{"name": "caches", "table": "cache_stream",
                                  "columns": [{"f": "text"}], "writers": ["master"]}])

        async def instance(name, consumers=()):
            db = Database(parse_database({"postgres": dsn}))
            self.addCleanup(db.close)
            registry = StreamRegistry(db, name, streams, reactor=reactor)
            await registry.start()
            self.addCleanup(registry.stop)
            handler = ReplicationHandler(registry, name, "localhost", consumers)
            handler.start()
            return registry, handler

        registry, master = await instance("master")
        port = await server_endpoint(reactor, self.listen, self.pki["ca.crt"]).listen(
            ReplicationServerFactory(master, "localhost", clock=reactor))
        self.addCleanup(port.stopListening)

        # A client with a certificate from our CA gets the handshake.
        good = await deferToThread(self._raw_tls, self.pki["client.crt"],
                                   self.pki["client.key"])
        self.assertIsInstance(good, bytes, good)
        self.assertTrue(good.startswith(b"SERVER localhost\n"), good)
        self.assertIn(b"POSITION caches master 0 0", good)
        # No certificate, or one from another CA: refused before any command.
        for cert, key in ((None, None), (self.pki["stranger.crt"], self.pki["stranger.key"])):
            bad = await deferToThread(self._raw_tls, cert, key)
            self.assertFalse(isinstance(bad, bytes) and b"SERVER" in bad, bad)

        # Our own worker over tls: with hostname verification replicates.
        consumer = WatchedConsumer(positions={("caches", "master"): 0})
        _, worker = await instance("worker1", [consumer])
        upstream = (f"tls:localhost:{self.port}:trustRoots={self.pki['trust']}"
                    f":certificate={self.pki['client.crt']}:privateKey={self.pki['client.key']}")
        client = upstream_service(reactor, upstream, worker, "worker1", "localhost",
                                  initial_delay=0.05, max_delay=0.2)
        client.startService()
        self.addCleanup(client.stopService)
        await registry.get("caches").write_fact([["over tls"]])
        await consumer.until(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "master", 1, [["over tls"]])])
        # As an instance stops: peers told, then the upstream service
        # stopped before it can reconnect.
        worker.stop()
        await client.stopService()
        # A name the certificate does not carry is refused by the worker.
        consumer2 = MemoryConsumer(positions={("caches", "master"): 0})
        _, worker2 = await instance("worker2", [consumer2])
        wrong = (f"tls:127.0.0.1:{self.port}:trustRoots={self.pki['trust']}"
                 f":certificate={self.pki['client.crt']}:privateKey={self.pki['client.key']}")
        log = LogWatch(self)
        events = log.events
        client2 = upstream_service(reactor, wrong, worker2, "worker2", "localhost",
                                   initial_delay=0.05, max_delay=0.2)
        client2.startService()
        self.addCleanup(client2.stopService)
        # Each retry says why, in a few words: what the TLS handshake said.
        await log.until(lambda: sum("retry" in e for e in events) >= 2)
        retries = [formatEvent(e) for e in events if "retry" in e]
        for line in retries:
            self.assertRegex(line, rf"^upstream 127\.0\.0\.1:{self.port}: TLS: "
                                   r"the certificate is not for 127\.0\.0\.1; retry \d+ in ")
        # A TLS client's protocol is connected before the handshake: an
        # attempt may be under way, but none ever heard the server.
        self.assertEqual([c for c in worker2.connections if c.instance_name is not None], [])
        self.assertEqual(consumer2.facts, [])
        self.flushLoggedErrors()

    async def test_name_is_bound_to_the_client_certificate(self):
        """With client_ca, a peer is the name its certificate carries: a
        certificate for worker1 cannot say NAME master or NAME worker2, and a
        certificate for worker9 cannot pose as the writer worker1 to get
        forged RDATA relayed to the readers or delivered."""
        from twisted.internet.testing import StringTransport

        from replicator.config import parse_database, parse_streams
        from replicator.replication.transport.peers import local_names, policy_from_config
        from replicator.replication.transport.protocol import ServerReplicationProtocol
        from replicator.storage.database import Database
        from replicator.streams.registry import StreamRegistry
        from tests.servers import PostgresServer

        dsn = PostgresServer.shared().create_database()
        streams = parse_streams([{"name": "caches", "table": "cache_stream",
                                  "columns": [{"f": "text"}],
                                  "writers": ["master", "worker1"]}])
        db = Database(parse_database({"postgres": dsn}))
        self.addCleanup(db.close)
        registry = StreamRegistry(db, "master", streams, reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        consumer = MemoryConsumer(positions={("caches", "worker1"): 0})
        master = ReplicationHandler(registry, "master", "localhost", [consumer])
        master.start()
        config = parse_replication({"listen": self.listen, "client_ca": self.pki["ca.crt"]})
        policy = policy_from_config(config, local_names(master))
        port = await server_endpoint(reactor, self.listen, self.pki["ca.crt"]).listen(
            ReplicationServerFactory(master, "localhost", clock=reactor, policy=policy))
        self.addCleanup(port.stopListening)
        # An honest reader of the master.
        reader = ServerReplicationProtocol(master, "localhost", policy=policy,
                                           clock=task.Clock())
        reader_transport = StringTransport()
        reader.makeConnection(reader_transport)
        reader.dataReceived(b"REPLICATE\n")
        self.addCleanup(reader.connectionLost, None)

        def exchange(who, send):
            return deferToThread(self._raw_tls, self.pki[f"{who}.crt"],
                                 self.pki[f"{who}.key"], send, b"\x00")

        for who, name, error in (
                ("client", b"master", b"ERROR NAME is taken by the server\n"),
                ("client", b"worker2", b"ERROR NAME does not match the client certificate\n"),
                ("intruder", b"worker1",
                 b"ERROR NAME does not match the client certificate\n")):
            got = await exchange(who, b"NAME " + name + b"\nPOSITION caches worker1 0 1\n"
                                 b'RDATA caches worker1 1 ["forged"]\n'
                                 b"POSITION caches worker1 1 1\n")
            self.assertIsInstance(got, bytes, repr(got))
            self.assertTrue(got.endswith(error), (who, name, got))
        # The names a certificate carries are accepted: CN and DNS SAN.
        for who, name in (("client", b"worker1"), ("alias", b"worker2")):
            got = await deferToThread(self._raw_tls, self.pki[f"{who}.crt"],
                                      self.pki[f"{who}.key"],
                                      b"NAME " + name + b"\nREPLICATE\n")
            self.assertIsInstance(got, bytes, repr(got))
            self.assertIn(b"POSITION caches master 0 0", got)
            self.assertNotIn(b"ERROR", got)
        # Whatever the forged lines started (a check of the sequence) ends.
        self.assertTrue(await master.drain())
        relayed = [line for line in reader_transport.value().splitlines()
                   if b"worker1" in line]
        self.assertEqual(relayed, [b"POSITION caches worker1 0 0"])
        self.assertEqual(consumer.facts, [])


class ReloadedCertificateTests(TestCase):
    """A reload reads an ``ssl:`` listener's files again: new connections get
    the new certificate, an open connection keeps its own and stays open."""

    timeout = 60

    async def test_new_connections_use_the_new_certificate(self):
        from replicator.daemon.listening import ListeningService
        from tests.handlers import RecordingHandler

        class Handler(RecordingHandler):
            instance_name = "master"
            registry = ()
            known_names = frozenset({"master"})

            def __init__(self):
                super().__init__()
                self.waits = Waits()

            def new_connection(self, conn):
                self.events.append(("new_connection", conn.address))

            def on_PING(self, conn, cmd):
                self.events.append(("PING", cmd))
                self.waits.check()

        tmp = tempfile.mkdtemp()
        pki = make_pki(tmp)
        port = free_port()
        factory = ReplicationServerFactory(Handler(), "hs.example", clock=reactor)
        service = ListeningService(
            reactor, f"ssl:{port}:interface=127.0.0.1:privateKey={pki['server.key']}"
                     f":certKey={pki['server.crt']}", factory, "replication")
        service.startService()
        await service.listening
        self.addCleanup(service.stopService)
        # The client only looks at which certificate it is shown.
        context = stdlib_ssl.SSLContext(stdlib_ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = stdlib_ssl.CERT_NONE

        def open_connection():
            raw = socket.create_connection(("127.0.0.1", port), timeout=30)
            s = context.wrap_socket(raw, server_hostname="localhost")
            s.recv(4096)  # SERVER hs.example
            return s

        def certificate_of_a_new_connection():
            with open_connection() as s:
                return s.getpeercert(binary_form=True)

        first = await deferToThread(open_connection)
        self.addCleanup(first.close)
        before = first.getpeercert(binary_form=True)
        # The certificate is renewed in place (a new key and certificate).
        renewed = make_pki(tempfile.mkdtemp())
        for name in ("server.key", "server.crt"):
            with open(renewed[name], "rb") as src, open(pki[name], "wb") as dst:
                dst.write(src.read())
        self.assertEqual(await deferToThread(certificate_of_a_new_connection), before)
        self.assertTrue(service.tls.take(await deferToThread(service.tls.read, None)))
        after = await deferToThread(certificate_of_a_new_connection)
        self.assertNotEqual(after, before)
        # The open connection was never closed.
        await deferToThread(first.sendall, b"PING 1\n")
        await factory.handler.waits.wait(
            lambda: ("PING", ) in [e[:1] for e in factory.handler.events])
        opened = [p for p in factory.live if p.close_reason is None]
        self.assertEqual(len(opened), 1)
        self.assertEqual([e[0] for e in factory.handler.events].count("new_connection"), 3)
