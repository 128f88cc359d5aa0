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

from tests.servers import free_port
from tests.test_cli import CACHES, PY, SECRET, Daemon, base_config, cli, http


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
