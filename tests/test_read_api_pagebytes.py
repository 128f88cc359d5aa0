"""Pages bounded in bytes (``http.max_page_bytes``, docs/read-api.md):
a page ends at the fact whose JSON reaches the bound, a fact bigger than
it is a page alone, nothing is skipped and ``next`` resumes exactly, from
memory and from the table alike; and many large pages asked at once from
one address are built one at a time, each answer bounded."""

import urllib.request

import orjson
from twisted.internet import defer
from twisted.trial.unittest import SynchronousTestCase

from tests.http_api import SECRET
from tests.read_api_cases import ReadTestCase

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
                                               "Authorization": "Bearer " + SECRET}))
            for _ in range(20)])
        for response, data in answers:
            self.assertEqual(response.code, 200)
            # One page: at most the bound and one fact (150 KB), not the
            # whole 1.1 MB stream.
            self.assertLess(len(data), BOUND + 150_000 + 1000)
        builds = self.api.reads.builds
        self.assertEqual((builds.most, builds.building, builds.waiting("127.0.0.1")),
                         (1, 0, 0))


class DaemonMemoryTests(SynchronousTestCase):
    """The red team's case on a real daemon: 20 pages of ``limit=1000``
    asked at once of a stream of 900 KB facts (60 rows of 15 KB).  Each
    answer is at most ``max_page_bytes`` and one fact, and the daemon's
    peak resident memory grows by a few pages' worth, not by 20 times
    the whole stream (before: every answer 27 MB; less than the 20 whole
    answers' 540 MB, when it grew by 1.5 GB)."""

    def test_concurrent_large_pages_are_bounded(self):
        from concurrent.futures import ThreadPoolExecutor

        from tests.daemon import SECRET as WRITE_SECRET
        from tests.read_api import ReadApiDaemon, get

        api = ReadApiDaemon(self).start()
        row = "z" * 15_000
        fact = {"rows": [[f"{row}{r}", None, r] for r in range(60)]}
        for _ in range(30):
            request = urllib.request.Request(
                api.url(), data=orjson.dumps(fact), method="POST",
                headers={"Authorization": f"Bearer {WRITE_SECRET}",
                         "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                self.assertEqual(response.status, 200)
        pid = api.daemon.proc.pid
        get(api.url() + "?limit=1")  # (the reading machinery warmed up)
        before = peak_rss(pid)
        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda _: get(api.url() + "?limit=1000"), range(20)))
        grown = peak_rss(pid) - before
        fact_bytes = len(orjson.dumps({"stream_id": 1, "writer": "master", "rows": [
            {"cache_func": r[0], "keys": None, "invalidation_ts": r[2]}
            for r in fact["rows"]]}))
        for status, _, body in answers:
            self.assertEqual(status, 200)
            doc = orjson.loads(body)
            self.assertEqual(len(doc["facts"]), 5)  # 4 MiB reached at the fifth
            self.assertLess(len(body), 4 * 1024 * 1024 + fact_bytes + 4096)
        # (Measured: 0.2-0.35 GB; 1.57 GB before, with answers of 27 MB.)
        self.assertLess(grown, 20 * 27_000_000, f"peak RSS grew by {grown} bytes")


def peak_rss(pid: int) -> int:
    """A process's peak resident memory (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")
