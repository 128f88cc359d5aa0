"""Replication over real loopback TCP between processes' worth of instances,
on a real PostgreSQL: nothing lost, nothing duplicated, nothing reordered,
across random disconnects; a client that never reads is dropped."""

import random
import socket

from twisted.internet import defer, endpoints, reactor
from twisted.trial.unittest import TestCase

from replicator.config import parse_database, parse_streams
from replicator.consumers import MemoryConsumer
from replicator.observe import metrics
from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.transport.tcp import (
    ConnectionSettings,
    ReplicationServerFactory,
    upstream_service,
)
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from tests.servers import PostgresServer
from tests.support import as_sets, sleep, table_facts, until, until_handled, write_randomly

STREAMS = parse_streams([
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": ["master", "worker1"]},
    {"name": "events", "table": "event_stream",
     "columns": [{"event_id": "text"}, {"content": "json"}], "writers": ["master"]},
])
KEYS = [("caches", "master"), ("caches", "worker1"), ("events", "master")]
#: ``caches`` written by three instances, as an operator adds a writer.
THREE_WRITERS = parse_streams([
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": ["master", "worker1", "worker2"]},
])


class Instance:
    """One replicator instance in this process: registry, handler, consumer."""

    def __init__(self, test, dsn, name, streams=STREAMS):
        self.test = test
        self.streams = streams
        self.dsn = dsn
        self.name = name
        self.consumer = None
        self.client = None

    async def start(self, consumer_keys=(), fetch_limit=1000):
        db = Database(parse_database({"postgres": self.dsn, "pool_max": 3}))
        self.test.addCleanup(db.close)
        self.registry = StreamRegistry(db, self.name, self.streams, reactor=reactor)
        await self.registry.start()
        self.test.addCleanup(self.registry.stop)
        self.consumer = MemoryConsumer(positions={k: 0 for k in consumer_keys})
        self.handler = ReplicationHandler(self.registry, self.name, "hs.test", [self.consumer],
                                          fetch_limit=fetch_limit)
        self.handler.start()
        return self

    def listen(self, settings=None):
        factory = ReplicationServerFactory(self.handler, "hs.test", settings, clock=reactor)
        d = endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(factory)

        def listening(port):
            self.test.addCleanup(port.stopListening)
            self.port = port.getHost().port
            return self
        return d.addCallback(listening)

    def connect(self, port):
        self.client = upstream_service(
            reactor, f"tcp:host=127.0.0.1:port={port}", self.handler, self.name, "hs.test",
            initial_delay=0.02, max_delay=0.2)
        self.client.startService()
        self.test.addCleanup(self.stop_client)

    def stop_client(self):
        self.handler.stop()
        return self.client.stopService()

    def drop_connection(self):
        for conn in list(self.handler.connections):
            conn.transport.abortConnection()


TABLES = [("caches", "cache_stream", "cache_func, keys, ts"),
          ("events", "event_stream", "event_id, content")]


def consumed(instance):
    out = {}
    for stream, writer, token, rows in instance.consumer.facts:
        out.setdefault((stream, writer), []).append((token, rows))
    return out


class TcpReplicationTests(TestCase):
    timeout = 300

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()

    async def test_every_fact_exactly_once_across_disconnects(self):
        rng = random.Random(2024)
        master = await Instance(self, self.dsn, "master").start([("caches", "worker1")])
        await master.listen()
        workers = []
        for name in ("worker1", "worker2", "worker3"):
            keys = [k for k in KEYS if k[1] != name]
            w = await Instance(self, self.dsn, name).start(keys)
            w.connect(master.port)
            workers.append(w)
        await until_handled([master.handler], lambda: len(master.handler.connections) == 3)

        target = 10_000
        written = {"n": 0}

        def row_for(stream, i):
            if stream == "caches":
                return [f"func{i % 7}", rng.choice([None, [f"@u{i}:hs"], []]), i]
            return [f"$ev{i}", {"body": "x " * rng.randint(0, 5), "n": i}]

        async def writer_loop(instance, stream_name):
            await write_randomly(
                instance.registry.get(stream_name), rng, written, target,
                lambda n, j: row_for(stream_name, n), row_counts=(0, 1, 1, 1, 2, 4))

        async def chaos():
            while written["n"] < target:
                await sleep(rng.uniform(0.02, 0.15))
                rng.choice(workers).drop_connection()

        await defer.gatherResults([
            defer.ensureDeferred(writer_loop(master, "caches")),
            defer.ensureDeferred(writer_loop(master, "events")),
            defer.ensureDeferred(writer_loop(workers[0], "caches")),
            defer.ensureDeferred(chaos()),
        ])
        self.assertGreaterEqual(written["n"], target)

        def writer_token(key):
            owner = master if key[1] == "master" else workers[0]
            return owner.registry.get(key[0]).id_gen.get_current_token(key[1])

        def caught_up():
            for inst in [master] + workers:
                positions = inst.handler.reader_positions()
                for key, pos in positions.items():
                    if pos is None or pos < writer_token(key):
                        return False
            return True

        await until_handled([i.handler for i in [master] + workers], caught_up, timeout=120)
        expected = {k: [] for k in KEYS}
        expected.update(table_facts(self.dsn, TABLES))
        self.assertGreater(sum(len(v) for v in expected.values()), 5000)
        for inst in [master] + workers:
            got = consumed(inst)
            for key in KEYS:
                if key[1] == inst.name or (inst is master and key[1] == "master"):
                    self.assertNotIn(key, got)
                    continue
                self.assertEqual(len(got.get(key, [])), len(expected[key]),
                                 f"{inst.name} {key}")
                self.assertEqual(as_sets({key: got.get(key, [])}), as_sets({key: expected[key]}),
                                 f"{inst.name} {key}")
        self.assertGreater(metrics.CATCHUP_FETCHES.labels("caches")._value.get(), 0)

    async def test_reader_starting_far_behind_gets_every_fact_whole(self):
        """A reader that starts 6,000 facts behind while the writers go on:
        catch-up in small pages (multi-row facts straddle page ends), live
        RDATA batches arriving meanwhile, its link cut during catch-up."""
        rng = random.Random(99)
        master = await Instance(self, self.dsn, "master").start([("caches", "worker1")])
        await master.listen()
        writer = await Instance(self, self.dsn, "worker1").start([("caches", "master"),
                                                                  ("events", "master")])
        writer.connect(master.port)
        written = {"n": 0}

        def row_for(stream, i, j):
            if stream == "caches":
                return [f"func{i}.{j}", rng.choice([None, [f"@u{i}:hs"] * rng.randint(1, 30)]), i]
            return [f"$ev{i}.{j}", {"body": "x" * rng.randint(0, 3000), "n": i}]

        async def writers(target):
            await defer.gatherResults([
                defer.ensureDeferred(write_randomly(
                    inst.registry.get(name), rng, written, target,
                    lambda n, j, name=name: row_for(name, n, j),
                    row_counts=(0, 1, 2, 3, 7, 12), max_facts=8))
                for inst, name in ((master, "caches"), (master, "events"),
                                   (writer, "caches"))])

        await writers(6000)
        reader = await Instance(self, self.dsn, "worker2").start(
            [k for k in KEYS], fetch_limit=5)
        reader.connect(master.port)

        async def cuts():
            for _ in range(4):
                await sleep(rng.uniform(0.1, 0.4))
                reader.drop_connection()

        await defer.gatherResults([defer.ensureDeferred(writers(9000)),
                                   defer.ensureDeferred(cuts())])

        def writer_token(key):
            owner = writer if key[1] == "worker1" else master
            return owner.registry.get(key[0]).id_gen.get_current_token(key[1])

        await until_handled([reader.handler], lambda: all(
            (reader.handler.reader_positions()[k] or 0) >= writer_token(k) for k in KEYS),
            timeout=180)
        expected = {k: [] for k in KEYS}
        expected.update(table_facts(self.dsn, TABLES))
        self.assertGreater(sum(len(v) for v in expected.values()), 6000)
        got = consumed(reader)
        for key in KEYS:
            self.assertEqual([t for t, _ in got.get(key, [])], [t for t, _ in expected[key]],
                             key)
            self.assertEqual(as_sets({key: got.get(key, [])}), as_sets({key: expected[key]}),
                             key)

    async def test_client_that_never_reads_is_dropped(self):
        settings = ConnectionSettings(max_queued_lines=2000)
        master = await Instance(self, self.dsn, "master").start()
        await master.listen(settings)
        reader = await Instance(self, self.dsn, "worker2").start(KEYS)
        reader.connect(master.port)
        await until_handled([master.handler], lambda: len(master.handler.connections) == 1)

        sock = socket.create_connection(("127.0.0.1", master.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"NAME sleeper\nREPLICATE\n")
        self.addCleanup(sock.close)
        # Connected is not yet named: wait for its NAME.
        await until(lambda: any(c.name == "sleeper" for c in master.handler.connections))
        sleeper = [c for c in master.handler.connections if c.name == "sleeper"][0]
        before = metrics.DISCONNECTS.labels("congestion")._value.get()
        stream = master.registry.get("events")
        big = {"pad": "x" * 2000}
        peak = 0
        n = 0
        while sleeper.close_reason is None and n < 20000:
            await stream.write_facts([[[f"$e{n + i}", big]] for i in range(50)])
            n += 50
            peak = max(peak, sleeper.queued)
        self.assertEqual(sleeper.close_reason, "congestion")
        self.assertLessEqual(peak, 2000)
        # Gone within the congestion grace even though it never read.
        await until_handled([master.handler], lambda: sleeper not in master.handler.connections,
                            timeout=1.5)
        self.assertEqual(metrics.DISCONNECTS.labels("congestion")._value.get(), before + 1)
        sock.setblocking(False)
        data = b""
        try:
            while True:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
        except (BlockingIOError, ConnectionResetError):
            pass
        # What it was sent before the ERROR is whole lines of commands.
        self.assertTrue(data.startswith(b"SERVER hs.test\n"))
        # The other client kept receiving everything.
        await until_handled([reader.handler],
                            lambda: reader.handler.reader_positions()[("events", "master")]
                            == stream.id_gen.get_current_token("master"))
        self.assertEqual(len(consumed(reader)[("events", "master")]), n)

    async def test_congested_client_that_reads_late_gets_the_error(self):
        """Closed for congestion, a client that finally reads within the
        grace period receives everything buffered, ending with the ERROR."""
        settings = ConnectionSettings(max_queued_lines=500)
        master = await Instance(self, self.dsn, "master").start()
        await master.listen(settings)
        sock = socket.create_connection(("127.0.0.1", master.port))
        # (Default buffers: a tiny receive window on loopback is only
        # reopened by the sender's slow persist probes.)
        sock.sendall(b"NAME late\nREPLICATE\n")
        self.addCleanup(sock.close)
        await until_handled([master.handler], lambda: len(master.handler.connections) == 1)
        late = list(master.handler.connections)[0]
        stream = master.registry.get("events")
        n = 0
        while late.close_reason is None and n < 20000:
            await stream.write_facts([[[f"$e{n + i}", {"pad": "y" * 2000}]] for i in range(50)])
            n += 50
        self.assertEqual(late.close_reason, "congestion")
        sock.setblocking(False)
        data = b""
        end = None
        for _ in range(400):
            try:
                chunk = sock.recv(1 << 20)
            except BlockingIOError:
                await sleep(0.002)
                continue
            except ConnectionResetError:
                end = "reset"
                break
            if not chunk:
                end = "eof"
                break
            data += chunk
        self.assertEqual(end, "eof", (len(data), data[-60:]))
        self.assertTrue(data.endswith(b"ERROR Failed to keep up\n"), data[-100:])
        self.assertEqual(data.count(b"ERROR"), 1)


class _OffsetReactor:
    """The global reactor, but its clock reads ``OFFSET`` seconds ahead:
    whatever is timed on this object, not on the global reactor, shows it."""

    OFFSET = 10_000_000.0

    def __getattr__(self, name):
        return getattr(reactor, name)

    def seconds(self):
        return reactor.seconds() + self.OFFSET


class InstanceReactorTests(TestCase):
    async def test_accepted_connections_run_on_the_instances_reactor(self):
        """The listener's protocols time themselves on the reactor the
        instance was given (its clock is in the PING of the handshake),
        never on the global one."""
        import tempfile

        from replicator.config import parse_instance
        from replicator.daemon.service import Instance

        tmp = tempfile.mkdtemp()
        config = parse_instance({
            "server_name": "hs.test", "instance_name": "master",
            "database": {"sqlite": f"{tmp}/master.sqlite"},
            "replication": {"listen": "tcp:0:interface=127.0.0.1"},
        })
        clock = _OffsetReactor()
        instance = Instance(config, clock)
        await instance.start()
        self.addCleanup(lambda: defer.ensureDeferred(instance.stop()))
        port = instance.listeners[0].port.getHost().port
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.addCleanup(sock.close)
        sock.setblocking(False)
        data = b""

        def handshake():
            nonlocal data
            try:
                data += sock.recv(4096)
            except BlockingIOError:
                pass
            return data.count(b"\n") >= 2

        await until(handshake)
        server, ping = data.split(b"\n")[:2]
        self.assertEqual(server, b"SERVER hs.test")
        self.assertTrue(ping.startswith(b"PING "), ping)
        sent = int(ping[5:]) / 1000
        self.assertLess(abs(sent - clock.seconds()), 600, (sent, clock.seconds()))
