"""Reading ahead through immutable pages, for a reader catching up.

A reader that walks a stream from an old token asks for page after page,
each ``from`` the ``next`` of the one before, and parses each before it
asks again: the database, the daemon and the reader take turns, one page
at a time.  :class:`ReadAhead` lets them overlap: when a request continues
from the ``next`` of a full, final page served shortly before (a reader
walking the stream), the daemon starts building the page after the one it
answers, and the ones after it (:data:`DEPTH` in all, one build after the
other), so that the reader's next request finds its page built or under
way.

Invariants:

* Only a page that is full and final is ever handed out from here: such
  a page depends only on its token, ``limit`` and format (the page byte
  bound is the daemon's, fixed while it runs) and can never change
  (:mod:`.pages`), so it is the page a build at the time of the request
  would give.  Anything else built ahead is dropped and built again.
* It is built like any other page (:meth:`.routes.ReadRoutes.page`: in
  its address's turn, counted in the page builds at once), and what it
  holds is bounded: at most :data:`ENTRIES` pages, each kept at most
  :data:`TTL` seconds (so a trim boundary that passed it meanwhile is
  seen within that time), requests or not: while a page is held a sweep
  drops what grew too old.
* A build that fails is dropped silently: the request, built again,
  says what is wrong.
* Only a reader that walks reads ahead: a request whose token is not the
  ``next`` of a page served in the last :data:`TTL` seconds (a first
  page, a random old page from a cache in front) builds nothing more.
"""

from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from twisted.internet import defer

from .pages import Page
from .tokens import Positions

#: Pages built ahead, all readers together.
ENTRIES = 16
#: Pages built ahead of the one answered, per walking reader: each is
#: started when the one before it is built (one build at a time per walk).
DEPTH = 3
#: Seconds a page built ahead (or a served ``next``) is kept.
TTL = 5.0

#: ``(stream, positions, limit, format)``: what a page is built from.
Key = tuple[str, tuple[tuple[str, int], ...], int, str]
Build = Callable[[Positions], Coroutine[Any, Any, Page]]


def key(stream: str, since: Positions, limit: int, form: str = "json") -> Key:
    return (stream, tuple(sorted(since.items())), limit, form)


def _after(k: Key, page: Page) -> Key:
    """The key of the page that follows ``page`` (built for ``k``)."""
    return key(k[0], page.next, k[2], k[3])


class _Ahead:
    """A page built ahead: when its build started, the build, its page
    once built (None until then, or if it failed), and how many pages
    after it are to be built once it is."""

    __slots__ = ("born", "d", "page", "more")

    def __init__(self, born: float, more: int):
        self.born = born
        self.d: defer.Deferred[Page | None] | None = None
        self.page: Page | None = None
        self.more = more


class ReadAhead:
    """Pages built ahead, and the ``next`` tokens lately served (reactor thread)."""

    def __init__(self, clock, entries: int = ENTRIES, ttl: float = TTL, depth: int = DEPTH):
        self._clock = clock
        self.entries = entries
        self.ttl = ttl
        self.depth = depth
        self._built: OrderedDict[Key, _Ahead] = OrderedDict()
        self._served: OrderedDict[Key, float] = OrderedDict()
        self._sweep = None  # the call that drops what grew too old, while a page is held
        self.used = 0  # pages handed out from here
        self.wasted = 0  # pages built ahead and never used (or not final and full)

    async def take(self, k: Key) -> Page | None:
        """The page built ahead for ``k`` if there is one still fresh, and
        full and final; else None (the caller builds it)."""
        self._expire()
        entry = self._built.pop(k, None)
        self._settle_sweep()
        if entry is None:
            return None
        assert entry.d is not None
        page = await entry.d
        if page is None or not (page.full and page.final):
            self.wasted += 1
            return None
        self.used += 1
        return page

    def served(self, k: Key, page: Page, build: Build) -> None:
        """``page`` was served for ``k``: if it is full and final, note its
        ``next``; and if ``k`` itself was such a ``next`` (a reader walking
        the stream), have the :attr:`depth` pages after it built ahead,
        with ``build(positions)``, one after the other."""
        if not (page.full and page.final):
            return
        self._expire()
        now = self._clock.seconds()
        after = _after(k, page)
        walking = self._served.pop(k, None) is not None
        self._served[after] = now
        while len(self._served) > 4 * self.entries:
            self._served.popitem(last=False)
        if walking:
            self._extend(after, build, self.depth)

    def _extend(self, k: Key, build: Build, depth: int) -> None:
        """``depth`` pages from ``k`` on built or under way: along the
        pages built already, the first missing one started (or the one
        under way told how many to start after it)."""
        for i in range(depth):
            entry = self._built.get(k)
            more = depth - i - 1
            if entry is None:
                self._start(k, build, more)
                return
            if entry.page is None:
                entry.more = max(entry.more, more)  # (under way, or failed: nothing more)
                return
            if not (entry.page.full and entry.page.final):
                return  # (what follows it is not known yet)
            k = _after(k, entry.page)

    def _start(self, k: Key, build: Build, more: int) -> None:
        entry = _Ahead(self._clock.seconds(), more)
        self._built[k] = entry
        while len(self._built) > self.entries:
            self._built.popitem(last=False)  # (its build goes on; its page is dropped)
            self.wasted += 1
        self._settle_sweep()

        def built(page: Page) -> Page:
            entry.page = page
            if (entry.more > 0 and page.full and page.final
                    and self._built.get(k) is entry):
                self._extend(_after(k, page), build, entry.more)
            return page

        d: defer.Deferred[Page | None] = defer.ensureDeferred(build(dict(k[1])))
        d.addCallbacks(built, lambda _: None)
        entry.d = d

    def _settle_sweep(self) -> None:
        """A sweep pending while a page is held, none otherwise (nothing
        is left behind once every page built ahead was taken)."""
        if self._built and self._sweep is None:
            self._sweep = self._clock.callLater(self.ttl, self._swept)
        elif not self._built and self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def _swept(self) -> None:
        """Expiry without a request: an idle daemon holds no page for long."""
        self._sweep = None
        self._expire()
        self._settle_sweep()

    def _expire(self) -> None:
        """Drop what is older than ``ttl`` (both tables are in age order)."""
        limit = self._clock.seconds() - self.ttl
        while self._built and next(iter(self._built.values())).born < limit:
            self._built.popitem(last=False)
            self.wasted += 1
        while self._served and next(iter(self._served.values())) < limit:
            self._served.popitem(last=False)
