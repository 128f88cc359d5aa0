"""What a newcomer meets first, through the real CLI: ``tail`` saying what
it is doing against a dead port, ``tail --json`` lines, and a quiet log on
writes at the default level."""

import json
import os
import select
import signal
import subprocess
import time
import urllib.error

from twisted.trial.unittest import SynchronousTestCase

from tests.daemon import CACHES, PY, SECRET, Daemon, base_config, cli, http
from tests.servers import free_port


def read_lines(stream, count, timeout=60.0):
    """``count`` lines from a pipe, failing (not hanging) past ``timeout``."""
    lines = []
    deadline = time.monotonic() + timeout
    while len(lines) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"only {lines!r} within {timeout}s")
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            line = stream.readline()
            if not line:
                raise AssertionError(f"EOF after {lines!r}")
            lines.append(line.rstrip("\n"))
    return lines


class TailTests(SynchronousTestCase):
    def tail(self, *args):
        proc = subprocess.Popen([PY, "-m", "replicator.cli", "tail", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def stop():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
            proc.stdout.close()
            proc.stderr.close()
        self.addCleanup(stop)
        return proc

    def test_dead_port_says_connecting_and_each_retry(self):
        port = free_port()
        endpoint = f"tcp:host=127.0.0.1:port={port}"
        proc = self.tail(endpoint)
        lines = read_lines(proc.stderr, 4)
        self.assertEqual(lines[0], f"# connecting to {endpoint}")
        self.assertTrue(lines[1].startswith(f"# cannot connect to {endpoint}: "), lines)
        self.assertIn("refused", lines[1].lower())
        self.assertRegex(lines[1], r"; retry 1 in \d+\.\ds$")
        self.assertEqual(lines[2], f"# connecting to {endpoint} (retry 1)")
        self.assertRegex(lines[3], r"; retry 2 in \d+\.\ds$")

    def test_json_lines_name_the_command_once(self):
        rep_port, http_port = free_port(), free_port()
        config = base_config("master", http_port, [CACHES], database={"sqlite": "s.db"},
                             replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        Daemon(self, config).start()
        proc = self.tail(f"tcp:host=127.0.0.1:port={rep_port}", "--json")
        first = json.loads(read_lines(proc.stdout, 1)[0])
        self.assertEqual(first, {"command": "SERVER", "server_name": "hs.test"})


    def test_host_port_is_taken_as_a_tcp_endpoint(self):
        rep_port, http_port = free_port(), free_port()
        config = base_config("master", http_port, [CACHES], database={"sqlite": "s.db"},
                             replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        Daemon(self, config).start()
        proc = self.tail(f"127.0.0.1:{rep_port}")
        self.assertEqual(read_lines(proc.stdout, 1), ["SERVER hs.test"])

    def test_an_unparsable_endpoint_says_how_to_write_one(self):
        result = subprocess.run([PY, "-m", "replicator.cli", "tail", "tcp:9092"],
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertEqual(result.stderr.count("\n"), 1, result.stderr)
        self.assertIn("HOST:PORT", result.stderr)
        self.assertNotIn("Traceback", result.stderr)


class WriteMistakeTests(SynchronousTestCase):
    """``replicator write`` mistakes are usage errors: exit 2, one line,
    nothing written (no stream ID used)."""

    def test_forgotten_rows_and_unknown_streams(self):
        http_port = free_port()
        config = base_config("master", http_port, [CACHES], database={"sqlite": "s.db"})
        daemon = Daemon(self, config).start()
        forgot = cli("write", "-c", daemon.path, "caches", cwd=daemon.dir)
        self.assertEqual((forgot.returncode, forgot.stdout), (2, ""), forgot.stderr)
        self.assertIn("--empty", forgot.stderr)
        self.assertEqual(forgot.stderr.count("\n"), 1, forgot.stderr)
        unknown = cli("write", "-c", daemon.path, "cachez", '["f", null, 1]', cwd=daemon.dir)
        self.assertEqual(unknown.returncode, 2, unknown.stderr)
        self.assertEqual(unknown.stderr,
                         "replicator: write: unknown stream 'cachez' (this config has: caches)\n")
        # Nothing above took an ID: the first fact written is 1; --empty
        # writes a fact with no rows on purpose.
        written = cli("write", "-c", daemon.path, "caches", '["f", null, 1]', cwd=daemon.dir)
        self.assertEqual((written.returncode, written.stdout), (0, "1\n"), written.stderr)
        empty = cli("write", "-c", daemon.path, "caches", "--empty", cwd=daemon.dir)
        self.assertEqual((empty.returncode, empty.stdout), (0, "2\n"), empty.stderr)


class AccessLogTests(SynchronousTestCase):
    def test_writes_log_no_access_line_at_info_but_refusals_do(self):
        http_port = free_port()
        config = base_config("master", http_port, [CACHES], database={"sqlite": "s.db"})
        daemon = Daemon(self, config).start()
        for i in range(3):
            written = cli("write", "-c", daemon.path, "caches",
                          json.dumps(["f", None, i]), cwd=daemon.dir)
            self.assertEqual(written.returncode, 0, written.stderr)
        with self.assertRaises(urllib.error.HTTPError):
            http(daemon.http_base + "/_replicator/v1/positions", secret="wrong")
        daemon.kill(signal.SIGTERM)
        out = daemon.output()
        access = [line for line in out.splitlines() if "http.access:" in line]
        self.assertEqual([line for line in access if "POST" in line], [])
        self.assertEqual(len([line for line in access if '"GET /_replicator/v1/positions" 403'
                              in line]), 1, access)
        self.assertNotIn(SECRET, out)
        self.assertTrue(os.path.exists(os.path.join(daemon.dir, "s.db")))
