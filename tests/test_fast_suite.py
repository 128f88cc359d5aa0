"""``make test-fast``'s list (``tests/fast.txt``) stays true: every line
names test modules or classes that load and hold tests, none twice, and
the in-memory suites are on it."""

import os

from twisted.trial.runner import TestLoader
from twisted.trial.unittest import SynchronousTestCase

FAST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast.txt")


def listed():
    with open(FAST) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


class FastListTests(SynchronousTestCase):
    def test_every_line_loads_and_holds_tests_once(self):
        names = listed()
        self.assertEqual(len(names), len(set(names)))
        loader = TestLoader()
        empty = [n for n in names if loader.loadByName(n).countTestCases() == 0]
        self.assertEqual(empty, [])

    def test_the_in_memory_suites_are_listed(self):
        names = listed()
        for name in ("tests.test_redis_memory.RedisInMemoryTests",
                     "tests.test_read_api_memory.PageTests", "tests.test_harness.HarnessTests",
                     "tests.test_http.InMemoryHttpTests", "tests.test_fast_suite.FastListTests"):
            self.assertIn(name, names)
