"""How many pages of the read API are built at once: one at a time per
client address, and at most :data:`PAGE_BUILDS` in all.

A page build (the table read, and its facts encoded) holds up to
``http.max_page_bytes`` of JSON plus the rows the read gave, until it is
handed on; what many builds at once would hold is what this bounds.  A
request waits its turn (nothing is refused): one address cannot have more
than one build going, so many concurrent requests from it take turns
instead of holding many pages at once, and other addresses are not kept
out by it (per address first, then the shared cap).
"""

from collections.abc import Awaitable, Callable
from typing import TypeVar

from twisted.internet import defer

T = TypeVar("T")

#: Page builds at once, all addresses together.
PAGE_BUILDS = 4


class PageBuilds:
    """One page build at a time per address, :data:`PAGE_BUILDS` in all."""

    def __init__(self, limit: int = PAGE_BUILDS):
        self._all = defer.DeferredSemaphore(limit)
        # address -> (its lock, requests holding or waiting for it)
        self._hosts: dict[str | None, tuple[defer.DeferredLock, int]] = {}
        self.building = 0  # builds running now
        self.most = 0  # the most that ever ran at once

    async def run(self, host: str | None, build: Callable[[], Awaitable[T]]) -> T:
        """``await build()`` in its turn (per ``host``, then in all)."""
        lock, users = self._hosts.get(host, (None, 0))
        if lock is None:
            lock = defer.DeferredLock()
        self._hosts[host] = (lock, users + 1)
        try:
            await lock.acquire()
            try:
                await self._all.acquire()
                self.building += 1
                self.most = max(self.most, self.building)
                try:
                    return await build()
                finally:
                    self.building -= 1
                    self._all.release()
            finally:
                lock.release()
        finally:
            lock, users = self._hosts[host]
            if users > 1:
                self._hosts[host] = (lock, users - 1)
            else:
                del self._hosts[host]

    def waiting(self, host: str | None) -> int:
        """Requests of ``host`` building or waiting for their turn."""
        return self._hosts.get(host, (None, 0))[1]
