"""The status page's parts on a Clock: the bounded lag ring, the problem
ring, the sparkline, and HTML that escapes whatever a peer calls itself."""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from replicator import status, status_page


class Handler:
    """The two handler methods the recorder reads, with settable values."""

    def __init__(self):
        self.lags = {}

    def reader_lag(self):
        return dict(self.lags)


class RecorderTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.handler = Handler()
        self.problem = None
        self.recorder = status.StatusRecorder(handler=self.handler, clock=self.clock,
                                              problem=lambda: self.problem,
                                              interval=5.0, window=900.0)
        self.recorder.startService()
        self.addCleanup(self.recorder.stopService)

    def test_lag_ring_is_bounded_to_the_window(self):
        key = ("caches", "w1")
        for i in range(1000):  # 5000 s of samples
            self.handler.lags[key] = i
            self.clock.advance(5.0)
        ring = self.recorder.lag[key]
        self.assertEqual(len(ring), 181)
        history = self.recorder.history(key)
        self.assertEqual(len(history), 181)
        self.assertEqual(history[-1], [5000.0, 999])
        self.assertEqual(history[0], [4100.0, 819])
        # A sample older than the window is not shown even if still kept.
        self.clock.advance(100.0)
        self.assertEqual(self.recorder.history(key)[0][0], 4200.0)

    def test_a_going_problem_is_one_entry_and_the_ring_is_bounded(self):
        self.clock.advance(5)
        self.problem = "stream caches/w1 lagging by 3 for 10s"
        self.clock.advance(5)
        self.problem = "stream caches/w1 lagging by 4 for 15s"
        self.clock.advance(5)
        self.assertEqual(list(self.recorder.problems),
                         [(10.0, "stream caches/w1 lagging by 4 for 15s")])
        self.problem = "stream caches: writer w1 has 1 committed fact not received for 2s"
        self.clock.advance(5)
        self.problem = "stream caches: writer w1 has 5 committed facts not received for 7s"
        self.clock.advance(5)
        self.assertEqual(list(self.recorder.problems)[-1], (
            20.0, "stream caches: writer w1 has 5 committed facts not received for 7s"))
        self.recorder.problems.pop()
        self.problem = None
        self.clock.advance(5)
        self.problem = "stream caches/w1 lagging by 3 for 10s"
        self.clock.advance(5)
        self.assertEqual(len(self.recorder.problems), 2)  # it went away and came back
        for i in range(100):
            self.problem = "other problem" if i % 2 else "stream presence/w2 lagging by 1"
            self.clock.advance(5)
        self.assertEqual(len(self.recorder.problems), status.MAX_PROBLEMS)
        self.assertEqual(self.recorder.problems[-1][1], "other problem")


def sample_snapshot(peer="worker1", reason="ping_timeout"):
    return {
        "instance": "master", "role": "master", "now": 1000.0, "healthy": False,
        "problem": "stream caches: writer w1 has 3 committed facts not received for 12s",
        "problems": [{"at": 990.0, "reason": "stream caches/w1 lagging by 3 for 10s"}],
        "streams": [{"name": "caches", "linear": 7, "writers": [
            {"writer": "master", "local": True, "position": 7, "in_flight": 12,
             "in_flight_ids": list(range(8, 18)), "announced": 7, "verdict": "ok"},
            {"writer": "w1", "local": False, "position": 3, "reader_position": 3, "lag": 3,
             "lag_history": [[990.0, 0], [995.0, 3], [1000.0, 3]], "verdict": "behind by 3"},
        ]}],
        "connections": [{"peer": peer, "address": "127.0.0.1:5000", "role": "client",
                         "queued_lines": 2, "queued_bytes": 80, "connected_since": 900.0}],
        "disconnects": [{"at": 950.0, "peer": peer, "address": "127.0.0.1:4999",
                         "reason": reason}],
        "window": 900.0,
    }


class RenderTests(SynchronousTestCase):
    def test_page_shows_every_part(self):
        page = status_page.render_html(sample_snapshot()).decode()
        for text in ("caches", "12 (8, 9, 10, 11, 12, 13, 14, 15, 16, 17, …)", "behind by 3",
                     "127.0.0.1:5000", "ping_timeout", "1970-01-01 00:15:00 UTC",
                     "lagging by 3 for 10s", "unhealthy: stream caches: writer w1 has 3"):
            self.assertIn(text, page)
        self.assertIn('<script src="/status.js" defer></script>', page)
        self.assertNotIn("<script>", page)  # nothing inline: the CSP forbids it
        self.assertNotIn("style=", page)

    def test_hostile_peer_names_are_escaped(self):
        page = status_page.render_html(
            sample_snapshot(peer='<img src=x onerror="alert(1)">',
                            reason="</td><script>x</script>")).decode()
        self.assertNotIn("<img", page)
        self.assertNotIn("<script>x", page)
        self.assertIn("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;", page)

    def test_sparkline_spans_the_window(self):
        svg = status_page.sparkline([[100.0, 0], [550.0, 5], [1000.0, 10]], 1000.0, 900.0)
        self.assertIn('points="0.0,23.0 60.0,12.0 120.0,1.0"', svg)
        flat = status_page.sparkline([[1000.0, 0]], 1000.0, 900.0)
        self.assertIn('points="120.0,23.0"', flat)
