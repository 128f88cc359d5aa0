"""Replication through a redis-server that speaks only TLS (``--port 0
--tls-port``), with certificates made by the test: the ``tls:`` endpoint
string's trust roots and client certificate; a wrong CA or a missing client
certificate is one clear line per retry and harms no other instance; the
config checks a ``tls:`` client's files before anything starts."""

import os
import shutil
import tempfile

import yaml
from prometheus_client import REGISTRY
from twisted.internet import reactor
from twisted.logger import formatEvent
from twisted.trial.unittest import TestCase

from replicator.config import ConfigError, parse_replication, validate_replication
from tests.daemon import cli
from tests.operations_doc import doc_block
from tests.pki import make_pki
from tests.redis_nodes import KEYS, STREAMS, Node
from tests.servers import PostgresServer, RedisServer, free_port, unavailable
from tests.support import LogWatch, WatchedConsumer, create_stream_tables


def tls_redis(pki: dict, auth_clients: str = "yes", password: str = None) -> RedisServer:
    """A redis-server on a free loopback port that speaks only TLS, with the
    test CA's ``localhost`` certificate; ``auth_clients`` is its
    ``--tls-auth-clients``."""
    port = free_port()
    args = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", pki["server.crt"],
            "--tls-key-file", pki["server.key"], "--tls-ca-cert-file", pki["ca.crt"],
            "--tls-auth-clients", auth_clients]
    try:
        return RedisServer(password=password, args=args, port=port)
    except RuntimeError as e:  # e.g. a build without TLS: nothing listens
        unavailable(f"redis-server with TLS did not start: {e}")
        raise


def tls_endpoint(port: int, trust: str, cert: str = None, key: str = None) -> str:
    endpoint = f"tls:host=localhost:port={port}:trustRoots={trust}"
    if cert is not None:
        endpoint += f":certificate={cert}:privateKey={key}"
    return endpoint


class RedisTlsTests(TestCase):
    timeout = 120

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="replicator-redis-tls-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.pki = make_pki(self.tmp)
        self.redis = tls_redis(self.pki, password="tls-redis-secret")
        self.addCleanup(self.redis.stop)
        self.dsn = PostgresServer.shared().create_database()
        self.good = tls_endpoint(self.redis.port, self.pki["trust"], self.pki["client.crt"],
                                 self.pki["client.key"])

    async def _pair(self):
        consumer = WatchedConsumer(positions={k: 0 for k in KEYS})
        writer = await Node(self, self.dsn, "w1", self.redis, endpoint=self.good).start()
        reader = await Node(self, self.dsn, "r", self.redis, consumer,
                            endpoint=self.good).start()
        return writer, reader, consumer

    async def test_replication_over_tls_with_a_client_certificate(self):
        writer, reader, consumer = await self._pair()
        await writer.registry.get("caches").write_fact([["over tls", None, 1]])
        await consumer.until(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "w1", 1, [["over tls", None, 1]])])
        self.assertTrue(writer.link.connected and reader.link.connected)

    async def _refused(self, endpoint: str, expected: str):
        """An instance with ``endpoint`` retries with one line per retry
        matching ``expected`` (the TLS handshake's word), never joins, and
        the instances beside it go on replicating."""
        writer, reader, consumer = await self._pair()
        log = LogWatch(self)
        events = log.events
        refused = {link: REGISTRY.get_sample_value("replicator_redis_auth_refused_total",
                                                   {"link": link}) or 0
                   for link in ("subscriber", "publisher")}
        stranger = await Node(self, self.dsn, "w2", self.redis, endpoint=endpoint).start()

        def retries():
            return [formatEvent(e) for e in events
                    if "retry" in e and e.get("what", "").startswith("redis ")]

        await log.until(lambda: len(retries()) >= 4)
        for line in retries():
            self.assertRegex(line, rf"^redis (subscriber|publisher) localhost:{self.redis.port}: "
                                   rf"TLS: {expected}; retry \d+ in ")
        self.assertFalse(stranger.link.connected)
        # Not an AUTH refusal: the handshake failed before AUTH was answered.
        for link, count in refused.items():
            self.assertEqual(REGISTRY.get_sample_value("replicator_redis_auth_refused_total",
                                                       {"link": link}) or 0, count)
        # The others are untouched: a fact written now reaches the reader.
        await writer.registry.get("caches").write_fact([["still here", None, 2]])
        await consumer.until(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "w1", 1, [["still here", None, 2]])])
        self.flushLoggedErrors()

    async def test_a_wrong_ca_is_a_clear_line_per_retry_and_harms_nothing(self):
        # Trust roots that hold someone else's certificate, not the CA.
        wrong = os.path.join(self.tmp, "wrong-trust")
        os.makedirs(wrong)
        shutil.copy(self.pki["stranger.crt"], os.path.join(wrong, "stranger.pem"))
        await self._refused(tls_endpoint(self.redis.port, wrong, self.pki["client.crt"],
                                         self.pki["client.key"]),
                            "certificate verify failed")

    async def test_no_client_certificate_is_a_clear_line_per_retry(self):
        # --tls-auth-clients yes: redis-server ends the handshake.
        await self._refused(tls_endpoint(self.redis.port, self.pki["trust"]),
                            ".*certificate required")


class RedisTlsConfigTests(TestCase):
    """A ``tls:`` client's files are checked at config time: one line naming
    the key for what would make every handshake fail."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="replicator-redis-tls-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.pki = make_pki(self.tmp)

    def check(self, endpoint: str) -> None:
        validate_replication(parse_replication({"redis": {"endpoint": endpoint}}), reactor)

    def refused(self, endpoint: str) -> str:
        with self.assertRaises(ConfigError) as e:
            self.check(endpoint)
        text = str(e.exception)
        self.assertTrue(text.startswith("config: replication.redis.endpoint: "), text)
        self.assertNotIn("\n", text)
        return text

    def test_a_good_tls_client_passes(self):
        self.check(tls_endpoint(6380, self.pki["trust"], self.pki["client.crt"],
                                self.pki["client.key"]))
        self.check(tls_endpoint(6380, self.pki["trust"]))

    def test_trust_roots_must_be_a_directory_of_pem_certificates(self):
        empty = os.path.join(self.tmp, "empty")
        os.makedirs(empty)
        self.assertIn(f"trustRoots {empty} holds no *.pem certificate",
                      self.refused(tls_endpoint(6380, empty)))
        self.assertIn(f"trustRoots {self.pki['ca.crt']} is not a directory",
                      self.refused(tls_endpoint(6380, self.pki["ca.crt"])))

    def test_a_private_key_needs_its_certificate(self):
        endpoint = tls_endpoint(6380, self.pki["trust"]) + f":privateKey={self.pki['client.key']}"
        self.assertIn("privateKey= without certificate=", self.refused(endpoint))
        endpoint = tls_endpoint(6380, self.pki["trust"]) + f":certificate={self.pki['client.crt']}"
        self.assertIn(f"certificate {self.pki['client.crt']} holds no private key",
                      self.refused(endpoint))
        mismatched = tls_endpoint(6380, self.pki["trust"], self.pki["client.crt"],
                                  self.pki["stranger.key"])
        self.assertIn("do not match", self.refused(mismatched))


class OperationsPageTests(TestCase):
    """docs/operations.md, "Redis over TLS", tried as written: its
    redis.conf lines start the redis-server (the test's files and port in
    place of the page's), its ``replication.redis`` block passes
    ``replicator check`` and carries a fact from one instance to another;
    the same block with trust roots that hold no certificate is one line
    naming the key, exit 2."""

    timeout = 120

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="replicator-redis-tls-doc-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.pki = make_pki(self.tmp)
        self.dsn = PostgresServer.shared().create_database()

    def server_args(self, port: int) -> list:
        text = doc_block("redis-tls-server")
        for page, ours in (("/etc/redis/tls/redis.crt", self.pki["server.crt"]),
                           ("/etc/redis/tls/redis.key", self.pki["server.key"]),
                           ("/etc/redis/tls/ca.crt", self.pki["ca.crt"]),
                           ("tls-port 6380", f"tls-port {port}")):
            self.assertIn(page, text)
            text = text.replace(page, ours)
        return [arg for line in text.splitlines() if line.strip()
                for arg in ("--" + line.split()[0], *line.split()[1:])]

    def client_section(self, port: int) -> dict:
        text = doc_block("redis-tls")
        for page, ours in (("host=redis.example.com", "host=localhost"),
                           ("port=6380", f"port={port}"),
                           ("/etc/replicator/tls/ca", self.pki["trust"]),
                           ("/etc/replicator/tls/worker1.crt", self.pki["client.crt"]),
                           ("/etc/replicator/tls/worker1.key", self.pki["client.key"])):
            self.assertIn(page, text)
            text = text.replace(page, ours)
        return yaml.safe_load(text)["replication"]

    def check(self, replication: dict):
        config = {"server_name": "hs.test", "instance_name": "r",
                  "database": {"postgres": self.dsn}, "replication": replication,
                  "streams": [{"name": "caches", "table": "cache_stream",
                               "columns": [{"cache_func": "text"}, {"keys": "json?"},
                                           {"ts": "bigint"}],
                               "writers": ["w1", "w2"]}]}
        path = os.path.join(self.tmp, "r.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        return cli("check", "-c", path, cwd=self.tmp)

    async def test_the_page_as_written(self):
        port = free_port()
        replication = self.client_section(port)
        try:
            server = RedisServer(password=replication["redis"]["password"],
                                 args=self.server_args(port), port=port)
        except RuntimeError as e:
            unavailable(f"redis-server with TLS did not start: {e}")
        self.addCleanup(server.stop)
        create_stream_tables(self.dsn, STREAMS)
        checked = self.check(replication)
        self.assertEqual((checked.returncode, checked.stderr), (0, ""))
        endpoint = replication["redis"]["endpoint"]
        consumer = WatchedConsumer(positions={k: 0 for k in KEYS})
        writer = await Node(self, self.dsn, "w1", server, endpoint=endpoint).start()
        await Node(self, self.dsn, "r", server, consumer, endpoint=endpoint).start()
        await writer.registry.get("caches").write_fact([["as the page says", None, 1]])
        await consumer.until(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "w1", 1, [["as the page says", None, 1]])])
        # Trust roots without a certificate: one line naming the key.
        empty = os.path.join(self.tmp, "empty")
        os.makedirs(empty)
        replication["redis"]["endpoint"] = endpoint.replace(self.pki["trust"], empty)
        refused = self.check(replication)
        self.assertEqual(refused.returncode, 2)
        self.assertEqual(refused.stderr.count("\n"), 1, refused.stderr)
        self.assertTrue(refused.stderr.startswith(
            "replicator: config: replication.redis.endpoint: "), refused.stderr)
        self.assertIn(f"trustRoots {empty} holds no *.pem certificate", refused.stderr)

