"""Redis replication benchmarks: the Redis part of ``make bench``.

Every figure is measured against a baseline from the same run and appended
to ``bench-results.jsonl`` by :func:`common.record`.  A fresh
``redis-server`` (``tests.servers.RedisServer``, default settings, so also
the default ``client-output-buffer-limit pubsub 32mb 8mb 60``) and the
PostgreSQL database passed in (fsync on).

The writer is this process: our library as the daemon assembles it
(``Database`` + ``StreamRegistry`` + ``ReplicationHandler`` +
``RedisReplication``), instance ``master`` of server ``bench``, so it
PUBLISHes on channel ``bench`` and is itself subscribed to it (it receives,
parses and drops its own echoes, as every real instance does).

Readers are 3 separate processes (this file with ``--reader``): one plain
blocking socket each, ``SUBSCRIBE bench``, no Twisted and none of our reader
code.  They count RDATA message payloads (occurrences of ``\\r\\nRDATA `` in
the RESP stream, straddling ``recv`` boundaries included), or, in latency
mode, split the stream at CRLF and note the token of every RDATA payload
with the ``time.time()`` of the ``recv`` that completed it.  Every fact here
is one row, so one RDATA line per fact.  The bench waits for ``PUBSUB
NUMSUB`` to show every subscriber before it starts.

``redis.e2e.facts_per_s``
    ``E2E_WRITERS`` concurrent ``write_fact`` loops (one fact per call,
    ``E2E_FACTS_PER_CALL``; waiting calls go together into one transaction:
    group commit) on ``E2E_LOOPS`` write connections (PostgreSQL, fsync
    on), for ``E2E_SECONDS``; rate = facts that reached all 3 readers /
    (last arrival at the slowest reader - first write).  Baseline: what a
    user would write by hand, with the same concurrency: ``E2E_WRITERS``
    threads of this process sharing ``E2E_LOOPS`` psycopg2 connections
    (a thread takes a free one per fact), each fact ``nextval`` +
    ``INSERT`` + commit, then the fact's RDATA line (encoded there)
    PUBLISHed on the thread's own Redis socket and its reply read; in two
    slices of ``HAND_SECONDS / 2`` (before ours, and after it once the
    instance's own echoes drained: the fsync rate of a shared machine
    drifts), to the same kind of 3 readers; total facts / total (last
    arrival - first write).  Printed, not recorded: the ceiling of Redis
    pub/sub plus the readers here (one plain client PUBLISHing pre-encoded
    lines, one PUBLISH per line, pipelined in batches of ``RAW_BATCH``, no
    database, ``RAW_SECONDS``).  For the database's share, the same loops
    on a registry of their own (same database, no handler, no Redis) run
    ``ALONE_SECONDS`` before and after ours and are printed (not
    recorded).  Also printed: how far behind the instance's own
    subscriber is on its echoes when the last fact is out (a marker
    PUBLISHed then; the time it comes back), and whether the instance's
    Redis link was replaced meanwhile (its PING, queued behind the echoes,
    unanswered in ``ping_timeout``): lines published while it reconnects
    reach no plain reader (ours would catch up from the database), so the
    figure counts only what reached all 3 readers.
``redis.latency.3readers.p50_ms`` / ``.p99_ms``
    ``LAT_RATE`` facts/s, steady (``tcp.Pacer``: a 5 ms timer issues the
    facts due by the wall clock, all of one tick in one ``write_facts``
    transaction, about 10 facts), for ``LAT_WARMUP + LAT_SECONDS``.  A
    fact's commit time is stamped where tcp.py stamps it: when its write
    completes on the reactor thread (``complete_many`` of the stream's ID
    generator, right after the commit returned); arrival is the reader's
    ``time.time()``.  Percentiles over every (reader, fact) pair after the
    warm-up.  Baseline: the raw publisher paced by the same timer, stamped
    just before the ``sendall`` of the tick's pipelined PUBLISHes.  Ours runs
    right after the instance joined, before the e2e phase (whose echo
    backlog would otherwise still be draining).

``REDIS_LAT_NAGLE=1`` runs ours a second time with the links' ``TCP_NODELAY``
off (as before it was set), printed only.

Run alone: ``python scripts/bench/redis_bench.py [--only e2e,latency]
[--profile]`` (``--profile`` prints a cProfile of this process during our
phases: the writer).
"""

import argparse
import gc
import os
import re
import socket
import sys
import time

import reader  # the reader loop, shared with the TCP readers

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.path.dirname(os.path.dirname(HERE)) not in sys.path:  # run alone
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

SERVER_NAME = "bench"  # = the channel
WRITER = "master"
READERS = 3
E2E_LOOPS = int(os.environ.get("REDIS_E2E_LOOPS", "4"))  # write connections
E2E_WRITERS = int(os.environ.get("REDIS_E2E_WRITERS", "32"))  # concurrent write calls
E2E_FACTS_PER_CALL = int(os.environ.get("REDIS_E2E_FACTS_PER_CALL", "1"))
E2E_SECONDS = 10.0
HAND_SECONDS = 10.0
RAW_SECONDS = 5.0
ALONE_SECONDS = 3.0
RAW_BATCH = 1000
RAW_POOL = 100  # distinct pre-encoded batches, cycled through
LAT_WARMUP = 1.0
LAT_SECONDS = 8.0


# ------------------------------------------------------------------ RESP

def resp(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def read_replies(sock, n, pending=b""):
    """Read ``n`` one-line replies (``:3\\r\\n``); returns the leftover."""
    buf = pending
    seen = buf.count(b"\r\n")
    while seen < n:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("redis closed the connection")
        seen += data.count(b"\r\n")
        buf += data
    if seen == n:
        return b""
    # keep what belongs to later replies
    cut = 0
    for _ in range(n):
        cut = buf.index(b"\r\n", cut) + 2
    return buf[cut:]


def numsub(port, channel):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(resp("PUBSUB", "NUMSUB", channel))
        data = b""
        while not re.search(rb":(\d+)\r\n$", data):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(re.search(rb":(\d+)\r\n$", data).group(1))


# ------------------------------------------------------------------ reader process

def reader_main(argv):
    """One subscriber: prints one JSON line (the format of reader.py's)."""
    p = argparse.ArgumentParser()
    p.add_argument("--reader", action="store_true")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--channel", required=True)
    p.add_argument("--mode", choices=("count", "latency"), default="count")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    sock = socket.create_connection(("127.0.0.1", args.port), timeout=args.timeout)
    sock.sendall(resp("SUBSCRIBE", args.channel))
    # The confirmation may come in one recv with the first messages
    # published (the bench publishes as soon as Redis counts us): what
    # follows it is the start of the stream.
    confirm = b""
    while b":1\r\n" not in confirm:
        data = sock.recv(4096)
        if not data:
            raise SystemExit("redis closed the connection before confirming SUBSCRIBE")
        confirm += data
    rest = confirm.split(b":1\r\n", 1)[1]
    result = reader.read_loop([sock], args.mode == "latency", None, args.timeout,
                              separator=b"\r\n", initial=[rest])
    sock.close()
    reader.emit(result)


if __name__ == "__main__" and "--reader" in sys.argv:
    reader_main(sys.argv[1:])
    sys.exit(0)


# ------------------------------------------------------------------ the bench

import threading  # noqa: E402

import orjson  # noqa: E402
import tcp  # noqa: E402
from common import (  # noqa: E402
    cpu_seconds,
    delays_ms,
    percentile,
    profiled,
    record,
    spread,
    stamp_commits,
    stamp_sends,
    standalone_main,
    write_path_report,
)
from twisted.internet import defer, reactor, task, threads  # noqa: E402

from replicator.config import RedisConfig, parse_database, parse_streams  # noqa: E402
from replicator.replication.core.handler import ReplicationHandler  # noqa: E402
from replicator.replication.transport.redis import RedisReplication  # noqa: E402
from replicator.replication.wire.encoding import encode_rdata_lines  # noqa: E402
from replicator.storage.database import Database  # noqa: E402
from replicator.streams.registry import StreamRegistry  # noqa: E402

COLUMNS = tcp.COLUMNS
STREAMS = parse_streams([
    {"name": "e2e", "table": "redis_e2e", "columns": COLUMNS, "writers": [WRITER]},
    {"name": "latency", "table": "redis_latency", "columns": COLUMNS, "writers": [WRITER]},
])
ALONE = parse_streams([
    {"name": "alone", "table": "redis_alone", "columns": COLUMNS, "writers": [WRITER]},
])
HAND = parse_streams([  # the hand-written baseline's table (created by a registry)
    {"name": "e2e", "table": "redis_hand", "columns": COLUMNS, "writers": [WRITER]},
])
row = tcp.row
sleep = tcp.sleep
until = tcp.until


def proc_cpu(pid):
    """utime + stime of another process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_spawned = []


def spawn_readers(port, mode, timeout):
    procs = []
    for _ in range(READERS):
        proc = tcp.ReaderProcess()
        args = [sys.executable, os.path.abspath(__file__), "--reader", "--port", str(port),
                "--channel", SERVER_NAME, "--mode", mode, "--timeout", str(timeout)]
        reactor.spawnProcess(proc, sys.executable, args, env=os.environ,
                             childFDs={0: "w", 1: "r", 2: 2})
        procs.append(proc)
        _spawned.append(proc)
    return procs


async def subscribed(port, n):
    await until(lambda: numsub(port, SERVER_NAME) >= n, 30, f"{n} subscribers")


def check(results, expect, what):
    last, problems = tcp.arrivals_done(results, expect)
    if problems:
        raise RuntimeError(f"{what}: {problems[:3]}")
    return last


def group_count(stream):
    """Write transactions the stream has run (its group-size histogram's count)."""
    return sum(b.get() for b in stream._group_size._buckets)


def reader_cpu(results):
    return sum(r.get("cpu", 0.0) for r in results)


# ------------------------------------------------------------------ baselines

def raw_lines(stream, tokens):
    return [encode_rdata_lines(stream, WRITER, [(t, row(t))])[0] for t in tokens]


def raw_publish(port, batches, seconds):
    """Pipelined PUBLISHes from one blocking socket for ``seconds``; the next
    batch goes out before the replies of the previous one are read.
    Returns (lines, time.time() of the first send)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sent = 0
    pending = b""
    start = time.time()
    end = time.monotonic() + seconds
    in_flight = 0
    i = 0
    while time.monotonic() < end:
        payload, n = batches[i % len(batches)]
        sock.sendall(payload)
        i += 1
        sent += n
        if in_flight:
            pending = read_replies(sock, in_flight, pending)
        in_flight = n
    read_replies(sock, in_flight, pending)
    sock.close()
    return sent, start


async def e2e_raw(port, redis_pid):
    lines = raw_lines("e2e", range(1, RAW_BATCH * RAW_POOL + 1))
    batches = []
    for k in range(0, len(lines), RAW_BATCH):
        chunk = lines[k:k + RAW_BATCH]
        batches.append((b"".join(resp("PUBLISH", SERVER_NAME, l.rstrip(b"\n")) for l in chunk),
                        len(chunk)))
    procs = spawn_readers(port, "count", RAW_SECONDS + 60)
    await subscribed(port, READERS)
    rcpu0 = proc_cpu(redis_pid)
    sent, start = await threads.deferToThread(raw_publish, port, batches, RAW_SECONDS)
    rcpu = proc_cpu(redis_pid) - rcpu0
    for p in procs:
        p.expect(sent)
    results = await tcp.collect(procs)
    last = check(results, sent, "e2e (raw)")
    elapsed = last - start
    print(f"    raw PUBLISH: {sent:,} lines to {READERS} readers in {elapsed:.2f}s "
          f"({RAW_BATCH} per pipelined batch); redis-server CPU {rcpu / elapsed * 100:.0f}%, "
          f"readers {reader_cpu(results) / elapsed * 100:.0f}% (sum of {READERS})", flush=True)
    return sent / elapsed


async def latency_raw(port):
    total = int((LAT_WARMUP + LAT_SECONDS) * tcp.LAT_RATE) + 100
    commands = [resp("PUBLISH", SERVER_NAME, l.rstrip(b"\n"))
                for l in raw_lines("latency", range(1, total + 1))]
    procs = spawn_readers(port, "latency", LAT_WARMUP + LAT_SECONDS + 60)
    await subscribed(port, READERS)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    commit_at = {}
    n = [0]

    def issue(count):
        payload = b"".join(commands[n[0]:n[0] + count])
        now = time.time()
        for t in range(n[0] + 1, n[0] + count + 1):
            commit_at[t] = now
        n[0] += count
        sock.sendall(payload)
        try:  # drain the replies without waiting for them
            while sock.recv(65536, socket.MSG_DONTWAIT):
                pass
        except BlockingIOError:
            pass

    try:
        start = time.time()
        issued = await tcp.Pacer(issue, LAT_WARMUP + LAT_SECONDS).run()
        for p in procs:
            p.expect(issued)
        results = await tcp.collect(procs)
    finally:
        sock.close()
    delays, missing = delays_ms(results, commit_at, start + LAT_WARMUP)
    if missing:
        raise RuntimeError(f"latency (raw): {missing} (reader, line) arrivals missing")
    print(f"    raw  : {issued:,} lines to {READERS} readers; {spread(delays)}", flush=True)
    return delays


def hand_written(dsn, port, seconds):
    """What a user would write by hand (see the module docstring): facts
    and the ``time.time()`` of the first write.  Connecting is not timed."""
    import queue

    import psycopg2

    conns = queue.SimpleQueue()
    opened = [psycopg2.connect(dsn) for _ in range(E2E_LOOPS)]
    for c in opened:
        conns.put(c)
    socks = []
    for _ in range(E2E_WRITERS):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(sock)
    counts = [0] * E2E_WRITERS
    barrier = threading.Barrier(E2E_WRITERS + 1)
    stop_at = [float("inf")]
    channel = SERVER_NAME.encode()

    def worker(k):
        sock = socks[k]
        barrier.wait()
        n = 0
        while time.monotonic() < stop_at[0]:
            conn = conns.get()
            try:
                cur = conn.cursor()
                cur.execute("SELECT nextval('redis_hand_seq')")
                (i,) = cur.fetchone()
                r = row(i)
                cur.execute("INSERT INTO redis_hand VALUES (%s, %s, %s, %s::jsonb, %s)",
                            (i, WRITER, r[0], orjson.dumps(r[1]).decode(), r[2]))
                conn.commit()
            finally:
                conns.put(conn)
            line = encode_rdata_lines("e2e", WRITER, [(i, r)])[0].rstrip(b"\n")
            sock.sendall(b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
                         % (len(channel), channel, len(line), line))
            read_replies(sock, 1)
            n += 1
        counts[k] = n

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(E2E_WRITERS)]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.time()
    stop_at[0] = time.monotonic() + seconds
    for w in workers:
        w.join()
    for c in opened:
        c.close()
    for sock in socks:
        sock.close()
    return sum(counts), start


async def hand_written_slice(dsn, port, seconds, subscribers):
    """One slice of the hand-written baseline to ``READERS`` readers:
    (facts, seconds from the first write to the last arrival)."""
    procs = spawn_readers(port, "count", seconds + 60)
    await subscribed(port, subscribers)
    facts, start = await threads.deferToThread(hand_written, dsn, port, seconds)
    for p in procs:
        p.expect(facts)
    results = await tcp.collect(procs)
    last = check(results, facts, "e2e (hand-written)")
    return facts, last - start


async def make_hand_table(dsn):
    db = Database(parse_database({"postgres": dsn, "pool_min": 1, "pool_max": 1}))
    registry = StreamRegistry(db, WRITER, HAND, reactor=reactor)
    await registry.start()  # creates redis_hand and its sequence
    await registry.stop()
    db.close()


# ------------------------------------------------------------------ ours

MARKER = b"BENCH-MARKER"  # not a command: every instance ignores it
MARKER_TEXT = MARKER.decode()


def publish_marker(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(resp("PUBLISH", SERVER_NAME, MARKER))
        read_replies(sock, 1)
    return time.time()


class Writer:
    """Our instance: Database + registry + handler + RedisReplication."""

    def __init__(self, dsn, redis):
        self.dsn = dsn
        self.redis = redis

    async def start(self):
        self.db = Database(parse_database({"postgres": self.dsn, "pool_min": 1,
                                           "pool_max": E2E_LOOPS + 1}))
        self.registry = StreamRegistry(self.db, WRITER, STREAMS, reactor=reactor)
        await self.registry.start()
        self.handler = ReplicationHandler(self.registry, WRITER, SERVER_NAME)
        self.handler.start()
        self.link = RedisReplication(reactor, RedisConfig(self.redis.endpoint), self.handler,
                                     SERVER_NAME, WRITER)
        self.link.startService()
        await until(lambda: self.link.connected, 30, "the Redis link")
        self.losses = []
        link_lost = self.link.link_lost

        def lost(protocol):
            role = ("subscriber" if protocol is self.link.subscriber else
                    "publisher" if protocol is self.link.publisher else None)
            if role is not None:
                self.losses.append((time.time(), role))
            return link_lost(protocol)

        self.link.link_lost = lost
        # When its own echo of a marker published after the last fact
        # comes back: how far behind the instance's subscriber is.
        self.marker_at = None
        message_received = self.link.message_received

        def received(protocol, channel, message):
            if message[:len(MARKER)] in (MARKER, MARKER_TEXT):
                self.marker_at = time.time()
            return message_received(protocol, channel, message)

        self.link.message_received = received
        return self

    async def flushed(self, stream):
        key = (stream.name, WRITER)
        await until(lambda: self.handler.announced_positions()[key]
                    >= stream.id_gen.get_current_token(WRITER), 30, "the fan-out")
        # the publisher's transport buffer emptied into redis
        t = self.link.publisher.transport
        await until(lambda: len(t.dataBuffer) - t.offset == 0 and not t._tempDataBuffer,
                    30, "the publisher")

    async def stop(self):
        self.handler.stop("benchmark over")
        await self.link.stopService()
        await self.handler.drain()
        await self.registry.stop()
        self.db.close()


async def write_loops(stream, seconds, written, calls):
    """``E2E_WRITERS`` loops of ``write_facts`` (``E2E_FACTS_PER_CALL``
    facts each) for ``seconds``."""
    async def loop(end):
        while time.monotonic() < end:
            base = written[0]
            written[0] += E2E_FACTS_PER_CALL
            await stream.write_facts([[row(base + k)] for k in range(E2E_FACTS_PER_CALL)])
            calls[0] += 1

    end = time.monotonic() + seconds
    await defer.gatherResults([defer.ensureDeferred(loop(end)) for _ in range(E2E_WRITERS)],
                              consumeErrors=True)


async def writes_alone(dsn, seconds):
    """The same loops on a registry of their own (same database), with no
    handler and no Redis: what the write path alone does now (facts/s)."""
    db = Database(parse_database({"postgres": dsn, "pool_min": 1,
                                  "pool_max": E2E_LOOPS + 1}))  # as ours: E2E_LOOPS write
    registry = StreamRegistry(db, WRITER, ALONE, reactor=reactor)
    await registry.start()
    try:
        written, calls = [0], [0]
        start = time.monotonic()
        await write_loops(registry.get("alone"), seconds, written, calls)
        return written[0] / (time.monotonic() - start)
    finally:
        await registry.stop()
        db.close()


async def e2e_ours(writer, port, redis_pid):
    stream = writer.registry.get("e2e")
    procs = spawn_readers(port, "count", E2E_SECONDS + 60)
    await subscribed(port, READERS + 1)  # + our own subscriber
    writer.losses.clear()
    written = [0]
    calls = [0]
    groups0 = group_count(stream)
    gc.collect()
    cpu0, rcpu0 = cpu_seconds(), proc_cpu(redis_pid)
    start = time.time()
    with profiled():
        await write_loops(stream, E2E_SECONDS, written, calls)
        wrote = time.time()
        await writer.flushed(stream)
    handed = time.time()
    cpu, rcpu = cpu_seconds() - cpu0, proc_cpu(redis_pid) - rcpu0
    for p in procs:
        p.expect(written[0])
    writer.marker_at = None
    marked = publish_marker(port)
    # (a replaced subscriber never gets the marker: its backlog died with it)
    await until(lambda: writer.marker_at is not None or writer.losses, 60,
                "the writer's own echoes")
    if writer.losses:  # what was published while it reconnected is lost for plain readers
        await sleep(2.0)
        for p in procs:
            p.finish()
    results = await tcp.collect(procs)
    reached = min(c for r in results for c in r["counts"])
    last = max(at for r in results for at in r["last_at"])
    elapsed = last - start
    if writer.losses or reached != written[0]:
        print(f"    LOSS: the writer's Redis link was lost at "
              f"{[(round(t - start, 2), role) for t, role in writer.losses]} s; "
              f"{reached:,} of {written[0]:,} facts reached all {READERS} readers", flush=True)
    groups = group_count(stream) - groups0
    print(f"    ours: {written[0]:,} facts ({calls[0]:,} calls of {E2E_FACTS_PER_CALL} by "
          f"{E2E_WRITERS} loops, in {groups:,.0f} transactions) written in "
          f"{wrote - start:.2f}s, all handed to the publisher "
          f"{handed - wrote:.2f}s later, the last at the slowest reader {last - wrote:.2f}s "
          f"after the last write returned; writer CPU {cpu / (handed - start) * 100:.0f}%, "
          f"redis-server {rcpu / (handed - start) * 100:.0f}%, readers "
          f"{reader_cpu(results) / elapsed * 100:.0f}%", flush=True)
    if writer.marker_at is not None:
        print(f"          its own subscriber got its echoes {writer.marker_at - marked:.2f}s "
              f"behind (a marker published after the last fact came back then)", flush=True)
    else:
        print("          its own subscriber was replaced before its echoes caught up",
              flush=True)
    return reached / elapsed


async def latency_ours(writer, port):
    stream = writer.registry.get("latency")
    commit_at = stamp_commits(stream.id_gen)
    sent_at = stamp_sends(writer.handler)
    write_s = []

    async def timed_write(facts):
        t0 = time.monotonic()
        await stream.write_facts(facts)
        write_s.append(time.monotonic() - t0)

    procs = spawn_readers(port, "latency", LAT_WARMUP + LAT_SECONDS + 60)
    try:
        await subscribed(port, READERS + 1)
        writes = []
        n = [0]

        def issue(count):
            facts = [[row(n[0] + k)] for k in range(1, count + 1)]
            n[0] += count
            writes.append(defer.ensureDeferred(timed_write(facts)))

        gc.collect()
        cpu0 = cpu_seconds()
        start = time.time()
        with profiled():
            issued = await tcp.Pacer(issue, LAT_WARMUP + LAT_SECONDS).run()
            await defer.gatherResults(writes, consumeErrors=True)
            written = time.time()
            for p in procs:
                p.expect(issued)
            if writer.losses:  # what was published while it reconnected is lost
                await sleep(2.0)
                for p in procs:
                    p.finish()
            results = await tcp.collect(procs)
        cpu = cpu_seconds() - cpu0
    finally:
        del stream.id_gen.complete_many  # the stamping wrappers
        del writer.handler.fanout.send_updates
        del writer.handler.fanout.send_written
    if writer.losses:
        print(f"    the writer's Redis link was lost: "
              f"{[(round(t - start, 2), role) for t, role in writer.losses]}", flush=True)
    delays, missing = delays_ms(results, commit_at, start + LAT_WARMUP)
    if missing:
        got = set(results[0]["tokens"][0])
        lost = sorted(t for t in commit_at if t not in got)
        raise RuntimeError(f"latency (ours): {missing} (reader, fact) arrivals missing; "
                           f"reader 0: {results[0]['counts']} of {issued}, timeout "
                           f"{results[0]['timeout']}, lost {len(lost)}: {lost[:3]}.."
                           f"{lost[-3:]}; link lost {writer.losses}")
    print(f"    ours : {issued:,} facts in {written - start:.1f}s "
          f"({issued / (written - start):,.0f}/s) to {READERS} readers, "
          f"{len(delays):,} arrivals timed; {spread(delays)}; "
          f"writer CPU {cpu / (written - start) * 100:.0f}%", flush=True)
    print(write_path_report(write_s, commit_at, sent_at, start + LAT_WARMUP, "write_facts",
                            "the publisher"), flush=True)
    # The Redis leg alone: handed to the publisher -> arrival.
    stamped = {t: at for t, at in sent_at.items() if commit_at.get(t, 0) >= start + LAT_WARMUP}
    leg, _ = delays_ms(results, stamped, start + LAT_WARMUP)
    if leg:
        print(f"           handed to the publisher -> arrival: {spread(leg)}", flush=True)
    return delays


# ------------------------------------------------------------------ driver

PHASES = ("e2e", "latency")


async def run(dsn, only=PHASES):
    """Every Redis figure, on the PostgreSQL database ``dsn`` (fsync on)."""
    from tests.servers import RedisServer

    redis = RedisServer()
    writer = None
    try:
        port = redis.port
        # Baselines first: no instance of ours is subscribed then.
        if "e2e" in only:
            print(f"  e2e: {E2E_WRITERS} concurrent writes of {E2E_FACTS_PER_CALL} fact(s) on "
                  f"{E2E_LOOPS} write connections, fsync on, {READERS} reader processes "
                  "counting RDATA payloads", flush=True)
            ceiling = await e2e_raw(port, redis.proc.pid)
            await make_hand_table(dsn)
            hand = [await hand_written_slice(dsn, port, HAND_SECONDS / 2, READERS)]
        if "latency" in only:
            print(f"  latency: {tcp.LAT_RATE:,} facts/s, {READERS} readers, "
                  f"first {LAT_WARMUP:.0f}s not counted")
            raw_delays = await latency_raw(port)
        writer = await Writer(dsn, redis).start()
        # Latency first: after the e2e phase the instance's own subscriber is
        # still seconds behind on its echoes (see the e2e output).
        if "latency" in only:
            delays = await latency_ours(writer, port)
            if os.environ.get("REDIS_LAT_NAGLE"):  # printed only: the links as before
                for protocol in (writer.link.publisher, writer.link.subscriber):
                    protocol.transport.setTcpNoDelay(False)
                print("    ours again, the links without TCP_NODELAY (Nagle's algorithm on):",
                      flush=True)
                await latency_ours(writer, port)
                for protocol in (writer.link.publisher, writer.link.subscriber):
                    protocol.transport.setTcpNoDelay(True)
            what = "raw PUBLISH of pre-encoded lines on the same timer"
            for p in (50, 99):
                record(f"redis.latency.{READERS}readers.p{p}_ms", percentile(delays, p), "ms",
                       what, percentile(raw_delays, p), higher_is_better=False)
        if "e2e" in only:
            # The write path alone before and after (the fsync rate of a
            # shared machine drifts): how much of the bound is the database.
            alone = [await writes_alone(dsn, ALONE_SECONDS)]
            rate = await e2e_ours(writer, port, redis.proc.pid)
            alone.append(await writes_alone(dsn, ALONE_SECONDS))
            print(f"    the same write_facts loops alone (no handler, no Redis), "
                  f"{ALONE_SECONDS:.0f}s before and after: {alone[0]:,.0f} and "
                  f"{alone[1]:,.0f} facts/s", flush=True)
            hand.append(await hand_written_slice(dsn, port, HAND_SECONDS / 2, READERS + 1))
            hand_rate = sum(f for f, _ in hand) / sum(t for _, t in hand)
            print(f"    by hand: {sum(f for f, _ in hand):,} facts in two slices, "
                  f"{' and '.join(f'{f / t:,.0f}' for f, t in hand)} facts/s; "
                  f"the ceiling of Redis pub/sub here (no database) {ceiling:,.0f} lines/s",
                  flush=True)
            record("redis.e2e.facts_per_s", rate, "facts/s",
                   f"by hand: psycopg2 nextval+INSERT+commit then PUBLISH, {E2E_WRITERS} "
                   f"threads on {E2E_LOOPS} connections", hand_rate)
    finally:
        while _spawned:
            _spawned.pop().finish()
        if writer is not None:
            await writer.stop()
        redis.stop()


if __name__ == "__main__":
    task.react(lambda r: defer.ensureDeferred(
        standalone_main(sys.modules[__name__], "redisbench", sys.argv[1:])))
