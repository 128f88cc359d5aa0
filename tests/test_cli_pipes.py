"""The CLI in a pipe: when the reader of its standard output goes away
(``replicator tail ... | head -2``, ``replicator positions --json | head``),
the command ends quietly with exit 0: no ``BrokenPipeError`` traceback, no
"Exception ignored" line, and ``tail`` does not go on forever."""

import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading

import yaml
from twisted.trial.unittest import SynchronousTestCase

from tests.daemon import tail_of_a_server

PY = sys.executable
SECRET = "test-secret-0123456789"


class TailPipeTests(SynchronousTestCase):
    def test_tail_exits_quietly_when_its_reader_goes(self):
        tail, conn = tail_of_a_server(self, text=False)
        conn.sendall(b"SERVER hs.test\nPOSITION caches master 0 0\n")
        self.assertEqual(tail.stdout.readline(), b"SERVER hs.test\n")
        # The reader goes (head -1 exiting): every later line meets a closed pipe.
        tail.stdout.close()
        for i in range(1, 200):
            try:
                conn.sendall(b'RDATA caches master %d ["f",null,1]\n' % i)
            except OSError:
                break  # tail has gone and closed its connection
        self.assertEqual(tail.wait(30), 0)
        err = tail.stderr.read().decode()
        self.assertNotIn("Traceback", err)
        self.assertNotIn("BrokenPipe", err)
        self.assertNotIn("Exception ignored", err)


class _Positions(http.server.BaseHTTPRequestHandler):
    """Answers /_replicator/v1/positions once the test says the reader left."""

    def do_GET(self):
        self.server.reader_gone.wait(30)
        body = json.dumps({"streams": {f"s{i}": {"linear": i, "writers": {
            "master": {"position": i, "local": True, "in_flight": 0}}}
            for i in range(2000)}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class PositionsPipeTests(SynchronousTestCase):
    def _positions(self, *extra):
        server = http.server.HTTPServer(("127.0.0.1", 0), _Positions)
        server.reader_gone = threading.Event()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        directory = tempfile.mkdtemp(prefix="replicator-pipe-")
        path = os.path.join(directory, "c.yaml")
        with open(path, "w") as f:
            yaml.safe_dump({
                "server_name": "hs.test", "instance_name": "master",
                "database": {"sqlite": os.path.join(directory, "state.db")},
                "http": {"listen": f"tcp:{server.server_port}:interface=127.0.0.1",
                         "secret": SECRET},
                "streams": [{"name": "caches", "table": "cache_invalidation_stream",
                             "columns": [{"cache_func": "text"}], "writers": ["master"]}],
            }, f)
        proc = subprocess.Popen([PY, "-m", "replicator.cli", "positions", "-c", path, *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        proc.stdout.close()
        server.reader_gone.set()
        code = proc.wait(30)
        err = proc.stderr.read().decode()
        self.assertEqual((code, err), (0, ""))

    def test_positions_json_exits_quietly_when_its_reader_goes(self):
        self._positions("--json")

    def test_positions_table_exits_quietly_when_its_reader_goes(self):
        self._positions()
