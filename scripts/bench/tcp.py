"""TCP replication benchmarks: the second part of ``make bench``.

Every figure is measured against a baseline from the same run and appended
to ``bench-results.jsonl`` by :func:`common.record`.

Readers are separate processes (``reader.py``): plain sockets multiplexed
with ``selectors``, counting RDATA lines or noting when each arrived.  On a
2-core machine 50 reader processes would measure the scheduler, so one
process holds up to ``PER_PROCESS`` connections (50 clients = 5 processes x
10 sockets); every connection is a real client that sends NAME + REPLICATE
and receives every row.

``tcp.rdata.1client`` / ``.10clients`` / ``.50clients``
    Rows per second delivered to each client.  The server is this process:
    a :class:`ReplicationHandler` (on a started registry whose stream is
    never written) behind a :class:`ReplicationServerFactory`.  Its fan-out
    entry point ``send_written`` is fed pages of rows as a local writer's
    fan-out takes them from memory (``encoded_since``: each row's JSON line
    as the write path encoded it), ``CHUNK`` rows per call, so the lines'
    assembly (once for every connection), framing, metrics and the
    per-connection writes are the real path.  ``RDATA_FROM_TABLE=1`` feeds
    ``send_updates`` the ``(token, row)`` pairs instead (the path when
    memory cannot answer: the rows encoded by the fan-out; figures named
    ``....from_table``).  Between chunks the feeder
    yields to the reactor, and waits while any connection is paused
    (transport buffer over 64 KiB), so nothing queues past the bound and no
    client is dropped.  Baseline: a plain Twisted protocol (streaming
    producer, same pacing rule) that answers REPLICATE and gets the same
    lines, pre-encoded, with ``transport.writeSequence`` in the same chunks:
    the ceiling of anything that writes through Twisted.  Rate = rows /
    (last row at the slowest client - first write).  ``RDATA_ROUNDS``
    rounds (default 3) alternate plain, ours and Synapse; medians recorded.
    ``RDATA_CLIENTS=1`` (or ``1,50``...) runs only those client counts.
``tcp.rdata.1client.chunk100`` / ``.chunk10``, ``tcp.rdata.50clients.chunk100`` / ``.chunk10``
    The same with 100 and 10 rows per call (``RDATA_CHUNKS``): the fixed
    cost of one fan-out call, as a live writer at moderate rates (or
    Synapse's streamer, at most 100 rows per stream per pass) feeds it.
``tcp.rdata.1client.vs_synapse`` / ``.10clients.vs_synapse`` / ``.50clients.vs_synapse``
    The same figure of ours against Synapse's own
    ``ServerReplicationStreamProtocol`` (``synapse_server.py``, run by the
    Python of the Synapse virtualenv, ``SYNAPSE_PYTHON`` or
    ``.venv-synapse``; skipped without it): the same rows, the same pump
    (CHUNK rows, one reactor trip, wait while a connection is paused), the
    same reader processes; one ``RdataCommand`` per row handed to every
    connection's ``send_command``, as Synapse's command handler does.
``tcp.rdata.{1client,50clients}.chunk100.from_table`` (and ``.vs_synapse``)
    The 100-row chunks fed as rows to encode (as with ``RDATA_FROM_TABLE=1``),
    in every run: the path of rows not encoded at write time (relayed
    facts, catch-up, rows written behind our back), beside the same
    baselines.
``tcp.rdata.*.cpu_vs_synapse``
    The same runs by CPU: the server process's CPU per row delivered to
    one client (ns), ours against Synapse's (ratio: Synapse's over ours).
    At 50 clients the rates are capped by the 50 reader processes sharing
    the cores with the server; the CPU is the server's own cost.
``tcp.latency.50clients.p50_ms`` / ``.p99_ms``
    Facts written through the Stream on PostgreSQL (fsync on) at a steady
    ``LAT_RATE`` facts/s, 50 clients: a 5 ms timer issues the facts due by
    the wall clock, all of one tick in one ``write_facts`` transaction
    (about 10 facts, 200 commits/s: single-fact commits at 2,000/s saturate
    this machine's fsync and the pool, so the queue in front of the
    database, not replication, would be measured; ``LAT_FACTS_PER_TXN=1``
    in the environment measures that anyway).  A fact's commit time is
    stamped when its write completes on the reactor thread
    (``complete_many`` of the stream's ID generator, right after the commit
    returned, just before the position advances and the fan-out is
    scheduled); its arrival is the reader's ``time.time()`` at the ``recv``
    that completed the line.  So the figure is the replication path: the
    fan-out's read of the rows (``updates_since`` through the pool),
    encoding, the writes to 50 sockets, the reader's wake-up.  Percentiles
    over every (client, fact) pair after the first ``LAT_WARMUP`` s;
    ``LAT_ROUNDS`` rounds (default 3) alternate plain and ours, and each
    figure is the median of the rounds' percentiles.
    Baseline: the same readers fed by a plain Twisted writer, pre-encoded
    lines pushed the moment the same timer fires (the floor of TCP plus
    reader wake-up on this machine).  Both runs also print where a tail
    can come from in this process (:class:`TailWatch`): garbage-collection
    pauses, how late a 1 ms reactor timer fires, and fan-outs deferred by
    the coalescing interval.  Variants (environment): ``LAT_GC_FREEZE=1``
    (``gc.freeze()`` first), ``LAT_FANOUT_INTERVAL=s``,
    ``LAT_SWITCH_INTERVAL=s`` (the GIL's), ``LAT_FACTS_PER_TXN=n``.
``e2e.facts_per_s``, ``e2e.write.p50_ms`` / ``.p99_ms``
    ``E2E_WRITERS`` concurrent ``write_fact`` loops (one fact per call;
    waiting calls go together into one transaction: group commit) on a
    pool of ``E2E_LOOPS + 1`` connections, ``E2E_LOOPS`` of them writing
    (one left for reads), fsync on, 10 clients; facts / time from the first
    write to the fan-out having written the last fact (plus the time it took
    to reach the slowest client).  Baseline: raw psycopg2 ``nextval`` +
    ``INSERT`` + commit, one fact per transaction, in ``E2E_WRITERS``
    threads sharing ``E2E_LOOPS`` connections (a thread takes a free one
    per transaction).  Latency: one write's call to its answer (ours: on
    the reactor; raw: from wanting a connection to the commit), p50/p99 over
    every write of the slices.
    ``E2E_SECONDS`` each, in ``E2E_SLICES`` alternating slices (raw, ours,
    ours, raw): the fsync rate of a shared 2-core machine drifts by 2x
    within a minute, and slices keep the ratio honest.
``tcp.congestion.rss_mb`` / ``.close_s``
    One healthy client is fed at full rate (in memory, as above), then a
    client connects that sends REPLICATE and never reads (4 KiB receive
    buffer).  Defaults: ``max_queued_lines`` 10,000 and the protocol's
    congestion grace.  rss_mb = peak VmRSS of this process until the
    sleeper is gone minus the peak while feeding the healthy client alone;
    close_s = first ``pauseProducing`` of the sleeper -> its
    ``connectionLost`` (Twisted pauses a producer whenever its buffer passes
    64 KiB, so that is within the first chunk after the sleeper joined).
    Not counted by either: the kernel's socket buffers of the sleeper
    (``tcp_wmem``, up to 4 MiB here), which hold what the transport handed
    over.  No meaningful baseline exists: the baseline is the target
    (8 MB, 1 s); lower is better.

Run alone: ``python scripts/bench/tcp.py [--only rdata,latency,e2e,congestion]
[--profile]`` (``--profile`` prints a cProfile of the server side of the
phases run).
"""

import contextlib
import gc
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(os.path.dirname(HERE)) not in sys.path:  # run alone
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import psycopg2  # noqa: E402
from benchrows import row  # the rows Synapse's protocol gets too
from common import (  # noqa: F401 (percentile, delays_ms, cpu_seconds: redis_bench's too)
    cpu_seconds,
    delays_ms,
    median,
    percentile,
    profiled,
    record,
    spread,
    stamp_commits,
    stamp_sends,
    standalone_main,
    write_path_report,
)
from twisted.internet import defer, endpoints, protocol, reactor, task, threads
from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

from replicator.config import parse_database, parse_streams
from replicator.jsontext import encode_json_line
from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.transport.tcp import ReplicationServerFactory
from replicator.replication.wire.encoding import encode_rdata_lines
from replicator.storage.database import Database
from replicator.streams.recent import EncodedPage
from replicator.streams.registry import StreamRegistry

READER = os.path.join(HERE, "reader.py")
SYNAPSE_SERVER = os.path.join(HERE, "synapse_server.py")
ROOT = os.path.dirname(os.path.dirname(HERE))

SERVER_NAME = "bench"
WRITER = "master"
COLUMNS = [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}]
STREAMS = parse_streams([
    {"name": "caches", "table": "tcp_caches", "columns": COLUMNS, "writers": [WRITER]},
    {"name": "latency", "table": "tcp_latency", "columns": COLUMNS, "writers": [WRITER]},
    {"name": "e2e", "table": "tcp_e2e", "columns": COLUMNS, "writers": [WRITER]},
])

PER_PROCESS = 10
#: Rows per fan-out call: 1,000 (the figures without a suffix), and smaller
#: chunks as a live writer at moderate rates (or Synapse's streamer, at most
#: 100 rows per stream per pass) produces them: the per-call cost.
#: ``RDATA_CHUNKS=100`` (or ``1000,10``...) runs only those.
CHUNK = 1000
RDATA_CHUNKS = [int(c) for c in os.environ.get("RDATA_CHUNKS", "1000,100,10").split(",") if c]
#: Client counts of the smaller chunks (1,000-row chunks: every RDATA_ROWS).
SMALL_CHUNK_CLIENTS = (1, 50)
#: Rows sent with the smaller chunks, as a share of the 1,000-row runs'
#: (a run lasts about as long).
CHUNK_ROWS_SHARE = {1000: 1.0, 100: 0.5, 10: 0.1}
#: Rows in memory (cycled through) and rows sent per run: clients ->
#: (ours, baseline), about a second or two each.
RDATA_DATA_ROWS = 1_000_000
RDATA_ROWS = {1: (3_000_000, 8_000_000), 10: (1_000_000, 1_500_000), 50: (300_000, 300_000)}
#: Rows sent through Synapse's protocol (5-20x slower: about as long).
SYNAPSE_ROWS = {1: 400_000, 10: 60_000, 50: 12_000}
#: Rounds of (plain, ours, Synapse) per client count; medians are recorded
#: (a shared 2-core machine drifts between rounds).
RDATA_ROUNDS = int(os.environ.get("RDATA_ROUNDS", "3"))
#: Client counts to run (default all of RDATA_ROWS), e.g. RDATA_CLIENTS=1.
RDATA_CLIENTS = [int(c) for c in os.environ.get("RDATA_CLIENTS", "").split(",") if c]
#: RDATA_FROM_TABLE=1: feed rows to ``send_updates`` (encoded in the fan-out).
RDATA_FROM_TABLE = os.environ.get("RDATA_FROM_TABLE") == "1"
#: Without it, the 100-row chunks run that way too (``....chunk100.from_table``).
FROM_TABLE_CHUNK = 100
LAT_CLIENTS = 50
LAT_RATE = 2000
LAT_SECONDS = 10.0
LAT_BASELINE_SECONDS = 5.0
LAT_WARMUP = 1.0
LAT_ROUNDS = int(os.environ.get("LAT_ROUNDS", "3"))
LAT_TICK = 0.005
#: Facts per transaction: 0 = all facts due at a tick in one transaction.
LAT_FACTS_PER_TXN = int(os.environ.get("LAT_FACTS_PER_TXN", "0"))
#: Variants to find where the tail comes from (defaults: as the daemon runs):
#: the fan-out's coalescing interval (s) and the interpreter's GIL switch
#: interval (s) while ours runs.
LAT_FANOUT_INTERVAL = os.environ.get("LAT_FANOUT_INTERVAL")
LAT_SWITCH_INTERVAL = os.environ.get("LAT_SWITCH_INTERVAL")
#: LAT_GC_FREEZE=1: gc.freeze() before ours runs (what a daemon could do once
#: started: the objects of its start are never walked by a collection again).
LAT_GC_FREEZE = os.environ.get("LAT_GC_FREEZE") == "1"
E2E_CLIENTS = 10
E2E_LOOPS = 4
# Concurrent writes on our side (an application's requests): they share the
# same E2E_LOOPS write connections, one fact per transaction each.
E2E_WRITERS = 32
E2E_SECONDS = 10.0
E2E_SLICES = 4
CONGESTION_WARM = 1.0


def tick():
    """One trip through the reactor."""
    return task.deferLater(reactor, 0, lambda: None)


def sleep(seconds):
    return task.deferLater(reactor, seconds, lambda: None)


async def until(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await sleep(0.01)


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


# ------------------------------------------------------------------ readers

class ReaderProcess(protocol.ProcessProtocol):
    """One reader.py child; ``result`` fires with its JSON report."""

    def __init__(self):
        self.out = []
        self.result = defer.Deferred()

    def outReceived(self, data):
        self.out.append(data)

    def expect(self, n):
        self.transport.write(b"%d\n" % n)

    def finish(self):
        """Stop now with what was seen (harmless once it has ended)."""
        try:
            self.transport.closeStdin()
        except Exception:
            pass

    def processEnded(self, reason):
        lines = [l for l in b"".join(self.out).decode().splitlines() if l.strip()]
        if not lines:
            self.result.errback(RuntimeError(f"reader produced no report: {reason.value}"))
        else:
            self.result.callback(json.loads(lines[-1]))


_spawned = []


def finish_readers():
    """Tell every reader still running to stop (after a failure)."""
    while _spawned:
        _spawned.pop().finish()


def spawn_readers(port, clients, mode="count", timeout=120.0, name="bench", per=PER_PROCESS):
    procs = []
    k = 0
    while clients > 0:
        n = min(per, clients)
        proc = ReaderProcess()
        args = [sys.executable, READER, "--port", str(port), "--sockets", str(n),
                "--mode", mode, "--name", f"{name}{k}", "--timeout", str(timeout)]
        reactor.spawnProcess(proc, sys.executable, args, env=os.environ,
                             childFDs={0: "w", 1: "r", 2: 2})
        procs.append(proc)
        _spawned.append(proc)
        clients -= n
        k += 1
    return procs


async def collect(procs):
    results = await defer.gatherResults([p.result for p in procs], consumeErrors=True)
    return results


def arrivals_done(results, expect):
    """(time the last row reached the slowest client, problems)."""
    problems = []
    last = 0.0
    for r in results:
        for count, at, closed in zip(r["counts"], r["last_at"], r["closed"]):
            if count != expect:
                problems.append(f"client got {count} of {expect} rows"
                                + (" (closed)" if closed else ""))
            last = max(last, at)
        if r["timeout"]:
            problems.append("reader timed out")
    return last, problems


# ------------------------------------------------------------------ servers

class OurServer:
    """The real server path: handler + ReplicationServerFactory on loopback."""

    def __init__(self, registry, settings=None):
        self.handler = ReplicationHandler(registry, WRITER, SERVER_NAME)
        self.handler.start()
        # Every reader comes from loopback under a name of its own.
        self.factory = ReplicationServerFactory(self.handler, SERVER_NAME, settings, clock=reactor,
                                                max_connections_per_address=256)

    async def listen(self):
        ep = endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1:backlog=256")
        self.listening = await ep.listen(self.factory)
        self.port = self.listening.getHost().port
        return self

    def clients(self):
        return [c for c, s in self.handler.connections.items() if s.replicating]

    def busy(self):
        return any(c.paused for c in self.handler.connections)

    async def stop(self):
        self.handler.stop("benchmark over")
        await self.listening.stopListening()
        await until(lambda: not self.handler.connections, 10, "connections to close")


@implementer(IPushProducer)
class PlainProtocol(protocol.Protocol):
    """The baseline: answers REPLICATE by joining the clients, then only
    ever gets ``transport.writeSequence`` of pre-encoded lines."""

    paused = False

    def connectionMade(self):
        self.transport.setTcpNoDelay(True)
        self.transport.registerProducer(self, True)
        self.transport.write(b"SERVER %s\n" % SERVER_NAME.encode())
        self.buffer = b""

    def dataReceived(self, data):
        if self in self.factory.clients:
            return
        self.buffer += data
        if b"REPLICATE" in self.buffer:
            self.factory.clients.append(self)

    def connectionLost(self, reason):
        if self in self.factory.clients:
            self.factory.clients.remove(self)

    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False

    def stopProducing(self):
        pass


class PlainServer(protocol.Factory):
    protocol = PlainProtocol

    def __init__(self):
        self.clients = []

    async def listen(self):
        ep = endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1:backlog=256")
        self.listening = await ep.listen(self)
        self.port = self.listening.getHost().port
        return self

    def busy(self):
        return any(c.paused for c in self.clients)

    def send(self, lines):
        for c in self.clients:
            c.transport.writeSequence(lines)

    async def stop(self):
        for c in list(self.clients):
            c.transport.loseConnection()
        await self.listening.stopListening()


# ------------------------------------------------------------------ rdata

class RdataData:
    """Rows in memory as ``updates_since`` returns them, chunked; the same
    as ``encoded_since`` pages (rows' JSON lines as the write path encodes
    them); and the same lines pre-encoded for the baseline."""

    def __init__(self, rows, chunk=CHUNK):
        pool = [row(i) for i in range(10_000)]
        encoded = [encode_json_line(r) for r in pool]
        self.chunk = chunk
        self.chunks = []
        self.pages = []
        self.lines = []
        prev = 0
        for start in range(0, rows, chunk):
            tokens = range(start + 1, min(rows, start + chunk) + 1)
            updates = [(t, pool[t % 10_000]) for t in tokens]
            upto = updates[-1][0]
            self.chunks.append((prev, updates, upto))
            self.pages.append((prev, EncodedPage(list(tokens),
                                                 [encoded[t % 10_000] for t in tokens],
                                                 len(tokens), upto, False)))
            self.lines.append(list(encode_rdata_lines("caches", WRITER, updates)))
            prev = upto
        self.bytes_per_line = sum(map(len, self.lines[0])) / len(self.lines[0])


async def feed(n_chunks, send, busy, stop=None):
    """Send chunks 0..n-1, yielding to the reactor after each and waiting
    while ``busy()`` (some connection paused)."""
    for i in range(n_chunks):
        if stop is not None and stop():
            return i
        send(i)
        await tick()
        while busy():
            await tick()
    return n_chunks


async def rdata_run(server, data, clients, rows, ours, from_table=RDATA_FROM_TABLE):
    procs = spawn_readers(server.port, clients, "count", timeout=120.0)
    if ours:
        await until(lambda: len(server.clients()) == clients, 30, "clients")
        fanout = server.handler.fanout
        if from_table:
            def send(i):
                prev, updates, upto = data.chunks[i % len(data.chunks)]
                fanout.send_updates("caches", WRITER, prev, updates, upto)
        else:
            def send(i):
                prev, page = data.pages[i % len(data.pages)]
                fanout.send_written("caches", WRITER, prev, page)
    else:
        await until(lambda: len(server.clients) == clients, 30, "clients")

        def send(i):
            server.send(data.lines[i % len(data.lines)])
    await sleep(0.2)  # handshakes flushed, readers idle
    for p in procs:
        p.expect(rows)
    n_chunks = rows // data.chunk
    gc.collect()
    cpu0 = cpu_seconds()
    start = time.time()
    with profiled() if ours else contextlib.nullcontext():
        await feed(n_chunks, send, server.busy)
    fed = time.time()
    cpu = cpu_seconds() - cpu0
    results = await collect(procs)
    last, problems = arrivals_done(results, rows)
    if problems:
        raise RuntimeError(f"rdata {clients} clients ({'ours' if ours else 'plain'}): "
                           f"{problems[:3]}")
    elapsed = last - start
    print(f"    {'ours ' if ours else 'plain'} {clients:>2} clients: {rows:,} rows in "
          f"{elapsed:.2f}s (fed in {fed - start:.2f}s, server CPU {cpu:.2f}s = "
          f"{cpu / rows / clients * 1e6:.2f} us/row/client)", flush=True)
    return rows / elapsed, cpu / rows / clients


class SynapseServer(protocol.ProcessProtocol):
    """``synapse_server.py`` under the Synapse virtualenv's Python: Synapse's
    ``ServerReplicationStreamProtocol`` in a process of its own, driven over
    its stdin/stdout (one JSON object per line)."""

    def __init__(self, python):
        self.python = python
        self.buffer = b""
        self.replies = []
        self.waiting = None
        self.ended = defer.Deferred()

    async def start(self):
        reactor.spawnProcess(self, self.python, [self.python, SYNAPSE_SERVER], env=os.environ,
                             childFDs={0: "w", 1: "r", 2: 2})
        self.port = (await self.reply())["port"]
        return self

    def outReceived(self, data):
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            if line.strip():
                self.replies.append(json.loads(line))
        if self.replies and self.waiting is not None:
            d, self.waiting = self.waiting, None
            d.callback(self.replies.pop(0))

    def processEnded(self, reason):
        if self.waiting is not None:
            d, self.waiting = self.waiting, None
            d.errback(RuntimeError(f"synapse_server.py ended: {reason.value}"))
        self.ended.callback(None)

    def reply(self):
        if self.replies:
            return defer.succeed(self.replies.pop(0))
        self.waiting = defer.Deferred()
        return self.waiting

    async def ask(self, line):
        self.transport.write(line.encode() + b"\n")
        return await self.reply()

    async def stop(self):
        self.transport.closeStdin()
        await self.ended


async def rdata_run_synapse(server, clients, rows, chunk=CHUNK):
    procs = spawn_readers(server.port, clients, "count", timeout=300.0)
    await server.ask(f"wait {clients}")
    await sleep(0.2)  # handshakes flushed, readers idle
    for p in procs:
        p.expect(rows)
    fed = await server.ask(f"run {rows} {chunk}")
    results = await collect(procs)
    await server.ask("close")
    last, problems = arrivals_done(results, rows)
    if problems:
        raise RuntimeError(f"rdata {clients} clients (Synapse): {problems[:3]}")
    elapsed = last - fed["start"]
    print(f"    synapse {clients:>2} clients: {rows:,} rows in {elapsed:.2f}s (fed in "
          f"{fed['fed'] - fed['start']:.2f}s, its CPU {fed['cpu']:.2f}s = "
          f"{fed['cpu'] / rows / clients * 1e6:.2f} us/row/client)", flush=True)
    return rows / elapsed, fed["cpu"] / rows / clients


def synapse_python():
    """The Synapse virtualenv's Python, or None (then no Synapse figures)."""
    python = os.environ.get("SYNAPSE_PYTHON") or os.path.join(ROOT, ".venv-synapse", "bin",
                                                              "python")
    return python if os.access(python, os.X_OK) else None


async def run_rdata(registry):
    python = synapse_python()
    for chunk in RDATA_CHUNKS:
        data = RdataData(RDATA_DATA_ROWS, chunk)
        gc.collect()
        gc.freeze()
        try:
            print(f"  rdata: {data.bytes_per_line:.0f} bytes per RDATA line, {chunk:,} rows per "
                  f"call, {RDATA_ROUNDS} alternating rounds (plain, ours"
                  + (", Synapse" if python else "; no Synapse virtualenv: `make synapse-deps`")
                  + "), medians")
            for clients, (rows, base_rows) in RDATA_ROWS.items():
                if RDATA_CLIENTS and clients not in RDATA_CLIENTS \
                        or chunk != CHUNK and clients not in SMALL_CHUNK_CLIENTS:
                    continue
                await rdata_figures(registry, data, python, clients, rows, base_rows)
                if chunk == FROM_TABLE_CHUNK and not RDATA_FROM_TABLE \
                        and clients in SMALL_CHUNK_CLIENTS:
                    # Rows not encoded at write time (relayed, caught up,
                    # written behind our back): the encoder in the path.
                    await rdata_figures(registry, data, python, clients, rows, base_rows,
                                        from_table=True)
        finally:
            gc.unfreeze()
            del data
            gc.collect()


def rdata_name(clients, chunk, from_table=RDATA_FROM_TABLE):
    """``tcp.rdata.1client``, ``tcp.rdata.50clients.chunk100``..."""
    name = "tcp.rdata.1client" if clients == 1 else f"tcp.rdata.{clients}clients"
    name = name if chunk == CHUNK else f"{name}.chunk{chunk}"
    return name + ".from_table" if from_table else name


async def rdata_figures(registry, data, python, clients, rows, base_rows,
                        from_table=RDATA_FROM_TABLE):
    """Alternating rounds of plain, ours and Synapse at ``clients`` and
    ``data.chunk`` rows per call; the medians recorded."""
    chunk = data.chunk
    share = CHUNK_ROWS_SHARE.get(chunk, 1.0)
    rows, base_rows = (int(n * share) // chunk * chunk for n in (rows, base_rows))
    synapse_rows = int(SYNAPSE_ROWS[clients] * max(share, 0.5)) // chunk * chunk
    rates = {"plain": [], "ours": [], "synapse": []}
    cpus = {"ours": [], "synapse": []}  # server CPU seconds per row delivered to a client
    for _ in range(RDATA_ROUNDS):
        plain = await PlainServer().listen()
        try:
            rates["plain"].append((await rdata_run(plain, data, clients, base_rows,
                                                   ours=False))[0])
        finally:
            await plain.stop()
        ours = await OurServer(registry).listen()
        try:
            rate, cpu = await rdata_run(ours, data, clients, rows, ours=True,
                                        from_table=from_table)
            rates["ours"].append(rate)
            cpus["ours"].append(cpu)
        finally:
            await ours.stop()
        if python:
            synapse = await SynapseServer(python).start()
            try:
                rate, cpu = await rdata_run_synapse(synapse, clients, synapse_rows, chunk)
                rates["synapse"].append(rate)
                cpus["synapse"].append(cpu)
            finally:
                await synapse.stop()
    name = rdata_name(clients, chunk, from_table)
    value = median(rates["ours"])
    per = "" if chunk == CHUNK else f", {chunk} rows per call"
    record(name, value, "rows/s", f"plain Twisted writeSequence of pre-encoded lines{per}",
           median(rates["plain"]))
    if python:
        record(name + ".vs_synapse", value, "rows/s",
               f"Synapse's ServerReplicationStreamProtocol{per}", median(rates["synapse"]))
        # By CPU: at many clients the rate is the reader processes' (they
        # share the cores with the server); the server's CPU per row it
        # delivered to one client is its own cost.
        record(name + ".cpu_vs_synapse", median(cpus["ours"]) * 1e9, "ns/row",
               f"Synapse's ServerReplicationStreamProtocol{per}, server CPU per row delivered",
               median(cpus["synapse"]) * 1e9, higher_is_better=False)


# ------------------------------------------------------------------ latency

class Pacer:
    """Calls ``issue(n)`` every ``LAT_TICK`` with the number of facts due so
    that ``LAT_RATE`` facts/s are issued, steadily, for ``seconds``."""

    def __init__(self, issue, seconds):
        self.issue = issue
        self.seconds = seconds
        self.issued = 0

    async def run(self):
        self.start = time.monotonic()
        loop = task.LoopingCall(self._tick)
        self.loop = loop
        await loop.start(LAT_TICK, now=True)
        return self.issued

    def _tick(self):
        elapsed = time.monotonic() - self.start
        if elapsed >= self.seconds:
            self.loop.stop()
            return
        due = int(elapsed * LAT_RATE) + 1 - self.issued
        if due > 0:
            self.issue(due)
            self.issued += due


class TailWatch:
    """Where a latency tail can come from in this process, while a run
    lasts: garbage collections (count, total and longest pause), how late
    a 1 ms reactor timer fires (the reactor thread busy or waiting for the
    GIL), and, for ours, how many fan-outs the coalescing timer deferred
    and for how long."""

    def __init__(self, fanout=None):
        self.gc_pauses = []
        self.lags = []
        self.deferred = []
        self.advances = []  # (time.time(), the writer's position then)
        self.fanout = fanout

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_at = time.perf_counter()
        elif hasattr(self, "_gc_at"):
            self.gc_pauses.append(time.perf_counter() - self._gc_at)

    def _tick(self):
        now = time.perf_counter()
        if self._due is not None:
            self.lags.append(now - self._due)
        self._due = now + 0.001

    def start(self):
        gc.callbacks.append(self._gc)
        self._due = None
        self._loop = task.LoopingCall(self._tick)
        self._loop.start(0.001)
        fanout = self.fanout
        if fanout is not None:
            advanced = fanout.advanced

            def watched(stream, writer):
                key = (stream.name, writer)
                had = key in fanout._timers
                self.advances.append((time.time(), stream.id_gen.get_current_token(writer)))
                advanced(stream, writer)
                call = fanout._timers.get(key)
                if call is not None and not had:
                    self.deferred.append(call.getTime() - fanout._clock.seconds())

            fanout.advanced = watched

    def stop(self):
        gc.callbacks.remove(self._gc)
        self._loop.stop()
        if self.fanout is not None:
            del self.fanout.advanced

    def position_delays_ms(self, commit_at, since):
        """Sorted ms from a fact's commit to the writer's position first
        covering it: the wait for earlier facts still in flight on other
        connections (a position never passes an uncommitted fact)."""
        out = []
        facts = sorted((t, c) for t, c in commit_at.items() if c >= since)
        k = 0
        for at, token in self.advances:
            while k < len(facts) and facts[k][0] <= token:
                out.append(max(0.0, at - facts[k][1]) * 1000.0)
                k += 1
        return sorted(out)

    def report(self, seconds):
        lags = sorted(x * 1000.0 for x in self.lags)
        text = (f"gc {len(self.gc_pauses)} pauses, {sum(self.gc_pauses) * 1000:.1f} ms in all, "
                f"longest {max(self.gc_pauses, default=0) * 1000:.2f} ms; 1 ms timer late p50 "
                f"{percentile(lags, 50):.2f} ms, p99 {percentile(lags, 99):.2f} ms, max "
                f"{lags[-1] if lags else float('nan'):.1f} ms")
        if self.fanout is not None:
            text += (f"; fan-outs deferred by coalescing: {len(self.deferred)} "
                     f"({len(self.deferred) / seconds:.0f}/s), wait p50 "
                     f"{percentile(sorted(self.deferred), 50) * 1000:.2f} ms")
        return text


async def latency_ours(registry):
    server = await OurServer(registry).listen()
    if LAT_FANOUT_INTERVAL is not None:
        server.handler.fanout.fanout_interval = float(LAT_FANOUT_INTERVAL)
    stream = registry.get("latency")
    # Where the time goes: the write itself, and commit -> lines handed to
    # every transport (the fan-out's read of the rows and the encoding).
    commit_at = stamp_commits(stream.id_gen)
    sent_at = stamp_sends(server.handler)
    write_s = []

    async def timed_write(facts):
        t0 = time.monotonic()
        if len(facts) == 1:
            await stream.write_fact(facts[0])
        else:
            await stream.write_facts(facts)
        write_s.append(time.monotonic() - t0)

    procs = spawn_readers(server.port, LAT_CLIENTS, "latency", timeout=LAT_SECONDS + 60)
    try:
        await until(lambda: len(server.clients()) == LAT_CLIENTS, 30, "clients")
        await sleep(0.2)
        writes = []
        n = [0]

        def issue(count):
            facts = [[row(n[0] + k)] for k in range(1, count + 1)]
            n[0] += count
            if LAT_FACTS_PER_TXN:
                for k in range(0, count, LAT_FACTS_PER_TXN):
                    writes.append(defer.ensureDeferred(timed_write(facts[k:k + LAT_FACTS_PER_TXN])))
            else:
                writes.append(defer.ensureDeferred(timed_write(facts)))

        gc.collect()
        if LAT_GC_FREEZE:
            gc.freeze()
        watch = TailWatch(server.handler.fanout)
        switch = sys.getswitchinterval()
        if LAT_SWITCH_INTERVAL is not None:
            sys.setswitchinterval(float(LAT_SWITCH_INTERVAL))
        cpu0 = cpu_seconds()
        start = time.time()
        watch.start()
        with profiled():
            issued = await Pacer(issue, LAT_SECONDS).run()
            await defer.gatherResults(writes, consumeErrors=True)
            written = time.time()
            watch.stop()
            for p in procs:
                p.expect(issued)
            results = await collect(procs)
        cpu = cpu_seconds() - cpu0
    finally:
        if LAT_GC_FREEZE:
            gc.unfreeze()
        sys.setswitchinterval(switch)
        del stream.id_gen.complete_many  # the stamping wrapper
        await server.stop()
    delays, missing = delays_ms(results, commit_at, start + LAT_WARMUP)
    if missing:
        raise RuntimeError(f"latency (ours): {missing} (client, fact) arrivals missing")
    print(f"    ours : {issued:,} facts in {written - start:.1f}s "
          f"({issued / (written - start):,.0f}/s) to {LAT_CLIENTS} clients, "
          f"{len(delays):,} arrivals timed; {spread(delays)}; "
          f"server CPU {cpu / (written - start) * 100:.0f}%", flush=True)
    print(write_path_report(write_s, commit_at, sent_at, start + LAT_WARMUP, "write_fact",
                            "the transports"), flush=True)
    to_position = watch.position_delays_ms(commit_at, start + LAT_WARMUP)
    print(f"           commit -> the position covers it (earlier facts in flight) p50 "
          f"{percentile(to_position, 50):.2f} ms, p99 {percentile(to_position, 99):.2f} ms",
          flush=True)
    print(f"           {watch.report(written - start)} (fan-out interval "
          f"{server.handler.fanout.fanout_interval * 1000:g} ms, GIL switch interval "
          f"{float(LAT_SWITCH_INTERVAL or switch) * 1000:g} ms"
          + (", gc frozen" if LAT_GC_FREEZE else "") + ")", flush=True)
    return delays


async def latency_plain():
    server = await PlainServer().listen()
    total = int(LAT_BASELINE_SECONDS * LAT_RATE) + 100
    lines = [encode_rdata_lines("latency", WRITER, [(t, row(t))])[0] for t in range(1, total + 1)]
    commit_at = {}
    procs = spawn_readers(server.port, LAT_CLIENTS, "latency", timeout=LAT_BASELINE_SECONDS + 60)
    try:
        await until(lambda: len(server.clients) == LAT_CLIENTS, 30, "clients")
        await sleep(0.2)
        n = [0]

        def issue(count):
            batch = lines[n[0]:n[0] + count]
            now = time.time()
            for t in range(n[0] + 1, n[0] + count + 1):
                commit_at[t] = now
            n[0] += count
            server.send(batch)

        watch = TailWatch()
        start = time.time()
        watch.start()
        issued = await Pacer(issue, LAT_BASELINE_SECONDS).run()
        watch.stop()
        for p in procs:
            p.expect(issued)
        results = await collect(procs)
    finally:
        await server.stop()
    delays, missing = delays_ms(results, commit_at, start + LAT_WARMUP)
    if missing:
        raise RuntimeError(f"latency (plain): {missing} (client, fact) arrivals missing")
    print(f"    plain: {issued:,} lines to {LAT_CLIENTS} clients; {spread(delays)}",
          flush=True)
    print(f"           {watch.report(LAT_BASELINE_SECONDS)}", flush=True)
    return delays


async def run_latency(registry):
    """``LAT_ROUNDS`` rounds, each the plain writer then ours; each figure is
    the median over rounds of that round's percentile (one round's p99 of
    either side varies severalfold on a loaded machine)."""
    print(f"  latency: {LAT_RATE:,} facts/s, {LAT_CLIENTS} clients, "
          f"first {LAT_WARMUP:.0f}s not counted, {LAT_ROUNDS} rounds")
    rounds = []
    for i in range(LAT_ROUNDS):
        print(f"   round {i + 1}", flush=True)
        rounds.append((await latency_plain(), await latency_ours(registry)))
    what = "plain Twisted writer pushing pre-encoded lines on the same timer"
    for p in (50, 99):
        base = statistics.median(percentile(b, p) for b, _ in rounds)
        ours = statistics.median(percentile(o, p) for _, o in rounds)
        record(f"tcp.latency.{LAT_CLIENTS}clients.p{p}_ms", ours, "ms", what, base,
               higher_is_better=False)


# ------------------------------------------------------------------ e2e

def raw_e2e(dsn, seconds, loops, writers=None):
    """(facts, seconds, latencies in s) of raw psycopg2 nextval + INSERT +
    commit, one fact per transaction: ``writers`` threads (default
    ``E2E_WRITERS``) share ``loops`` connections, each taking a free one per
    transaction (connecting is not timed).  A latency runs from a writer
    wanting to write (before waiting for a connection) to its commit."""
    import queue

    writers = writers or E2E_WRITERS
    conns = queue.SimpleQueue()
    opened = [psycopg2.connect(dsn) for _ in range(loops)]
    for c in opened:
        conns.put(c)
    counts = [0] * writers
    latencies = [[] for _ in range(writers)]
    barrier = threading.Barrier(writers + 1)
    stop_at = [0.0]

    def worker(k):
        barrier.wait()
        n = 0
        lat = latencies[k]
        while True:
            t0 = time.monotonic()
            if t0 >= stop_at[0]:
                break
            conn = conns.get()
            try:
                cur = conn.cursor()
                cur.execute("SELECT nextval('tcp_e2e_seq')")
                (i,) = cur.fetchone()
                cur.execute("INSERT INTO tcp_e2e VALUES (%s, %s, %s, %s::jsonb, %s)",
                            (i, "raw", "get_user_by_id", '["@user:example.com"]', i))
                conn.commit()
            finally:
                conns.put(conn)
            lat.append(time.monotonic() - t0)
            n += 1
        counts[k] = n

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(writers)]
    for w in workers:
        w.start()
    stop_at[0] = time.monotonic() + 1e9
    barrier.wait()
    start = time.monotonic()
    stop_at[0] = start + seconds
    for w in workers:
        w.join()
    elapsed = time.monotonic() - start
    for c in opened:
        c.close()
    return sum(counts), elapsed, [x for lat in latencies for x in lat]


async def ours_e2e_slice(server, stream, seconds, written, latencies):
    """``E2E_WRITERS`` write_fact loops for ``seconds``, then until the
    fan-out has written every fact to every connection; returns the time.
    Each write's latency (call to answer, on the reactor) goes to
    ``latencies``."""
    async def loop(end):
        while True:
            t0 = time.monotonic()
            if t0 >= end:
                break
            await stream.write_fact([row(written[0])])
            latencies.append(time.monotonic() - t0)
            written[0] += 1

    key = ("e2e", WRITER)
    start = time.time()
    end = time.monotonic() + seconds
    await defer.gatherResults([defer.ensureDeferred(loop(end)) for _ in range(E2E_WRITERS)],
                              consumeErrors=True)
    await until(lambda: server.handler.announced_positions()[key]
                >= stream.id_gen.get_current_token(WRITER), 30, "the fan-out")
    return start, time.time()


def group_sizes(stream_name):
    """(transactions, facts) of the write-group histogram so far."""
    from prometheus_client import REGISTRY
    labels = {"stream": stream_name}
    return (REGISTRY.get_sample_value("replicator_write_group_size_count", labels) or 0.0,
            REGISTRY.get_sample_value("replicator_write_group_size_sum", labels) or 0.0)


async def run_e2e(registry, dsn):
    """Slices of raw and ours alternate (ABBA) so that both see the same
    disk: the fsync rate of a shared machine drifts by 2x within a minute."""
    print(f"  e2e: {E2E_WRITERS} concurrent writes on {E2E_LOOPS} write connections (raw: "
          f"{E2E_WRITERS} threads sharing {E2E_LOOPS} connections, one fact per transaction), "
          f"{E2E_CLIENTS} clients, {E2E_SECONDS:.0f}s each in {E2E_SLICES} alternating slices, "
          "fsync on")
    server = await OurServer(registry).listen()
    stream = registry.get("e2e")
    procs = spawn_readers(server.port, E2E_CLIENTS, "count", timeout=3 * E2E_SECONDS + 120)
    slice_s = 2 * E2E_SECONDS / E2E_SLICES
    raw_facts = raw_s = ours_s = 0.0
    raw_lat, ours_lat = [], []
    written = [0]
    groups0 = group_sizes("e2e")
    try:
        await until(lambda: len(server.clients()) == E2E_CLIENTS, 30, "clients")
        await sleep(0.2)
        cpu = 0.0
        for i in range(E2E_SLICES):
            if (i % 4) in (0, 3):
                n, s, lat = await threads.deferToThread(raw_e2e, dsn, slice_s, E2E_LOOPS)
                raw_facts += n
                raw_s += s
                raw_lat += lat
            else:
                cpu0 = cpu_seconds()
                with profiled():
                    start, done = await ours_e2e_slice(server, stream, slice_s, written,
                                                       ours_lat)
                cpu += cpu_seconds() - cpu0
                ours_s += done - start
        for p in procs:
            p.expect(written[0])
        results = await collect(procs)
    finally:
        await server.stop()
    last, problems = arrivals_done(results, written[0])
    if problems:
        raise RuntimeError(f"e2e: {problems[:3]}")
    # The last slice's facts were all handed to the transports at ``done``;
    # add the time they took to reach the slowest client.
    tail = max(0.0, last - done)
    ours_s += tail
    base = raw_facts / raw_s
    value = written[0] / ours_s
    txns, facts = (b - a for a, b in zip(groups0, group_sizes("e2e")))
    print(f"    raw psycopg2: {raw_facts:,.0f} facts in {raw_s:.1f}s; ours: {written[0]:,} facts "
          f"committed and delivered to {E2E_CLIENTS} clients in {ours_s:.1f}s (last "
          f"arrival {tail * 1000:.1f} ms after the fan-out wrote it); server CPU "
          f"{cpu / ours_s * 100:.0f}%; {txns:,.0f} write transactions, "
          f"{facts / txns if txns else float('nan'):.1f} facts each on average "
          "(group commit)", flush=True)
    what = f"raw psycopg2 nextval+INSERT+commit, {E2E_WRITERS} threads on {E2E_LOOPS} connections"
    record("e2e.facts_per_s", value, "facts/s", what, base)
    raw_lat.sort()
    ours_lat.sort()
    for p in (50, 99):
        record(f"e2e.write.p{p}_ms", percentile(ours_lat, p) * 1000, "ms", what,
               percentile(raw_lat, p) * 1000, higher_is_better=False)


# ------------------------------------------------------------------ congestion

async def run_congestion(registry):
    data = RdataData(200_000)
    gc.collect()
    server = await OurServer(registry).listen()
    handler = server.handler
    healthy = spawn_readers(server.port, 1, "count", timeout=60.0, name="healthy")
    sleeper = None
    fed = [0]
    try:
        await until(lambda: len(server.clients()) == 1, 30, "the healthy client")
        (good,) = server.clients()
        n_chunks = len(data.chunks)

        def send(i):
            prev, updates, upto = data.chunks[i % n_chunks]
            handler.fanout.send_updates("caches", WRITER, prev, updates, upto)
            fed[0] += len(updates)

        def busy():
            return good.paused  # the sleeper is not waited for

        # Full rate with the healthy client alone: the reference level.
        peak = [rss_mb()]
        end = time.monotonic() + CONGESTION_WARM

        def sampled_busy():
            peak[0] = max(peak[0], rss_mb())
            return busy()

        await feed(10 ** 9, send, sampled_busy, stop=lambda: time.monotonic() > end)
        before = peak[0]

        events = {}
        sleeper = spawn_readers(server.port, 1, "sleep", name="sleeper")[0]
        await until(lambda: len(server.clients()) == 2, 30, "the sleeper")
        (conn,) = [c for c in server.clients() if c is not good]

        def hook(name, method):
            def wrapped(*args, **kwargs):
                events.setdefault(name, time.monotonic())
                return method(*args, **kwargs)
            setattr(conn, name, wrapped)

        hook("pauseProducing", conn.pauseProducing)
        hook("close", conn.close)
        hook("connectionLost", conn.connectionLost)
        events["replicating"] = time.monotonic()
        peak = [before]
        end = time.monotonic() + 10.0
        await feed(10 ** 9, send, sampled_busy,
                   stop=lambda: "connectionLost" in events or time.monotonic() > end)
        peak_during = peak[0]
        for p in healthy:
            p.expect(fed[0])
        results = await collect(healthy)
        _, problems = arrivals_done(results, fed[0])
    finally:
        if sleeper is not None:
            sleeper.finish()
        await server.stop()
    if "connectionLost" not in events:
        raise RuntimeError("congestion: the client that never reads was not dropped in 10 s")
    close_s = events["connectionLost"] - events["pauseProducing"]
    grown = peak_during - before
    print(f"    {conn.close_reason}: dropped {close_s:.3f}s after its first pause "
          f"({events['connectionLost'] - events['replicating']:.3f}s after it joined, "
          f"{events['connectionLost'] - events.get('close', float('nan')):.3f}s after the "
          f"queue overflowed); RSS "
          f"{before:.1f} -> {peak_during:.1f} MB; healthy client got {fed[0]:,} rows"
          + (f" PROBLEMS {problems[:3]}" if problems else ""), flush=True)
    record("tcp.congestion.rss_mb", max(grown, 0.001), "MB", "target", 8.0,
           higher_is_better=False)
    record("tcp.congestion.close_s", close_s, "s", "target", 1.0, higher_is_better=False)


# ------------------------------------------------------------------ driver

PHASES = ("rdata", "latency", "e2e", "congestion")


async def run(dsn, only=PHASES):
    """Every TCP figure, on the PostgreSQL database ``dsn`` (fsync on)."""
    db = Database(parse_database({"postgres": dsn, "pool_min": 1, "pool_max": E2E_LOOPS + 1}))
    registry = StreamRegistry(db, WRITER, STREAMS, reactor=reactor)
    await registry.start()
    try:
        if "rdata" in only:
            await run_rdata(registry)
        if "latency" in only:
            await run_latency(registry)
        if "e2e" in only:
            await run_e2e(registry, dsn)
        if "congestion" in only:
            await run_congestion(registry)
    finally:
        finish_readers()
        await registry.stop()
        db.close()


if __name__ == "__main__":
    task.react(lambda r: defer.ensureDeferred(
        standalone_main(sys.modules[__name__], "tcpbench", sys.argv[1:])))
