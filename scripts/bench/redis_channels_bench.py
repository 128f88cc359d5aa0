"""Redis channel layouts: the ``redis-channels`` part of ``make bench``.

Every figure beside a baseline from the same run, appended to
``bench-results.jsonl`` by :func:`common.record`.  A fresh ``redis-server``
(``tests.servers.RedisServer``) and the PostgreSQL database passed in.

``redis.channels.one_reader_bytes``
    One writer instance (our library as the daemon assembles it) writes
    ``CHANNEL_STREAMS`` streams, ``CHANNEL_FACTS`` one-row facts each,
    round-robin over the streams, ``CHANNEL_FACTS_PER_TXN`` facts per
    ``write_facts``; one reader instance configured with the first stream
    only.  Figure: the bytes the reader's Redis subscriber socket received
    (RESP, as read from the socket) from its subscription until a marker
    published on the control channel after the last fact came back, with
    ``channels: per_stream``; baseline: the same with ``channels: single``
    (every line on one channel, as before).  Both layouts run in the same
    run, one after the other, each with its own writer and tables.

``redis.cluster.<n>masters.facts_per_s`` and ``.redis_cpu_us_per_fact``
    Sharded pub/sub on a Redis 7 cluster of ``n`` masters (1, then 3;
    ``tests.redis_cluster_servers``), beside plain pub/sub on one
    redis-server (``channels: per_stream``) in the same run.  One writer bus
    and ``CLUSTER_READERS`` reader buses, all in this process (our
    transport, no database: the writer hands pre-encoded one-row RDATA lines
    of ``CLUSTER_STREAMS`` streams to ``publish_lines``, ``CLUSTER_BATCH``
    per stream per call, as a fan-out does, holding back while its
    publishers' socket buffers pass 1 MB; the readers parse every line and
    count each stream's RDATA).  Rate: ``CLUSTER_FACTS`` facts / (the last
    one counted by the slowest reader - the first handed over).  Redis CPU:
    ``used_cpu_sys + used_cpu_user`` of every master (``INFO cpu``) over
    the phase, per fact.  Our three buses share one Python process, so on a
    small machine the rate is this process's ceiling more than Redis's;
    the CPU per fact is Redis's own.  ``--big``: 10x the facts.

Run alone: ``python scripts/bench/redis_channels_bench.py [--only channels,cluster]``.
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.path.dirname(os.path.dirname(HERE)) not in sys.path:  # run alone
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import tcp  # noqa: E402
from common import record, standalone_main  # noqa: E402
from twisted.internet import defer, reactor, task  # noqa: E402

from replicator.config import RedisConfig, parse_database, parse_streams  # noqa: E402
from replicator.replication.core.handler import ReplicationHandler  # noqa: E402
from replicator.replication.transport.redis import RedisReplication  # noqa: E402
from replicator.storage.database import Database  # noqa: E402
from replicator.streams.registry import StreamRegistry  # noqa: E402

SERVER_NAME = "bench"
CHANNEL_STREAMS = 10
CHANNEL_FACTS = int(os.environ.get("REDIS_CHANNEL_FACTS", "2000"))
CHANNEL_FACTS_PER_TXN = 50
MARKER = b"BENCH-MARKER"  # not a command: every instance ignores it
until = tcp.until
row = tcp.row


def stream_configs(layout, writer):
    return parse_streams([
        {"name": f"s{i}", "table": f"chan_{layout}_{i}", "columns": tcp.COLUMNS,
         "writers": [writer]}
        for i in range(CHANNEL_STREAMS)])


class Instance:
    """Database + registry + handler + RedisReplication, as the daemon
    builds them."""

    def __init__(self, dsn, endpoint, name, streams, layout):
        self.dsn, self.endpoint, self.name = dsn, endpoint, name
        self.streams, self.layout = streams, layout

    async def start(self):
        self.db = Database(parse_database({"postgres": self.dsn, "pool_min": 1,
                                           "pool_max": 3}))
        self.registry = StreamRegistry(self.db, self.name, self.streams, reactor=reactor)
        await self.registry.start()
        self.handler = ReplicationHandler(self.registry, self.name, SERVER_NAME)
        self.handler.start()
        self.link = RedisReplication(reactor, RedisConfig(self.endpoint, channels=self.layout),
                                     self.handler, SERVER_NAME, self.name)
        self.link.startService()
        await until(lambda: self.link.connected, 30, f"{self.name}'s Redis link")
        # (single: past the probe for a Synapse, which holds our lines.)
        await until(lambda: not self.link.holding, 30, f"{self.name}'s probe")
        return self

    async def stop(self):
        self.handler.stop("benchmark over")
        await self.link.stopService()
        await self.handler.drain()
        await self.registry.stop()
        self.db.close()


async def one_reader_bytes(dsn, endpoint, layout):
    """Bytes a one-stream reader's subscriber received while a writer wrote
    every stream (see the module's docstring)."""
    writer_name = f"w-{layout}"
    streams = stream_configs(layout, writer_name)
    writer = await Instance(dsn, endpoint, writer_name, streams, layout).start()
    reader = await Instance(dsn, endpoint, f"r-{layout}", streams[:1], layout).start()
    try:
        subscriber = reader.link.subscriber
        received = [0]
        data_received = subscriber.dataReceived

        def counted(data):
            received[0] += len(data)
            return data_received(data)

        subscriber.dataReceived = counted
        marked = [False]
        message_received = reader.link.message_received

        def watch(protocol, channel, message):
            if message[:len(MARKER)] in (MARKER, MARKER.decode()):
                marked[0] = True
            return message_received(protocol, channel, message)

        reader.link.message_received = watch
        start = time.time()
        for base in range(0, CHANNEL_FACTS, CHANNEL_FACTS_PER_TXN):
            n = min(CHANNEL_FACTS_PER_TXN, CHANNEL_FACTS - base)
            await defer.gatherResults([
                defer.ensureDeferred(writer.registry.get(s.name).write_facts(
                    [[row(base + k)] for k in range(n)]))
                for s in streams], consumeErrors=True)
        def flushed():
            announced = writer.handler.announced_positions()
            return all(announced[(s.name, writer_name)] >= writer.registry.get(s.name)
                       .id_gen.get_current_token(writer_name) for s in streams)

        await until(flushed, 60, "the fan-out")
        last = writer.registry.get("s0").id_gen.get_current_token(writer_name)
        await until(lambda: reader.handler.reader_positions()[("s0", writer_name)] == last,
                    120, "the reader")
        writer.link.publish_lines([MARKER + b"\n"], channel=writer.link.channel.encode())
        await until(lambda: marked[0], 120, "the marker")
        elapsed = time.time() - start
        if reader.link.subscriber is not subscriber:
            raise RuntimeError(f"{layout}: the reader's subscriber was replaced")
        print(f"    {layout:<10}: {CHANNEL_STREAMS} streams x {CHANNEL_FACTS:,} facts; "
              f"the one-stream reader received {received[0]:,} bytes in {elapsed:.1f}s",
              flush=True)
        return received[0]
    finally:
        await reader.stop()
        await writer.stop()


CLUSTER_STREAMS = 6
CLUSTER_READERS = 2
CLUSTER_FACTS = int(os.environ.get("REDIS_CLUSTER_FACTS", "30000"))
CLUSTER_BATCH = 100


class _Stream:
    def __init__(self, name):
        self.name = name
        self.config = parse_streams([{"name": name, "table": name, "columns": tcp.COLUMNS,
                                      "writers": ["w"]}])[0]


class CountingHandler:
    """What a bus needs of a handler, counting each stream's RDATA."""

    def __init__(self, names):
        self.registry = [_Stream(n) for n in names]
        self.counts = dict.fromkeys(names, 0)
        self.done_at = None
        self.expect = None

    def new_connection(self, conn):
        pass

    def lost_connection(self, conn, reason):
        pass

    def on_RDATA(self, conn, cmd):
        self.counts[cmd.stream_name] += 1
        if self.expect is not None and sum(self.counts.values()) >= self.expect:
            self.done_at = self.done_at or time.time()

    def on_POSITION(self, conn, cmd):
        pass

    def on_REPLICATE(self, conn, cmd):
        pass


def redis_cpu(ports):
    from tests.redis_cluster_servers import command

    total = 0.0
    for port in ports:
        for line in command(port, "INFO", "cpu").splitlines():
            if line.startswith(("used_cpu_sys:", "used_cpu_user:")):
                total += float(line.split(":")[1])
    return total


async def cluster_phase(what, make_bus, ports):
    """(facts/s, Redis CPU microseconds per fact) of one topology."""
    from replicator.replication.wire.encoding import encode_rdata_lines

    names = [f"c{i}" for i in range(CLUSTER_STREAMS)]
    writer = make_bus(CountingHandler(names), "w")
    readers = [make_bus(CountingHandler(names), f"r{i}") for i in range(CLUSTER_READERS)]
    for bus in [writer] + readers:
        bus.startService()
    try:
        await until(lambda: all(b.connected for b in [writer] + readers), 60, "the buses")
        per_stream = CLUSTER_FACTS // CLUSTER_STREAMS
        total = per_stream * CLUSTER_STREAMS
        for r in readers:
            r.handler.expect = total
        publishers = (list(writer.publishers.values()) if hasattr(writer, "publishers")
                      else [writer.publisher])

        def backlog():
            return sum(len(p.transport.dataBuffer) - p.transport.offset
                       + sum(map(len, p.transport._tempDataBuffer)) for p in publishers)

        cpu0 = redis_cpu(ports)
        start = time.time()
        for base in range(1, per_stream + 1, CLUSTER_BATCH):
            tokens = range(base, min(base + CLUSTER_BATCH, per_stream + 1))
            for name in names:
                writer.publish_lines(list(encode_rdata_lines(
                    name, "w", [(t, row(t)) for t in tokens])))
            while backlog() > 1 << 20:
                await tcp.sleep(0.001)
        await until(lambda: all(r.handler.done_at for r in readers), 300, "the readers")
        elapsed = max(r.handler.done_at for r in readers) - start
        cpu = redis_cpu(ports) - cpu0
        if any(r.generations_ended if hasattr(r, "generations_ended") else 0
               for r in readers):
            print("    (a reader's cluster links were replaced meanwhile)", flush=True)
        print(f"    {what:<22}: {total:,} facts of {CLUSTER_STREAMS} streams to "
              f"{CLUSTER_READERS} readers in {elapsed:.2f}s: {total / elapsed:,.0f} facts/s; "
              f"Redis CPU {cpu:.2f}s ({cpu / total * 1e6:.1f} us per fact)", flush=True)
        return total / elapsed, cpu / total * 1e6
    finally:
        for bus in [writer] + readers:
            await bus.stopService()


async def cluster_figures():
    from replicator.replication.transport.redis_cluster import RedisClusterBus
    from tests.redis_cluster_servers import RedisCluster
    from tests.servers import RedisServer

    redis = RedisServer()
    try:
        config = RedisConfig(redis.endpoint, channels="per_stream")
        plain = await cluster_phase(
            "plain pub/sub", lambda h, n: RedisReplication(reactor, config, h, SERVER_NAME, n),
            [redis.port])
    finally:
        redis.stop()
    for masters in (1, 3):
        cluster = RedisCluster(masters)
        try:
            config = RedisConfig(cluster.endpoints[0], channels="per_stream",
                                 cluster=tuple(cluster.endpoints))
            rate, cpu = await cluster_phase(
                f"cluster, {masters} master{'s' if masters > 1 else ''}",
                lambda h, n, c=config: RedisClusterBus(reactor, c, h, SERVER_NAME, n),
                cluster.ports)
        finally:
            cluster.stop()
        record(f"redis.cluster.{masters}masters.facts_per_s", rate, "facts/s",
               f"plain pub/sub, one redis-server, {CLUSTER_READERS} readers", plain[0])
        record(f"redis.cluster.{masters}masters.redis_cpu_us_per_fact", cpu, "us",
               "plain pub/sub, one redis-server", plain[1], higher_is_better=False)


PHASES = ("channels", "cluster")


async def run(dsn, only=PHASES, big=False):
    """Every figure of this file, on the PostgreSQL database ``dsn``."""
    from tests.servers import RedisServer

    global CHANNEL_FACTS, CLUSTER_FACTS
    if big:
        CHANNEL_FACTS *= 10
        CLUSTER_FACTS *= 10
    redis = RedisServer()
    try:
        if "channels" in only:
            print(f"  channels: a reader of 1 of {CHANNEL_STREAMS} busy streams", flush=True)
            single = await one_reader_bytes(dsn, redis.endpoint, "single")
            per_stream = await one_reader_bytes(dsn, redis.endpoint, "per_stream")
            record("redis.channels.one_reader_bytes", per_stream, "bytes",
                   f"channels: single (every stream on one channel), {CHANNEL_STREAMS} streams",
                   single, higher_is_better=False)
    finally:
        redis.stop()
    if "cluster" in only:
        print(f"  cluster: {CLUSTER_STREAMS} streams, a writer and {CLUSTER_READERS} readers "
              f"(our Redis transport, no database)", flush=True)
        await cluster_figures()


if __name__ == "__main__":
    task.react(lambda r: defer.ensureDeferred(
        standalone_main(sys.modules[__name__], "redischannelsbench", sys.argv[1:])))
