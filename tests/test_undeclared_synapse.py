"""A Synapse on our Redis channel that the config does not declare (issue 20,
item 9): an operator pointed ``replication.redis`` at Synapse's Redis and
left out the ``synapse:`` section, so our instances publish on Synapse's
channel ``<server_name>``.  Every POSITION of ours for a stream Synapse does
not know raises in Synapse's subscription handler (its Redis connection is
dropped and made again); every RDATA is an ERROR in its log.

Once one of our instances has seen Synapse there (its POSITIONs for streams
like ``events`` or ``typing`` that no config of ours defines), it publishes
nothing more on that channel, says why on ``/health`` and in one log line
naming the ``synapse:`` key.  An instance that joins while Synapse is there
asks first (REPLICATE) and announces its own positions only once no Synapse
answered: Synapse never hears a stream of ours.
"""

import socket
import threading
import types

from twisted.internet import task
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator.config import RedisConfig, parse_streams
from replicator.consumers import MemoryConsumer
from replicator.observe.health import HealthMonitor
from replicator.replication.transport.base_handler import BaseHandler
from replicator.replication.transport.redis import RedisReplication
from replicator.replication.wire.commands import parse_line
from tests.fakes import FakeView
from tests.redis_nodes import Node
from tests.servers import PostgresServer, RedisServer
from tests.support import WatchedConsumer, until, until_handled
from tests.synapse_side import (
    OWN,
    READER,
    SYNAPSE_CACHES_DDL,
    ChannelRecorder,
    _pg,
    redis_call,
    tokens,
)

CHANNEL = "example.org"
#: What Synapse 1.163.2's main process announces (one POSITION per stream it
#: writes), a sample: two of these are streams a replicator config may also
#: define (``caches``, ``receipts``), the others no config of ours does here.
SYNAPSE_POSITIONS = ["POSITION events master 40 40", "POSITION caches master 0 0",
                     "POSITION typing master 3 3", "POSITION receipts master 7 7",
                     "POSITION to_device master 12 12"]


def _bulk(s: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(s), s)


class SynapseStandIn:
    """Synapse's main process on Redis, as far as the channel sees it: on
    subscribing it publishes ``REPLICATE `` and then its positions
    (``synapse/replication/tcp/redis.py``), and it answers every REPLICATE
    on the channel with its positions.  Runs in a thread on plain sockets."""

    def __init__(self, port: int):
        self.port = port
        self.sub = socket.create_connection(("127.0.0.1", port))
        self.pub = socket.create_connection(("127.0.0.1", port))
        self.sub.sendall(b"*2\r\n" + _bulk(b"SUBSCRIBE") + _bulk(CHANNEL.encode()))
        self._read_until(b"subscribe")
        self.answered = 0
        self.lock = threading.Lock()  # the thread and the test both publish
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _read_until(self, marker: bytes) -> bytes:
        data = b""
        while marker not in data:
            data += self.sub.recv(65536)
        return data

    def publish(self, line: str) -> None:
        with self.lock:
            self.pub.sendall(b"*3\r\n" + _bulk(b"PUBLISH") + _bulk(CHANNEL.encode())
                             + _bulk(line.encode()))
            reply = b""
            while not reply.endswith(b"\r\n"):
                reply += self.pub.recv(100)

    def start(self) -> "SynapseStandIn":
        self.publish("REPLICATE ")
        for line in SYNAPSE_POSITIONS:
            self.publish(line)
        self.thread.start()
        return self

    def _run(self) -> None:
        self.sub.settimeout(0.05)
        buffer = b""
        while not self._stop:
            try:
                chunk = self.sub.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            while b"$7\r\nmessage\r\n" in buffer:
                head, _, rest = buffer.partition(b"$7\r\nmessage\r\n")
                lines = rest.split(b"\r\n")
                if len(lines) < 5:
                    break  # the rest of this message is still on its way
                payload = lines[3]
                buffer = b"\r\n".join(lines[4:])
                if payload.rstrip() == b"REPLICATE":
                    for line in SYNAPSE_POSITIONS:
                        self.publish(line)
                    self.answered += 1

    def stop(self) -> None:
        self._stop = True
        if self.thread.is_alive():
            self.thread.join(5)
        self.sub.close()
        self.pub.close()


def seen(link):
    """What the instance saw of a Synapse (None: nothing)."""
    return getattr(link, "synapse_seen", None)


def heard_synapse(link):
    """Synapse's ``POSITION caches master`` reached the instance's handler
    (it comes after ``POSITION events master`` in Synapse's answer)."""
    return ("caches", "master") in link.handler.reader_heard()


def ours(messages):
    """The messages that name a stream or an instance of ours."""
    return [m for _, m in messages if "app_events" in m or " app1 " in m or " app2 " in m]


class UndeclaredSynapseTests(TestCase):
    timeout = 120

    def setUp(self):
        self.redis = RedisServer.shared()
        self.dsn = PostgresServer.shared().create_database("undeclared")
        _pg(self.dsn, SYNAPSE_CACHES_DDL)
        self.recorder = ChannelRecorder(self.redis.port, [CHANNEL, CHANNEL + "/USER_IP"])
        self.addCleanup(self.recorder.close)
        self.logged = []
        globalLogPublisher.addObserver(self._observe)
        self.addCleanup(globalLogPublisher.removeObserver, self._observe)

    def _observe(self, event):
        if "`synapse:`" in (formatEvent(event) or ""):
            self.logged.append(event)

    async def node(self, name, consumer):
        """An instance with our own stream and a reader of Synapse's caches
        (as a preset would give it), without the ``synapse:`` section."""
        node = await Node(self, self.dsn, name, self.redis, consumer,
                          streams=parse_streams([OWN, READER]), server_name=CHANNEL,
                          ping_timeout=2).start()
        return node.registry, node.link

    async def marker(self, text):
        """Publish ``PING text`` and wait until the recorder has it: every
        line published before it is in the recorder by then."""
        redis_call(self.redis.port, "PUBLISH", CHANNEL, "PING " + text)
        await until(lambda: any(m == "PING " + text for _, m in self.recorder.messages()),
                    timeout=30)
        return len(self.recorder.messages())

    async def test_synapse_arriving_later_is_never_answered_and_hears_nothing_more(self):
        c1, c2 = MemoryConsumer(), WatchedConsumer()
        r1, link1 = await self.node("app1", c1)
        _, link2 = await self.node("app2", c2)
        await until_handled([link1.handler, link2.handler],
                            lambda: link1.connected and link2.connected, timeout=30)
        for i in range(3):
            await r1.get("app_events").write_fact([[f"m{i}"]])
        await c2.until(lambda: len(tokens(c2, "app_events", "app1")) == 3)
        # Our own instances (REPLICATE, POSITION and RDATA of our streams,
        # and lines no one reads) are no Synapse.
        redis_call(self.redis.port, "PUBLISH", CHANNEL, "POSITION other_app worker9 1 1")
        before = await self.marker("before")
        self.assertIsNone(seen(link1))
        self.assertIsNone(seen(link2))
        self.assertTrue(ours(self.recorder.messages()))

        synapse = SynapseStandIn(self.redis.port).start()
        self.addCleanup(synapse.stop)
        await until(lambda: heard_synapse(link1) and heard_synapse(link2), timeout=30)
        for i in range(3):
            await r1.get("app_events").write_fact([[f"late{i}"]])
        # Synapse reconnects (as it does after an error): asks again.
        synapse.publish("REPLICATE ")
        for line in SYNAPSE_POSITIONS:
            synapse.publish(line)
        await until(lambda: synapse.answered >= 1, timeout=30)
        after = await self.marker("after")
        self.assertGreater(after, before)
        # Nothing of ours after Synapse appeared: not even an answer to its
        # first REPLICATE.
        self.assertEqual(ours(self.recorder.messages()[before:]), [])
        self.assertEqual(
            sum(1 for _, m in self.recorder.messages()[before:] if m.startswith("REPLICATE")),
            2)  # Synapse's two
        for link in (link1, link2):
            self.assertIn("synapse:", seen(link))
            self.assertIn("POSITION events master", seen(link))
        # One log line per instance, naming the key.
        self.assertEqual(sorted(e["instance"] for e in self.logged), ["app1", "app2"])

    async def test_joining_beside_synapse_publishes_nothing_of_ours(self):
        synapse = SynapseStandIn(self.redis.port).start()
        self.addCleanup(synapse.stop)
        before = await self.marker("synapse-up")
        c1 = MemoryConsumer()
        r1, link1 = await self.node("app1", c1)
        await until_handled([link1.handler], lambda: link1.connected, timeout=30)
        await until(lambda: heard_synapse(link1), timeout=30)
        await r1.get("app_events").write_fact([["m0"]])
        await self.marker("after")
        messages = self.recorder.messages()[before:]
        self.assertEqual(ours(messages), [])
        # It asked (one REPLICATE); Synapse answered; nothing else of ours.
        self.assertIn("REPLICATE", [m.rstrip() for _, m in messages])
        self.assertEqual(len(self.logged), 1)


class SynapseWatchTests(SynchronousTestCase):
    """What proves a Synapse, and what does not."""

    def watch(self):
        from replicator.replication.transport.synapse_watch import SynapseWatch

        return SynapseWatch(CHANNEL, ["app_events", "caches", "receipts"])

    def test_synapse_streams_that_no_config_of_ours_defines(self):
        for line in ("POSITION events master 40 40", 'RDATA typing master 3 ["!r:hs",[]]',
                     "POSITION to_device synapse-worker1 1 1"):
            watch = self.watch()
            self.assertIsNone(watch.evidence)
            evidence = watch.observe(parse_line(line))
            self.assertIn(line.split(" ", 3)[1], evidence)
            self.assertEqual(watch.evidence, evidence)
            # Said once.
            self.assertIsNone(watch.observe(parse_line(line)))

    def test_our_own_traffic_is_no_synapse(self):
        watch = self.watch()
        for line in ("REPLICATE ", "REPLICATE", "POSITION app_events app1 1 1",
                     'RDATA caches master 5 ["f",null,1]', "POSITION receipts master 1 1",
                     "POSITION other_app worker9 1 2", "CLEAR_USER_SYNC app1",
                     "USER_SYNC synapse1 @u:hs None start 1000", "PING 1"):
            self.assertIsNone(watch.observe(parse_line(line)), line)
        self.assertIsNone(watch.evidence)


class HealthReasonTests(SynchronousTestCase):
    def test_a_standing_condition_is_the_health_reason(self):
        reasons = [None]
        monitor = HealthMonitor(registry=[], handler=FakeView(), db=None, clock=task.Clock(),
                                conditions=[lambda: reasons[0]])
        self.assertIsNone(monitor.problem(True, "connected"))
        reasons[0] = "Synapse is on redis channel example.org"
        self.assertEqual(monitor.problem(True, "connected"), reasons[0])


class _Handler(BaseHandler):
    """What the Redis link calls on its handler, recorded."""

    def __init__(self, link_lines):
        super().__init__()
        self.registry = [types.SimpleNamespace(name="app_events")]
        self.link_lines = link_lines
        self.answered = 0

    def new_connection(self, conn):
        conn.send_lines([b"POSITION app_events app1 5 5\n"], "POSITION")

    def on_REPLICATE(self, conn, cmd):
        self.answered += 1
        conn.send_lines([b"POSITION app_events app1 6 6\n"], "POSITION")

    def on_POSITION(self, conn, cmd):
        pass


class HoldTests(SynchronousTestCase):
    """In memory: a registration without the ``synapse:`` section publishes
    REPLICATE alone, keeps our lines for ``synapse_probe`` seconds, then
    publishes them in order and answers; a Synapse seen meanwhile gets
    none of them."""

    def setUp(self):
        self.clock = task.Clock()
        self.published = []
        self.handler = _Handler(self.published)
        self.link = RedisReplication(self.clock, RedisConfig("tcp:host=127.0.0.1:port=1"),
                                     self.handler, CHANNEL, "app1", clock=self.clock)
        self.link.publish_lines = lambda lines, channel=None: self.published.extend(lines)
        self.link._subscribed, self.link.publisher = True, object()
        self.link.subscriber = object()
        self.link._maybe_register()

    def hear(self, line):
        self.link.message_received(self.link.subscriber, CHANNEL.encode(), line.encode())

    def test_asks_first_then_publishes_what_it_held_in_order(self):
        self.link.conn.send_lines([b"RDATA app_events app1 6 [\"x\"]\n"])
        self.hear("REPLICATE ")  # our own echo: one answer for all
        self.assertEqual(self.published, [b"REPLICATE \n"])
        self.clock.advance(1.0)
        self.assertEqual(self.published, [
            b"REPLICATE \n", b"POSITION app_events app1 5 5\n",
            b"RDATA app_events app1 6 [\"x\"]\n", b"POSITION app_events app1 6 6\n"])
        self.assertEqual(self.handler.answered, 1)
        # Later REPLICATEs are answered late too, live lines go out at once.
        self.hear("REPLICATE ")
        self.link.conn.send_lines([b"RDATA app_events app1 7 [\"y\"]\n"])
        self.assertEqual(self.handler.answered, 1)
        self.clock.advance(1.0)
        self.assertEqual(self.handler.answered, 2)

    def test_a_synapse_seen_while_holding_gets_nothing(self):
        self.link.conn.send_lines([b"RDATA app_events app1 6 [\"x\"]\n"])
        self.hear("POSITION typing master 3 3")
        self.clock.advance(5.0)
        self.assertEqual(self.published, [b"REPLICATE \n"])
        self.assertEqual(self.handler.answered, 0)
        self.assertIn("POSITION typing master", self.link.synapse_seen)

    def test_too_much_held_is_dropped_and_the_answer_announces(self):
        from replicator.replication.transport.redis import HOLD_MAX_LINES

        self.link.conn.send_lines([b"RDATA app_events app1 batch [\"x\"]\n"] * HOLD_MAX_LINES)
        self.link.conn.send_lines([b"RDATA app_events app1 6 [\"x\"]\n"])
        self.clock.advance(1.0)
        self.assertEqual(self.published,
                         [b"REPLICATE \n", b"POSITION app_events app1 6 6\n"])
