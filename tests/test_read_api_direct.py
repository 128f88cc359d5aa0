"""Event streams at scale: a live pass's bytes go straight to each
client's socket (HTTP/1.0 and chunked HTTP/1.1 alike), a slice of clients
per turn of the reactor, so that many clients do not starve the rest of
the daemon (the write API first); facts read while a pass runs go to the
clients it has not reached yet in the same pass."""

import orjson
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from twisted.internet import defer, endpoints, protocol, reactor, task
from twisted.trial.unittest import SynchronousTestCase

from replicator.http.read import live, tokens
from replicator.http.read.sse import SseClient
from tests.http_api import AUTH
from tests.read_api_cases import EVENTS, ReadTestCase, SseSocket
from tests.read_api_fakes import FakeRequest, FakeStream, live_feed, page_reader
from tests.support import Waits, until


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
        self._waits = Waits()

    def until(self, predicate, timeout: float = 30.0):
        """A Deferred that fires once ``predicate()`` holds, woken by each
        read of the socket and by its close (not a poll)."""
        return self._waits.wait(predicate, timeout, "event stream condition")

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        try:
            self._parse(data)
        finally:
            self._waits.check()

    def _parse(self, data):
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
        self._waits.check()

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
        # The server has both clients live before the head reaches the client.
        await new.until(lambda: new.head is not None)
        self.assertIn(b"chunked", new.head.lower())
        left_behind = []
        write = feed._write

        def written(clients):
            write(clients)
            for client in clients:
                transport = client.request.channel.transport
                left_behind.append(len(transport.dataBuffer) - transport.offset
                                   + transport._tempDataLen)

        feed._write = written
        ids = await self.write("events", 5)
        await old.until(lambda: len(old.facts()) == 5)
        await new.until(lambda: len(new.facts()) == 5)
        self.assertEqual([f["stream_id"] for _, f in old.facts()], ids)
        self.assertEqual(new.facts(), ids)
        self.assertTrue(left_behind)
        self.assertEqual(set(left_behind), {0})
        # The access log's length counts the events.
        for client in feed.clients:
            self.assertGreater(client.request.sentLength, 5 * len(b"event: fact"))


class SliceTests(SynchronousTestCase):
    def feed_and_clients(self, n):
        """A feed written 2 clients per slice, and ``n`` live clients."""
        self.patch(live, "SLICE", 2)
        clock = task.Clock()
        stream = FakeStream(["a"])
        feed = live_feed(stream, clock)

        page = page_reader(stream)

        requests = []
        for _ in range(n):
            requests.append(FakeRequest())
            SseClient(requests[-1], stream, feed, {"a": 0}, page, clock, 3600).start()
        return clock, stream, feed, page, requests

    def test_a_round_is_written_in_slices_and_a_client_joining_meanwhile_has_it_once(self):
        """Between two slices of a round the reactor does other work; a
        client that catches up and joins meanwhile (at the round's start)
        gets the round's events too, once, and everyone has them in order."""
        clock, stream, feed, page, requests = self.feed_and_clients(5)
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


    def test_a_fact_read_during_a_pass_reaches_the_clients_not_reached_yet(self):
        """A fact read while a pass is under way goes to the clients that
        pass has not reached yet, in the same write as what it was
        carrying: nobody waits for the pass to end and then for a whole
        pass of its own (at 1,000 clients that doubled the latency)."""
        clock, stream, feed, page, requests = self.feed_and_clients(6)
        for i in (1, 2):  # the second while the first's pass is at its first slice
            stream.add("a", i, [[i]])
            stream.id_gen.move("a", i)
        # The first slice had fact 1 alone; the pass then takes fact 2 to
        # the four it had not reached, with fact 1 in one write, and the
        # next pass (in the same turn as the last slice) to the first two.
        clock.advance(0)
        clock.advance(0)
        self.assertEqual([SseTestsEvents.ids(r) for r in requests], [[1, 2]] * 6)
        self.assertEqual(sorted(len(r.written) for r in requests), [2, 2, 2, 2, 3, 3])
        self.assertEqual(len(feed._log), 0)  # every client has every segment


class FeedMachine(RuleBasedStateMachine):
    """Any interleaving of writes by two writers, reads, passes in slices,
    clients pausing, resuming, going, and joining from any past position:
    every client gets every fact after its start exactly once, in order
    per writer, each event's id the positions after it; the log keeps
    nothing every live client has."""

    def __init__(self):
        super().__init__()
        self.clock = task.Clock()
        self.stream = FakeStream(["a", "b"])
        self.feed = live_feed(self.stream, self.clock, 0.003)
        self._page = page_reader(self.stream)
        self.clients = []  # (client, request, start)
        self.next_id = 1

    @rule(writer=st.sampled_from("ab"))
    def write(self, writer):
        i, self.next_id = self.next_id, self.next_id + 1
        self.stream.add(writer, i, [[i]] * (1 + i % 3))
        self.stream.id_gen.move(writer, i)

    @rule(a=st.integers(0, 40), b=st.integers(0, 40))
    def connect(self, a, b):
        now = self.stream.id_gen.get_positions()
        start = {"a": min(a, now["a"]), "b": min(b, now["b"])}
        request = FakeRequest()
        client = SseClient(request, self.stream, self.feed, dict(start), self._page,
                           self.clock, 3600)
        client.start()
        self.clients.append((client, request, start))

    @rule(seconds=st.sampled_from([0, 0, 0.001, 0.003]))
    def turn(self, seconds):
        self.clock.advance(seconds)

    @precondition(lambda self: self.clients)
    @rule(k=st.integers(0, 50))
    def pause(self, k):
        self.clients[k % len(self.clients)][0].pauseProducing()

    @precondition(lambda self: self.clients)
    @rule(k=st.integers(0, 50))
    def resume(self, k):
        self.clients[k % len(self.clients)][0].resumeProducing()

    @precondition(lambda self: self.clients)
    @rule(k=st.integers(0, 50))
    def go(self, k):
        client, request, _ = self.clients.pop(k % len(self.clients))
        client.stopProducing()

    @invariant()
    def received_in_order_once(self):
        for client, request, start in self.clients:
            self._check(request, start, complete=False)

    @invariant()
    def log_holds_only_what_a_live_client_lacks(self):
        feed = self.feed
        oldest = min((c.seq for c in feed.clients), default=feed._seq)
        if not feed._passing:
            self.assertEqual(len(feed._log), feed._seq - oldest)

    def teardown(self):
        for client, _, _ in self.clients:
            client.resumeProducing()
        for _ in range(200):
            self.clock.advance(0.003)
        for client, request, start in self.clients:
            if not client.closed:
                self._check(request, start, complete=True)
                self.assertTrue(client.live)
        for client, _, _ in self.clients:
            client.stopProducing()

    def _check(self, request, start, complete):
        data = b"".join(request.written)
        got = {"a": [], "b": []}
        for block in data.split(b"\n\n"):
            if not block.startswith(b"id: "):
                continue
            lines = block.split(b"\n")
            fact = orjson.loads(lines[2][6:])
            got[fact["writer"]].append(fact["stream_id"])
            position = tokens.decode(lines[0][4:].decode(), "events", ["a", "b"])
            self.assertEqual(position[fact["writer"]], fact["stream_id"])
        for w in "ab":
            want = sorted(i for i in self.stream.facts[w] if i > start[w])
            if complete:
                self.assertEqual(got[w], want, w)
            else:
                self.assertEqual(got[w], want[:len(got[w])], w)

    def assertEqual(self, a, b, msg=None):
        assert a == b, (a, b, msg)

    def assertTrue(self, a):
        assert a


class FeedMachineTests(SynchronousTestCase):
    def test_the_feed_under_any_interleaving(self):
        machine = type("Machine", (FeedMachine,), {})
        machine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                             deadline=None)
        self.patch(live, "SLICE", 2)
        machine.TestCase().runTest()


class SseTestsEvents:  # (the stream IDs a fake request was written)
    @staticmethod
    def ids(request):
        data = b"".join(request.written)
        return [orjson.loads(line[6:])["stream_id"] for line in data.split(b"\n")
                if line.startswith(b"data: ")]
