"""Pages bounded in bytes (``http.max_page_bytes``, docs/read-api.md):
a page ends at the fact whose JSON reaches the bound, a fact bigger than
it is a page alone, nothing is skipped and ``next`` resumes exactly, from
memory and from the table alike; and many large pages asked at once from
one address are built one at a time, each answer bounded."""

import orjson
from twisted.internet import defer

from tests.test_read_api import ReadTestCase

BOUND = 100_000


def fact_sizes(doc):
    return [len(orjson.dumps(f)) for f in doc["facts"]]


class PageBytesTests(ReadTestCase):
    async def write_sized(self, sizes):
        """A fact per size: rows of 10 KB, the last shorter."""
        ids = []
        for n in sizes:
            rows = [["y" * min(10_000, n - k)] for k in range(0, n, 10_000)]
            code, answer = await self.post("events", {"rows": rows})
            self.assertEqual(code, 200, answer)
            ids.append(answer["stream_id"])
        return ids

    async def all_pages(self, limit=1000):
        pages, token = [], None
        while True:
            query = f"?limit={limit}" + (f"&from={token}" if token else "")
            response, doc = await self.page("events", query)
            self.assertEqual(response.code, 200, doc)
            if not doc["facts"]:
                return pages
            pages.append(doc)
            token = doc["next"]

    def check_pages(self, pages, ids, limit=1000):
        self.assertEqual([f["stream_id"] for p in pages for f in p["facts"]], ids)
        for doc in pages[:-1]:
            sizes = fact_sizes(doc)
            # Ends at the fact that reaches the bound (or the limit-th),
            # not one before.
            self.assertLess(sum(sizes[:-1]), BOUND)
            self.assertTrue(sum(sizes) >= BOUND or len(sizes) == limit, sizes)

    async def test_a_page_ends_at_the_fact_that_reaches_the_bound(self):
        await self.start_reading(max_page_bytes=BOUND)
        sizes = [30_000, 45_000, 30_000, 250_000, 5_000, 99_000, 1_000, 60_000, 40_000,
                 10_000, 10_000]
        ids = await self.write_sized(sizes)
        from_memory = await self.all_pages()
        self.check_pages(from_memory, ids)
        big = [p for p in from_memory if any(f["stream_id"] == ids[3] for f in p["facts"])]
        # A page starting at the 250 KB fact is that fact alone.
        self.assertEqual([f["stream_id"] for f in big[0]["facts"]], [ids[3]])
        stream = self.registry.get("events")
        stream.forget("worker1", ids[-1])
        from_table = await self.all_pages()
        self.assertEqual(from_table, from_memory)
        # limit still counts: the smaller of the two ends a page.
        self.check_pages(await self.all_pages(limit=2), ids, limit=2)

    async def test_many_large_pages_at_once_are_built_one_at_a_time(self):
        await self.start_reading(max_page_bytes=BOUND)
        ids = await self.write_sized([150_000] * 2 + [40_000] * 20)
        self.registry.get("events").forget("worker1", ids[-1])
        answers = await defer.gatherResults([
            defer.ensureDeferred(self.call("GET", "/_replicator/v1/streams/events/facts"
                                           "?limit=1000", headers={
                                               "Authorization": "Bearer " + self.secret()}))
            for _ in range(20)])
        for response, data in answers:
            self.assertEqual(response.code, 200)
            # One page: at most the bound and one fact (150 KB), not the
            # whole 1.1 MB stream.
            self.assertLess(len(data), BOUND + 150_000 + 1000)
        builds = self.api.reads.builds
        self.assertEqual((builds.most, builds.building, builds.waiting("127.0.0.1")),
                         (1, 0, 0))

    def secret(self):
        from tests.test_http import SECRET

        return SECRET
