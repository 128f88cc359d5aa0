"""The read API in memory: resume tokens, pages over a fake stream, the
Server-Sent Events framing and the switch of a slow client to the table."""

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer, task
from twisted.trial.unittest import SynchronousTestCase

from replicator.http.read import tokens
from replicator.http.read.live import LiveFeed
from replicator.http.read.pages import read_page
from replicator.http.read.sse import PING, RETRY, SseClient
from replicator.http.read.watch import StreamWatch
from tests.read_api_fakes import FakeRequest, FakeStream, live_feed, page_reader, run

names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
positions = st.dictionaries(names, st.integers(0, 2 ** 63 - 1), min_size=1, max_size=5)


class TokenTests(SynchronousTestCase):
    @settings(max_examples=200, deadline=None)
    @given(names, positions)
    def test_round_trip(self, stream, pos):
        text = tokens.encode(stream, pos)
        self.assertTrue(text.startswith("v1."))
        self.assertRegex(text, r"^[A-Za-z0-9_.\-]+$")  # URL-safe as is
        self.assertEqual(tokens.decode(text, stream, pos), dict(sorted(pos.items())))
        self.assertEqual(tokens.encode(stream, dict(reversed(list(pos.items())))), text)

    @settings(max_examples=300, deadline=None)
    @given(st.text(max_size=200))
    def test_anything_else_is_a_token_error(self, text):
        try:
            tokens.decode(text, "events", ["master"])
        except tokens.TokenError:
            pass

    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=120))
    def test_any_v1_payload_is_a_token_error_or_positions(self, raw):
        import base64

        text = "v1." + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
        try:
            got = tokens.decode(text, "events", ["master"])
        except tokens.TokenError:
            return
        self.assertEqual(set(got), {"master"})

    def test_foreign_tokens(self):
        with self.assertRaisesRegex(tokens.TokenError, "another stream"):
            tokens.decode(tokens.encode("caches", {"master": 1}), "events", ["master"])
        with self.assertRaisesRegex(tokens.TokenError, "not a writer"):
            tokens.decode(tokens.encode("events", {"w9": 1}), "events", ["master"])
        for bad in ("", "v2.xx", "v1.!!", "v1." + "A" * 9000,
                    "v1." + tokens.encode("e", {"m": 1})[3:] + "=",
                    tokens.encode("events", {"master": 2 ** 63})):
            with self.assertRaises(tokens.TokenError, msg=bad):
                tokens.decode(bad, "events", ["master"])

    def test_a_writer_added_later_starts_at_zero(self):
        text = tokens.encode("events", {"master": 5})
        self.assertEqual(tokens.decode(text, "events", ["master", "w2"]),
                         {"master": 5, "w2": 0})


class PageTests(SynchronousTestCase):
    def stream(self):
        s = FakeStream(["a", "b"])
        for i, w in [(1, "a"), (2, "b"), (3, "a"), (4, "a"), (6, "b"), (7, "b")]:
            s.add(w, i, [[i], [i * 10]])
        return s

    def test_merged_in_id_order_full_page_ends_at_its_last_fact(self):
        s = self.stream()
        page = run(read_page(s, {"a": 0, "b": 0}, {"a": 10, "b": 10}, 3, final_below=5))
        self.assertEqual([(f[0], f[1]) for f in page.facts], [(1, "a"), (2, "b"), (3, "a")])
        self.assertEqual(page.facts[0][2], [[1], [10]])
        self.assertEqual(page.next, {"a": 3, "b": 3})
        self.assertTrue(page.full and page.final)
        rest = run(read_page(s, page.next, {"a": 10, "b": 10}, 3, final_below=5))
        self.assertEqual([f[0] for f in rest.facts], [4, 6, 7])
        self.assertFalse(rest.final)  # 7 is above the linear token 5

    def test_never_past_the_bounds(self):
        s = self.stream()
        page = run(read_page(s, {"a": 0, "b": 0}, {"a": 3, "b": 2}, 100))
        self.assertEqual([f[0] for f in page.facts], [1, 2, 3])
        self.assertEqual(page.next, {"a": 3, "b": 2})
        self.assertFalse(page.full or page.final)

    def test_a_position_ahead_of_the_bounds_never_goes_back(self):
        s = self.stream()
        page = run(read_page(s, {"a": 9, "b": 0}, {"a": 4, "b": 7}, 100))
        self.assertEqual([f[0] for f in page.facts], [2, 6, 7])
        self.assertEqual(page.next, {"a": 9, "b": 7})


class PageMemoryTests(SynchronousTestCase):
    def test_a_page_holds_its_facts_json_at_their_size(self):
        """A page keeps each fact's JSON: in a bytes object of its own size,
        not in orjson's output buffer (4 KB for a short one; a page of 1,000
        short facts held 4 MB for 50 KB of JSON)."""
        import gc
        import tracemalloc

        stream = FakeStream(["a"])
        for i in range(1, 201):
            stream.add("a", i, [[i]])
        stream.id_gen.move("a", 200)
        gc.collect()
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        before = tracemalloc.get_traced_memory()[0]
        page = run(read_page(stream, {"a": 0}, {"a": 200}, 1000, columns=["v"],
                             max_bytes=1 << 20))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        self.assertEqual([f[0] for f in page.facts], list(range(1, 201)))
        json = sum(len(f[3]) for f in page.facts)
        # The JSON (about 45 bytes a fact) and the page's own objects.
        self.assertLess(held, json + 200 * 400, f"{held} bytes held for {json} of JSON")


class SseTests(SynchronousTestCase):
    def setUp(self):
        self.clock = task.Clock()
        self.stream = FakeStream(["a"])
        self.watch = StreamWatch()
        bounds = lambda s: s.id_gen.get_positions()  # noqa: E731
        self.feed = LiveFeed(self.stream, bounds, self.watch, self.clock, interval=0)

    def client(self, position):
        request = FakeRequest()

        page = page_reader(self.stream)

        c = SseClient(request, self.stream, self.feed, position, page, self.clock, 15)
        c.start()
        return c, request

    def write(self, stream_id, value="x"):
        self.stream.add("a", stream_id, [[value]])
        self.stream.id_gen.move("a", stream_id)

    def events(self, request):
        data = b"".join(request.written)
        out = []
        for block in data.split(b"\n\n"):
            if block.startswith(b"id: "):
                lines = block.split(b"\n")
                self.assertEqual(lines[1], b"event: fact")
                out.append((lines[0][4:].decode(), orjson.loads(lines[2][6:])))
        return out

    def test_framing_retry_events_and_heartbeat(self):
        c, request = self.client({"a": 0})
        self.assertEqual(request.written[0], RETRY)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"content-type"),
                         [b"text/event-stream; charset=utf-8"])
        self.assertTrue(c.live)
        self.write(1, "hello")
        self.assertEqual(self.events(request), [
            (tokens.encode("events", {"a": 1}),
             {"stream_id": 1, "writer": "a", "rows": [{"v": "hello"}]})])
        self.clock.advance(15)
        self.assertEqual(request.written[-1], PING)

    def test_live_bytes_are_encoded_once_for_every_client(self):
        (_, r1), (_, r2) = self.client({"a": 0}), self.client({"a": 0})
        self.write(1)
        self.assertIs(r1.written[-1], r2.written[-1])
        self.assertEqual(self.stream.reads, 1)

    def test_a_paused_client_leaves_the_feed_and_catches_up_when_resumed(self):
        slow, rs = self.client({"a": 0})
        _, rf = self.client({"a": 0})
        slow.pauseProducing()
        for i in range(1, 6):
            self.write(i)
        self.assertEqual(len(self.events(rf)), 5)
        self.assertEqual(self.events(rs), [])  # nothing queued for it
        self.assertFalse(slow.live)
        self.assertEqual(slow.switched, 1)
        self.assertNotIn(slow, self.feed.clients)
        slow.resumeProducing()
        self.assertTrue(slow.live)
        self.assertEqual(self.events(rs), self.events(rf))
        self.write(6)
        self.assertEqual([e[1]["stream_id"] for e in self.events(rs)], [1, 2, 3, 4, 5, 6])

    def test_a_slow_client_catching_up_never_has_a_fact_read_twice(self):
        """A client catching up whose transport backs up after every write
        (a slow reader) resumes where it was, and the daemon reads no fact
        of the table twice for it: its pages are cut at about one write.
        It used to read a page of up to ``http.max_page_bytes`` (4 MB) at
        each resume and write 64 KB of it before the next pause: a reader
        at one byte a second made the daemon read the same megabytes again
        and again, taking the page-build turns of every other reader."""
        for i in range(1, 41):
            self.stream.add("a", i, [["x" * 20000]])
        self.stream.id_gen.move("a", 40)
        read = []

        async def page(pos, limit, bounds, max_bytes=None):
            got = await read_page(self.stream, pos, bounds, limit, columns=["v"],
                                  max_bytes=max_bytes)
            read.extend(f[0] for f in got.facts)
            return got

        request = FakeRequest()
        client = SseClient(request, self.stream, self.feed, {"a": 0}, page, self.clock, 15)
        write = request.write

        def backs_up(data):
            write(data)
            if b"event: fact" in data:
                client.pauseProducing()

        request.write = backs_up
        client.start()
        for _ in range(100):
            if client.live:
                break
            client.resumeProducing()
        self.assertTrue(client.live)
        self.assertEqual([e[1]["stream_id"] for e in self.events(request)], list(range(1, 41)))
        self.assertEqual(sorted(read), list(range(1, 41)))  # each fact read once

    def test_a_catching_up_client_asks_the_table_for_about_one_write(self):
        """Its pages are cut at one write (64 KB): of 20 KB facts a page
        holds 4.  It used to ask the table for 256 facts each time (the
        driver fetching, and the pool thread shaping, all of them) and drop
        all but those 4: here 40 + 36 + ... + 4 = 220 facts fetched for 40
        written.  Now it asks for about as many as the last page held."""
        for i in range(1, 41):
            self.stream.add("a", i, [["x" * 20000]])
        self.stream.id_gen.move("a", 40)
        fetched = []
        table_fact_pages = self.stream.table_fact_pages

        async def counted(ranges, then, json_rows=False):
            return await table_fact_pages(
                ranges, lambda pages: fetched.append(sum(len(p[0]) for p in pages))
                or then(pages), json_rows)

        self.stream.table_fact_pages = counted

        async def page(pos, limit, bounds, max_bytes=None):
            return await read_page(self.stream, pos, bounds, limit, columns=["v"],
                                   max_bytes=max_bytes)

        request = FakeRequest()
        client = SseClient(request, self.stream, self.feed, {"a": 0}, page, self.clock, 15)
        client.start()
        self.assertTrue(client.live)
        self.assertEqual([e[1]["stream_id"] for e in self.events(request)], list(range(1, 41)))
        # The first page asks for FIRST_PAGE (32), each next for 4 + 1 + 1
        # (the last has only 4 left).
        self.assertEqual(fetched, [32] + [6] * 8 + [4])

    def test_a_client_behind_catches_up_then_goes_live(self):
        for i in range(1, 4):
            self.write(i)
        c, request = self.client({"a": 1})
        self.assertTrue(c.live)
        self.write(4)
        self.assertEqual([e[1]["stream_id"] for e in self.events(request)], [2, 3, 4])
        self.assertEqual(self.events(request)[0][0], tokens.encode("events", {"a": 2}))

    def test_a_client_ahead_waits_for_the_feed(self):
        c, request = self.client({"a": 3})
        self.assertFalse(c.live)
        for i in range(1, 6):
            self.write(i)
        self.assertTrue(c.live)
        self.assertEqual([e[1]["stream_id"] for e in self.events(request)], [4, 5])


class MultiWriterSseTests(SynchronousTestCase):
    def test_ids_name_every_writer_and_resume_exactly(self):
        clock = task.Clock()
        stream = FakeStream(["a", "b"])
        feed = live_feed(stream, clock)

        def client(position):
            request = FakeRequest()

            page = page_reader(stream)

            SseClient(request, stream, feed, position, page, clock, 15).start()
            return request

        first = client({"a": 0, "b": 0})
        for stream_id, writer in [(1, "a"), (2, "b"), (3, "a"), (5, "b")]:
            stream.add(writer, stream_id, [[stream_id]])
            stream.id_gen.move(writer, stream_id)
        events = SseTests.events(self, first)
        self.assertEqual([e[1]["stream_id"] for e in events], [1, 2, 3, 5])
        self.assertEqual(tokens.parse(events[1][0])[1], {"a": 1, "b": 2})
        # Resuming from each id gives exactly the events after it.
        for i, (token, _) in enumerate(events):
            again = client(tokens.decode(token, "events", ["a", "b"]))
            self.assertEqual([e[1]["stream_id"] for e in SseTests.events(self, again)],
                             [e[1]["stream_id"] for e in events[i + 1:]])


class FailingReadTests(SynchronousTestCase):
    def test_a_failed_read_is_503_logged_once_per_outage(self):
        from twisted.logger import globalLogPublisher

        from replicator.http.answers import HttpError
        from replicator.http.read.auth import ReaderAuth
        from replicator.http.read.routes import ReadRoutes

        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        stream = FakeStream(["a"])
        stream.add("a", 1, [[1]])
        stream.id_gen.move("a", 1)
        broken = [True]
        read = stream.updates_since

        async def updates_since(*args):
            if broken[0]:
                raise OSError("connection refused")
            return await read(*args)

        stream.updates_since = updates_since
        routes = ReadRoutes(registry=None, auth=ReaderAuth("x" * 16), clock=task.Clock())
        for _ in range(3):
            failure = self.failureResultOf(defer.ensureDeferred(
                routes.page(stream, {"a": 0}, 10)), HttpError)
            self.assertEqual((failure.value.code, failure.value.message),
                             (503, "database read failed"))
        broken[0] = False
        page = self.successResultOf(defer.ensureDeferred(routes.page(stream, {"a": 0}, 10)))
        self.assertEqual([f[0] for f in page.facts], [1])
        texts = [e.get("log_format", "") for e in events]
        self.assertEqual(sum("Reading a page" in t for t in texts), 1)
        self.assertEqual(sum("succeed again" in t for t in texts), 1)
        self.flushLoggedErrors(OSError)


class CoalescingTests(SynchronousTestCase):
    def test_under_load_a_client_gets_one_write_per_interval(self):
        clock = task.Clock()
        stream = FakeStream(["a"])
        feed = live_feed(stream, clock, 0.01)
        request = FakeRequest()

        page = page_reader(stream)

        SseClient(request, stream, feed, {"a": 0}, page, clock, 15).start()
        for i in range(1, 11):
            stream.add("a", i, [[i]])
            stream.id_gen.move("a", i)
        # The first fact at once (idle), the nine others in one write later.
        self.assertEqual(len(request.written), 2)
        clock.advance(0.01)
        self.assertEqual(len(request.written), 3)
        self.assertEqual(request.written[-1].count(b"event: fact"), 9)
        self.assertEqual(stream.reads, 2)


class GoneEarlyTests(SynchronousTestCase):
    def test_a_client_gone_before_its_stream_starts_gives_its_slot_back(self):
        """The client goes while the start is checked (here, the sequence
        read for a token ahead of the stream): its event stream never
        starts, holds no slot and no place in the feed."""
        from twisted.python.failure import Failure

        from replicator.http.read.auth import ReaderAuth
        from replicator.http.read.routes import ReadRoutes

        stream = FakeStream(["a"])
        sequence = defer.Deferred()
        stream.sequence_value = lambda: sequence

        class Registry:
            def find(self, name):
                return stream if name == "events" else None

        routes = ReadRoutes(registry=Registry(), auth=ReaderAuth("s" * 16),
                            clock=task.Clock())
        request = FakeRequest()
        request.method = b"GET"
        request.requestHeaders.setRawHeaders(b"authorization", [b"Bearer " + b"s" * 16])
        request.requestHeaders.setRawHeaders(
            b"last-event-id", [tokens.encode("events", {"a": 5}).encode()])
        d = defer.ensureDeferred(routes.events(request, "events"))
        request.processingFailed(Failure(ConnectionError("gone")))
        sequence.callback(10)
        self.assertIsNone(self.successResultOf(d))
        self.assertEqual(routes.slots.open, 0)
        self.assertEqual(routes.feed(stream).clients, set())


class LiveOutageTests(SynchronousTestCase):
    def test_a_failing_live_read_is_retried_with_two_log_lines_per_outage(self):
        from twisted.logger import globalLogPublisher

        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        clock = task.Clock()
        stream = FakeStream(["a"])
        feed = live_feed(stream, clock)
        request = FakeRequest()

        page = page_reader(stream)

        SseClient(request, stream, feed, {"a": 0}, page, clock, 3600).start()
        read = stream.updates_since
        broken = [True]

        async def updates_since(*args):
            if broken[0]:
                raise OSError("connection refused")
            return await read(*args)

        stream.updates_since = updates_since
        stream.add("a", 1, [[1]])
        stream.id_gen.move("a", 1)
        for _ in range(5):
            clock.advance(60)
        broken[0] = False
        clock.advance(60)
        self.assertEqual(SseTests.events(self, request)[0][1]["stream_id"], 1)
        texts = [e.get("log_format", "") for e in events
                 if e.get("log_namespace", "").startswith("replicator")]
        self.assertEqual(len([t for t in texts if "outage" in t]), 2, texts)
        self.assertFalse([e for e in events if e.get("log_failure")])
