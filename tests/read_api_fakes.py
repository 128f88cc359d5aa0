"""Stand-ins for the read API's tests in memory: a stream whose facts are
in memory (:class:`FakeStream`, with its ID generator and config), a
request that records what is written to it (:class:`FakeRequest`), a page
reader and a live feed over a fake stream, and :func:`run` (a coroutine
that ends at once, run to its result).  Test modules take them from
here, never from one another."""

from twisted.internet import defer
from twisted.web.test.requesthelper import DummyRequest

from replicator.http.read.live import LiveFeed
from replicator.http.read.pages import read_page
from replicator.http.read.watch import StreamWatch
from replicator.streams.table_pages import group


class FakeGen:
    def __init__(self, positions, linear):
        self.positions = positions
        self.linear = linear
        self.listeners = []

    def get_positions(self):
        return dict(self.positions)

    def get_linear_token(self):
        return self.linear

    def add_listener(self, fn, first=False):
        self.listeners.insert(0, fn) if first else self.listeners.append(fn)

    def move(self, writer, token):
        old = self.positions[writer]
        self.positions[writer] = token
        self.linear = min(self.positions.values())
        for fn in self.listeners:
            fn(writer, old, token)


class FakeConfig:
    def __init__(self, writers):
        self.writers = tuple(writers)
        self.column_names = ["v"]


class FakeStream:
    """Facts per writer in memory; ``updates_since`` as the real one
    (limit counts rows, facts whole)."""

    name = "events"
    json_rows = False

    def __init__(self, writers):
        self.config = FakeConfig(writers)
        self.facts = {w: {} for w in writers}  # writer -> id -> rows
        self.id_gen = FakeGen({w: 0 for w in writers}, 0)
        self.reads = 0

    def add(self, writer, stream_id, rows):
        self.facts[writer][stream_id] = rows

    async def fact_page(self, writer, since, until, limit):
        updates, upto, limited = await self.updates_since(writer, since, until, limit)
        return group(updates), upto, limited

    def memory_fact_page(self, writer, since, until, limit):
        return None  # (everything is in the "table")

    async def table_fact_pages(self, ranges, then, json_rows=False):
        """As the real one: pages counted in facts, ``then`` on them."""
        pages = []
        for writer, since, until, count in ranges:
            updates, _, _ = await self.updates_since(writer, since, until, 10 ** 9)
            facts = group(updates)[:count]
            limited = len(facts) >= count
            pages.append((facts, facts[-1][0] if limited else until, limited))
        return pages, then(pages)

    async def updates_since(self, writer, since, until, limit):
        self.reads += 1
        ids = sorted(i for i in self.facts[writer] if since < i <= until)
        out, upto, limited = [], until, False
        for i in ids:
            rows = self.facts[writer][i]
            if out and len(out) + len(rows) > limit:
                upto, limited = out[-1][0], True
                break
            out += [(i, r) for r in rows]
        return out, upto, limited


def page_reader(stream):
    """What an event stream reads its pages with (``read_page`` of a
    route), over ``stream``."""
    async def page(pos, limit, bounds, max_bytes=None):
        return await read_page(stream, pos, bounds, limit)

    return page


def live_feed(stream, clock, interval=0):
    """A live feed of ``stream`` bounded by its writers' positions."""
    return LiveFeed(stream, lambda s: s.id_gen.get_positions(), StreamWatch(), clock,
                    interval=interval)


def run(coro):
    d = defer.ensureDeferred(coro)
    return d.result if d.called else d


class FakeRequest(DummyRequest):
    """A request whose transport never pauses on its own (the test does)."""

    def __init__(self):
        super().__init__([b""])
        self.channel = None
        self.producer = None

    def registerProducer(self, producer, streaming):
        self.producer = producer

    def unregisterProducer(self):
        self.producer = None

    def notifyFinish(self):
        if self._finishedDeferreds is None:  # gone already: as twisted.web, never fires
            return defer.Deferred()
        return super().notifyFinish()
