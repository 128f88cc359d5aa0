"""A loopback TCP proxy (asyncio) that the nemesis puts on every
replication link, and the faults it can inject.

Every accepted connection gets its own upstream connection and two pumps.
Faults act on all current connections of the proxy:

* :meth:`Proxy.cut` aborts them (both sides see a reset); new ones pass.
* :meth:`Proxy.partition` aborts them and, for ``seconds``, accepts new
  connections but forwards nothing on them (a peer that answers no more);
  when it ends those are aborted too.
* :meth:`Proxy.stall` stops forwarding on the current connections for
  ``seconds`` (bytes wait in the proxy and the kernel), then resumes.
* :meth:`Proxy.slow_cut` forwards a few bytes every few milliseconds for
  ``seconds``, then aborts the connections.

Only loopback addresses are used.  The proxy never changes a byte.
"""

import asyncio
import random
from typing import Optional, Set

CHUNK = 65536


class _Link:
    """One proxied connection: client side and upstream side."""

    def __init__(self, proxy: "Proxy", client_writer, upstream_writer, blackholed: bool):
        self.proxy = proxy
        self.writers = (client_writer, upstream_writer)
        self.blackholed = blackholed
        self.closed = False

    def abort(self):
        if not self.closed:
            self.closed = True
            for w in self.writers:
                try:
                    w.transport.abort()
                except Exception:
                    pass


class Proxy:
    """Listens on 127.0.0.1:``port`` (free if 0), forwards to 127.0.0.1:``target``."""

    def __init__(self, name: str, target_port: int, rng: Optional[random.Random] = None):
        self.name = name
        self.target_port = target_port
        self.port = 0
        self.links: Set[_Link] = set()
        self._server = None
        self._partitioned = False
        self._running = asyncio.Event()  # cleared while stalled
        self._running.set()
        self._trickle = False
        self._rng = rng or random.Random(0)
        self.connections = 0
        self._handlers: Set[asyncio.Task] = set()

    async def start(self, port: int = 0):
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self):
        if self._server is not None:
            self._server.close()
            self._server = None
        self.heal()
        for link in list(self.links):
            link.abort()
        # Each connection's task ends by itself once its link is aborted; one
        # left running would be cancelled by the loop's shutdown instead, which
        # asyncio reports as an unhandled exception.
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5)

    # ------------------------------------------------------------ faults
    def cut(self) -> int:
        """Abort every current connection; the number aborted."""
        links = list(self.links)
        for link in links:
            link.abort()
        return len(links)

    async def partition(self, seconds: float):
        self._partitioned = True
        self.cut()
        try:
            await asyncio.sleep(seconds)
        finally:
            self._partitioned = False
            for link in list(self.links):
                if link.blackholed:
                    link.abort()

    async def stall(self, seconds: float):
        self._running.clear()
        try:
            await asyncio.sleep(seconds)
        finally:
            self._running.set()

    async def slow_cut(self, seconds: float):
        self._trickle = True
        try:
            await asyncio.sleep(seconds)
        finally:
            self._trickle = False
            self.cut()

    def heal(self):
        self._partitioned = False
        self._trickle = False
        self._running.set()

    # ------------------------------------------------------------ plumbing
    async def _accept(self, reader, writer):
        task = asyncio.current_task()
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        link = _Link(self, writer, up_writer, blackholed=self._partitioned)
        self.links.add(link)
        try:
            await asyncio.gather(self._pump(link, reader, up_writer),
                                 self._pump(link, up_reader, writer))
        finally:
            link.abort()
            self.links.discard(link)

    async def _pump(self, link: _Link, reader, writer):
        try:
            while not link.closed:
                data = await reader.read(CHUNK)
                if not data:
                    break
                while not link.closed and (link.blackholed or not self._running.is_set()):
                    if link.blackholed:
                        await asyncio.sleep(0.05)
                    else:
                        await self._running.wait()
                while data and not link.closed:
                    if self._trickle:
                        n = self._rng.randint(1, 8)
                        writer.write(data[:n])
                        data = data[n:]
                        await asyncio.sleep(self._rng.uniform(0.002, 0.01))
                    else:
                        writer.write(data)
                        data = b""
                    await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            link.abort()
