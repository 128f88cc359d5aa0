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
* :meth:`Proxy.hold_release` holds what the clients of the current
  connections send (read, not forwarded; the upstream side stays open when
  a client goes away) for ``seconds`` and until each such client has gone
  and come back on a new connection (its link replaced after a ping
  timeout); then it forwards a prefix of the held bytes, cut at a random
  offset (a link that dies mid-stream delivers part of what was sent, late),
  and closes the upstream side.  :meth:`Proxy.hold` and :meth:`Proxy.release`
  are its two halves, for tests that choose the moment and the cut.

Only loopback addresses are used.  The proxy never changes a byte.
"""

import asyncio
import random
import time
from collections.abc import Callable

CHUNK = 65536


class _Link:
    """One proxied connection: client side and upstream side."""

    def __init__(self, proxy: "Proxy", client_writer, upstream_writer, blackholed: bool):
        self.proxy = proxy
        self.writers = (client_writer, upstream_writer)
        self.blackholed = blackholed
        self.closed = False
        #: What the client sent while held (None: not held).
        self.held: bytearray | None = None
        self.client_gone = False

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

    def __init__(self, name: str, target_port: int, rng: random.Random | None = None):
        self.name = name
        self.target_port = target_port
        self.port = 0
        self.links: set[_Link] = set()
        self._server = None
        self._partitioned = False
        self._running = asyncio.Event()  # cleared while stalled
        self._running.set()
        self._trickle = False
        self._rng = rng or random.Random(0)
        self.connections = 0
        self._handlers: set[asyncio.Task] = set()

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

    def hold(self) -> int:
        """Hold what the clients of the current connections send, from now
        until :meth:`release`; the number of connections held."""
        links = [link for link in self.links if not link.closed and link.held is None]
        for link in links:
            link.held = bytearray()
        return len(links)

    async def release(self, cut: Callable[[bytes], int] | None = None) -> int:
        """Forward ``held[:cut(held)]`` (default: a random offset) of every
        held connection upstream, close its upstream side (Redis runs the
        complete commands of that prefix and drops the rest) and abort its
        client side; the number of bytes forwarded."""
        forwarded = 0
        for link in [link for link in self.links if link.held is not None and not link.closed]:
            held = bytes(link.held)
            n = cut(held) if cut is not None else self._rng.randint(0, len(held))
            upstream = link.writers[1]
            try:
                upstream.write(held[:n])
                await upstream.drain()
                upstream.close()  # after the prefix, not a reset that could discard it
                await upstream.wait_closed()
            except (OSError, ConnectionError):
                pass
            forwarded += n
            link.abort()
        return forwarded

    async def hold_release(self, seconds: float, settle: float = 1.0, limit: float = 30.0):
        """:meth:`hold` for ``seconds``, and then until every held client
        has gone and as many new connections came (at most ``limit`` more
        seconds), ``settle`` more for the new links to say who they are;
        then :meth:`release` a random prefix."""
        before = self.connections
        held = self.hold()
        try:
            await asyncio.sleep(seconds)
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline and not (
                    self.connections >= before + held
                    and all(link.client_gone for link in self.links if link.held is not None)):
                await asyncio.sleep(0.05)
            await asyncio.sleep(settle)
        finally:
            await self.release()

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
            await asyncio.gather(self._pump(link, reader, up_writer, upstream=True),
                                 self._pump(link, up_reader, writer, upstream=False))
        finally:
            link.abort()
            self.links.discard(link)

    async def _pump(self, link: _Link, reader, writer, upstream: bool):
        try:
            while not link.closed:
                data = await reader.read(CHUNK)
                if not data:
                    break
                if upstream and link.held is not None:
                    link.held += data
                    continue
                while not link.closed and (link.blackholed or link.held is not None
                                           or not self._running.is_set()):
                    if link.blackholed or link.held is not None:
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
            if upstream and link.held is not None and not link.closed:
                link.client_gone = True  # the upstream side waits for the release
            else:
                link.abort()
