"""A worker is back within a couple of seconds of its master's return, over
real processes with the default reconnect settings.

A master ``replicator run`` is killed (SIGKILL, its PID) and restarted on
the same port after an outage of ~20 s, the time a restart or an upgrade
takes.  What counts is the reconnect backoff's cap: the worker's logged
retry delays never exceed it, and the worker's replication link is up
again within the cap plus a margin for a loaded machine (3 s in all) of
the master answering ``/health`` again.  The retry lines name the reason
(``connection refused``) and count the retries of this outage.
"""

import json
import re
import subprocess
import time
import urllib.error
import urllib.request

from twisted.trial.unittest import SynchronousTestCase

from replicator.net.backoff import RECONNECT_MAX_DELAY
from replicator.net.reconnect import LOUD_RETRIES
from tests.daemon import CACHES, PY, Daemon, base_config
from tests.servers import PostgresServer, free_port, wait_for

#: How long the master stays down: long enough for today's exponential
#: backoff to pass any cap meant for a peer on the local network.
OUTAGE = 20.0
#: The reconnect must come within the cap plus this (a loaded machine's
#: scheduling, the connect and the handshake).
MARGIN = 1.0
#: Retry lines: ours, and Twisted's own wording (which must not be logged,
#: but whose delays count if it is).
RETRY = re.compile(r"retry (\d+) in ([0-9.]+) s\b")
TWISTED_RETRY = re.compile(r"Scheduling retry (\d+) to connect .* in ([0-9.e-]+) seconds")


def health(daemon):
    """``(status, body)`` of ``GET /health``, or None while nothing answers."""
    try:
        with urllib.request.urlopen(daemon.http_base + "/health", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError:
        return None


def link_up(answer) -> bool:
    """The worker's ``/health`` is 200, or at least no longer says that
    the upstream is not connected (lag checks may still be settling)."""
    if answer is None:
        return False
    status, body = answer
    return status == 200 or "not connected" not in str(body.get("reason", ""))


class Process(Daemon):
    def spawn(self):
        """Start without waiting for anything."""
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([PY, "-m", "replicator.cli", "run", "-c", self.path],
                                     cwd=self.dir, stdout=self.log, stderr=subprocess.STDOUT)
        self.test.addCleanup(self.kill)


class ReconnectTimeTests(SynchronousTestCase):
    def test_worker_is_back_within_the_cap_of_its_masters_return(self):
        dsn = PostgresServer.shared().create_database()
        rep_port = free_port()
        master = Process(self, base_config(
            "master", free_port(), [CACHES], database={"postgres": dsn},
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"}), "master").start()
        worker = Process(self, base_config(
            "worker1", free_port(), [CACHES], database={"postgres": dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"}), "worker1").start()
        wait_for(lambda: link_up(health(worker)), 60, "worker connected")

        master.kill()  # SIGKILL, by PID
        wait_for(lambda: not link_up(health(worker)), 30, "worker notices")
        time.sleep(OUTAGE)  # the outage itself, not a wait for an event
        master.spawn()
        wait_for(lambda: health(master) is not None, 90, "master answering /health")
        returned = time.monotonic()
        wait_for(lambda: link_up(health(worker)), 60, "worker link up again")
        reconnect = time.monotonic() - returned

        out = worker.output()
        delays = [(int(n), float(d)) for n, d in
                  RETRY.findall(out) + TWISTED_RETRY.findall(out)]
        self.assertTrue(delays, out[-3000:])
        longest = max(d for _, d in delays)
        self.assertLessEqual(longest, RECONNECT_MAX_DELAY,
                             f"retry delays {[d for _, d in delays]} over the cap "
                             f"{RECONNECT_MAX_DELAY} s (back {reconnect:.1f} s after the master)")
        self.assertLessEqual(reconnect, RECONNECT_MAX_DELAY + MARGIN,
                             f"worker back {reconnect:.1f} s after its master")
        # The counter counts the retries of this outage: 1, 2, 3... (each
        # of the first LOUD_RETRIES is logged, later ones now and then).
        counts = [n for n, _ in delays]
        loud = min(len(counts), LOUD_RETRIES)
        self.assertEqual(counts[:loud], list(range(1, loud + 1)), out[-3000:])
        self.assertEqual(counts, sorted(set(counts)), out[-3000:])
        retry_lines = [line for line in out.splitlines() if RETRY.search(line)]
        self.assertRegex(retry_lines[0], r"upstream 127\.0\.0\.1:\d+: "
                                         r"(closed by peer|connection lost); retry 1 in ")
        self.assertIn("connection refused; retry", retry_lines[-1])
        self.assertNotIn("<", "\n".join(retry_lines))
        self.log_reconnect(reconnect, delays)

    def log_reconnect(self, reconnect, delays):
        from twisted.python import log

        log.msg(f"reconnect {reconnect:.2f} s after the master's return; "
                f"{len(delays)} retries, longest wait {max(d for _, d in delays):.1f} s")
