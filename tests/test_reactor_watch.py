"""The reactor watch (replicator.observe.reactor_watch): a reactor held
past its limit is reported once, with how long and where; a process
stopped as a whole is not a stall; the gauge read from another thread
rises while the reactor is held."""

import sys
import threading
import time

from prometheus_client import REGISTRY
from twisted.application.service import IService
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial import unittest
from zope.interface.verify import verifyObject

from replicator.observe import metrics
from replicator.observe.reactor_watch import ReactorWatch, describe

from .support import LogWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def held_here():
    """A frame to stand for the reactor thread's."""
    return sys._getframe()


class WatchInMemoryTests(unittest.TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.frame = held_here()
        self.watch = ReactorWatch(reactor=None, now=self.clock,
                                  frames=lambda: {self.watch.reactor_thread: self.frame},
                                  beat=0.25, blocked=1.0)
        self.log = LogWatch(self)
        self.stalls_before = metrics.REACTOR_STALLS._value.get()

    def warnings(self) -> list:
        return [e for e in self.log.events
                if e.get("log_namespace") == "replicator.observe.reactor_watch"]

    def looks(self, count: int, step: float = 0.25) -> None:
        """The thread's ``count`` looks, ``step`` seconds apart, with no beat."""
        for _ in range(count):
            slept = self.clock.now
            self.clock.now += step
            self.watch.look(slept)

    def test_interface(self) -> None:
        verifyObject(IService, self.watch)

    def test_a_turning_reactor_says_nothing(self) -> None:
        for _ in range(20):
            self.looks(1)
            self.watch.beat()
        self.assertEqual(self.warnings(), [])
        self.assertEqual(self.watch.blocked_for(), 0.0)

    def test_a_held_reactor_is_reported_once_with_where(self) -> None:
        self.watch.beat()
        # The reactor does not beat for 3.5 s; the thread looks every 0.25 s.
        self.looks(14)
        self.assertAlmostEqual(self.watch.blocked_for(), 3.25)
        self.clock.now += 0.01
        self.watch.beat()
        self.watch.beat()  # (the next turn: nothing more to say)
        [event] = self.warnings()
        self.assertAlmostEqual(event["held"], 3.51)
        self.assertAlmostEqual(event["late"], 1.0)
        self.assertIn("held_here", event["stack"])
        self.assertIn("test_reactor_watch.py", event["stack"])
        self.assertEqual(metrics.REACTOR_STALLS._value.get(), self.stalls_before + 1)

    def test_a_short_hold_is_no_stall(self) -> None:
        self.watch.beat()
        self.looks(3)
        self.watch.beat()
        self.assertEqual(self.warnings(), [])

    def test_a_stopped_process_is_no_stall(self) -> None:
        # SIGSTOP for 30 s: the thread's own sleep overran as much.
        self.watch.beat()
        self.looks(1, step=30.0)
        self.looks(1)
        self.watch.beat()
        self.assertEqual(self.warnings(), [])

    def test_stalls_one_after_another_are_each_reported(self) -> None:
        for _ in range(2):
            self.watch.beat()
            self.looks(6)
            self.watch.beat()
        self.assertEqual(len(self.warnings()), 2)

    def test_describe_names_the_innermost_call_first(self) -> None:
        text = describe(held_here())
        self.assertTrue(text.startswith("tests/test_reactor_watch.py:") or
                        text.startswith("test_reactor_watch.py:"), text)
        self.assertIn(" held_here < ", text)


class DescribeTests(unittest.TestCase):
    def test_the_import_machinery_is_one_entry(self):
        # A module run on first use: its own frame, then the import
        # machinery's, then the code that imported it.
        import importlib
        import os
        import tempfile

        directory = tempfile.mkdtemp()
        self.addCleanup(lambda: __import__("shutil").rmtree(directory))
        with open(os.path.join(directory, "imported_on_the_reactor.py"), "w") as f:
            f.write("import sys\nfrom replicator.observe.reactor_watch import describe\n"
                    "TEXT = describe(sys._getframe())\n")
        sys.path.insert(0, directory)
        self.addCleanup(sys.path.remove, directory)
        self.addCleanup(sys.modules.pop, "imported_on_the_reactor", None)
        text = importlib.import_module("imported_on_the_reactor").TEXT
        parts = text.split(" < ")
        self.assertTrue(parts[0].startswith("imported_on_the_reactor.py:3 <module>"), text)
        self.assertEqual(parts[1], "(import)", text)
        self.assertEqual(parts[2].split(" ")[1], "import_module", text)
        self.assertIn("test_the_import_machinery_is_one_entry", parts[3])
        self.assertNotIn("frozen", text)


class WatchOnTheReactorTests(unittest.TestCase):
    """The real thread, the real reactor, a call that holds it."""

    async def test_a_blocking_call_is_named(self) -> None:
        log = LogWatch(self)
        watch = ReactorWatch(reactor, beat=0.05, blocked=0.3)
        watch.startService()
        self.addCleanup(lambda: watch.running and watch.stopService())
        seen = []

        def metrics_side() -> None:  # what the metrics thread reads
            deadline = time.monotonic() + 0.7
            while time.monotonic() < deadline:
                seen.append(REGISTRY.get_sample_value("replicator_reactor_blocked_seconds"))
                time.sleep(0.02)

        def hold_the_reactor() -> None:
            side = threading.Thread(target=metrics_side)
            side.start()
            time.sleep(0.8)
            side.join()

        await deferLater(reactor, 0.1, hold_the_reactor)
        await log.until(lambda: any(
            e.get("log_namespace") == "replicator.observe.reactor_watch" for e in log.events))
        [event] = [e for e in log.events
                   if e.get("log_namespace") == "replicator.observe.reactor_watch"]
        self.assertGreaterEqual(event["held"], 0.8)
        self.assertIn("hold_the_reactor", event["stack"])
        self.assertGreater(max(seen), 0.3)
        watch.stopService()
        self.assertFalse(watch._thread)
