"""``replicator check -c FILE`` over real processes: exit 0 and one line for
a file a start would accept, exit 2 and one line naming the key for one it
would refuse, and nothing changed in the database either way."""

import os
import tempfile

import psycopg2
import yaml
from twisted.trial.unittest import SynchronousTestCase

from replicator.storage import migrations
from tests.daemon import CACHES, SECRET, cli
from tests.servers import PostgresServer, free_port


class CheckTests(SynchronousTestCase):
    def write(self, config: dict) -> str:
        directory = tempfile.mkdtemp(prefix="replicator-check-")
        path = os.path.join(directory, "c.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        return path

    def config(self, database: dict, **extra) -> dict:
        config = {"server_name": "hs.test", "instance_name": "master",
                  "database": database,
                  "http": {"listen": f"tcp:{free_port()}:interface=127.0.0.1", "secret": SECRET},
                  "streams": [CACHES]}
        config.update(extra)
        return config

    def check(self, path):
        return cli("check", "-c", path, cwd=os.path.dirname(path))

    def assert_refused(self, result, start: str):
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertEqual(result.stderr.count("\n"), 1, result.stderr)
        self.assertTrue(result.stderr.startswith(f"replicator: {start}"), result.stderr)
        self.assertNotIn("Traceback", result.stderr + result.stdout)

    def test_sqlite_file_not_created(self):
        path = self.write(self.config({"sqlite": "state.db"}))
        result = self.check(path)
        self.assertEqual((result.returncode, result.stderr), (0, ""))
        self.assertTrue(result.stdout.startswith("replicator: config ok: instance master"),
                        result.stdout)
        self.assertFalse(os.path.exists(os.path.join(os.path.dirname(path), "state.db")))

    def test_config_mistakes(self):
        self.assert_refused(self.check(self.write(self.config({"sqlite": "s.db"}, bogus=1))),
                            "config: bogus: unknown key")
        tls = self.config({"sqlite": "s.db"}, replication={
            "listen": f"ssl:{free_port()}:interface=127.0.0.1:privateKey=/nonexistent.key:"
                      "certKey=/nonexistent.crt"})
        self.assert_refused(self.check(self.write(tls)), "config: replication.listen")

    def test_postgres(self):
        server = PostgresServer.shared()
        dsn = server.dsn(server.create_database("check"))
        # A fresh database: start would create the tables; check creates nothing.
        result = self.check(self.write(self.config({"postgres": dsn})))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("database reachable", result.stdout)
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM information_schema.tables "
                        "WHERE table_schema = current_schema()")
            self.assertEqual(cur.fetchone()[0], 0)
            # A table that lacks a configured column is what start refuses.
            cur.execute("CREATE TABLE cache_invalidation_stream (stream_id bigint, "
                        "instance_name text, cache_func text, invalidation_ts bigint)")
        conn.close()
        self.assert_refused(self.check(self.write(self.config({"postgres": dsn}))),
                            "config: streams[0].columns[1]: unknown column 'keys'")

    def test_a_read_only_stream_whose_writer_has_not_started_yet(self):
        """A worker checked before the master's first start (the order
        docs/operations.md gives): the master's tables are the master's to
        create, so check passes and says so; what is wrong still fails."""
        server = PostgresServer.shared()
        dsn = server.dsn(server.create_database("check"))
        reader = dict(CACHES, name="events", table="events_stream", writers=["master"])
        own = dict(CACHES, writers=["master", "worker1"])
        worker = {"instance_name": "worker1", "streams": [own, reader]}
        result = self.check(self.write(self.config({"postgres": dsn}, **worker)))
        self.assertEqual((result.returncode, result.stderr), (0, ""))
        self.assertEqual(result.stdout.split("; ")[2:], [
            "no replicator tables yet (start creates schema version "
            f"{migrations.CURRENT_VERSION})",
            "events_stream (stream events) is created by its writer (master) at its first "
            "start", "start this instance after it\n"])
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM information_schema.tables "
                        "WHERE table_schema = current_schema()")
            self.assertEqual(cur.fetchone()[0], 0)  # still nothing made
        conn.close()
        # A table nobody creates (create: false) must exist.
        foreign = dict(reader, create=False)
        self.assert_refused(
            self.check(self.write(self.config({"postgres": dsn}, instance_name="worker1",
                                              streams=[foreign]))),
            "config: streams[0].table: table 'events_stream' does not exist")
        # Once it exists, its columns and its sequence are checked.
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE events_stream (stream_id bigint, instance_name text, "
                        "cache_func text, keys jsonb, invalidation_ts bigint)")
        conn.close()
        self.assert_refused(self.check(self.write(self.config({"postgres": dsn}, **worker))),
                            "config: streams[1].sequence: sequence 'events_stream_seq' "
                            "does not exist")
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("CREATE SEQUENCE events_stream_seq")
            cur.execute("ALTER TABLE events_stream DROP COLUMN invalidation_ts")
        conn.close()
        self.assert_refused(self.check(self.write(self.config({"postgres": dsn}, **worker))),
                            "config: streams[1].columns[2]: unknown column 'invalidation_ts'")

    def test_a_writer_in_the_table_that_the_config_does_not_name(self):
        """``writers: [master, wroker1]`` while the table holds worker1's
        facts: check fails naming the stream, the value and the key."""
        server = PostgresServer.shared()
        dsn = server.dsn(server.create_database("check"))
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE cache_invalidation_stream (stream_id bigint, "
                        "instance_name text, cache_func text, keys jsonb, "
                        "invalidation_ts bigint)")
            cur.execute("CREATE SEQUENCE cache_invalidation_stream_seq")
            cur.execute("INSERT INTO cache_invalidation_stream VALUES "
                        "(1, 'master', 'f', NULL, 1), (2, 'worker1', 'f', NULL, 2), "
                        "(3, NULL, 'f', NULL, 3)")
        conn.close()
        typo = dict(CACHES, writers=["master", "wroker1"])
        result = self.check(self.write(self.config({"postgres": dsn}, streams=[typo])))
        self.assert_refused(result, "config: streams.caches.writers: stream 'caches': "
                                    "'worker1' wrote to table 'cache_invalidation_stream'")
        self.assertIn("['master', 'wroker1']", result.stderr)
        fixed = dict(CACHES, writers=["master", "worker1"])
        result = self.check(self.write(self.config({"postgres": dsn}, streams=[fixed])))
        self.assertEqual((result.returncode, result.stderr), (0, ""))

    def test_unbound_remote_writers_are_warned_about(self):
        server = PostgresServer.shared()
        dsn = server.dsn(server.create_database("check"))
        listen = {"listen": f"tcp:{free_port()}:interface=127.0.0.1"}
        streams = [dict(CACHES, writers=["master", "worker1", "worker2"])]
        path = self.write(self.config({"postgres": dsn}, streams=streams, replication=listen))
        result = self.check(path)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stderr.splitlines(), [
            f"replicator: warning: replication.writer_secrets: remote writer {w!r} (of caches) "
            f"proves nothing: any connection saying NAME {w} is taken for it (give it a "
            "secret, or set client_ca)" for w in ("worker1", "worker2")])
        self.assertIn("config ok", result.stdout)
        secret = os.path.join(os.path.dirname(path), "worker1.secret")
        with open(secret, "w") as f:
            f.write("worker1-secret-0123456789\n")
        result = self.check(self.write(self.config(
            {"postgres": dsn}, streams=streams,
            replication=dict(listen, writer_secrets={"worker1": secret}))))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual([line.split("'")[1] for line in result.stderr.splitlines()],
                         ["worker2"])

    def test_a_plaintext_listener_on_every_interface_is_warned_about(self):
        """``tcp:PORT`` binds every interface (Twisted's meaning): check
        says so as the start does, before anything listens."""
        port = free_port()
        config = self.config({"sqlite": "s.db"})
        config["http"]["listen"] = f"tcp:{port}"
        result = self.check(self.write(config))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stderr.splitlines(), [
            f"replicator: warning: http.listen: HTTP listener tcp:{port} is plaintext on a "
            "non-loopback address: anyone who can reach it can read positions and metrics, "
            "and anyone on the path can read the Bearer secret that writes send"])

    def test_unreachable_database(self):
        port = free_port()
        result = self.check(self.write(self.config({
            "postgres": f"host=127.0.0.1 port={port} dbname=x user=x password=hidden-pw "
                        "connect_timeout=5"})))
        self.assert_refused(result, "database.postgres: cannot connect")
        self.assertNotIn("hidden-pw", result.stderr)


class RedisTrustTests(SynchronousTestCase):
    """``replicator check`` says when our own Redis channels are open to
    any publisher, and checks the key files of ``replication.redis.keys``."""

    def test_unauthenticated_channels_are_said(self):
        from tests.redis_signing_keys import write_keys

        checks = CheckTests()
        redis = {"endpoint": "tcp:host=127.0.0.1:port=6379"}
        result = checks.check(checks.write(checks.config(
            {"sqlite": "s.db"}, replication={"redis": redis})))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("WARNING: our own Redis channels are unauthenticated", result.stdout)
        self.assertEqual(result.stdout.count("\n"), 1)
        paths = write_keys(tempfile.mkdtemp(), "master")
        keyed = dict(redis, keys={"private_key": paths["master"][0]})
        result = checks.check(checks.write(checks.config(
            {"sqlite": "s.db"}, replication={"redis": keyed})))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertNotIn("WARNING", result.stdout)
        upgrading = dict(redis, keys={"private_key": paths["master"][0],
                                      "accept_unsigned": True})
        result = checks.check(checks.write(checks.config(
            {"sqlite": "s.db"}, replication={"redis": upgrading})))
        self.assertIn("WARNING: replication.redis.keys.accept_unsigned", result.stdout)
        missing = dict(redis, keys={"private_key": "/nonexistent.key"})
        checks.assert_refused(checks.check(checks.write(checks.config(
            {"sqlite": "s.db"}, replication={"redis": missing}))),
            "config: replication.redis.keys.private_key: cannot read /nonexistent.key")
