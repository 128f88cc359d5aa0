"""Phase 2: hostile connections over real sockets against a running
``replicator run``, beside an honest writer (HTTP) and an honest reader
(TCP); with phase 6's stall monitor inside the daemon and a latency probe
outside (``/health`` and a REPLICATE round trip).

Invariants: the honest reader is never disconnected and gets every fact the
table holds, exactly (rows and IDs), and nothing else from the writer; the
honest writer never gets an error; every line the daemon sends a fuzz
connection is a valid command within the line limit; the daemon logs no
traceback and no critical event, stays alive, stops cleanly (exit 0) on
SIGTERM, its RSS grows boundedly, and its reactor never stalls over 100 ms.
"""

import json
import os
import random
import re
import shutil
import socket
import struct
import tempfile
import threading
import time

from . import inputs
from .daemon import (
    SECRET,
    Daemon,
    HonestReader,
    HonestWriter,
    canonical,
    http_get,
    log_problems,
    table_facts,
    wait_for,
)
from .lines import _judge_line
from .results import PhaseResult, show

STALL_LIMIT = 0.1
#: RSS growth (KB) over the phase that counts as unbounded.
RSS_LIMIT_KB = 100 * 1024
#: Small bookkeeping caps (issue 11 item 5), so that the flood family reaches them.
CAPS = {"max_user_ips": 300, "max_user_syncs": 300, "max_federation_acks": 50}
#: Prometheus series (lines) beyond which /metrics counts as unbounded.
METRICS_LIMIT = 3000


class Prober(threading.Thread):
    """Outside latency probe: /health and a REPLICATE -> POSITION round trip."""

    def __init__(self, daemon: Daemon, interval: float = 0.25):
        super().__init__(daemon=True)
        self.d = daemon
        self.interval = interval
        self.health = []
        self.replicate = []
        self.failures = []
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.d.rep_port), timeout=10)
            sock.sendall(b"NAME prober\n")
        except OSError as e:
            self.failures.append(f"connect: {e}")
            return
        sock.settimeout(10)
        buffer = b""
        while not self.stopping.wait(self.interval):
            try:
                t = time.monotonic()
                status, _ = http_get(self.d.http_port, "/health")
                self.health.append(time.monotonic() - t)
                t = time.monotonic()
                sock.sendall(b"PING 1\nREPLICATE\n")
                while b"POSITION events master" not in buffer:
                    data = sock.recv(1 << 16)
                    if not data:
                        raise OSError("EOF")
                    buffer += data
                self.replicate.append(time.monotonic() - t)
                buffer = b""
            except OSError as e:
                self.failures.append(f"{type(e).__name__}: {e}")
                return
        sock.close()

    def stop(self):
        self.stopping.set()
        self.join(15)


def _fuzz_connection(port: int, rng: random.Random, result: PhaseResult, lock) -> None:
    prefix = rng.choice([b"", b"NAME worker1\n", b"NAME worker1\nREPLICATE\n",
                         b"NAME fuzz\nREPLICATE\n", b"REPLICATE\n"])
    families = list(inputs.FAMILIES)
    payload = b""
    used = []
    for _ in range(rng.randint(1, 4)):
        family = rng.choice(families)
        payload += inputs.FAMILIES[family](rng, "server")
        used.append(family)
    mode = rng.choice(["read", "read", "read", "rst", "noread"])
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError as e:
        with lock:
            result.found("connect_failed", type(e).__name__, used[0], show(payload), str(e))
        return
    received = b""
    try:
        sock.sendall(prefix)
        for chunk in inputs.chunks(rng, payload):
            sock.sendall(chunk)
        if mode == "rst":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif mode == "read":
            sock.settimeout(0.3)
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    break
                if not data:
                    break
                received += data
    except OSError:
        pass  # the daemon closed on us: expected after garbage
    finally:
        sock.close()
    with lock:
        for family in used:
            result.tried(family)
        for line in received.split(b"\n")[:-1]:
            why = _judge_line(line, "client")
            if why is not None:
                result.found("bad_line_to_fuzzer", why[:60], used[0], show(payload), show(line))


def run_phase(seed: int, connections: int, threads: int = 3, honest_streams=("caches", "events"),
              postgres_dsn: str | None = None, keep_dir: bool = False) -> PhaseResult:
    result = PhaseResult("2-sockets-pg" if postgres_dsn else "2-sockets")
    directory = tempfile.mkdtemp(prefix="fuzz-sockets-")
    daemon = Daemon(directory, postgres_dsn, **CAPS)
    try:
        daemon.start()
        rss0 = daemon.rss_kb()
        reader = HonestReader(daemon.rep_port)
        reader.start()
        reader.connected.wait(10)
        writer = HonestWriter(daemon.http_port, honest_streams, seed=seed, pause=0.005)
        writer.start()
        prober = Prober(daemon)
        prober.start()
        lock = threading.Lock()
        counter = {"n": 0}

        def worker(k: int) -> None:
            while True:
                with lock:
                    i = counter["n"]
                    if i >= connections:
                        return
                    counter["n"] += 1
                # One generator per connection: the same inputs whatever the threads do.
                _fuzz_connection(daemon.rep_port, random.Random(seed * 1_000_003 + i), result,
                                 lock)

        workers = [threading.Thread(target=worker, args=(k,), daemon=True)
                   for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        writer.stop()
        prober.stop()
        result.tried("connections", 0)
        result.figure("fuzz_connections", counter["n"])
        result.figure("honest_facts_written", sum(len(v) for v in writer.written.values()))
        wait_caught_up(result, reader, writer, os.path.join(directory, "state.db"),
                       postgres_dsn)
        _check_bounds(result, daemon)
        rss1 = daemon.rss_kb()
        result.figure("rss_kb_before_after", f"{rss0} -> {rss1}")
        if rss1 - rss0 > RSS_LIMIT_KB:
            result.found("memory_growth", f"RSS grew by {(rss1 - rss0) // 1024} MB", "-", "")
        alive = daemon.alive()
        reader.stop()
        code = daemon.stop()
        if not alive:
            result.found("daemon_died", f"exit {daemon.proc.returncode}", "-", "")
        elif code != 0:
            result.found("unclean_stop", f"exit {code}", "-", "")
        _check_honest(result, reader, writer, os.path.join(directory, "state.db"),
                      postgres_dsn)
        _check_daemon(result, daemon, prober)
    finally:
        daemon.kill()
        if not keep_dir:
            shutil.rmtree(directory, ignore_errors=True)
    return result.done()


def _check_bounds(result, daemon: Daemon) -> None:
    """Bookkeeping within its caps, /metrics within a bounded number of series."""
    for path, key, cap in (("user_ips", "user_ips", CAPS["max_user_ips"]),
                           ("federation_acks", "acks", CAPS["max_federation_acks"])):
        status, body = http_get(daemon.http_port, f"/_replicator/v1/{path}", SECRET, timeout=30)
        n = len(json.loads(body)[key]) if status == 200 else -1
        result.figure(f"{path}_kept", n)
        if n > cap:
            result.found("bookkeeping_over_cap", f"{path}: {n} > {cap}", "flood", "")
    status, body = http_get(daemon.http_port, "/_replicator/v1/user_syncs", SECRET, timeout=30)
    if status == 200:
        n = sum(len(v) for v in json.loads(body)["user_syncs"].values())
        result.figure("user_syncs_kept", n)
        if n > CAPS["max_user_syncs"]:
            result.found("bookkeeping_over_cap", f"user_syncs: {n} > {CAPS['max_user_syncs']}",
                         "flood", "")
    status, body = http_get(daemon.http_port, "/metrics", timeout=30)
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    result.figure("metrics_series", series)
    if series > METRICS_LIMIT:
        result.found("metrics_unbounded", f"{series} series", "-", "")


def wait_caught_up(result, reader, writer, db_path, dsn) -> None:
    """Wait until the reader has seen every master fact in the table."""
    table = table_facts(db_path, dsn)
    last = {s: max(table.get((s, "master"), {0: None})) for s in writer.streams}
    try:
        wait_for(lambda: all(reader.positions.get((s, "master"), 0) >= i
                             for s, i in last.items()) or reader.disconnected,
                 60, "honest reader caught up")
    except AssertionError as e:
        result.found("honest_reader_behind", str(e), "-", "",
                     f"reader at {reader.positions}, table at {last}")


def _check_honest(result, reader, writer, db_path, dsn) -> None:
    if reader.disconnected:
        result.found("honest_reader_disconnected", reader.disconnected, "-", "",
                     f"errors: {reader.errors[:3]}")
    for error in reader.errors:
        result.found("honest_reader_got_error", error[:80], "-", "")
    for line in reader.bad_lines:
        result.found("bad_line_to_honest_reader", "invalid line", "-", show(line))
    for failure in writer.failures:
        result.found("honest_writer_failed", failure[:80], "-", "")
    table = table_facts(db_path, dsn)
    for stream in writer.streams:
        key = (stream, "master")
        got = canonical(reader.facts.get(key, {}))
        want = canonical(table.get(key, {}))
        acked = canonical({k: v for k, v in writer.written[stream].items() if v})
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(t for t in set(got) & set(want) if got[t] != want[t])
        if missing:
            result.found("honest_reader_lost_facts", f"{stream}: {len(missing)} facts missing",
                         "-", "", f"first missing IDs {missing[:5]}; reader positions "
                         f"{ {f'{s}/{w}': p for (s, w), p in reader.positions.items()} }")
        if extra or wrong:
            result.found("honest_reader_wrong_facts", f"{stream}: {len(extra)} extra, "
                         f"{len(wrong)} different", "-", "", f"{(extra + wrong)[:5]}")
        not_in_table = sorted(t for t in acked if want.get(t) != acked[t])
        if not_in_table:
            result.found("acknowledged_write_lost", f"{stream}: {len(not_in_table)}", "-", "",
                         f"{not_in_table[:5]}")
        result.figure(f"{stream}_facts_compared", len(want))
    # Anything the reader got from another writer was relayed from a fuzzer.
    relayed = sum(len(v) for (s, w), v in reader.facts.items() if w != "master")
    result.figure("facts_relayed_from_fuzzers", relayed)


def _check_daemon(result, daemon: Daemon, prober: Prober | None) -> None:
    for kind, line in log_problems(daemon.output()):
        result.found(kind, line, "-", "", "")
    # Peer text is escaped in logs (issue 11 item 14): no raw control character.
    with open(daemon.log_path, "rb") as f:
        for line in f:
            m = re.search(rb"[\x00-\x08\x0b-\x1f\x7f]", line.rstrip(b"\n"))
            if m:
                words = line.split(b" ", 3)
                result.found("log_control_chars", " ".join(w.decode("utf-8", "replace")
                                                          for w in words[:2]), "-", "",
                             show(line[:200]))
    stalls = daemon.stalls()
    busy = [(late, cpu) for late, cpu in stalls if cpu >= STALL_LIMIT]
    result.figure("reactor_stalls_over_100ms", len(stalls))
    result.figure("largest_reactor_stall_s", round(max((l for l, _ in stalls), default=0), 3))
    result.figure("load_average", os.getloadavg()[0])
    if busy:
        late, cpu = max(busy)
        result.found("reactor_stall", f"reactor thread busy over {STALL_LIMIT * 1000:.0f} ms",
                     "-", "", f"{len(busy)} stalls; largest {late:.3f}s with {cpu:.3f}s CPU")
    if prober is not None:
        for name, values in (("health", prober.health), ("replicate", prober.replicate)):
            if values:
                values = sorted(values)
                result.figure(f"{name}_latency_ms_p50_max",
                              f"{values[len(values) // 2] * 1000:.1f} / {values[-1] * 1000:.1f}")
        for failure in prober.failures:
            result.found("prober_failed", failure[:80], "-", "")
