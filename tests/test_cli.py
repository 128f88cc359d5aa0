"""The CLI end to end, on real processes: config errors, run / write / tail /
positions, a clean SIGTERM, the jsonl consumer across kill -9, and a master
with two workers over TCP on PostgreSQL with every metric present and moving."""

import json
import os
import signal
import subprocess
import tempfile

import yaml
from twisted.trial.unittest import SynchronousTestCase

from tests.daemon import CACHES, PY, SECRET, Daemon, base_config, cli, http, tail_of_a_server
from tests.servers import PostgresServer, free_port, wait_for
from tests.support import as_sets, table_facts


class ConfigErrorTests(SynchronousTestCase):
    CASES = [
        ({"bogus": 1}, "config: bogus: unknown key"),
        ({"http": {"lisen": "tcp:0"}}, "config: http.lisen: unknown key (did you mean 'listen'?)"),
        ({"replication": {"listen": "tcp:9092:interfac=127.0.0.1"}},
         "config: replication.listen: a tcp: listener has no option 'interfac' (did you mean "
         "'interface'?); its options: port, interface, backlog"),
        ({"replication": {"upstream": "tcp:host=127.0.0.1:port=9092:timout=5"}},
         "config: replication.upstream: a tcp: client has no option 'timout' (did you mean "
         "'timeout'?); its options: host, port, timeout, bindAddress"),
        ({"replication": {"ping_intervall": 5}},
         "config: replication.ping_intervall: unknown key (did you mean 'ping_interval'?)"),
        ({"replication": {"ping_timeout": "soon"}},
         "config: replication.ping_timeout: expected a number, got str"),
        ({"consumers": [{"type": "log", "streams": ["nope"]}]},
         "config: consumers[0].streams[0]: unknown stream 'nope'"),
        ({"http": {"listen": "tcp:0", "secret_file": "/nonexistent/secret"}},
         "config: http.secret_file: cannot read secret file /nonexistent/secret: "
         "No such file or directory"),
        ({"replication": {"listen": "tcp:notaport"}},
         "config: replication.listen: cannot parse endpoint 'tcp:notaport': invalid literal "
         "for int() with base 10: 'notaport'"),
        ({"streams": [dict(CACHES, columns=[{"x": "float"}])]},
         "config: streams[0].columns[0].x: unknown type 'float' (one of text, bigint, "
         "boolean, json, '?' for nullable)"),
        ({"replication": {"max_queued_bytes": 1000}},
         "config: replication.max_queued_bytes: must be an integer from 65536 to 2147483648, "
         "got 1000"),
        ({"replication": {"idle_timeout": float("nan")}},
         "config: replication.idle_timeout: must be a number from 1 to 86400, got nan"),
        ({"replication": {"max_connections": 0}},
         "config: replication.max_connections: must be an integer from 1 to 65536, got 0"),
        ({"replication": {"max_connections": 10**9}},
         "config: replication.max_connections: must be an integer from 1 to 65536, "
         "got 1000000000"),
        ({"replication": {"reconnect_initial_delay": 5, "reconnect_max_delay": 1}},
         "config: replication.reconnect_max_delay: must be at least reconnect_initial_delay (5s)"),
        ({"replication": {"allowed_networks": ["10.0.0.1/8"]}},
         "config: replication.allowed_networks[0]: 10.0.0.1/8 has host bits set"),
        ({"replication": {"allowed_peers": ["worker 1"]}},
         "config: replication.allowed_peers[0]: 'worker 1' is not an instance name"),
        ({"replication": {"max_user_ips": 1e30}},
         "config: replication.max_user_ips: expected an integer, got float"),
        ({"streams": [dict(CACHES, retention={"max_facts": 0})]},
         "config: streams[0].retention.max_facts: must be an integer from 1 to "
         "4611686018427387904, got 0"),
        ({"streams": [dict(CACHES, retention={"max_age": "7d"})]},
         "config: streams[0].retention.max_age: needs the stream's timestamp_column (a bigint "
         "column of milliseconds since the epoch): a fact's age is read from it"),
    ]

    def test_each_mistake_is_one_line_and_exit_2(self):
        tmp = tempfile.mkdtemp()
        for i, (change, message) in enumerate(self.CASES):
            config = {"server_name": "hs", "instance_name": "master",
                      "database": {"sqlite": "x.db"}, "streams": [CACHES]}
            config.update(change)
            path = os.path.join(tmp, f"c{i}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(config, f)
            result = cli("run", "-c", path, cwd=tmp)
            self.assertEqual(result.returncode, 2, (message, result.stderr))
            self.assertEqual(result.stderr, f"replicator: {message}\n")
            self.assertEqual(result.stdout, "")
        # Nothing listened, nothing was created.
        self.assertFalse(os.path.exists(os.path.join(tmp, "x.db")))

    def test_unreadable_and_malformed_files(self):
        result = cli("run", "-c", "/nonexistent.yaml")
        self.assertEqual((result.returncode, result.stderr),
                         (2, "replicator: config: file: cannot read /nonexistent.yaml: "
                             "No such file or directory\n"))
        tmp = tempfile.mkdtemp()
        path = os.path.join(tmp, "bad.yaml")
        with open(path, "w") as f:
            f.write("server_name: [unclosed\n")
        result = cli("run", "-c", path)
        self.assertEqual(result.returncode, 2)
        self.assertTrue(result.stderr.startswith(f"replicator: config: file: {path} is not "
                                                 "valid YAML at line"), result.stderr)
        self.assertEqual(result.stderr.count("\n"), 1)


class TailTests(SynchronousTestCase):
    def test_peer_text_is_printed_with_control_characters_escaped(self):
        tail, conn = tail_of_a_server(self)
        conn.sendall(b"SERVER hs.test\nERROR a\x1b[2Jb\x00c\rd\n")
        lines = [tail.stdout.readline().rstrip("\n") for _ in range(2)]
        self.assertEqual(lines, ["SERVER hs.test", "ERROR a\\x1b[2Jb\\x00c\\rd"])


class EmbeddedDaemonTests(SynchronousTestCase):
    def test_run_write_tail_positions_and_clean_shutdown(self):
        rep_port, http_port = free_port(), free_port()
        config = base_config("master", http_port, [CACHES],
                             database={"sqlite": "state.db"},
                             replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        daemon = Daemon(self, config).start()
        tail = subprocess.Popen(
            [PY, "-m", "replicator.cli", "tail", f"tcp:host=127.0.0.1:port={rep_port}",
             "--name", "tailer"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: tail.poll() is None and tail.kill())
        assert tail.stdout is not None
        lines = [tail.stdout.readline().strip() for _ in range(3)]
        self.assertEqual(lines[0], "SERVER hs.test")
        self.assertTrue(lines[1].startswith("PING "))
        self.assertEqual(lines[2], "POSITION caches master 0 0")

        written = cli("write", "-c", daemon.path, "caches", '["get_user", ["@a:hs"], 1000]',
                      '["get_user", null, 1001]', cwd=daemon.dir)
        self.assertEqual((written.returncode, written.stdout), (0, "1\n"), written.stderr)

        def next_command() -> str:
            # The server's keepalive PING may come between any two lines
            # (the write above can take seconds on a loaded machine).
            line = tail.stdout.readline().strip()
            while line.startswith("PING "):
                line = tail.stdout.readline().strip()
            return line

        self.assertEqual(next_command(), 'RDATA caches master batch ["get_user",["@a:hs"],1000]')
        self.assertEqual(next_command(), 'RDATA caches master 1 ["get_user",null,1001]')

        bad = cli("write", "-c", daemon.path, "caches", '["only one column"]', cwd=daemon.dir)
        self.assertEqual(bad.returncode, 1)
        self.assertIn("400", bad.stderr)

        positions = cli("positions", "-c", daemon.path, cwd=daemon.dir)
        self.assertEqual(positions.returncode, 0, positions.stderr)
        rows = [line.split() for line in positions.stdout.splitlines()[1:]]
        self.assertIn(["caches", "master", "1", "0", "-", "(local)"], rows)

        daemon.proc.send_signal(signal.SIGTERM)
        self.assertEqual(daemon.proc.wait(30), 0)
        rest = ""
        while "ERROR" not in rest:
            line = tail.stdout.readline()
            if not line:
                break
            rest += line
        self.assertIn("ERROR server stopping", rest)
        tail.send_signal(signal.SIGTERM)
        self.assertEqual(tail.wait(10), 0)
        out = daemon.output()
        self.assertIn("instance master stopped", out)
        self.assertNotIn(SECRET, out)


class PostgresClusterTests(SynchronousTestCase):
    """Master + two workers on PostgreSQL, the way systemd runs them."""

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()

    def cluster_configs(self, rep_port):
        streams = [dict(CACHES, writers=["master", "worker1"]),
                   {"name": "account_data", "table": "account_data_stream",
                    "columns": [{"user_id": "text"}, {"room_id": "text?"}, {"data_type": "text"}],
                    "writers": ["master"]}]
        master = base_config("master", free_port(), streams,
                             database={"postgres": self.dsn},
                             replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        master["http"]["metrics_listen"] = f"127.0.0.1:{free_port()}"
        workers = []
        for name in ("worker1", "worker2"):
            w = base_config(name, free_port(), streams, database={"postgres": self.dsn},
                            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
                            consumers=[{"type": "jsonl", "path": f"facts-{name}.jsonl"}])
            w["http"]["metrics_listen"] = f"127.0.0.1:{free_port()}"
            workers.append(w)
        return master, workers

    def table_facts(self):
        return table_facts(self.dsn, [
            ("caches", "cache_invalidation_stream", "cache_func, keys, invalidation_ts"),
            ("account_data", "account_data_stream", "user_id, room_id, data_type")])

    @staticmethod
    def jsonl_facts(path, skip_writer):
        facts = {}
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                if "rows" in entry:
                    key = (entry["stream"], entry["writer"])
                    facts.setdefault(key, []).append((entry["token"], entry["rows"]))
        return facts

    def write(self, daemon, stream, rows):
        status, body = http(f"{daemon.http_base}/_replicator/v1/streams/{stream}/facts",
                            json.dumps({"rows": rows}).encode(), SECRET)
        return json.loads(body)["stream_id"]

    def test_master_two_workers_kill_9_and_metrics(self):
        rep_port = free_port()
        master_cfg, worker_cfgs = self.cluster_configs(rep_port)
        master = Daemon(self, master_cfg, "master").start()
        w1 = Daemon(self, worker_cfgs[0], "worker1").start()
        w2 = Daemon(self, worker_cfgs[1], "worker2").start()
        metrics_before = http(f"http://{master_cfg['http']['metrics_listen']}/metrics")[1].decode()

        for i in range(60):
            self.write(master, "caches", [[f"f{i}", [f"@u{i}:hs"], i]] * (i % 3))
            self.write(master, "account_data", [[f"@u{i}:hs", None, "m.push_rules"]])
            self.write(w1, "caches", [[f"w{i}", None, i]])
            if i == 20:
                w2.kill(signal.SIGKILL)  # crash mid-stream
            if i == 40:
                w2.start()
        # Everything committed reaches both workers' jsonl files, once, in order.
        expected = self.table_facts()

        def caught_up(daemon, own):
            got = self.jsonl_facts(os.path.join(daemon.dir, f"facts-{own}.jsonl"), own)
            want = {k: v for k, v in expected.items() if k[1] != own}
            return as_sets(got) == as_sets(want)

        wait_for(lambda: caught_up(w1, "worker1"), 60, "worker1 caught up")
        wait_for(lambda: caught_up(w2, "worker2"), 60, "worker2 caught up")
        self.assertEqual(len(expected[("caches", "worker1")]), 60)

        # Health: all up and caught up.
        for d in (master, w1, w2):
            self.assertEqual(http(d.http_base + "/health")[0], 200)

        metrics_after = http(f"http://{master_cfg['http']['metrics_listen']}/metrics")[1].decode()
        for name in ("replicator_connections", "replicator_commands_received_total",
                     "replicator_commands_sent_total", "replicator_pending_commands",
                     "replicator_transport_buffer_bytes", "replicator_disconnects_total",
                     "replicator_stream_position", "replicator_stream_in_flight_ids",
                     "replicator_reader_lag", "replicator_catchup_fetches_total",
                     "replicator_catchup_rows_total", "replicator_facts_written_total",
                     "replicator_write_latency_seconds_bucket",
                     "replicator_fanout_latency_seconds_bucket"):
            self.assertIn(name, metrics_after, name)

        def value(text, prefix):
            for line in text.splitlines():
                if line.startswith(prefix):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        self.assertEqual(value(metrics_after, 'replicator_facts_written_total{stream="caches"}'),
                         60)  # facts without rows (i % 3 == 0) count too
        self.assertGreater(value(metrics_after, 'replicator_stream_position{stream="caches",'
                                                'writer="worker1"}'), 0)
        self.assertGreater(value(metrics_after, "replicator_disconnects_total"), 0)
        self.assertGreater(value(metrics_after, "replicator_fanout_latency_seconds_count"),
                           value(metrics_before, "replicator_fanout_latency_seconds_count"))
        for d in (master, w1, w2):
            d.kill(signal.SIGTERM)
            self.assertEqual(d.proc.returncode, 0, d.output()[-2000:])


class ExampleConfigTests(SynchronousTestCase):
    """The shipped examples stay valid (secret files pointed at a temp file)."""

    def test_examples_parse(self):
        from twisted.internet import reactor

        from replicator.config import load_config, validate

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        tmp = tempfile.mkdtemp()
        secret = os.path.join(tmp, "secret")
        with open(secret, "w") as f:
            f.write("example-secret-0123456789\n")
        names = {}
        for name in ("dev.yaml", "master.yaml", "worker.yaml", "synapse-reader.yaml"):
            with open(os.path.join(root, "conf", name)) as f:
                doc = yaml.safe_load(f)
            doc["http"]["secret_file"] = secret
            path = os.path.join(tmp, name)
            with open(path, "w") as f:
                yaml.safe_dump(doc, f)
            config = validate(load_config(path), reactor)
            self.assertEqual(config.http.secret, "example-secret-0123456789")
            names[name] = (config.instance_name, [s.name for s in config.streams])
        self.assertEqual(names["dev.yaml"], ("master", ["caches", "account_data", "presence"]))
        self.assertEqual(names["master.yaml"], ("master", ["caches", "account_data"]))
        self.assertEqual(names["worker.yaml"], ("worker1", ["caches", "account_data"]))
        self.assertEqual(names["synapse-reader.yaml"],
                         ("app1", ["caches", "presence", "receipts", "push_rules", "app_events"]))


class VersionTests(SynchronousTestCase):
    """Which version is running: ``--version``, the build-info metric, and
    the one place it is written (packaging reads the same)."""

    def test_version_flag(self):
        import replicator

        result = cli("--version")
        self.assertEqual((result.returncode, result.stdout),
                         (0, f"replicator {replicator.__version__}\n"))

    def test_python_dash_m_replicator_is_the_command(self):
        import replicator

        result = subprocess.run([PY, "-m", "replicator", "--version"], capture_output=True,
                                text=True, timeout=60)
        self.assertEqual((result.returncode, result.stdout),
                         (0, f"replicator {replicator.__version__}\n"))

    def test_build_info_metric(self):
        import platform

        from prometheus_client import REGISTRY

        import replicator

        self.assertEqual(REGISTRY.get_sample_value("replicator_build_info", {
            "version": replicator.__version__, "python": platform.python_version(),
            "twisted": __import__("twisted").__version__}), 1.0)
