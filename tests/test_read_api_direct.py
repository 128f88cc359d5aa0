"""Event streams at scale: a live round's bytes go straight to each
client's socket (HTTP/1.0 and chunked HTTP/1.1 alike), and a round whose
writes were costly is followed by a rest of the same length, so that many
clients get more facts per write instead of starving the reactor."""

import orjson
from twisted.internet import defer, endpoints, protocol, reactor, task
from twisted.trial.unittest import SynchronousTestCase

from replicator.readapi import live
from replicator.readapi.live import LiveFeed
from replicator.readapi.pages import read_page
from replicator.readapi.sse import SseClient
from replicator.readapi.watch import StreamWatch
from tests.support import until
from tests.test_http import AUTH
from tests.test_read_api import EVENTS, ReadTestCase, SseSocket
from tests.test_read_api_memory import FakeRequest, FakeStream


class ChunkedSseSocket(protocol.Protocol):
    """An HTTP/1.1 event-stream client: undoes the chunked framing (and
    checks it), then keeps the facts' stream IDs."""

    def __init__(self, path: str, headers: dict):
        self.request = (f"GET {path} HTTP/1.1\r\nHost: localhost\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
        self.raw = b""
        self.head = None
        self.body = b""
        self.closed = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.raw += data
        if self.head is None:
            head, sep, rest = self.raw.partition(b"\r\n\r\n")
            if not sep:
                return
            self.head, self.raw = head, rest
        while True:
            size_line, sep, rest = self.raw.partition(b"\r\n")
            if not sep:
                return
            size = int(size_line, 16)
            if len(rest) < size + 2:
                return
            if rest[size:size + 2] != b"\r\n":
                raise AssertionError(f"bad chunk framing: {self.raw[:80]!r}")
            self.body += rest[:size]
            self.raw = rest[size + 2:]

    def connectionLost(self, reason):
        self.closed.callback(None)

    def facts(self):
        return [orjson.loads(line[6:])["stream_id"] for line in self.body.split(b"\n")
                if line.startswith(b"data: ")]


class DirectWriteTests(ReadTestCase):
    async def connect(self, client):
        endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        await endpoints.connectProtocol(endpoint, client)
        self.addCleanup(lambda: client.transport.loseConnection() or client.closed)
        return client

    async def test_live_events_reach_the_sockets_in_the_round_that_encodes_them(self):
        """Nothing of a live round waits in a transport's buffer for a later
        turn of the reactor: each client's socket has it when the round
        ends, and both framings arrive whole and in order."""
        await self.start_reading()
        old = await self.connect(SseSocket(EVENTS.format("events"), AUTH))
        new = await self.connect(ChunkedSseSocket(EVENTS.format("events"), AUTH))
        await until(lambda: self.api.reads.slots.open == 2)
        feed = self.api.reads.feed(self.registry.get("events"))
        await until(lambda: len(feed.clients) == 2)
        self.assertIn(b"chunked", new.head.lower())
        left_behind = []
        send = feed._send

        def sent(data, position):
            send(data, position)
            for client in feed.clients:
                transport = client.request.channel.transport
                left_behind.append(len(transport.dataBuffer) - transport.offset
                                   + transport._tempDataLen)

        feed._send = sent
        ids = await self.write("events", 5)
        await until(lambda: len(old.facts()) == 5 and len(new.facts()) == 5)
        self.assertEqual([f["stream_id"] for _, f in old.facts()], ids)
        self.assertEqual(new.facts(), ids)
        self.assertTrue(left_behind)
        self.assertEqual(set(left_behind), {0})
        # The access log's length counts the events.
        for client in feed.clients:
            self.assertGreater(client.request.sentLength, 5 * len(b"event: fact"))


class CostlyRequest(FakeRequest):
    """A request whose writes take the (fake) time ``cost`` each."""

    def __init__(self, now, cost):
        super().__init__()
        self.now = now
        self.cost = cost

    def write(self, data):
        self.now[0] += self.cost
        super().write(data)


def timed(case, now) -> None:
    """Rounds' writes timed by ``now[0]`` (not by the wall clock)."""
    old = live.__dict__.get("perf_counter")
    live.perf_counter = lambda: now[0]
    case.addCleanup(lambda: setattr(live, "perf_counter", old) if old is not None
                    else delattr(live, "perf_counter"))


class RestTests(SynchronousTestCase):
    def test_a_costly_round_is_followed_by_a_rest_as_long(self):
        now = [0.0]
        timed(self, now)
        clock = task.Clock()
        stream = FakeStream(["a"])
        feed = LiveFeed(stream, lambda s: s.id_gen.get_positions(), StreamWatch(), clock,
                        interval=0.003)
        request = CostlyRequest(now, 0.05)

        async def page(pos, limit, bounds):
            return await read_page(stream, pos, bounds, limit)

        SseClient(request, stream, feed, {"a": 0}, page, clock, 3600).start()
        written = len(request.written)
        stream.add("a", 1, [[1]])
        stream.id_gen.move("a", 1)
        self.assertEqual(len(request.written), written + 1)  # idle: at once
        for i in range(2, 6):
            stream.add("a", i, [[i]])
            stream.id_gen.move("a", i)
        clock.advance(0.003)  # the interval is over, the rest (50 ms) is not
        self.assertEqual(len(request.written), written + 1)
        clock.advance(0.047)
        self.assertEqual(len(request.written), written + 2)
        self.assertEqual(request.written[-1].count(b"event: fact"), 4)

    def test_cheap_rounds_keep_the_interval(self):
        now = [0.0]
        timed(self, now)
        clock = task.Clock()
        stream = FakeStream(["a"])
        feed = LiveFeed(stream, lambda s: s.id_gen.get_positions(), StreamWatch(), clock,
                        interval=0.003)
        request = CostlyRequest(now, 0.0005)  # below a millisecond

        async def page(pos, limit, bounds):
            return await read_page(stream, pos, bounds, limit)

        SseClient(request, stream, feed, {"a": 0}, page, clock, 3600).start()
        written = len(request.written)
        for i in range(1, 4):
            stream.add("a", i, [[i]])
            stream.id_gen.move("a", i)
        clock.advance(0.003)
        self.assertEqual(len(request.written), written + 2)
        self.assertEqual(request.written[-1].count(b"event: fact"), 2)
