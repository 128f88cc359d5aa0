"""Event streams at scale: a live round's bytes go straight to each
client's socket (HTTP/1.0 and chunked HTTP/1.1 alike), a slice of clients
per turn of the reactor, so that many clients do not starve the rest of
the daemon (the write API first)."""

import orjson
from twisted.internet import defer, endpoints, protocol, reactor, task
from twisted.trial.unittest import SynchronousTestCase

from replicator.http.read import live
from replicator.http.read.live import LiveFeed
from replicator.http.read.pages import read_page
from replicator.http.read.sse import SseClient
from replicator.http.read.watch import StreamWatch
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
        write = feed._write

        def written(frames, position, clients):
            write(frames, position, clients)
            for client in clients:
                transport = client.request.channel.transport
                left_behind.append(len(transport.dataBuffer) - transport.offset
                                   + transport._tempDataLen)

        feed._write = written
        ids = await self.write("events", 5)
        await until(lambda: len(old.facts()) == 5 and len(new.facts()) == 5)
        self.assertEqual([f["stream_id"] for _, f in old.facts()], ids)
        self.assertEqual(new.facts(), ids)
        self.assertTrue(left_behind)
        self.assertEqual(set(left_behind), {0})
        # The access log's length counts the events.
        for client in feed.clients:
            self.assertGreater(client.request.sentLength, 5 * len(b"event: fact"))


class SliceTests(SynchronousTestCase):
    def test_a_round_is_written_in_slices_and_a_client_joining_meanwhile_has_it_once(self):
        """Between two slices of a round the reactor does other work; a
        client that catches up and joins meanwhile (at the round's start)
        gets the round's events too, once, and everyone has them in order."""
        self.patch(live, "SLICE", 2)
        clock = task.Clock()
        stream = FakeStream(["a"])
        feed = LiveFeed(stream, lambda s: s.id_gen.get_positions(), StreamWatch(), clock,
                        interval=0)

        async def page(pos, limit, bounds):
            return await read_page(stream, pos, bounds, limit)

        requests = []
        for _ in range(5):
            requests.append(FakeRequest())
            SseClient(requests[-1], stream, feed, {"a": 0}, page, clock, 3600).start()
        paused = FakeRequest()
        late = SseClient(paused, stream, feed, {"a": 0}, page, clock, 3600)
        late.paused = True  # it starts behind its transport: not live yet
        late.start()
        self.assertNotIn(late, feed.clients)
        stream.add("a", 1, [[1]])
        stream.id_gen.move("a", 1)
        got = [r.written.count(r.written[-1]) if b"event: fact" in r.written[-1] else 0
               for r in requests]
        self.assertEqual(sorted(got), [0, 0, 0, 1, 1])  # the first slice only
        late.resumeProducing()  # joins at the round's start
        self.assertIn(late, feed.clients)
        clock.advance(0)
        clock.advance(0)
        for r in requests + [paused]:
            self.assertEqual(SseTestsEvents.ids(r), [1], r)
        stream.add("a", 2, [[2]])
        stream.id_gen.move("a", 2)
        clock.advance(0)
        clock.advance(0)
        for r in requests + [paused]:
            self.assertEqual(SseTestsEvents.ids(r), [1, 2])


class SseTestsEvents:  # (the stream IDs a fake request was written)
    @staticmethod
    def ids(request):
        data = b"".join(request.written)
        return [orjson.loads(line[6:])["stream_id"] for line in data.split(b"\n")
                if line.startswith(b"data: ")]
