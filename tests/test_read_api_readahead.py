"""Reading ahead for a reader walking a stream's pages: the page after the
one answered is built while the reader parses it, and handed out only if
it is full and final (the same bytes a build at the request would give);
nothing is built ahead for a reader that does not walk, and what is built
ahead is bounded in number and in age."""

import orjson
from twisted.internet import defer, task
from twisted.trial.unittest import SynchronousTestCase

from replicator.http.read import readahead
from replicator.http.read.pages import Page
from replicator.http.read.readahead import ReadAhead
from tests.http_api import AUTH
from tests.read_api_cases import PAGES, ReadTestCase, until_deferred


class WalkTests(ReadTestCase):
    async def persisted(self, position):
        """Until the stream's persisted position is ``position`` (its pages
        below are immutable)."""
        await until_deferred(lambda: self.db.runQuery(
            "SELECT stream_id FROM stream_positions WHERE stream_name = 'events'"),
            lambda r: r == [(position,)])

    async def walk(self, limit, first=""):
        pages, query = [], f"?limit={limit}{first}"
        while True:
            response, data = await self.call("GET", PAGES.format("events") + query,
                                             headers=AUTH)
            self.assertEqual(response.code, 200, data)
            pages.append((data, response.headers.getRawHeaders(b"etag"),
                          response.headers.getRawHeaders(b"cache-control")))
            doc = orjson.loads(data)
            if not doc["facts"]:
                return pages
            query = f"?limit={limit}&from={doc['next']}"

    async def test_a_walk_is_read_ahead_and_gets_the_same_pages(self):
        await self.start_reading()
        ids = await self.write("events", 23)
        await self.persisted(ids[-1])
        ahead = self.api.reads.readahead
        walked = await self.walk(5)
        # Pages 1..4 full and final. The 2nd continued from the 1st's next
        # (the reader walks): from then on each page after the one answered
        # was built ahead. The 3rd and 4th were handed out so; the 5th, not
        # full (the end of the stream), was built again at its request.
        self.assertEqual(len(walked), 6)  # 5 + 5 + 5 + 5 + 3 + the empty one
        self.assertEqual((ahead.used, ahead.wasted), (2, 1))
        self.api.reads.readahead = ReadAhead(self.api.reads._clock, entries=0)
        again = await self.walk(5)
        self.assertEqual(again, walked)  # the same bytes, ETags and caching
        self.assertEqual(self.api.reads.readahead.used, 0)
        for body, tag, cache in walked[:4]:
            self.assertEqual(cache, [b"public, max-age=31536000, immutable"])
            self.assertIsNotNone(tag)

    async def test_a_reader_that_does_not_walk_builds_nothing_ahead(self):
        await self.start_reading()
        ids = await self.write("events", 12)
        await self.persisted(ids[-1])
        from replicator.http.read import tokens

        for start in (ids[6], ids[0], ids[3]):  # pages from old tokens, out of order
            token = tokens.encode("events", {"worker1": start})
            response, _ = await self.call("GET", PAGES.format("events")
                                          + f"?limit=2&from={token}", headers=AUTH)
            self.assertEqual(response.code, 200)
        self.assertEqual(len(self.api.reads.readahead._built), 0)


def page(next_to, full=True, final=True):
    return Page([(next_to, "w", [[1]], None)], {"w": next_to}, full, final)


class ReadAheadTests(SynchronousTestCase):
    def setUp(self):
        self.clock = task.Clock()
        self.ahead = ReadAhead(self.clock, entries=2, ttl=5.0, depth=1)
        self.builds = []

    def build(self, since):
        d = defer.Deferred()
        self.builds.append((since, d))
        return defer.ensureDeferred(self._wait(d))

    async def _wait(self, d):
        return await d

    def serve(self, start, to, **kw):
        k = readahead.key("s", {"w": start}, 10)
        self.ahead.served(k, page(to, **kw), self.build)
        return k

    def take(self, start):
        d = defer.ensureDeferred(self.ahead.take(readahead.key("s", {"w": start}, 10)))
        return self.successResultOf(d)

    def test_deeper_one_build_after_the_other(self):
        """With ``depth`` 3 a walking reader has the three pages after the
        one answered built, each started when the one before is built;
        each page served extends the walk by one."""
        self.ahead = ReadAhead(self.clock, entries=8, ttl=5.0, depth=3)
        self.serve(0, 10)
        self.serve(10, 20)
        self.assertEqual([b[0] for b in self.builds], [{"w": 20}])
        self.builds[0][1].callback(page(30))
        self.assertEqual([b[0] for b in self.builds], [{"w": 20}, {"w": 30}])
        self.builds[1][1].callback(page(40))
        self.builds[2][1].callback(page(50))
        self.assertEqual([b[0]["w"] for b in self.builds], [20, 30, 40])
        self.assertEqual(self.take(20).next, {"w": 30})
        self.serve(20, 30)  # (as the route does after the take)
        self.assertEqual([b[0]["w"] for b in self.builds], [20, 30, 40, 50])
        self.assertEqual(self.take(30).next, {"w": 40})
        self.serve(30, 40)  # the build of 50 is under way: it goes on after it
        self.assertEqual(len(self.builds), 4)
        self.builds[3][1].callback(page(60, full=False))  # the end: nothing after it
        self.assertEqual(len(self.builds), 4)
        self.assertEqual((self.ahead.used, self.ahead.wasted), (2, 0))

    def test_only_a_walking_reader_reads_ahead(self):
        self.serve(0, 10)
        self.assertEqual(self.builds, [])  # a first page: nothing ahead
        self.serve(10, 20)  # from the next of the one before: it walks
        self.assertEqual([b[0] for b in self.builds], [{"w": 20}])
        self.builds[0][1].callback(page(30))
        self.assertEqual(self.take(20).next, {"w": 30})
        self.assertEqual(self.ahead.used, 1)
        self.assertIsNone(self.take(20))  # handed out once

    def test_a_page_not_full_or_not_final_is_not_handed_out(self):
        self.serve(0, 10)
        self.serve(10, 20)
        self.builds[0][1].callback(page(25, full=False))
        self.assertIsNone(self.take(20))
        self.assertEqual(self.ahead.wasted, 1)
        self.serve(40, 50)
        self.serve(50, 60)
        self.builds[1][1].callback(page(70, final=False))
        self.assertIsNone(self.take(60))
        self.serve(80, 90, full=False)  # a page not full: no next noted
        self.serve(90, 95)
        self.assertEqual(len(self.builds), 2)

    def test_a_failed_build_is_dropped(self):
        self.serve(0, 10)
        self.serve(10, 20)
        self.builds[0][1].errback(RuntimeError("database down"))
        self.assertIsNone(self.take(20))

    def test_bounded_in_number_and_age(self):
        for start in (0, 100, 200):  # three walkers, room for two pages
            self.serve(start, start + 10)
            self.serve(start + 10, start + 20)
        self.assertEqual(len(self.ahead._built), 2)
        self.assertEqual(self.ahead.wasted, 1)
        for _, d in self.builds:
            d.callback(page(999))
        self.assertIsNone(self.take(20))  # the oldest, dropped
        self.clock.advance(5.1)
        self.assertIsNone(self.take(120))  # too old
        self.assertIsNone(self.take(220))
        self.assertEqual(len(self.ahead._served), 0)

    def test_an_idle_daemon_lets_go_of_what_it_built_ahead(self):
        """Pages built ahead are dropped once too old even if no request
        comes again (a reader that stopped, a daemon idle for hours): they
        are not held until the next page request."""
        self.serve(0, 10)
        self.serve(10, 20)
        self.builds[0][1].callback(page(30))
        self.assertEqual(len(self.ahead._built), 1)
        self.clock.advance(5.1)
        self.assertEqual((len(self.ahead._built), len(self.ahead._served)), (0, 0))
        self.assertEqual(self.clock.getDelayedCalls(), [])

