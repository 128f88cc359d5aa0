"""The daemon's log lines over real processes, in each ``log_format``.

A master ``replicator run`` (SQLite) is started in each format, a
replication client connects, names itself and leaves, a write with a
malformed body is answered 400, and the daemon is stopped with SIGTERM.
Every line of its output must parse in its format and carry the time (the
text format leaves it out only when journald reads the output), no Python
object repr (``<...Protocol``, ``IPv4Address(``, ``object at 0x``) and
none of Twisted's own lines; the access line of the 400 says why.
"""

import json
import os
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request

from twisted.trial.unittest import SynchronousTestCase

from tests.daemon import CACHES, PY, SECRET, Daemon, base_config
from tests.servers import free_port, wait_for
from tests.support import recv_until

#: What must never appear in a line.
LEAKS = re.compile(r"<\w*Protocol\b|IPv[46]Address\(|object at 0x|log_legacy|"
                   r"Main loop terminated|starting on \d|Port \d+ Closed|Scheduling retry")
TEXT_TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} ")
TEXT_LINE = re.compile(r"^(?:DEBUG|INFO|WARN|ERROR|CRITICAL) [\w.-]+: \S")
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d$")
LOGFMT_PAIR = re.compile(r'([A-Za-z0-9_.-]+)=("(?:[^"\\]|\\.)*"|[^\s"=]*)(?: |$)')


def parse_logfmt(line: str) -> dict:
    """``key=value`` pairs covering the whole line, else AssertionError."""
    pairs, pos = {}, 0
    while pos < len(line):
        match = LOGFMT_PAIR.match(line, pos)
        if match is None:
            raise AssertionError(f"not logfmt at {pos}: {line!r}")
        value = match.group(2)
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        pairs[match.group(1)] = value
        pos = match.end()
    return pairs


class LogFormatTests(SynchronousTestCase):
    timeout = 240

    def run_daemon(self, log_format=None, env=None):
        """Start, exercise and stop a master; its output's lines."""
        rep_port, http_port = free_port(), free_port()
        config = base_config("master", http_port, [CACHES], database={"sqlite": "s.db"},
                             replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        if log_format is not None:
            config["log_format"] = log_format
        daemon = Daemon(self, config)
        for key, value in (env(daemon) if env is not None else {}).items():
            self.addCleanup(os.environ.pop, key, None)
            os.environ[key] = value  # the daemon inherits it
        daemon.start()
        # A replication client: names itself, then goes.
        with socket.create_connection(("127.0.0.1", rep_port), timeout=10) as sock:
            sock.sendall(b"NAME logtester\nREPLICATE\n")
            recv_until(sock, b"POSITION", b"ERROR")
        # A malformed body: 400, and the access line says why.
        request = urllib.request.Request(
            daemon.http_base + "/_replicator/v1/streams/caches/facts", data=b'{"rows": [1,',
            method="POST", headers={"Authorization": f"Bearer {SECRET}"})
        with self.assertRaises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=10)
        self.assertEqual(raised.exception.code, 400)
        error = json.loads(raised.exception.read())["error"]
        wait_for(lambda: "logtester" in daemon.output() and " 400 " in daemon.output()
                 or '"code": 400' in daemon.output() or "code=400" in daemon.output(),
                 30, "the client's and the 400's lines")
        daemon.kill(signal.SIGTERM)
        self.assertEqual(daemon.proc.returncode, 0, daemon.output()[-2000:])
        lines = daemon.output().splitlines()
        self.assertTrue(lines)
        for line in lines:
            self.assertIsNone(LEAKS.search(line), line)
        return lines, error

    def assert_access_line(self, lines, error):
        access = [line for line in lines if "400" in line and "/facts" in line]
        self.assertEqual(len(access), 1, lines)
        self.assertIn(error[:40], access[0])

    def test_text_carries_the_time_outside_journald(self):
        lines, error = self.run_daemon()
        for line in lines:
            self.assertRegex(line, TEXT_TIME)
            self.assertRegex(TEXT_TIME.sub("", line), TEXT_LINE)
        self.assert_access_line(lines, error)
        text = "\n".join(lines)
        self.assertRegex(text, r"INFO replication: listening on 127\.0\.0\.1:\d+\n")
        self.assertRegex(text, r"connection logtester \(127\.0\.0\.1:\d+\) lost")

    def test_text_leaves_the_time_to_journald(self):
        def journal(daemon):
            # systemd's JOURNAL_STREAM: device and inode of the daemon's stdout.
            open(daemon.log_path, "ab").close()
            stat = os.stat(daemon.log_path)
            return {"JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}"}

        lines, error = self.run_daemon(env=journal)
        for line in lines:
            self.assertRegex(line, TEXT_LINE)
        self.assert_access_line(lines, error)

    def test_logfmt(self):
        lines, error = self.run_daemon("logfmt")
        records = [parse_logfmt(line) for line in lines]
        for record in records:
            self.assertRegex(record["time"], RFC3339)
            self.assertIn(record["level"], ("debug", "info", "warn", "error", "critical"))
            self.assertTrue(record["system"] and record["msg"], record)
        access = [r for r in records if r.get("code") == "400"]
        self.assertEqual(len(access), 1, lines)
        self.assertIn(error[:40], access[0]["msg"])
        self.assertIn(error[:40], access[0]["error"])

    def test_json(self):
        lines, error = self.run_daemon("json")
        records = [json.loads(line) for line in lines]
        for record in records:
            self.assertRegex(record["time"], RFC3339)
            self.assertIn(record["level"], ("debug", "info", "warn", "error", "critical"))
            self.assertTrue(record["system"] and record["message"], record)
        access = [r for r in records if r.get("code") == 400]
        self.assertEqual(len(access), 1, lines)
        self.assertEqual(access[0]["system"], "http.access")
        self.assertIn(error[:40], access[0]["message"])
        listening = [r for r in records if r["message"].startswith("listening on")]
        self.assertEqual({r["system"] for r in listening}, {"replication", "http"})

    def test_an_unknown_format_is_one_line_and_exit_2(self):
        config = base_config("master", free_port(), [CACHES], database={"sqlite": "s.db"},
                             log_format="xml")
        daemon = Daemon(self, config)
        result = subprocess.run([PY, "-m", "replicator.cli", "run", "-c", daemon.path],
                                capture_output=True, text=True, timeout=60, cwd=daemon.dir)
        self.assertEqual(result.returncode, 2)
        self.assertEqual(result.stderr,
                         "replicator: config: log_format: 'xml' is not one of text, logfmt, "
                         "json\n")
