"""The read API of a real `replicator run` (SQLite), read with curl: pages,
long-poll, `curl -N` event streams, and a daemon restart resumed with
Last-Event-ID (nothing lost, nothing twice).  Config mistakes of
``http.readers``: one line naming the key, exit 2."""

import json
import os
import signal
import subprocess
import threading

import yaml
from twisted.trial.unittest import SynchronousTestCase

from tests.daemon import CACHES, SECRET, Daemon, base_config, cli, http
from tests.servers import free_port, wait_for

READER = "curl-reader-secret-0123456789"
STREAM = dict(CACHES, create=True)


def curl(*args, timeout=30):
    result = subprocess.run(["curl", "-sS", *args], capture_output=True, timeout=timeout)
    return result.stdout


class EventCurl:
    """``curl -N`` reading an event stream; keeps the events it printed."""

    def __init__(self, test, url, *headers):
        args = ["curl", "-sSN", url]
        for h in headers:
            args += ["-H", h]
        # (stderr: the stream cut by a daemon stop is curl's error 18)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        test.addCleanup(self.stop)
        self.events = []
        self.lines = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        fields = {}
        for raw in self.proc.stdout:
            line = raw.decode().rstrip("\n")
            self.lines.append(line)
            if not line:
                if fields.get("event") == "fact":
                    self.events.append((fields["id"], json.loads(fields["data"])))
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)
        self.proc.stdout.close()


class CurlTests(SynchronousTestCase):
    def daemon(self):
        port = free_port()
        directory = self.mktemp()
        os.makedirs(directory)
        secret_file = os.path.abspath(os.path.join(directory, "reader.secret"))
        with open(secret_file, "w") as f:
            f.write(READER)
        config = base_config("master", port, [STREAM], database={"sqlite": "s.db"})
        config["http"]["readers"] = [{"name": "curl", "secret_file": secret_file,
                                      "streams": ["caches"]}]
        daemon = Daemon(self, config)
        daemon.start()
        self.base = daemon.http_base + "/_replicator/v1/streams/caches"
        return daemon

    def write(self, daemon, n):
        ids = []
        for i in range(n):
            body = json.dumps({"rows": [["f", [i], i]]}).encode()
            ids.append(json.loads(http(self.base + "/facts", body, SECRET)[1])["stream_id"])
        return ids

    def test_pages_long_poll_and_events(self):
        daemon = self.daemon()
        ids = self.write(daemon, 3)
        auth = f"Authorization: Bearer {READER}"
        page = json.loads(curl("-H", auth, self.base + "/facts?limit=2"))
        self.assertEqual([f["stream_id"] for f in page["facts"]], ids[:2])
        self.assertEqual(page["facts"][0]["rows"],
                         [{"cache_func": "f", "keys": [0], "invalidation_ts": 0}])
        head = curl("-D", "-", "-o", "/dev/null", "-H", auth, self.base + "/facts?limit=2")
        self.assertIn(b"immutable", head.lower())
        rest = json.loads(curl(self.base + f"/facts?from={page['next']}&access_token={READER}"))
        self.assertEqual([f["stream_id"] for f in rest["facts"]], ids[2:])
        # Long-poll: curl waits until a fact is written.
        poll = subprocess.Popen(["curl", "-sS", "-H", auth,
                                 self.base + f"/facts?from={rest['next']}&wait=30"],
                                stdout=subprocess.PIPE)
        def waiting():
            readers = json.loads(http(daemon.http_base + "/status.json")[1])["readers"]
            return [(r["reader"], r["connected"]) for r in readers] == [("curl", 1)]

        wait_for(waiting, 30, "the long-poll waiting")
        (new,) = self.write(daemon, 1)
        out, _ = poll.communicate(timeout=30)
        self.assertEqual([f["stream_id"] for f in json.loads(out)["facts"]], [new])
        # An event stream with the cookie.
        events = EventCurl(self, self.base + "/events",
                           f"Cookie: replicator_reader={READER}")
        wait_for(lambda: len(events.events) == 4, 30, "4 events")
        self.assertEqual(events.lines[0], "retry: 2000")
        more = self.write(daemon, 2)
        wait_for(lambda: len(events.events) == 6, 30, "6 events")
        self.assertEqual([e[1]["stream_id"] for e in events.events], ids + [new] + more)
        self.assertNotIn(READER, daemon.output())

    def test_restart_resumes_from_last_event_id(self):
        daemon = self.daemon()
        auth = f"Authorization: Bearer {READER}"
        first = self.write(daemon, 3)
        events = EventCurl(self, self.base + "/events", auth)
        wait_for(lambda: len(events.events) == 3, 30, "3 events")
        daemon.kill(signal.SIGTERM)
        events.proc.wait(30)  # the stream ended with the daemon
        got = list(events.events)
        daemon.start()
        during = self.write(daemon, 2)
        again = EventCurl(self, self.base + "/events", auth, f"Last-Event-ID: {got[-1][0]}")
        wait_for(lambda: len(again.events) == 2, 30, "2 events after the restart")
        after = self.write(daemon, 2)
        wait_for(lambda: len(again.events) == 4, 30, "4 events after the restart")
        got += again.events
        self.assertEqual([e[1]["stream_id"] for e in got], first + during + after)
        table = json.loads(curl("-H", auth, self.base + "/facts?limit=1000"))
        self.assertEqual([e[1] for e in got], table["facts"])


    def test_sighup_reads_the_readers_again(self):
        daemon = self.daemon()
        self.write(daemon, 1)
        url = self.base + "/facts"
        code = lambda secret: curl("-o", "/dev/null", "-w", "%{http_code}",  # noqa: E731
                                   "-H", f"Authorization: Bearer {secret}", url)
        self.assertEqual(code(READER), b"200")
        new = "a-new-reader-secret-987654321"
        with open(daemon.config["http"]["readers"][0]["secret_file"], "w") as f:
            f.write(new)
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: code(new) == b"200", 30, "the new secret taken")
        self.assertEqual(code(READER), b"403")
        self.assertIn("http.readers", daemon.output())
        self.assertNotIn(new, daemon.output())


class ReaderConfigTests(SynchronousTestCase):
    def check(self, readers, message, secret_text=READER):
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        with open(os.path.join(directory, "r.secret"), "w") as f:
            f.write(secret_text)
        config = base_config("master", free_port(), [STREAM], database={"sqlite": "s.db"})
        config["http"]["readers"] = readers
        path = os.path.join(directory, "c.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        result = cli("check", "-c", path, cwd=directory)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertEqual(result.stderr.strip().splitlines(), [f"replicator: config: {message}"])

    def test_mistakes(self):
        self.check([{"name": "a", "secret_file": "r.secret", "streams": ["nope"]}],
                   "http.readers[0].streams[0]: unknown stream 'nope'")
        self.check([{"name": "a", "secret_file": "r.secret", "streams": []}],
                   "http.readers[0].streams: a reader reads some stream (or [\"*\"]: every "
                   "stream)")
        self.check([{"name": "a", "secret_file": "r.secret", "streams": ["*"], "x": 1}],
                   "http.readers[0].x: unknown key")
        self.check([{"name": "a", "secret_file": "missing", "streams": ["*"]}],
                   "http.readers[0].secret_file: cannot read secret file ./missing: No such "
                   "file or directory")
        self.check([{"name": "a", "secret_file": "r.secret", "streams": ["*"]}],
                   "http.readers[0].secret_file: the secret must be at least 16 characters",
                   secret_text="short")
        self.check([{"name": "a", "secret_file": "r.secret", "streams": ["*"]},
                    {"name": "a", "secret_file": "r.secret", "streams": ["*"]}],
                   "http.readers[1].name: 'a' is named twice")
        self.check([{"name": "a", "secret_file": "r.secret", "streams": ["*"]},
                    {"name": "b", "secret_file": "r.secret", "streams": ["*"]}],
                   "http.readers[1].secret_file: the same secret as reader 'a': each reader "
                   "needs its own")
