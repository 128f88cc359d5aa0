"""Other writers' links and the linear tokens' holders (:mod:`replicator.observe.writers`)
on a Clock, and the roles (:mod:`replicator.observe.roles`) of every kind of config."""

from types import SimpleNamespace

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import parse_instance
from replicator.observe import metrics, roles
from replicator.observe.writers import WriterWatch
from replicator.streams.idgen import StreamIdGenerator
from tests.fakes import FakeConnection, FakeView

STREAMS = [{"name": "caches", "table": "c", "columns": [{"x": "text"}],
            "writers": ["master", "worker2", "worker3"]}]


def stream(gen):
    return SimpleNamespace(name="caches", id_gen=gen, loaded=True, local_writers=["master"],
                           config=SimpleNamespace(writers=["master", "worker2", "worker3"]))


class WriterWatchTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.handler = FakeView(self.clock)
        self.gen = StreamIdGenerator("caches", {"master": 0, "worker2": 0, "worker3": 0},
                                     ["master"])
        self.stream = stream(self.gen)

    def watch(self, hub):
        return WriterWatch(registry=[self.stream], handler=self.handler, clock=self.clock,
                           hub=hub, via=None if hub else "redis")

    def test_on_a_hub_a_writer_is_connected_disconnected_or_never_connected(self):
        watch = self.watch(hub=True)
        peer = FakeConnection("worker2")  # it connected to us and named itself
        self.handler.connections.add(peer, replicating=True, label="worker2")
        self.handler.heard[("caches", "worker2")] = self.clock.seconds()
        self.clock.advance(3)
        link = watch.link("worker2")
        self.assertEqual((link["connected"], link["since"], link["heard_age"]),
                         (True, 1_000_000, 3))
        self.assertEqual(link["text"], "connected since 13:46:40 UTC")
        self.handler.connections.remove(peer, "connection_lost")
        self.clock.advance(41)
        link = watch.link("worker2")
        self.assertEqual((link["connected"], link["since"]), (False, 1_000_003))
        self.assertEqual(link["text"], "disconnected since 13:46:43 UTC (41s)")
        never = watch.link("worker3")
        self.assertEqual((never["connected"], never["since"], never["heard_age"]),
                         (False, None, None))
        self.assertEqual(never["text"], "never connected (up 44s)")
        # Both are down longer than the grace: warnings, never a 503.
        found = [f for f in watch.findings(10) if f.kind == "writer_down"]
        self.assertEqual([(f.writer, f.fails_health) for f in found],
                         [("worker2", False), ("worker3", False)])
        samples = {(m.name, labels): v for m, labels, v in watch.metric_samples()}
        self.assertEqual(samples[("replicator_writer_connected", ("worker2",))], 0)
        self.assertEqual(samples[("replicator_writer_heard_age_seconds",
                                  ("caches", "worker2"))], 44)

    def test_elsewhere_connected_is_unknown_and_last_heard_is_said(self):
        watch = self.watch(hub=False)
        self.handler.heard[("caches", "worker2")] = self.clock.seconds()
        self.clock.advance(125)
        link = watch.link("worker2")
        self.assertEqual((link["connected"], link["heard_age"], link["text"], link["via"]),
                         (None, 125, "last heard 2m05s ago", "redis"))
        self.assertEqual(watch.link("worker3")["text"], "never heard (up 2m05s)")
        self.assertNotIn(metrics.WRITER_CONNECTED,
                         [m for m, _, _ in watch.metric_samples()])

    def test_the_linear_token_is_held_by_remote_writers_or_an_id_in_flight(self):
        watch = self.watch(hub=True)
        self.assertIsNone(watch.linear_holder(self.stream))  # nothing known above it
        self.gen.advance("worker2", 5)
        self.gen.advance("worker3", 7)
        watch.observe()
        self.clock.advance(12)
        holder = watch.linear_holder(self.stream)
        self.assertEqual((holder["linear"], holder["writers"], holder["in_flight"],
                          holder["held_for"]), (5, ["worker2"], None, 12))
        self.gen.advance("worker2", 6)
        # It moved since the last look: moving, not held (held anew from here).
        self.assertIsNone(watch.linear_holder(self.stream))
        self.clock.advance(41)
        self.assertEqual(watch.linear_holder(self.stream)["text"],
                         "linear held at 6 by worker2: never connected (up 53s), for 41s")
        self.gen.advance("worker2", 9)
        self.gen.advance("worker3", 9)
        self.gen.reserved("master", [10], pending=False)
        self.gen.advance("worker2", 11)
        self.gen.advance("worker3", 11)
        self.assertIsNone(watch.linear_holder(self.stream))  # it just moved
        self.clock.advance(41)
        holder = watch.linear_holder(self.stream)
        self.assertEqual((holder["linear"], holder["writers"], holder["in_flight"]),
                         (9, [], [10, "master"]))
        self.assertEqual(watch.linear_holder(self.stream)["text"],
                         "linear held at 9 by ID 10 of master, in flight, for 41s")
        [finding] = [f for f in watch.findings(10) if f.kind == "linear_held"]
        self.assertEqual((finding.writer, finding.verdict, finding.fails_health),
                         ("master", "ID 10 in flight, holds the linear token at 9", False))
        self.gen.complete("master", 10)
        self.assertIsNone(watch.linear_holder(self.stream))


    def test_steady_writes_hold_nothing(self):
        """The linear token moving at every look (one fact in flight at a
        time, another writer idle) is never "held for 0s"."""
        watch = self.watch(hub=True)
        shown = []
        for token in range(1, 30):
            for w in ("worker2", "worker3"):  # their POSITIONs, one fact behind
                self.gen.advance(w, token)
            self.gen.reserved("master", [token + 1], pending=False)
            self.clock.advance(1)
            self.assertLess(self.gen.get_linear_token(), self.gen.get_max_known())
            shown.append(watch.linear_holder(self.stream))
            self.gen.complete("master", token + 1)
        self.assertEqual(shown, [None] * 29)

    def test_a_writer_added_by_a_reload_holds_the_token_and_counts_from_then(self):
        watch = self.watch(hub=True)
        for w in ("worker2", "worker3"):
            self.gen.advance(w, 9)
        self.assertIsNone(watch.linear_holder(self.stream))
        self.clock.advance(233)  # the instance has been up 3m53s
        # A reload adds worker4 at the stream's smallest persisted position.
        self.gen.add_remote("worker4", 0)
        self.stream.config.writers.append("worker4")
        watch.observe()
        for w in ("worker2", "worker3"):
            self.gen.advance(w, 12)
        watch.observe()
        self.clock.advance(12)
        holder = watch.linear_holder(self.stream)
        self.assertEqual((holder["linear"], holder["writers"]), (9, ["worker4"]))
        self.assertEqual(holder["text"], "linear held at 9 by worker4: never connected "
                                         "(added 12s ago), for 12s")
        self.assertEqual(watch.link("worker3")["text"], "never connected (up 4m05s)")
        # Not down past a grace of 20 s: it was configured 12 s ago.
        self.assertEqual([f.writer for f in watch.findings(20) if f.kind == "writer_down"],
                         ["worker2", "worker3"])


def config(name="w", **replication):
    return parse_instance({"server_name": "hs", "instance_name": name,
                           "database": {"postgres": "dbname=x"}, "streams": STREAMS,
                           "replication": replication}, "test.yaml")


class RoleTests(SynchronousTestCase):
    def test_one_definition_per_transport(self):
        redis = {"endpoint": "tcp:host=127.0.0.1:port=6379"}
        cases = [
            (config(listen="tcp:9092:interface=127.0.0.1"), "master", False),
            (config(upstream="tcp:host=127.0.0.1:port=9092"), "worker", True),
            (config("master", redis=redis), "master", True),
            (config("worker1", redis=redis), "worker", True),
            (config("master"), "master", False),
        ]
        for cfg, role, link in cases:
            self.assertEqual((roles.role(cfg), roles.has_replication_link(cfg)), (role, link),
                             cfg.replication)
