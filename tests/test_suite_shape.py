"""The suite's own shape: every test it holds can actually fail.

Test methods are ``async def`` (trial's ``TestCase`` awaits what a test
returns). A ``SynchronousTestCase`` only calls the method and drops the
result, so a coroutine (or generator) test there never runs its body and
passes: such a test must live in a ``TestCase``.
"""

import inspect

from twisted.trial import runner, unittest
from twisted.trial.unittest import SynchronousTestCase

import tests


def _cases(suite):
    for item in suite:
        if isinstance(item, unittest.SynchronousTestCase):
            yield item
        else:
            yield from _cases(item)


def never_run(suite) -> list:
    """The ids of the tests in ``suite`` whose body a SynchronousTestCase
    would never run (coroutine or generator test methods)."""
    found = []
    for case in _cases(suite):
        method = getattr(case, case._testMethodName)
        lazy = inspect.iscoroutinefunction(method) or inspect.isgeneratorfunction(method)
        if lazy and not isinstance(case, unittest.TestCase):
            found.append(case.id())
    return sorted(found)


class SuiteShapeTests(SynchronousTestCase):
    def test_a_lazy_test_in_a_synchronous_case_is_found(self):
        class Misplaced(SynchronousTestCase):
            async def test_coroutine(self):
                raise AssertionError("never reached")

            def test_generator(self):
                yield
                raise AssertionError("never reached")

            def test_plain(self):
                pass

        class Placed(unittest.TestCase):
            async def test_coroutine(self):
                pass

        loader = runner.TestLoader()
        suite = loader.suiteFactory([loader.loadClass(Misplaced), loader.loadClass(Placed)])
        self.assertEqual([i.rsplit(".", 1)[-1] for i in never_run(suite)],
                         ["test_coroutine", "test_generator"])

    def test_every_coroutine_test_in_the_suite_is_awaited(self):
        suite = runner.TestLoader().loadPackage(tests, recurse=True)
        self.assertEqual(never_run(suite), [])
