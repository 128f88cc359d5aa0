"""Tests of the fan-out's adaptive coalescing (replicator.replication.core.fanout):
a commit alone goes out at once, commits in a burst go out together, in
memory (the harness's clock; transactions held until the test lets them
run and answer)."""

from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import parse_streams
from tests.harness import Harness

STREAMS = parse_streams([{
    "name": "caches", "table": "cache_invalidations", "writers": ["master"],
    "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}],
}])

INTERVAL = 0.003


class HeldPool:
    """The harness's pool, whose write transactions (once ``held``) wait:
    :meth:`run` runs the next one (it takes its writes and commits),
    :meth:`answer` hands the oldest run one's outcome back."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self.held = False
        self.waiting: list[tuple[Callable[..., Any], tuple, defer.Deferred]] = []
        self.ran: list[tuple[defer.Deferred, defer.Deferred]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def runInteraction(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> defer.Deferred:
        if not self.held:
            return self._pool.runInteraction(fn, *args, **kwargs)
        d: defer.Deferred = defer.Deferred()
        self.waiting.append((lambda txn: fn(txn, *args, **kwargs), (), d))
        return d

    def run(self) -> None:
        fn, _, d = self.waiting.pop(0)
        self.ran.append((self._pool.runInteraction(fn), d))

    def answer(self) -> None:
        outcome, d = self.ran.pop(0)
        outcome.chainDeferred(d)


class AdaptiveCoalescingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = Harness(STREAMS, self.addCleanup)
        self.node = self.h.instance("master", fanout_interval=INTERVAL)
        self.pool = self.node.db.pool = HeldPool(self.node.db.pool)
        self.pool.held = True
        self.addCleanup(setattr, self.pool, "held", False)  # (before the harness closes)
        _, self.transport = self.h.serve(self.node, name="reader", replicate=True)
        self.stream = self.node.stream("caches")
        self.written: list[Any] = []

    def write(self, name: str) -> None:
        d = defer.ensureDeferred(self.stream.write_fact([[name, None, 1]]))
        d.addCallback(self.written.append)

    def sent(self) -> list[bytes]:
        """The RDATA tokens and rows the reader got, one entry per write
        to its connection (a fan-out)."""
        return [c for c in self.transport.value().split(b"\n") if c]

    def test_a_commit_alone_goes_out_at_once_however_soon_after_the_last(self):
        self.write("a")
        self.pool.run()
        self.pool.answer()
        self.h.flush()
        self.assertEqual(self.written, [1])
        self.assertEqual(self.sent(), [b'RDATA caches master 1 ["a",null,1]'])
        # A millisecond later (within the interval), another commit with
        # nothing else of its writer in flight: out with no clock advance.
        self.h.clock.advance(INTERVAL / 3)
        self.write("b")
        self.pool.run()
        self.pool.answer()
        self.h.flush()
        self.assertEqual(self.written, [1, 2])
        self.assertEqual(self.sent(), [b'RDATA caches master 1 ["a",null,1]',
                                       b'RDATA caches master 2 ["b",null,1]'])
        self.assertEqual(self.node.handler.fanout.announced[("caches", "master")], 2)
        self.assertTrue(self.node.handler.fanout.idle())  # no fan-out scheduled

    def test_commits_in_a_burst_go_out_together_after_the_interval(self):
        self.write("a")
        self.pool.run()
        self.pool.answer()
        self.h.flush()
        self.assertEqual(self.sent(), [b'RDATA caches master 1 ["a",null,1]'])
        writes: list[Any] = []
        self.transport.clear()
        transport_write = self.transport.write
        self.transport.write = lambda data: (writes.append(data), transport_write(data))
        # Two transactions in flight at once; the first commits while the
        # second is still on its way: its fan-out waits for the interval.
        self.write("b")
        self.pool.run()
        self.write("c")
        self.pool.run()
        self.pool.answer()
        self.h.flush()
        self.assertEqual(self.written, [1, 2])
        self.assertEqual(self.transport.value(), b"")
        self.pool.answer()
        self.h.flush()
        self.assertEqual(self.written, [1, 2, 3])
        self.assertEqual(self.transport.value(), b"")
        self.h.clock.advance(INTERVAL)
        self.h.flush()
        # Both facts, in one write to the connection.
        self.assertEqual(writes, [b'RDATA caches master 2 ["b",null,1]\n'
                                  b'RDATA caches master 3 ["c",null,1]\n'])
        self.assertEqual(self.node.handler.fanout.announced[("caches", "master")], 3)
