"""Reading ahead through immutable pages, for a reader catching up.

A reader that walks a stream from an old token asks for page after page,
each ``from`` the ``next`` of the one before, and parses each before it
asks again: the database, the daemon and the reader take turns, one page
at a time.  :class:`ReadAhead` lets them overlap: when a request continues
from the ``next`` of a full, final page served shortly before (a reader
walking the stream), the daemon starts building the page after the one it
answers, so that the reader's next request finds it built or under way.

Invariants:

* Only a page that is full and final is ever handed out from here: such
  a page depends only on its token and ``limit`` (the page byte bound is
  the daemon's, fixed while it runs) and can never change
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
from typing import Any, Callable, Coroutine, Optional, Tuple

from twisted.internet import defer

from .pages import Page
from .tokens import Positions

#: Pages built ahead, all readers together.
ENTRIES = 16
#: Seconds a page built ahead (or a served ``next``) is kept.
TTL = 5.0

Key = Tuple[str, Tuple[Tuple[str, int], ...], int]


def key(stream: str, since: Positions, limit: int) -> Key:
    return (stream, tuple(sorted(since.items())), limit)


class ReadAhead:
    """Pages built ahead, and the ``next`` tokens lately served (reactor thread)."""

    def __init__(self, clock, entries: int = ENTRIES, ttl: float = TTL):
        self._clock = clock
        self.entries = entries
        self.ttl = ttl
        self._built: "OrderedDict[Key, Tuple[float, defer.Deferred[Optional[Page]]]]" = \
            OrderedDict()
        self._served: "OrderedDict[Key, float]" = OrderedDict()
        self._sweep = None  # the call that drops what grew too old, while a page is held
        self.used = 0  # pages handed out from here
        self.wasted = 0  # pages built ahead and never used (or not final and full)

    async def take(self, k: Key) -> Optional[Page]:
        """The page built ahead for ``k`` if there is one still fresh, and
        full and final; else None (the caller builds it)."""
        self._expire()
        entry = self._built.pop(k, None)
        self._settle_sweep()
        if entry is None:
            return None
        page = await entry[1]
        if page is None or not (page.full and page.final):
            self.wasted += 1
            return None
        self.used += 1
        return page

    def served(self, k: Key, page: Page, build: Callable[[Positions], Coroutine[Any, Any, Page]]) -> None:
        """``page`` was served for ``k``: if it is full and final, note its
        ``next``; and if ``k`` itself was such a ``next`` (a reader walking
        the stream), build the page after it ahead with ``build(next)``."""
        if not (page.full and page.final):
            return
        self._expire()
        now = self._clock.seconds()
        after = key(k[0], page.next, k[2])
        walking = self._served.pop(k, None) is not None
        self._served[after] = now
        while len(self._served) > 4 * self.entries:
            self._served.popitem(last=False)
        if not walking or after in self._built:
            return
        d: "defer.Deferred[Optional[Page]]" = defer.ensureDeferred(build(page.next))
        d.addErrback(lambda _: None)
        self._built[after] = (now, d)
        while len(self._built) > self.entries:
            self._built.popitem(last=False)  # (its build goes on; its page is dropped)
            self.wasted += 1
        self._settle_sweep()

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
        while self._built and next(iter(self._built.values()))[0] < limit:
            self._built.popitem(last=False)
            self.wasted += 1
        while self._served and next(iter(self._served.values())) < limit:
            self._served.popitem(last=False)
