"""A 100,000-row fact through real daemons: a master and a worker over TCP
(PostgreSQL), the fact written through the master's HTTP write API while a
probe asks both for ``/health`` and other facts are written on both sides.

What is asserted is what must be true whatever the machine's load: the
worker's replication link never dropped (no disconnect on either side, the
same connection from start to end, no timeout or retry in the logs), the
fact reached the worker's ``jsonl`` file whole (every row, in order, one
line), and every other fact written meanwhile arrived; every probe got an
answer.  How fast ``/health`` answered is ``make bench``'s business
(``scripts/bench/bigfact.py``), not a test's.
"""

import json
import os
import threading
import urllib.error
import urllib.request

from twisted.trial.unittest import SynchronousTestCase

from tests.daemon import CACHES, SECRET, Daemon, base_config, http
from tests.servers import PostgresServer, free_port, wait_for
from tests.support import jsonl_facts

ROWS = 100_000
#: One small column: 100,000 rows fit in the write API's 1 MiB body.
BIG = {"name": "big", "table": "big_stream", "columns": [{"n": "bigint"}],
       "writers": ["master"]}
SMALL = dict(CACHES, writers=["master", "worker1"])
#: Links that would notice a stall of a few seconds.
LINK = {"ping_interval": 1, "ping_timeout": 5}


class Probe:
    """Asks ``/health`` of each daemon in a loop (a thread each) until
    stopped; what each answer was (its status, or the exception)."""

    def __init__(self, daemons):
        self.answers = {d.config["instance_name"]: [] for d in daemons}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(d,), daemon=True)
                         for d in daemons]
        for t in self._threads:
            t.start()

    def _run(self, daemon):
        out = self.answers[daemon.config["instance_name"]]
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(daemon.http_base + "/health", timeout=30) as r:
                    r.read()
                    out.append(r.status)
            except urllib.error.HTTPError as e:
                out.append(e.code)
            except OSError as e:
                out.append(repr(e))
            self._stop.wait(0.01)

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(60)


class BigFactDaemonTests(SynchronousTestCase):
    def status(self, daemon):
        return json.loads(http(daemon.http_base + "/status.json")[1])

    def write(self, daemon, stream, rows):
        status, body = http(f"{daemon.http_base}/_replicator/v1/streams/{stream}/facts",
                            json.dumps({"rows": rows}).encode(), SECRET)
        self.assertEqual(status, 200, body)
        return json.loads(body)["stream_id"]

    def test_a_100000_row_fact_arrives_whole_and_nothing_else_waits_or_drops(self):
        dsn = PostgresServer.shared().create_database()
        rep_port = free_port()
        streams = [BIG, SMALL]
        master = Daemon(self, base_config(
            "master", free_port(), streams, database={"postgres": dsn},
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1", **LINK},
            consumers=[{"type": "jsonl", "path": "facts-master.jsonl"}]), "master").start()
        worker = Daemon(self, base_config(
            "worker1", free_port(), streams, database={"postgres": dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}", **LINK},
            consumers=[{"type": "jsonl", "path": "facts-worker1.jsonl"}]), "worker1").start()
        wait_for(lambda: http(worker.http_base + "/health")[0] == 200, 60, "worker linked")
        linked = [c["connected_since"] for c in self.status(worker)["connections"]]
        self.assertEqual(len(linked), 1)

        probe = Probe([master, worker])
        self.addCleanup(probe.stop)
        big_done = threading.Event()
        small = {"master": [], "worker1": []}

        def small_writes():
            # Until the big fact has arrived, and at least a few each.
            i = 0
            while not big_done.is_set() or i < 5:
                for daemon, name in ((master, "master"), (worker, "worker1")):
                    rows = [[f"{name}-{i}", [f"@u{i}:hs"], i]]
                    small[name].append((self.write(daemon, "caches", rows), rows))
                i += 1
                big_done.wait(0.05)
        writer = threading.Thread(target=small_writes, daemon=True)
        writer.start()

        rows = [[i] for i in range(ROWS)]
        token = self.write(master, "big", rows)
        worker_file = os.path.join(worker.dir, "facts-worker1.jsonl")
        master_file = os.path.join(master.dir, "facts-master.jsonl")
        wait_for(lambda: jsonl_facts(worker_file).get(("big", "master")), 120,
                 "the big fact at the worker")
        big_done.set()
        writer.join(120)
        self.assertFalse(writer.is_alive())

        # Every small fact, written while the big one was on its way.
        def arrived(path, name):
            return jsonl_facts(path).get(("caches", name), []) == small[name]
        wait_for(lambda: arrived(worker_file, "master"), 60, "master's small facts at the worker")
        wait_for(lambda: arrived(master_file, "worker1"), 60, "worker's small facts at the master")
        probe.stop()

        # The big fact: once, whole, in order.
        self.assertEqual(jsonl_facts(worker_file)[("big", "master")], [(token, rows)])
        # The link never dropped, and nothing timed out.
        for daemon in (master, worker):
            status = self.status(daemon)
            self.assertEqual(status["disconnects"], [], daemon.config["instance_name"])
        self.assertEqual([c["connected_since"] for c in self.status(worker)["connections"]],
                         linked)
        for daemon in (master, worker):
            out = daemon.output()
            for word in ("timeout", "timed out", "retry", "Failed to keep up"):
                self.assertNotIn(word, out, out[-3000:])
        # Every probe got an answer.
        for name, answers in probe.answers.items():
            self.assertTrue(answers, name)
            self.assertEqual([a for a in answers if a not in (200, 503)], [], name)
