"""Tests for replicator.replication.core.fanout: what every connection gets from
one encoding of the rows (StringTransport + Clock)."""

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from replicator.replication.core.fanout import Fanout
from replicator.replication.transport.base_handler import BaseHandler
from replicator.replication.transport.protocol import ServerReplicationProtocol
from replicator.replication.wire.encoding import (
    MAX_LINE_LENGTH,
    _encode_rdata_lines_each,
    encode_position_line,
)

CLIENTS = 50


class _Handler(BaseHandler):
    def __init__(self):
        super().__init__()
        self.outbound = []

    def count_outbound(self, conn, name, n):
        self.outbound.append((conn, name, n))


class _WriteLog(StringTransport):
    """Records each write call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def write(self, data):
        self.calls.append(data)
        super().write(data)

    def writeSequence(self, seq):
        self.calls.append(list(seq))
        super().writeSequence(seq)


class FanoutToManyTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.handler = _Handler()
        self.conns = []
        for _ in range(CLIENTS):
            proto = ServerReplicationProtocol(self.handler, "hs", clock=self.clock)
            transport = _WriteLog()
            proto.makeConnection(transport)
            transport.clear()
            transport.calls.clear()
            self.conns.append(proto)
        self.handler.outbound.clear()

        def broadcast(lines, name):
            for conn in self.conns:
                conn.send_lines(lines, name)

        self.fanout = Fanout(broadcast, self.clock, max_line_length=MAX_LINE_LENGTH)

    def chunks(self):
        """Three fan-outs: batches, a gap ending in a POSITION, single rows."""
        return [
            (0, [(1, ["a"]), (1, ["b"]), (2, ["c"]), (4, ["d"]), (4, ["e"]), (4, ["f"])], 4),
            (4, [(5, ["g"]), (5, ["h"])], 9),
            (9, [(t, [f"r{t}", {"k": [t]}]) for t in range(10, 60)], 59),
        ]

    def expected(self):
        """The wire bytes the row-by-row encoder (the encoding before the
        one-comprehension fast path) gives for the same chunks."""
        out = []
        for prev, updates, upto in self.chunks():
            out.extend(_encode_rdata_lines_each("caches", "master", updates))
            if upto > updates[-1][0]:
                out.append(encode_position_line("caches", "master", updates[-1][0], upto))
        return b"".join(out)

    def test_every_client_gets_the_same_bytes_in_order(self):
        for prev, updates, upto in self.chunks():
            self.fanout.send_updates("caches", "master", prev, updates, upto)
        expected = self.expected()
        for conn in self.conns:
            self.assertEqual(conn.transport.value(), expected)
            # One write per fan-out of rows (a whole batch run is one
            # write: nothing can come between its lines), one for the
            # POSITION; never writeSequence.
            self.assertEqual([type(c) for c in conn.transport.calls], [bytes] * 4)
            self.assertTrue(conn.transport.calls[0].endswith(b'RDATA caches master 4 ["f"]\n'))
        # The rows' bytes are one object shared by every connection.
        firsts = {id(conn.transport.calls[0]) for conn in self.conns}
        self.assertEqual(len(firsts), 1)
        self.assertEqual(self.fanout.announced[("caches", "master")], 59)
        per_conn = {}
        for conn, name, n in self.handler.outbound:
            per_conn.setdefault(conn, []).append((name, n))
        self.assertEqual(len(per_conn), CLIENTS)
        self.assertEqual({tuple(v) for v in per_conn.values()},
                         {(("RDATA", 6), ("RDATA", 2), ("POSITION", 1), ("RDATA", 50))})

    def test_a_paused_client_gets_the_same_bytes_after_resuming(self):
        slow = self.conns[17]
        chunks = self.chunks()
        self.fanout.send_updates("caches", "master", *chunks[0])
        slow.pauseProducing()
        for chunk in chunks[1:]:
            self.fanout.send_updates("caches", "master", *chunk)
        self.assertEqual(slow.queued, 2 + 1 + 50)
        self.assertNotEqual(slow.transport.value(), self.expected())
        slow.resumeProducing()
        self.assertEqual(slow.queued, 0)
        for conn in self.conns:
            self.assertEqual(conn.transport.value(), self.expected())

    def test_the_queue_bound_counts_lines_of_a_fanout(self):
        slow = ServerReplicationProtocol(self.handler, "hs", clock=self.clock,
                                         max_queued_lines=55)
        slow.makeConnection(_WriteLog())
        self.conns.append(slow)
        slow.pauseProducing()
        chunks = self.chunks()
        self.fanout.send_updates("caches", "master", *chunks[0])  # 6 lines queued
        self.fanout.send_updates("caches", "master", *chunks[1])  # 9
        self.assertFalse(slow.transport.disconnecting)
        self.fanout.send_updates("caches", "master", *chunks[2])  # 59 > 55
        self.assertTrue(slow.transport.disconnecting)
        self.assertEqual(slow.close_reason, "congestion")
        for conn in self.conns[:-1]:
            self.assertEqual(conn.transport.value(), self.expected())
