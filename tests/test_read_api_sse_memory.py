"""What event streams that start far behind hold (docs/read-api.md, "Slow
readers"): each catching-up stream whose client does not read holds its
transport's buffer and one write, whatever the facts' shape, and what it
held is given back when it ends.  Measured with tracemalloc in the
daemon's own process, with real clients on real sockets."""

import gc
import socket
import tracemalloc

from twisted.internet import abstract, reactor, tcp

from replicator.http.read.sse import WRITE_SIZE
from tests.http_api import SECRET
from tests.read_api_cases import ReadTestCase
from tests.support import until

#: Event streams opened at once, all from the beginning of the stream.
STREAMS = 32
#: What one connection costs besides the bytes it holds (request, channel,
#: headers, the event stream's own state), measured at about 22 KB.
CONNECTION = 32 * 1024
#: Bytes of one event of these facts (its token and a fact of 700 bytes)
#: and more: a write ends at the event that crosses :data:`WRITE_SIZE`.
EVENT = 2048
#: What is left of a stream once it ended, at most: its line of the access
#: log, which the test's log watch keeps (about 1.2 KB), and little more.
KEPT = 8192


class CatchUpMemoryTests(ReadTestCase):
    async def test_streams_behind_hold_their_buffer_and_one_write(self):
        """32 event streams from the beginning of 400 facts (300 KB of
        events), their clients not reading: each holds its transport's
        buffer, the write that filled it and one connection's state (about
        90 KB).  It used to hold besides the last page it read (its facts'
        JSON, each in orjson's 4 KB buffer, and their rows as the driver
        gave them): about 960 KB each (128 such streams raised the
        daemon's RSS by 119 MB, 112 MB of it kept once they ended; now by
        7 MB)."""
        await self.start_reading()
        (listening,) = [r for r in reactor.getReaders()
                        if isinstance(r, tcp.Port) and r.getHost().port == self.port]
        # Small kernel buffers on both sides (accepted sockets inherit the
        # listening socket's): what backs up is the daemon's.
        listening.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        stream = self.registry.get("caches")
        ids = await stream.write_facts(
            [[["get_user", [f"@user{i}:hs", "k" * 600], i]] for i in range(400)], "worker1")
        stream.forget("worker1", ids[-1])  # far behind: read from the table
        reads = self.api.reads
        gc.collect()
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        before = tracemalloc.get_traced_memory()[0]
        clients = []
        for _ in range(STREAMS):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", self.port))
            s.sendall(b"GET /_replicator/v1/streams/caches/events HTTP/1.1\r\nHost: t\r\n"
                      b"Authorization: Bearer " + SECRET.encode() + b"\r\n\r\n")
            self.addCleanup(s.close)
            clients.append(s)
        await until(lambda: reads.slots.open == STREAMS, timeout=30)
        opened = list(reads.book.streams[("secret", "caches")])
        # Every stream paused by its transport, no page being built.
        await until(lambda: all(c.paused and not c.live for c in opened)
                    and reads.builds.waiting("127.0.0.1") == 0, timeout=30)
        gc.collect()
        held = (tracemalloc.get_traced_memory()[0] - before) / STREAMS
        bound = abstract.FileDescriptor.bufferSize + WRITE_SIZE + EVENT + CONNECTION
        buffered = [len(c.request.channel.transport.dataBuffer)
                    + c.request.channel.transport._tempDataLen for c in opened]
        self.assertTrue(all(b > abstract.FileDescriptor.bufferSize for b in buffered),
                        buffered)  # (each is paused by a full buffer, not done)
        self.assertLess(held, bound, f"{held:.0f} bytes held per event stream")
        # Their clients go: what they held is given back.
        for s in clients:
            s.close()
        await until(lambda: reads.slots.open == 0, timeout=30)
        opened.clear()
        gc.collect()
        left = (tracemalloc.get_traced_memory()[0] - before) / STREAMS
        self.assertLess(left, KEPT, f"{left:.0f} bytes per event stream left after it ended")
