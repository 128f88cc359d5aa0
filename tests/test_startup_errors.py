"""Careless or hostile configs and failed startups, through the real CLI.

Each mistake must end ``replicator run`` with one line on stderr naming the
key: exit 2 for a config mistake (nothing listened, nothing was created),
exit 1 for a runtime failure (port in use, database unreachable).  Never a
traceback, never a silent start with an absurd value.
"""

import os
import shutil
import socket
import subprocess
import tempfile

import yaml
from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator.config import parse_instance
from replicator.daemon.service import Instance
from replicator.daemon.startup import StartupError
from tests.daemon import CACHES, SECRET, cli
from tests.servers import free_port


def base(**change):
    config = {"server_name": "hs", "instance_name": "master",
              "database": {"sqlite": "x.db"}, "streams": [dict(CACHES)]}
    config.update(change)
    return config


def stream(**change):
    return base(streams=[dict(CACHES, **change)])


class ConfigMistakeTests(SynchronousTestCase):
    """Exit 2, one line naming the key, and nothing created."""

    CASES = [
        # Names ending in a newline would split a line on the wire.
        (base(server_name="localhost\n"),
         "config: server_name: 'localhost\\n' is not a name without spaces"),
        (base(instance_name="master\n"),
         "config: instance_name: 'master\\n' is not a name without spaces"),
        (stream(name="caches\n"),
         "config: streams[0].name: 'caches\\n' is not a name without spaces"),
        (stream(writers=["master\n"]),
         "config: streams[0].writers[0]: 'master\\n' is not an instance name"),
        (stream(table="cache_stream\n"),
         "config: streams[0].table: 'cache_stream\\n' is not an SQL identifier"),
        (stream(columns=[{"keys\n": "json"}]),
         "config: streams[0].columns[0]: 'keys\\n' is not a valid column name"),
        (base(server_name="hs\x1b[2J"),
         "config: server_name: 'hs\\x1b[2J' is not a name without spaces"),
        (base(http={"listen": "tcp:0", "secret": SECRET, "metrics_listen": "127.0.0.1:9\n"}),
         "config: http.metrics_listen: expected host:port, got '127.0.0.1:9\\n'"),
        # Durable Streams created over HTTP: fixed columns, one writer.
        (base(streams=[{"name": "ds", "table": "ds_ops", "durable_streams": "yes",
                        "writers": ["master"]}]),
         "config: streams[0].durable_streams: expected true or false, got str"),
        (base(streams=[{"name": "ds", "table": "ds_ops", "durable_streams": True,
                        "writers": ["master"], "columns": [{"a": "text"}]}]),
         "config: streams[0].columns: not given for a stream with durable_streams: true "
         "(its columns are fixed, its retention is the TTL)"),
        (base(streams=[{"name": "ds", "table": "ds_ops", "durable_streams": True,
                        "writers": ["master", "w1"]}]),
         "config: streams[0].writers: a stream with durable_streams: true has one writer: "
         "the instance that creates and appends"),
        (base(streams=[{"name": "ds", "table": "ds_ops", "durable_streams": True,
                        "writers": ["master"], "foreign_writers": True}]),
         "config: streams[0].foreign_writers: a stream with durable_streams: true is written "
         "over HTTP only (its writes of a path are checked and ordered there)"),
        (base(http={"listen": "tcp:0:interface=127.0.0.1", "secret": SECRET,
                    "ds_long_poll": 31}),
         "config: http.ds_long_poll: must be a number from 0.1 to 30, got 31"),
        # A key with a newline is still one line.
        (base(**{"bo\ngus": 1}), "config: 'bo\\ngus': unknown key"),
        # Every number has a range; NaN and infinity are not numbers.
        (base(replication={"ping_interval": float("nan")}),
         "config: replication.ping_interval: must be a number from 0.1 to 300, got nan"),
        (base(replication={"ping_timeout": float("inf")}),
         "config: replication.ping_timeout: must be a number from 1 to 3600, got inf"),
        (base(replication={"fanout_interval": float("-inf")}),
         "config: replication.fanout_interval: must be a number from 0 to 1, got -inf"),
        (base(replication={"max_queued_lines": 10 ** 30}),
         "config: replication.max_queued_lines: must be an integer from 1 to 10000000, "
         "got 1000000000000000000000000000000"),
        (base(replication={"max_queued_lines": 1e30}),
         "config: replication.max_queued_lines: expected an integer, got float"),
        (base(replication={"max_line_length": 1 << 40}),
         "config: replication.max_line_length: must be an integer from 1024 to 16777216, "
         "got 1099511627776"),
        (base(replication={"fetch_limit": 10 ** 9}),
         "config: replication.fetch_limit: must be an integer from 1 to 100000, "
         "got 1000000000"),
        (base(database={"postgres": "host=127.0.0.1", "pool_max": 1000000}),
         "config: database.pool_max: must be an integer from 1 to 100, got 1000000"),
        (base(database={"postgres": "password=hunter2 host"}),
         "config: database.postgres: is not a valid connection string (key=value pairs or a "
         "postgresql:// URI)"),
        (base(replication={"redis": {"endpoint": "tcp:host=127.0.0.1:port=6379",
                                     "dbid": 10 ** 12}}),
         "config: replication.redis.dbid: must be an integer from 0 to 65535, "
         "got 1000000000000"),
        # Table and column names are written into SQL unquoted.
        (stream(table="select"),
         "config: streams[0].table: 'select' is an SQL keyword"),
        (stream(columns=[{"Order": "text"}]),
         "config: streams[0].columns[0]: 'Order' is an SQL keyword"),
        (stream(sequence="table"),
         "config: streams[0].sequence: 'table' is an SQL keyword"),
        (stream(table="stream_positions"),
         "config: streams[0].table: 'stream_positions' is the replicator's own table"),
        (stream(id_column="instance_name"),
         "config: streams[0].writer_column: must differ from id_column ('instance_name')"),
        (stream(sequence="cache_invalidation_stream"),
         "config: streams[0].sequence: 'cache_invalidation_stream' is also a table "
         "(streams[0].table)"),
        # Endpoints Twisted parses but could never listen on.
        (base(http={"listen": "tcp:70000:interface=127.0.0.1", "secret": SECRET}),
         "config: http.listen: port 70000 is not from 0 to 65535"),
        (base(replication={"listen": "tcp:9092:interface=not-an-address"}),
         "config: replication.listen: interface 'not-an-address' is not an IP address"),
        # Secure by default: no port 443, no server.pem, no open door.
        (base(replication={"listen": "tls:"}),
         "config: replication.listen: a tls: listener needs the directory of its PEM files "
         "(private key and certificate) first: tls:DIRECTORY:PORT"),
        (base(http={"listen": "tcp:interface=127.0.0.1", "secret": SECRET}),
         "config: http.listen: cannot parse endpoint 'tcp:interface=127.0.0.1': no port"),
        (base(http={"listen": "ssl:9093:interface=127.0.0.1", "secret": SECRET}),
         "config: http.listen: an ssl: listener needs privateKey= (its key file; certKey= "
         "too if the certificate is in another file)"),
        (base(replication={"listen": "tcp:9092"}),
         "config: replication.listen: listens beyond loopback with neither client_ca nor "
         "allowed_networks, so anyone who reaches it reads every fact: bind it to 127.0.0.1, "
         "set client_ca or allowed_networks, or set replication.insecure_public_listener: "
         "true"),
    ]

    def test_each_mistake_is_one_line_and_exit_2(self):
        tmp = tempfile.mkdtemp()
        for i, (config, message) in enumerate(self.CASES):
            path = os.path.join(tmp, f"c{i}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(config, f)
            try:
                result = cli("run", "-c", path, cwd=tmp, timeout=30)
            except subprocess.TimeoutExpired:
                self.fail(f"started instead of refusing: {message}")
            self.assertEqual((result.returncode, result.stderr, result.stdout),
                             (2, f"replicator: {message}\n", ""), message)
        self.assertFalse(os.path.exists(os.path.join(tmp, "x.db")))

    def test_a_file_nested_too_deep(self):
        tmp = tempfile.mkdtemp()
        path = os.path.join(tmp, "deep.yaml")
        with open(path, "wb") as f:
            f.write(b"server_name: hs\nx: " + b"[" * 5000 + b"]" * 5000 + b"\n")
        result = cli("run", "-c", path, cwd=tmp)
        self.assertEqual((result.returncode, result.stderr), (2, (
            f"replicator: config: file: {path} nests too deeply to be a config\n")))

    def test_a_file_that_is_not_utf8(self):
        tmp = tempfile.mkdtemp()
        path = os.path.join(tmp, "latin1.yaml")
        with open(path, "wb") as f:
            f.write(b"server_name: caf\xe9\ninstance_name: master\n")
        result = cli("run", "-c", path, cwd=tmp)
        self.assertEqual((result.returncode, result.stderr), (2, (
            f"replicator: config: file: {path} is not UTF-8 text: byte 0xe9 at offset 16\n")))


class RuntimeFailureTests(SynchronousTestCase):
    """Exit 1, one line naming what failed, no traceback."""

    def run_config(self, config):
        tmp = tempfile.mkdtemp()
        path = os.path.join(tmp, "c.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        return cli("run", "-c", path, cwd=tmp)

    def assert_one_line(self, result, message):
        self.assertEqual((result.returncode, result.stderr), (1, f"replicator: {message}\n"))
        self.assertNotIn("Traceback", result.stdout)
        self.assertNotIn("FirstError", result.stdout)
        # Said once (a terminal shows the log and stderr together), with no
        # shutdown lines for an instance that never started.
        self.assertNotIn(message, result.stdout)
        self.assertNotIn("stopping", result.stdout)
        self.assertNotIn("stopped", result.stdout)

    def test_port_in_use(self):
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            for section, listen in (
                    ("http", {"listen": f"tcp:{port}:interface=127.0.0.1", "secret": SECRET}),
                    ("replication", {"listen": f"tcp:{port}:interface=127.0.0.1"})):
                result = self.run_config(base(**{section: listen}))
                self.assert_one_line(
                    result, f"{section}.listen: cannot listen on "
                            f"tcp:{port}:interface=127.0.0.1: address already in use")

    def test_database_unreachable(self):
        port = free_port()
        result = self.run_config(base(database={
            "postgres": f"host=127.0.0.1 port={port} dbname=x user=x password=hidden-pw "
                        "connect_timeout=5"}))
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertEqual(result.stderr.count("\n"), 1, result.stderr)
        self.assertTrue(result.stderr.startswith(
            "replicator: database.postgres: cannot connect: connection to server at "
            f'"127.0.0.1", port {port} failed: Connection refused'), result.stderr)
        self.assertNotIn("hidden-pw", result.stderr + result.stdout)
        self.assertNotIn("Traceback", result.stdout)


class InstanceStartFailureTests(TestCase):
    """``Instance.start`` failing in process: one StartupError naming the key
    (exit code 1), and after ``stop`` nothing of it is left: no listener
    (its port binds again), no open database pool, no timer on the reactor
    beyond those there before."""

    def instance(self, **change):
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp, True)
        config = base(database={"sqlite": os.path.join(tmp, "x.db")}, **change)
        return Instance(parse_instance(config), reactor)

    async def assert_start_fails(self, instance, message):
        before = set(reactor.getDelayedCalls())
        try:
            await instance.start()
        except StartupError as e:
            self.assertEqual((str(e), e.code), (message, 1))
        else:
            self.fail("start did not fail")
        finally:
            await instance.stop()
        self.assertFalse(instance.services.running)
        self.assertFalse(instance.db.pool.running)
        # Timers of the instance are gone (a stopped pool's or the logger's
        # may fire once more: only ours are counted).
        left = [c for c in reactor.getDelayedCalls() if c not in before and c.active()
                and "replicator" in repr(c.func)]
        self.assertEqual(left, [])

    async def test_port_in_use(self):
        replication_port = free_port()
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            instance = self.instance(
                replication={"listen": f"tcp:{replication_port}:interface=127.0.0.1"},
                http={"listen": f"tcp:{port}:interface=127.0.0.1", "secret": SECRET})
            await self.assert_start_fails(
                instance, f"http.listen: cannot listen on tcp:{port}:interface=127.0.0.1: "
                          "address already in use")
        # The replication listener that did bind is closed again.
        with socket.socket() as again:
            again.bind(("127.0.0.1", replication_port))

    async def test_endpoint_that_cannot_listen(self):
        """An endpoint string that parses and validates but names a socket in
        a directory that does not exist."""
        path = os.path.join(tempfile.mkdtemp(), "missing", "replication.sock")
        instance = self.instance(replication={"listen": f"unix:{path}"})
        await self.assert_start_fails(
            instance, f"replication.listen: cannot listen on unix:{path}: "
                      "no such file or directory")

    async def test_database_lost_during_start(self):
        """PostgreSQL restarting while the streams load (after the first
        query answered): the documented exit for a database that is not
        there, one line naming ``database.postgres``, exit 1 (a chaos run
        found a traceback and "startup failed")."""
        from tests.servers import PostgresServer

        server = PostgresServer.shared()
        dsn = server.dsn(server.create_database("lostatstart"))
        instance = Instance(parse_instance(base(database={"postgres": dsn})), reactor)

        async def lost():
            await instance.db.runInteraction(
                lambda txn: txn.execute("SELECT pg_terminate_backend(pg_backend_pid())"))
        instance.registry.start = lost
        with self.assertRaises(StartupError) as caught:
            await instance.start()
        await instance.stop()
        e = caught.exception
        self.assertEqual((e.key, e.code), ("database.postgres", 1))
        self.assertTrue(e.problem.startswith("lost during start: "), e.problem)
        self.assertFalse(instance.db.pool.running)
        self.flushLoggedErrors()

    async def test_database_unreachable(self):
        port = free_port()
        instance = Instance(parse_instance(base(database={
            "postgres": f"host=127.0.0.1 port={port} dbname=x user=x password=hidden-pw "
                        "connect_timeout=5"})), reactor)
        before = set(reactor.getDelayedCalls())
        with self.assertRaises(StartupError) as caught:
            await instance.start()
        await instance.stop()
        e = caught.exception
        self.assertEqual((e.key, e.code), ("database.postgres", 1))
        self.assertTrue(e.problem.startswith(
            "cannot connect: connection to server at "
            f'"127.0.0.1", port {port} failed: Connection refused'), e.problem)
        self.assertNotIn("hidden-pw", str(e))
        self.assertFalse(instance.db.pool.running)
        self.assertEqual([c for c in reactor.getDelayedCalls()
                          if c not in before and c.active() and "replicator" in repr(c.func)],
                         [])
