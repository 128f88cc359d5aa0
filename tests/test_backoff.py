"""Tests for replicator.net.backoff: the one reconnect policy."""

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from replicator.net.backoff import Backoff


class BackoffTests(SynchronousTestCase):
    def test_grows_to_the_maximum_and_ignores_the_attempt_number(self):
        b = Backoff(0.5, 30, rng=lambda: 0.0)
        # ClientService passes 1 after every accepted connection: ignored.
        self.assertEqual([b(1) for _ in range(9)], [0.5, 1, 2, 4, 8, 16, 30, 30, 30])
        self.assertEqual(b.failures, 9)

    def test_reset_starts_over(self):
        b = Backoff(0.5, 30, rng=lambda: 0.0)
        for _ in range(5):
            b(1)
        b.reset()
        self.assertEqual((b.failures, b(1)), (0, 0.5))

    def test_jitter_only_shortens_by_at_most_its_fraction(self):
        b = Backoff(1, 8, jitter=0.25, rng=lambda: 1.0)
        self.assertEqual([b() for _ in range(5)], [0.75, 1.5, 3, 6, 6])

    @settings(deadline=None)
    @given(st.lists(st.floats(min_value=0, max_value=1), min_size=1, max_size=80))
    def test_every_delay_is_longer_until_the_cap(self, randoms):
        it = iter(randoms)
        b = Backoff(0.5, 30, rng=lambda: next(it))
        delays = [b() for _ in randoms]
        for earlier, later in zip(delays, delays[1:]):
            self.assertTrue(later > earlier or later >= 30 * 0.75, delays)
        self.assertTrue(all(0.375 <= d <= 30 for d in delays))

    def test_bad_parameters(self):
        for kwargs in ({"initial": 0}, {"initial": 5, "maximum": 1}, {"factor": 0.5},
                       {"jitter": 1}):
            with self.assertRaises(ValueError):
                Backoff(**kwargs)
