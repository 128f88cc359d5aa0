"""The status page's parts on a Clock: the bounded lag ring, the problem
ring, the sparkline, and HTML that escapes whatever a peer calls itself."""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from replicator.observe import status, status_html
from replicator.observe.health import Finding
from tests.fakes import FakeView


def lagging(by, for_):
    return Finding("lagging", "caches", "w1", f"stream caches/w1 lagging by {by} for {for_}s",
                   f"lagging by {by} for {for_}s")


def unreceived(n, for_):
    noun = "fact" if n == 1 else "facts"
    what = f"{n} committed {noun} not received for {for_}s"
    return Finding("unreceived", "caches", "w1", f"stream caches: writer w1 has {what}", what)


class RecorderTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.handler = FakeView()
        self.found = []
        self.recorder = status.StatusRecorder(handler=self.handler, clock=self.clock,
                                              findings=lambda: self.found,
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

    def entries(self):
        return [(p.since, p.until, p.reason) for p in self.recorder.problems]

    def test_a_going_problem_is_one_entry_from_to_and_the_ring_is_bounded(self):
        self.clock.advance(5)
        self.found = [lagging(3, 10)]
        self.clock.advance(5)
        self.found = [lagging(4, 15)]
        self.clock.advance(5)
        self.assertEqual(self.entries(), [(10.0, None, "stream caches/w1 lagging by 4 for 15s")])
        # Another finding at the same time is its own entry; when the lag
        # ends its entry says when.
        self.found = [unreceived(1, 2)]
        self.clock.advance(5)
        self.found = [unreceived(5, 7)]
        self.clock.advance(5)
        self.assertEqual(self.entries(), [
            (10.0, 20.0, "stream caches/w1 lagging by 4 for 15s"),
            (20.0, None, "stream caches: writer w1 has 5 committed facts not received for 7s")])
        self.found = []
        self.clock.advance(5)
        self.assertEqual(self.entries()[-1][:2], (20.0, 30.0))
        self.found = [lagging(3, 10)]
        self.clock.advance(5)
        self.assertEqual(len(self.recorder.problems), 3)  # it went away and came back
        self.assertEqual(self.entries()[-1][:2], (35.0, None))
        other = Finding("link", None, None, "replication not connected: x", "")
        for i in range(100):
            self.found = [other] if i % 2 else [lagging(1, i)]
            self.clock.advance(5)
        self.assertEqual(len(self.recorder.problems), status.MAX_PROBLEMS)
        self.assertEqual(self.entries()[-1][1:], (None, "replication not connected: x"))
        self.assertTrue(all(p.until is not None for p in list(self.recorder.problems)[:-1]))


    def test_a_finding_that_says_when_it_began_starts_there(self):
        """A link down since its peer was last heard: the entry starts then
        (not at the sample); down again after answering between two
        samples, it is a second entry, the first ending when the second
        began; and the page's view notes the findings of the moment, so
        the history never lags the banner by a sample."""
        def down(since):
            return Finding("link", None, None, f"replication not connected: since {since}", "",
                           since=since)
        self.clock.advance(10)
        self.found = [down(7.0)]
        self.clock.advance(5)
        self.assertEqual(self.entries(), [(7.0, None, "replication not connected: since 7.0")])
        self.clock.advance(1)
        self.recorder.note([down(13.0)])  # answered at 13 and stopped again
        self.assertEqual(self.entries(), [(7.0, 13.0, "replication not connected: since 7.0"),
                                          (13.0, None, "replication not connected: since 13.0")])
        self.recorder.note([])
        self.assertEqual(self.entries()[-1][:2], (13.0, 16.0))


class RowVerdictTests(SynchronousTestCase):
    def test_a_row_gives_the_findings_about_it_never_a_lag_verdict_under_them(self):
        # Lag 0 and a committed fact not received: the row says so (it
        # used to read "unhealthy: ok").
        found = [unreceived(1, 17)]
        self.assertEqual(status.row_verdict(found, "caches", "w1", "ok"),
                         ("1 committed fact not received for 17s", "bad"))
        self.assertEqual(status.row_verdict(found, "caches", "w2", "ok"), ("ok", "ok"))
        self.assertEqual(status.row_verdict(found, "presence", "w1", "behind by 2"),
                         ("behind by 2", "ok"))
        down = Finding("writer_down", None, "w1", "writer w1 disconnected since 19:14:29 UTC",
                       "disconnected since 19:14:29 UTC", False)
        self.assertEqual(status.row_verdict([down], "presence", "w1", "ok"),
                         ("disconnected since 19:14:29 UTC", "warn"))
        self.assertEqual(status.row_verdict([down] + found, "caches", "w1", "ok"), (
            "disconnected since 19:14:29 UTC; 1 committed fact not received for 17s", "bad"))


def sample_snapshot(peer="worker1", reason="ping_timeout"):
    return {
        "instance": "master", "role": "master", "now": 1000.0, "healthy": False,
        "problem": "stream caches: writer w1 has 3 committed facts not received for 12s",
        "problems": [{"at": 990.0, "until": None,
                      "reason": "stream caches/w1 lagging by 3 for 10s"},
                     {"at": 900.0, "until": 960.0, "reason": "replication not connected: x"}],
        "streams": [{"name": "caches", "linear": 7, "linear_holder": {
            "by": "w1: disconnected since 00:15:50 UTC (50s)", "held": "50s"}, "writers": [
            {"writer": "master", "local": True, "position": 7, "in_flight": 12,
             "in_flight_ids": list(range(8, 18)), "announced": 7, "verdict": "ok"},
            {"writer": "w1", "local": False, "position": 3, "reader_position": 3, "lag": 3,
             "lag_history": [[990.0, 0], [995.0, 3], [1000.0, 3]], "verdict": "behind by 3",
             "link": {"connected": False, "since": 950.0, "heard_age": 50.0,
                      "text": "disconnected since 00:15:50 UTC (50s)"}},
        ]}],
        "connections": [{"peer": peer, "address": "127.0.0.1:5000", "role": "client",
                         "queued_lines": 2, "queued_bytes": 80, "connected_since": 900.0,
                         "state": "connected",
                         "state_since": 900.0, "state_text": "connected since 00:15:00 UTC"}],
        "disconnects": [{"at": 950.0, "peer": peer, "address": "127.0.0.1:4999",
                         "reason": reason}],
        "window": 900.0,
    }


class RenderTests(SynchronousTestCase):
    def test_page_shows_every_part(self):
        page = status_html.render_html(sample_snapshot()).decode()
        for text in ("caches", "12 (8, 9, 10, 11, 12, 13, 14, 15, 16, 17, …)", "behind by 3",
                     "127.0.0.1:5000", "ping_timeout", "connected since 00:15:00 UTC",
                     "lagging by 3 for 10s", "unhealthy: stream caches: writer w1 has 3",
                     "1970-01-01 00:16:30 UTC – ongoing", "1970-01-01 00:15:00 – 00:16:00 UTC",
                     "7 (held by w1: disconnected since 00:15:50 UTC (50s), for 50s)",
                     "disconnected since 00:15:50 UTC (50s); last heard 50s ago"):
            self.assertIn(text, page)
        self.assertIn('<script src="/status.js" defer></script>', page)
        self.assertNotIn("<script>", page)  # nothing inline: the CSP forbids it
        self.assertNotIn("style=", page)

    def test_hostile_peer_names_are_escaped(self):
        page = status_html.render_html(
            sample_snapshot(peer='<img src=x onerror="alert(1)">',
                            reason="</td><script>x</script>")).decode()
        self.assertNotIn("<img", page)
        self.assertNotIn("<script>x", page)
        self.assertIn("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;", page)

    def test_sparkline_spans_the_window(self):
        svg = status_html.sparkline([[100.0, 0], [550.0, 5], [1000.0, 10]], 1000.0, 900.0)
        self.assertIn('points="0.0,23.0 60.0,12.0 120.0,1.0"', svg)
        flat = status_html.sparkline([[1000.0, 0]], 1000.0, 900.0)
        self.assertIn('points="120.0,23.0"', flat)
