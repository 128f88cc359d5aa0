"""Background work: a coroutine started and not awaited never ends as
"Unhandled error in Deferred", and the handler's drain() waits on the work
that runs, its timeout measured on the clock."""

import gc

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from replicator.background import Background
from replicator.observe import metrics
from replicator.replication.core.handler import ReplicationHandler


class _IdGen:
    def __init__(self):
        self.token = 0

    def get_current_token(self, writer):
        return self.token


class _Stream:
    """The part of a stream fan-out uses, with a fetch that waits until the
    test releases it."""
    name = "caches"

    def __init__(self):
        self.id_gen = _IdGen()
        self.fetches = []

    def keep_recent_facts(self):
        pass

    def updates_since(self, writer, since, until, limit):
        d = defer.Deferred()
        self.fetches.append((d, until))
        return d

    def forget(self, writer, upto):
        pass

    def encoded_since(self, writer, since, until, limit):
        return None  # memory never answers: the fetch is the test's


def failures(task):
    return metrics.REGISTRY.get_sample_value(
        "replicator_background_failures_total", {"task": task}) or 0.0


class BackgroundTests(SynchronousTestCase):
    def test_a_failure_is_logged_once_counted_and_handled(self):
        async def broken():
            raise RuntimeError("boom")

        before = failures("test-broken")
        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        background = Background()
        d = background.run("test-broken", broken())
        self.assertIsNone(self.successResultOf(d))
        del d
        gc.collect()
        self.assertEqual(failures("test-broken"), before + 1)
        self.assertEqual([formatEvent(e) for e in events if e.get("task") == "test-broken"],
                         ["Background task test-broken failed: RuntimeError: boom"])
        self.assertEqual(background.running, set())

    def test_running_work_is_tracked_until_it_ends(self):
        gate = defer.Deferred()

        async def work():
            await gate

        background = Background()
        d = background.run("test-work", work())
        self.assertEqual(background.running, {d})
        gate.callback(None)
        self.assertEqual(background.running, set())


class DrainTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.handler = ReplicationHandler([], "master", "hs.test", clock=self.clock)
        self.stream = _Stream()
        self.handler.fanout.add_writer(self.stream, "master")
        self.stream.id_gen.token = 1
        self.handler.fanout.advanced(self.stream, "master")
        self.assertEqual(len(self.stream.fetches), 1)

    def test_timeout_is_measured_on_the_clock(self):
        d = defer.ensureDeferred(self.handler.drain(timeout=1.0))
        self.assertNoResult(d)
        self.clock.advance(1.0)
        self.assertIs(self.successResultOf(d), False)

    def test_returns_when_the_running_work_ends(self):
        d = defer.ensureDeferred(self.handler.drain(timeout=1.0))
        self.assertNoResult(d)
        fetch, until = self.stream.fetches.pop()
        fetch.callback(([], until, None))
        self.assertIs(self.successResultOf(d), True)
