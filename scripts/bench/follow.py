#!/usr/bin/env python3
"""What a worker costs to follow its master: CPU per fact, beside Synapse's
own client protocol fed the same lines.

Two ``replicator run`` processes on PostgreSQL (fsync on): a master, and a
worker following it with a ``jsonl`` consumer (fsync on), over TCP or over
Redis pub/sub.  Facts of one row are written through the master's write
API at a steady rate (writer threads on kept-alive connections, paced by
one schedule) for ``SECONDS`` s; the window ends when the last fact's line
is in the worker's file.

``follow.{tcp,redis}.{40,2000}fps.cpu_us_per_fact`` (baseline: Synapse)
    The worker's CPU (user + system, every thread, ``/proc/PID/stat``)
    over the window, divided by the facts it delivered; beside it the CPU
    of ``synapse_client.py`` (Synapse's ``ClientReplicationStreamProtocol``
    and the part of its ``ReplicationCommandHandler`` that gathers a fact's
    rows, run by the Synapse virtualenv's Python) connected to the same
    master over TCP and fed the same lines in the same window.  Synapse's
    figure is its protocol alone (no database, no file); ours is the whole
    worker: the line, the admission's read of the sequence, the reader,
    the audit, the file's write, fsync and state.  The issue's target:
    at most 250 us per fact (1% of a core) at 40 facts/s.  Also printed:
    the share of a core, the CPU of each of the worker's threads, and the
    load average.

Run alone: ``python scripts/bench/follow.py`` (its own PostgreSQL and
Redis) or ``make bench BENCH="--only follow"``; ``FOLLOW_SECONDS`` sets the
window, ``FOLLOW_RATES`` the rates (``40,2000``).
"""

import http.client
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

from bigfact import _Cleanups  # noqa: E402
from common import record  # noqa: E402
from redis_bench import proc_cpu  # noqa: E402
from tcp import synapse_python  # noqa: E402

SECONDS = float(os.environ.get("FOLLOW_SECONDS", "20"))
RATES = [int(r) for r in os.environ.get("FOLLOW_RATES", "40,2000").split(",")]
WRITER_THREADS = 8
SYNAPSE_CLIENT = os.path.join(HERE, "synapse_client.py")
SERVER_NAME = "hs.test"  # tests.test_cli.base_config's
STREAM = {"name": "ev", "table": "follow_stream", "columns": [{"n": "bigint"}, {"s": "text"}],
          "writers": ["master"]}
BODY = json.dumps({"rows": [[1, "a row of a fact"]]}).encode()


def thread_cpu(pid):
    """``{tid: (name, cpu seconds)}`` of every thread of ``pid``."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


class Writers:
    """Threads that POST one-row facts to the master, ``rate`` a second in
    all, until told to stop; ``last`` is the largest token answered."""

    def __init__(self, base: str, secret: str, rate: float):
        host, port = base.split("//", 1)[1].split(":")
        self.host, self.port, self.secret = host, int(port), secret
        self.rate = rate
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.next_at = 0.0
        self.count = 0
        self.last = 0
        self.errors = []

    def _slot(self):
        with self.lock:
            at = self.next_at
            self.next_at += 1.0 / self.rate
        return at

    def _run(self):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        headers = {"Authorization": f"Bearer {self.secret}", "Content-Type": "application/json"}
        try:
            while not self.stopping.is_set():
                delay = self._slot() - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                conn.request("POST", "/_replicator/v1/streams/ev/facts", BODY, headers)
                response = conn.getresponse()
                answer = response.read()
                if response.status != 200:
                    raise RuntimeError(f"the write answered {response.status}: {answer[:200]!r}")
                token = json.loads(answer)["stream_id"]
                with self.lock:
                    self.count += 1
                    self.last = max(self.last, token)
        except Exception as e:  # reported by run()
            self.errors.append(e)
        finally:
            conn.close()

    def run(self, seconds: float) -> None:
        self.next_at = time.monotonic()
        threads = [threading.Thread(target=self._run, daemon=True)
                   for _ in range(WRITER_THREADS if self.rate > 100 else 1)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        self.stopping.set()
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]


class SynapseClient:
    """``synapse_client.py`` connected to the master's TCP port."""

    def __init__(self, python: str, port: int):
        self.proc = subprocess.Popen([python, SYNAPSE_CLIENT, "127.0.0.1", str(port),
                                      SERVER_NAME], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def state(self) -> dict:
        self.proc.stdin.write("state\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("synapse_client.py ended")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _in_file(path: str, token: int) -> bool:
    """Whether fact ``token``'s line is complete at the end of a file."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            tail = f.read()
    except FileNotFoundError:
        return False
    at = tail.rfind(b'"token":%d,' % token)
    return at >= 0 and tail.endswith(b"\n")


def _window(master, worker, synapse, rate: float, seconds: float) -> dict:
    """Facts at ``rate`` for ``seconds``: the worker's and Synapse's CPU."""
    from tests.servers import wait_for
    from tests.test_cli import SECRET

    pid = worker.proc.pid
    path = os.path.join(worker.dir, "facts.jsonl")
    writers = Writers(master.http_base, SECRET, rate)
    threads0 = thread_cpu(pid)
    cpu0 = proc_cpu(pid)
    syn0 = synapse.state() if synapse else None
    start = time.monotonic()
    writers.run(seconds)
    wait_for(lambda: _in_file(path, writers.last), 120, f"fact {writers.last} at the worker")
    if synapse:
        wait_for(lambda: synapse.state()["last"] >= writers.last, 120,
                 f"fact {writers.last} at Synapse's client")
    elapsed = time.monotonic() - start
    cpu = proc_cpu(pid) - cpu0
    threads1 = thread_cpu(pid)
    out = {"facts": writers.count, "elapsed": elapsed, "cpu": cpu, "threads": {
        tid: t - threads0.get(tid, (name, 0.0))[1] for tid, (name, t) in threads1.items()}}
    if synapse:
        syn1 = synapse.state()
        out["synapse_cpu"] = syn1["cpu"] - syn0["cpu"]
        out["synapse_facts"] = syn1["facts"] - syn0["facts"]
    return out


def run_transport(dsn: str, transport: str, rates, seconds: float) -> None:
    from tests.servers import RedisServer, free_port, wait_for
    from tests.test_cli import Daemon, base_config, http

    cleanups = _Cleanups()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    try:
        rep_port = free_port()
        listen = {"listen": f"tcp:{rep_port}:interface=127.0.0.1"}
        if transport == "tcp":
            master_rep, worker_rep = listen, {"upstream": f"tcp:host=127.0.0.1:port={rep_port}"}
        else:
            redis = RedisServer()
            cleanups.addCleanup(redis.stop)
            # The master also listens on TCP: Synapse's client is fed there.
            master_rep = dict(listen, redis={"endpoint": redis.endpoint})
            worker_rep = {"redis": {"endpoint": redis.endpoint}}
        master = Daemon(cleanups, base_config(
            "master", free_port(), [STREAM], database={"postgres": dsn}, log_level="warn",
            replication=master_rep), "master", env=env).start()
        worker = Daemon(cleanups, base_config(
            "worker1", free_port(), [STREAM], database={"postgres": dsn}, log_level="warn",
            replication=worker_rep, consumers=[{"type": "jsonl", "path": "facts.jsonl"}]),
            "worker1", env=env).start()
        wait_for(lambda: http(worker.http_base + "/health")[0] == 200, 60, "worker linked")
        python = synapse_python()
        synapse = SynapseClient(python, rep_port) if python else None
        if synapse:
            cleanups.addCleanup(synapse.stop)
        # A first fact through both, then a quiet second: the window starts idle.
        _window(master, worker, synapse, 10, 0.2)
        time.sleep(1.0)
        for rate in rates:
            w = _window(master, worker, synapse, rate, seconds)
            us = w["cpu"] / w["facts"] * 1e6
            load = os.getloadavg()
            print(f"  follow {transport} {rate} facts/s: {w['facts']:,} facts in "
                  f"{w['elapsed']:.1f} s ({w['facts'] / w['elapsed']:,.0f}/s); worker CPU "
                  f"{w['cpu']:.2f} s = {100 * w['cpu'] / w['elapsed']:.2f}% of a core, "
                  f"{us:.0f} us/fact; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
                  flush=True)
            reactor_cpu = w["threads"].get(str(worker.proc.pid), 0.0)
            print(f"    worker CPU, us/fact: the reactor's thread "
                  f"{reactor_cpu / w['facts'] * 1e6:.0f}, its other threads (database pool, "
                  f"file) {(w['cpu'] - reactor_cpu) / w['facts'] * 1e6:.0f}", flush=True)
            syn_us = None
            if synapse:
                syn_us = w["synapse_cpu"] / max(1, w["synapse_facts"]) * 1e6
                print(f"    Synapse's client: {w['synapse_facts']:,} facts, CPU "
                      f"{w['synapse_cpu']:.2f} s = {100 * w['synapse_cpu'] / w['elapsed']:.2f}% "
                      f"of a core, {syn_us:.0f} us/fact", flush=True)
            record(f"follow.{transport}.{rate}fps.cpu_us_per_fact", us, "us",
                   "Synapse's ClientReplicationStreamProtocol, same lines (TCP)", syn_us,
                   higher_is_better=False)
        warned = [line for line in worker.output().splitlines()
                  if " WARN " in line or " ERROR " in line]
        print(f"    the worker's warnings and errors: {len(warned)}"
              + (f", the first: {warned[0]}" if warned else ""), flush=True)
    finally:
        cleanups.run()


def run(dsn: str) -> None:
    """The phase (blocking: processes and threads)."""
    for transport in ("tcp", "redis"):
        run_transport(dsn, transport, RATES, SECONDS)


if __name__ == "__main__":
    from tests.servers import PostgresServer

    server = PostgresServer(fsync=True)
    try:
        run(server.create_database("followbench"))
    finally:
        server.stop()
