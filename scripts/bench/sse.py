#!/usr/bin/env python3
"""Read API benchmarks: Server-Sent Events beside the TCP fan-out, and a
catch-up through pages beside a raw keyset ``SELECT``.

The server is a real ``replicator run`` process (PostgreSQL, fsync on):
the read API is its HTTP listener, the TCP fan-out its replication
listener, in the same process, so both are measured in the same run on the
same daemon.  Clients are separate processes: ``sse_reader.py`` for events
(``GET .../events?from=now``, HTTP/1.0), ``reader.py`` for TCP (``NAME`` +
``REPLICATE``), up to ``PER_PROCESS`` sockets each (1,000 clients = 20
processes of 50: more processes would measure the scheduler of 2 cores).
Facts are written through the daemon's write API (``POST``, one fact per
request, ``WRITERS`` threads on keep-alive connections); every figure is
taken for each client count of ``CLIENTS`` (1, 50, 1,000), SSE then TCP:

``sse.rows_per_s.<N>clients`` (baseline: TCP to the same N)
    ``BURST_FACTS[N]`` facts of ``BURST_ROWS`` rows written as fast as the
    write API takes them; rows / (last arrival at the slowest client -
    first write).  TCP sends one RDATA line per row, SSE one event per fact
    (all its rows): rows are what both deliver.  At 1 client both are
    bounded by the write path, not the fan-out.
``sse.latency.<N>clients.p99_ms`` (baseline: TCP to the same N)
    ``LAT_RATE`` facts/s (one row each) for ``LAT_SECONDS``, paced by the
    wall clock; commit -> arrival for every (client, fact) after
    ``LAT_WARMUP`` s.  A fact's commit time is when the write API's answer
    (sent after the commit) reached the writer: it is later than the commit
    by one loopback answer, so an event can arrive "before" its commit
    (counted as a negative delay), and when the daemon is busy its answers
    are late too; the delay from the request (an upper bound) is printed
    beside it.  The issue's target is 1,000 clients at
    200 facts/s with p99 <= 100 ms.  Also printed: facts/s delivered per
    client, events missing at the end.
``sse.rss_per_client_kb.<N>clients`` (baseline: TCP to the same N)
    The VmRSS of a daemon started for this alone, with the N clients
    connected and idle (after ``SETTLE`` s) minus before they connected,
    over N (a daemon that served clients before reuses the memory they
    freed: TCP measured after SSE on one daemon showed 0 KB).  Target
    <= 50 KB.  Not counted: the kernel's socket buffers.
``sse.pages.facts_per_s`` (baseline: raw keyset SELECT of the same rows)
    ``PAGE_FACTS`` facts (``--big``: 1,000,000; every tenth of three
    rows, generated inside PostgreSQL as ``catchup.py`` does) read from the
    beginning through ``GET .../facts?limit=1000`` on one keep-alive
    connection, each page's JSON parsed, until an empty page; against
    ``catchup.raw_pass`` (psycopg2, keyset pages of 1,000 rows).  Rounds
    alternate; medians recorded.
``sse.pages.ndjson.facts_per_s`` (baseline: the same raw pass, same rounds)
    The same walk with ``Accept: application/x-ndjson`` (docs/read-api.md,
    "Page formats"), every line parsed with ``orjson.loads`` (the head, then
    one fact a line, rows as arrays), and the stdlib ``json.loads`` of the
    same lines printed beside it.

``ds.rows_per_s.<N>clients``, ``ds.latency.<N>clients.p99_ms`` (baseline: SSE to the same N)
    The same two figures for Durable Streams readers
    (``GET .../ds/{stream}?offset=now&live=sse``, docs/read-api.md
    "Durable Streams"), for each client count of ``DS_CLIENTS`` (50): each
    reads its own pages, where ``.../events`` shares one encoding.

Run alone: ``python scripts/bench/sse.py [--only fanout,pages] [--big]``.
"""

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

import yaml  # noqa: E402
from common import delays_ms, median, percentile, rate, record  # noqa: E402

SSE_READER = os.path.join(HERE, "sse_reader.py")
TCP_READER = os.path.join(HERE, "reader.py")
SECRET = "sse-bench-write-secret-0123456789"
READER_SECRET = "sse-bench-reader-secret-0123456789"
STREAM = {"name": "bench", "table": "sse_bench",
          "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
          "writers": ["master"]}
CLIENTS = [int(c) for c in os.environ.get("SSE_CLIENTS", "1,50,1000").split(",") if c]
DS_CLIENTS = [int(c) for c in os.environ.get("DS_CLIENTS", "50").split(",") if c]
PER_PROCESS = 50
WRITERS = 8
BURST_ROWS = 20
BURST_FACTS = {1: 3000, 50: 600, 1000: 60}
LAT_RATE = 200
LAT_SECONDS = float(os.environ.get("SSE_LAT_SECONDS", "5"))
LAT_WARMUP = 1.0
SETTLE = 2.0
DRAIN = 60.0  # seconds the readers get after the last write
PAGE = 1000
PAGE_FACTS = 100_000
PAGE_FACTS_BIG = 1_000_000
PAGE_ROUNDS = 3


# ------------------------------------------------------------------ daemon

def free_port() -> int:
    from tests.servers import free_port as free

    return free()


class Daemon:
    """One ``replicator run`` (the server of every figure), by PID."""

    def __init__(self, dsn: str, stream: dict, clients: int):
        self.dir = tempfile.mkdtemp(prefix="sse-bench-")
        self.http_port = free_port()
        self.rep_port = free_port()
        secret_file = os.path.join(self.dir, "reader.secret")
        with open(secret_file, "w") as f:
            f.write(READER_SECRET + "\n")
        os.chmod(secret_file, 0o600)
        config = {
            "server_name": "bench.test", "instance_name": "master", "log_level": "warn",
            "database": {"postgres": dsn},
            "streams": [stream],
            "replication": {"listen": f"tcp:{self.rep_port}:interface=127.0.0.1:backlog=1024",
                            "max_connections": clients + 16,
                            "max_connections_per_address": clients + 16,
                            # All connect at once; an idle phase is not idle.
                            "max_unidentified": clients + 16,
                            "idle_timeout": 3600},
            "http": {"listen": f"tcp:{self.http_port}:interface=127.0.0.1:backlog=1024",
                     "secret": SECRET,
                     "max_connections": clients + 64,
                     "max_connections_per_address": clients + 64,
                     "max_waiting_reads": clients + 16,
                     "max_waiting_reads_per_address": clients + 16,
                     "readers": [{"name": "bench", "secret_file": secret_file,
                                  "streams": [stream["name"]]}]},
        }
        self.path = os.path.join(self.dir, "config.yaml")
        with open(self.path, "w") as f:
            yaml.safe_dump(config, f)
        self.log = open(os.path.join(self.dir, "out.log"), "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                              if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "replicator.cli", "run", "-c", self.path], cwd=self.dir,
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited: {self.tail()}")
            try:
                if self.get("/_replicator/v1/positions", SECRET)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not answer: {self.tail()}")
            time.sleep(0.1)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def get(self, path: str, secret: str = None):
        request = urllib.request.Request(self.base + path)
        if secret:
            request.add_header("Authorization", f"Bearer {secret}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def rss_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def tcp_clients(self) -> int:
        snap = json.loads(self.get("/status.json")[1])
        return sum(1 for c in snap["connections"] if c["role"] != "upstream")

    def tail(self) -> str:
        with open(os.path.join(self.dir, "out.log"), "rb") as f:
            return f.read().decode(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------ writers

class Writes:
    """Facts through the write API from ``WRITERS`` threads, each on its own
    keep-alive connection; ``answered[stream_id]``: when its answer came."""

    def __init__(self, daemon: Daemon, stream: str):
        self.port = daemon.http_port
        self.path = f"/_replicator/v1/streams/{stream}/facts"
        self.answered = {}
        self.sent = {}
        self.first_sent = None
        self.errors = []

    def _post(self, conn, rows) -> int:
        body = json.dumps({"rows": rows}).encode()
        conn.request("POST", self.path, body, {"Authorization": f"Bearer {SECRET}",
                                               "Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"write answered {response.status}: {data[:200]!r}")
        return json.loads(data)["stream_id"]

    def run(self, facts: int, rows: int, rate_per_s: float = None) -> int:
        """Write ``facts`` facts of ``rows`` rows, at ``rate_per_s`` facts/s
        by the wall clock (None: as fast as possible); the facts written."""
        lock = threading.Lock()
        counter = iter(range(facts))
        start = time.time()
        self.first_sent = start

        def work():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                while True:
                    with lock:
                        i = next(counter, None)
                    if i is None:
                        return
                    if rate_per_s:
                        due = start + i / rate_per_s
                        delay = due - time.time()
                        if delay > 0:
                            time.sleep(delay)
                    sent = time.time()
                    token = self._post(conn, [[f"f{i}", [f"@u{i}:bench"], j]
                                              for j in range(rows)])
                    self.answered[token] = time.time()
                    self.sent[token] = sent
            except Exception as e:  # reported, the run goes on
                self.errors.append(repr(e))
            finally:
                conn.close()

        threads = [threading.Thread(target=work) for _ in range(WRITERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.errors:
            raise RuntimeError(f"writes failed: {self.errors[:3]}")
        return len(self.answered)


# ------------------------------------------------------------------ readers

class Readers:
    """Reader processes holding ``clients`` connections (SSE or TCP)."""

    def __init__(self, daemon: Daemon, kind: str, clients: int, mode: str):
        self.kind = kind
        self.daemon = daemon
        self.procs = []
        left, k = clients, 0
        while left > 0:
            n = min(PER_PROCESS, left)
            if kind in ("sse", "ds"):
                path = (f"/_replicator/v1/ds/{STREAM['name']}?offset=now&live=sse"
                        if kind == "ds" else
                        f"/_replicator/v1/streams/{STREAM['name']}/events?from=now")
                args = [sys.executable, SSE_READER, "--port", str(daemon.http_port),
                        "--path", path, "--secret", READER_SECRET, "--sockets", str(n),
                        "--mode", "latency" if mode == "latency" else "count",
                        "--format", "ds" if kind == "ds" else "events", "--timeout", "600"]
            else:
                args = [sys.executable, TCP_READER, "--port", str(daemon.rep_port),
                        "--sockets", str(n), "--mode", mode, "--name", f"r{k}",
                        "--timeout", "600"]
            self.procs.append(subprocess.Popen(args, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE))
            left -= n
            k += 1
        if kind in ("sse", "ds"):
            for p in self.procs:  # every connection has its 200 and is live
                line = p.stdout.readline()
                if b'"ready"' not in line:
                    raise RuntimeError(f"an SSE reader did not start: {line[:300]!r}")
        else:
            deadline = time.monotonic() + 120
            while daemon.tcp_clients() < clients:
                if time.monotonic() > deadline:
                    raise RuntimeError("the TCP readers did not all connect")
                time.sleep(0.1)
            time.sleep(0.5)  # REPLICATE handled: their POSITION lines sent

    def finish(self, expect: int, drain: float = DRAIN) -> list:
        """Tell them how many to expect; their results once all got them
        (or ``drain`` s passed: then they stop with what they have)."""
        for p in self.procs:
            p.stdin.write(b"%d\n" % expect)
            p.stdin.flush()
        deadline = time.monotonic() + drain
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.close()

    def close(self) -> list:
        results = []
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            out = p.stdout.read().decode()
            p.wait(60)
            lines = [line for line in out.splitlines() if line.startswith("{")
                     and '"counts"' in line]
            if lines:
                results.append(json.loads(lines[-1]))
        if self.kind == "tcp":  # gone from the daemon before the next count
            deadline = time.monotonic() + 60
            while self.daemon.tcp_clients() and time.monotonic() < deadline:
                time.sleep(0.1)
        return results


def slowest_arrival(results, expect):
    last, short = 0.0, 0
    for r in results:
        for count, at in zip(r["counts"], r["last_at"]):
            short += max(0, expect - count)
            last = max(last, at)
    return last, short


# ------------------------------------------------------------------ phases

def burst(daemon: Daemon, kind: str, clients: int) -> float:
    readers = Readers(daemon, kind, clients, "count")
    facts = BURST_FACTS.get(clients, max(30, 60_000 // clients))
    writes = Writes(daemon, STREAM["name"])
    try:
        writes.run(facts, BURST_ROWS)
    except Exception:
        readers.close()
        raise
    expect = facts * BURST_ROWS if kind == "tcp" else facts
    results = readers.finish(expect)
    last, short = slowest_arrival(results, expect)
    rows_per_s = rate(facts * BURST_ROWS, last - writes.first_sent)
    print(f"    {kind} to {clients}: {facts} facts x {BURST_ROWS} rows in "
          f"{last - writes.first_sent:.2f} s to the slowest client: {rows_per_s:,.0f} rows/s"
          f" per client" + (f"; {short} {'rows' if kind == 'tcp' else 'events'} missing"
                            if short else ""), flush=True)
    return rows_per_s


def latency(daemon: Daemon, kind: str, clients: int) -> tuple:
    readers = Readers(daemon, kind, clients, "latency")
    facts = int(LAT_RATE * LAT_SECONDS)
    writes = Writes(daemon, STREAM["name"])
    try:
        writes.run(facts, 1, LAT_RATE)
    except Exception:
        readers.close()
        raise
    results = readers.finish(facts)
    delays, missing = delays_ms(results, writes.answered, writes.first_sent + LAT_WARMUP)
    # The commit lies between the request and its answer: from the request,
    # an upper bound (when the daemon is busy its answer is late too).
    upper, _ = delays_ms(results, writes.sent, writes.first_sent + LAT_WARMUP)
    last = max((max(r["last_at"]) for r in results), default=0.0)
    per_client = rate(facts, last - writes.first_sent)
    written = rate(facts, max(writes.answered.values()) - writes.first_sent)
    p50, p99 = percentile(delays, 50), percentile(delays, 99)
    print(f"    {kind} to {clients} at {LAT_RATE} facts/s: commit -> arrival p50 {p50:.1f} ms, "
          f"p99 {p99:.1f} ms, max {delays[-1] if delays else float('nan'):.0f} ms (from the "
          f"request: p99 {percentile(upper, 99):.1f} ms); "
          f"written at {written:,.0f} facts/s, {per_client:,.0f} facts/s delivered per client"
          + (f"; {missing} arrivals missing" if missing else ""), flush=True)
    return p99, missing


def idle_rss(new_dsn, kind: str, clients: int) -> float:
    """KB of the daemon's RSS per idle client, on a daemon of its own (a
    heap that served other clients before reuses what they freed)."""
    daemon = Daemon(new_dsn(), STREAM, clients)
    try:
        time.sleep(SETTLE)
        before = daemon.rss_kb()
        readers = Readers(daemon, kind, clients, "count")
        time.sleep(SETTLE)
        after = daemon.rss_kb()
        readers.close()
    finally:
        daemon.stop()
    per = (after - before) / clients
    print(f"    {kind}: {clients} idle clients: daemon RSS {before / 1024:.1f} -> "
          f"{after / 1024:.1f} MB, {per:.1f} KB each", flush=True)
    return per


def run_fanout(new_dsn) -> None:
    """``new_dsn()``: a fresh database for each daemon."""
    daemon = Daemon(new_dsn(), STREAM, max(CLIENTS))
    try:
        for clients in CLIENTS:
            print(f"  {clients} client{'s' if clients > 1 else ''}", flush=True)
            figures = {}
            for kind in ("sse", "tcp"):
                figures[kind] = {
                    "rss": idle_rss(new_dsn, kind, clients) if clients >= 50 else None,
                    "rows": burst(daemon, kind, clients),
                    "lat": latency(daemon, kind, clients),
                }
            name = f"{clients}client{'s' if clients > 1 else ''}"
            sse, tcp = figures["sse"], figures["tcp"]
            record(f"sse.rows_per_s.{name}", sse["rows"], "rows/s", f"TCP to {clients}",
                   tcp["rows"])
            record(f"sse.latency.{name}.p99_ms", max(sse["lat"][0], 0.001), "ms",
                   f"TCP to {clients}", max(tcp["lat"][0], 0.001), higher_is_better=False)
            if sse["rss"] is not None:
                record(f"sse.rss_per_client_kb.{name}", max(sse["rss"], 0.001), "KB",
                       f"TCP to {clients}", max(tcp["rss"], 0.001), higher_is_better=False)
            if clients in DS_CLIENTS:
                ds = {"rows": burst(daemon, "ds", clients), "lat": latency(daemon, "ds", clients)}
                record(f"ds.rows_per_s.{name}", ds["rows"], "rows/s", f"SSE to {clients}",
                       sse["rows"])
                record(f"ds.latency.{name}.p99_ms", max(ds["lat"][0], 0.001), "ms",
                       f"SSE to {clients}", max(sse["lat"][0], 0.001), higher_is_better=False)
    finally:
        daemon.stop()


def ndjson_page(body: bytes, loads) -> tuple:
    """``(facts, next)`` of an NDJSON page: facts as ``[stream_id,
    writer, rows]``, each line parsed by ``loads``."""
    lines = body.split(b"\n")
    head = loads(lines[0])
    return [loads(line) for line in lines[1:-1]], head["next"]


def page_pass(daemon: Daemon, stream: str, facts: int, form: str = "json") -> float:
    """Every fact from the beginning through pages: seconds.  ``form``:
    ``json``; ``ndjson`` (parsed with orjson) or ``ndjson-stdlib``."""
    import orjson

    conn = http.client.HTTPConnection("127.0.0.1", daemon.http_port, timeout=60)
    headers = {"Authorization": f"Bearer {READER_SECRET}"}
    if form != "json":
        headers["Accept"] = "application/x-ndjson"
        loads = orjson.loads if form == "ndjson" else json.loads
    start = time.monotonic()
    token, seen, last_id = None, 0, 0
    while True:
        path = f"/_replicator/v1/streams/{stream}/facts?limit={PAGE}"
        if token is not None:
            path += f"&from={token}"
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"page answered {response.status}: {body[:200]!r}")
        if form == "json":
            page = json.loads(body)
            if not page["facts"]:
                break
            for fact in page["facts"]:
                if fact["stream_id"] <= last_id:
                    raise RuntimeError(f"fact {fact['stream_id']} after {last_id}")
                last_id = fact["stream_id"]
            seen += len(page["facts"])
            token = page["next"]
            continue
        got, token = ndjson_page(body, loads)
        if not got:
            break
        for fact in got:
            if fact[0] <= last_id:
                raise RuntimeError(f"fact {fact[0]} after {last_id}")
            last_id = fact[0]
        seen += len(got)
    took = time.monotonic() - start
    conn.close()
    if seen != facts:
        raise RuntimeError(f"pages gave {seen} facts of {facts}")
    return took


def run_pages(dsn: str, facts: int) -> None:
    import catchup

    from replicator.config import parse_streams
    from tests.support import create_stream_tables

    stream = dict(catchup.STREAM)
    create_stream_tables(dsn, parse_streams([stream]))
    rows = catchup.generate(dsn, facts)
    print(f"  pages: {facts:,} facts, {rows:,} rows", flush=True)
    daemon = Daemon(dsn, stream, 8)
    pages, nds, raws = [], [], []
    rounds = PAGE_ROUNDS
    try:
        for i in range(rounds):
            pages.append(page_pass(daemon, stream["name"], facts))
            nds.append(page_pass(daemon, stream["name"], facts, "ndjson"))
            stdlib = page_pass(daemon, stream["name"], facts, "ndjson-stdlib")
            raws.append(catchup.raw_pass(dsn, facts)[0])
            print(f"    round {i + 1}: JSON pages {pages[-1]:.2f} s, NDJSON pages "
                  f"{nds[-1]:.2f} s (json.loads: {stdlib:.2f} s), raw SELECT "
                  f"{raws[-1]:.2f} s ({raws[-1] / nds[-1]:.2f}), "
                  f"daemon RSS {daemon.rss_kb() / 1024:.0f} MB, load {os.getloadavg()[0]:.1f}",
                  flush=True)
    finally:
        daemon.stop()
    record("sse.pages.facts_per_s", rate(facts, median(pages)), "facts/s",
           "raw keyset SELECT", rate(facts, median(raws)))
    record("sse.pages.ndjson.facts_per_s", rate(facts, median(nds)), "facts/s",
           "raw keyset SELECT", rate(facts, median(raws)))


PHASES = ("fanout", "pages")


def run(pg, only=PHASES, big: bool = False) -> None:
    """Every figure (blocking), each phase on a database of its own of ``pg``."""
    if "fanout" in only:
        run_fanout(lambda: pg.create_database("ssebench"))
    if "pages" in only:
        run_pages(pg.create_database("pagesbench"), PAGE_FACTS_BIG if big else PAGE_FACTS)


def main(argv=None) -> None:
    from tests.servers import PostgresServer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(PHASES))
    p.add_argument("--big", action="store_true", help="pages: 1,000,000 facts")
    args = p.parse_args(argv)
    pg = PostgresServer(fsync=True)
    try:
        run(pg, args.only.split(","), args.big)
    finally:
        pg.stop()


if __name__ == "__main__":
    main()
