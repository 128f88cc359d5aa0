"""The master's USER_SYNC / FEDERATION_ACK / USER_IP bookkeeping against
hostile peers: only an instance's own connection changes its state, every
table is bounded in size and age, and metrics are labelled only by names
the configuration knows.  Protocols on StringTransport, time on a Clock."""


from prometheus_client import REGISTRY
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from replicator.observe import metrics
from tests.fakes import FakeConnection
from tests.handlers import Peers, handler


class OwnershipTests(SynchronousTestCase):
    def assertRefused(self, proto, transport, error):
        self.assertEqual(transport.value(), b"ERROR " + error.encode() + b"\n")
        self.assertEqual(proto.close_reason, "refused")
        self.assertTrue(transport.disconnecting)

    def test_only_an_instance_own_connection_changes_its_state(self):
        h, _ = handler()
        peers = Peers(self, h)
        worker1, _ = peers.connect("worker1")
        worker1.dataReceived(b"USER_SYNC worker1 @u:hs DEV start 1000\n"
                             b"FEDERATION_ACK worker1 57\n")
        expected_syncs = {"worker1": {("@u:hs", "DEV"): 1000}}
        for lines, error in (
                (b"CLEAR_USER_SYNC worker1\n", "CLEAR_USER_SYNC for another instance"),
                (b"USER_SYNC worker1 @u:hs DEV end 1001\n", "USER_SYNC for another instance"),
                (b"USER_SYNC worker1 @x:hs None start 1\n", "USER_SYNC for another instance"),
                (b"FEDERATION_ACK worker1 99\n", "FEDERATION_ACK for another instance"),
                (b"USER_SYNC master @x:hs None start 1\n", "USER_SYNC for another instance"),
                (b"CLEAR_USER_SYNC master\n", "CLEAR_USER_SYNC for another instance")):
            for name in ("worker2", None):
                proto, transport = peers.connect(name)
                proto.dataReceived(lines)
                self.assertRefused(proto, transport, error)
                proto.connectionLost(None)
                self.assertEqual(h.user_syncs, expected_syncs, lines)
                self.assertEqual(h.federation_acks, {"worker1": 57}, lines)
        # A configured writer's name is its own even while it is away.
        worker1.connectionLost(None)
        self.assertEqual(h.user_syncs, {})
        proto, transport = peers.connect("worker2")
        proto.dataReceived(b"USER_SYNC worker1 @x:hs None start 1\n")
        self.assertRefused(proto, transport, "USER_SYNC for another instance")

    def test_synapse_process_ids_belong_to_the_connection_that_used_them(self):
        """Synapse's USER_SYNC carries a random per-process ID, not its NAME."""
        h, _ = handler()
        peers = Peers(self, h)
        synapse1, _ = peers.connect("synapse1")
        synapse1.dataReceived(b"USER_SYNC AbCdE @u:hs DEV start 1000\n"
                              b"FEDERATION_ACK synapse1 5\n")
        self.assertEqual(h.user_syncs, {"AbCdE": {("@u:hs", "DEV"): 1000}})
        intruder, transport = peers.connect("synapse2")
        intruder.dataReceived(b"CLEAR_USER_SYNC AbCdE\n")
        self.assertRefused(intruder, transport, "CLEAR_USER_SYNC for another instance")
        # Nor may a connection take another live connection's NAME as its ID.
        other, transport = peers.connect("synapse3")
        other.dataReceived(b"USER_SYNC synapse1 @v:hs None start 1\n")
        self.assertRefused(other, transport, "USER_SYNC for another instance")
        self.assertEqual(h.user_syncs, {"AbCdE": {("@u:hs", "DEV"): 1000}})
        # synapse1 reconnects before its old connection is timed out: the
        # new connection of the same NAME takes the ID over.
        again, transport = peers.connect("synapse1")
        again.dataReceived(b"USER_SYNC AbCdE @v:hs None start 1001\n")
        self.assertEqual(transport.value(), b"")
        synapse1.connectionLost(None)
        self.assertEqual(h.user_syncs, {"AbCdE": {("@u:hs", "DEV"): 1000,
                                                  ("@v:hs", None): 1001}})
        again.dataReceived(b"CLEAR_USER_SYNC AbCdE\n")
        self.assertEqual(h.user_syncs, {})
        self.assertFalse(transport.disconnecting)
        # An ID claimed before a peer of that NAME came is that peer's now.
        early, early_transport = peers.connect("synapse4")
        early.dataReceived(b"USER_SYNC synapse5 @e:hs None start 1\n")
        self.assertEqual(early_transport.value(), b"")
        late, late_transport = peers.connect("synapse5")
        early.dataReceived(b"CLEAR_USER_SYNC synapse5\n")
        self.assertRefused(early, early_transport, "CLEAR_USER_SYNC for another instance")
        late.dataReceived(b"USER_SYNC synapse5 @f:hs None start 2\n")
        self.assertEqual(late_transport.value(), b"")
        self.assertEqual(h.user_syncs["synapse5"], {("@e:hs", None): 1, ("@f:hs", None): 2})
        # One connection cannot claim IDs without end (it still owns AbCdE).
        for i in range(15):
            again.dataReceived(f"USER_SYNC id{i} @u:hs None start 1\n".encode())
        self.assertEqual(transport.value(), b"")
        again.dataReceived(b"USER_SYNC id99 @u:hs None start 1\n")
        self.assertRefused(again, transport, "too many instance IDs")


class BoundsTests(SynchronousTestCase):
    def evicted(self, table):
        return REGISTRY.get_sample_value("replicator_bookkeeping_evicted_total",
                                         {"table": table}) or 0

    def test_tables_are_bounded_in_size_and_age(self):
        h, clock = handler(max_user_syncs=50, max_user_ips=100, max_federation_acks=5,
                           bookkeeping_max_age=60)
        peers = Peers(self, h)
        worker1, transport = peers.connect("worker1")
        before = {t: self.evicted(t) for t in ("user_ips", "user_syncs", "federation_acks")}
        worker1.dataReceived(b"".join(
            b'USER_IP @u%d:hs ["tok","10.0.0.1","UA","DEV",%d]\n' % (i, i) for i in range(300)))
        self.assertEqual(sorted(h.user_ips), [(f"@u{i}:hs", "DEV") for i in range(200, 300)])
        worker1.dataReceived(b"".join(
            b"USER_SYNC worker1 @u%d:hs None start %d\n" % (i, i) for i in range(200)))
        self.assertEqual(sorted(h.user_syncs["worker1"].values()), list(range(150, 200)))
        for i in range(20):
            proto, _ = peers.connect(f"fed{i}")
            proto.dataReceived(b"FEDERATION_ACK fed%d %d\n" % (i, i))
        self.assertEqual(h.federation_acks, {f"fed{i}": i for i in range(15, 20)})
        self.assertEqual(transport.value(), b"")
        self.assertEqual({t: self.evicted(t) - before[t] for t in before},
                         {"user_ips": 200, "user_syncs": 150, "federation_acks": 15})
        # An update makes an entry the newest again.
        worker1.dataReceived(b'USER_IP @u200:hs ["tok","10.0.0.2","UA","DEV",1]\n'
                             b'USER_IP @new:hs ["tok","10.0.0.3","UA","DEV",1]\n')
        self.assertIn(("@u200:hs", "DEV"), h.user_ips)
        self.assertNotIn(("@u201:hs", "DEV"), h.user_ips)
        # Age: what was not updated for bookkeeping_max_age goes (on the next PING).
        clock.advance(30)
        worker1.dataReceived(b'USER_IP @late:hs ["tok","10.0.0.4","UA",null,1]\n')
        clock.advance(31)
        worker1.dataReceived(b"PING 1\n")
        self.assertEqual(list(h.user_ips), [("@late:hs", None)])
        self.assertEqual(h.federation_acks, {})
        # Users syncing stay while their connection lives (Synapse does not
        # repeat USER_SYNC for a long sync).
        self.assertEqual(len(h.user_syncs["worker1"]), 50)


class MetricsTests(SynchronousTestCase):
    LABELLED = {"replicator_connections": "name", "replicator_commands_received_total": "name",
                "replicator_commands_sent_total": "name", "replicator_user_syncs": "instance",
                "replicator_federation_ack_position": "instance",
                "replicator_pending_commands": "name",
                "replicator_transport_buffer_bytes": "name"}

    def labels(self):
        seen = set()
        for family in REGISTRY.collect():
            label = self.LABELLED.get(family.name)
            for sample in family.samples:
                if label is not None and label in sample.labels:
                    seen.add(sample.labels[label])
        return seen

    def test_thousands_of_names_give_a_bounded_number_of_series(self):
        h, _ = handler()
        peers = Peers(self, h)
        metrics.add_source(h.bookkeeping.metric_samples)
        self.addCleanup(metrics.remove_source, h.bookkeeping.metric_samples)
        before = self.labels()
        for i in range(5_000):
            proto, _ = peers.connect()
            proto.dataReceived(b"NAME w%d\nPING 1\nUSER_SYNC w%d @u:hs None start 1\n"
                               b"FEDERATION_ACK w%d %d\n" % (i, i, i, i))
            if i % 2:
                proto.connectionLost(None)
        labels = self.labels()
        self.assertLessEqual(labels - before, {"other", "unnamed"})
        self.assertEqual(REGISTRY.get_sample_value("replicator_user_syncs",
                                                   {"instance": "other"}), 2_500)
        # The newest 1,000 acks (max_federation_acks) are kept.
        self.assertEqual(len(h.federation_acks), 1_000)
        self.assertEqual(REGISTRY.get_sample_value(
            "replicator_federation_ack_position", {"instance": "other"}), 4_999)


def bookkeeping_machine():
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

    from replicator.replication.core.bookkeeping import Bookkeeping
    from replicator.replication.wire.commands import (
        ClearUserSyncCommand,
        FederationAckCommand,
        UserIpCommand,
        UserSyncCommand,
    )

    KNOWN = frozenset({"master", "worker1"})
    NAMES = st.sampled_from(["worker1", "s1", "s2", "master", None])
    IDS = st.sampled_from(["worker1", "master", "s1", "s2", "AbC", "XyZ"])
    USERS = st.sampled_from(["@a:hs", "@b:hs", "@c:hs", "@d:hs"])
    CAPS = dict(max_user_syncs=6, max_user_ips=5, max_federation_acks=3, max_age=100.0)

    class BookkeepingMachine(RuleBasedStateMachine):
        """Random peers against the rules: a refused command changes
        nothing, an accepted one is one the rules allow, tables stay bounded
        and consistent, and a connection's IDs go with it."""

        def __init__(self):
            super().__init__()
            self.clock = Clock()
            self.books = Bookkeeping(self.clock, KNOWN, **CAPS)
            self.live = []

        def tables(self):
            b = self.books
            return ({i: dict(u) for i, u in b.user_syncs.items()}, dict(b.federation_acks))

        def others_named(self, conn, name):
            return any(c is not conn and c.instance_name == name for c in self.live)

        def may_change(self, conn, instance):
            """The rule of the module docstring, from the outside."""
            if instance == conn.instance_name:
                return True
            if instance in KNOWN or self.others_named(conn, instance):
                return False
            owner = self.books._owners.get(instance)
            return owner is None or owner is conn or (
                conn.instance_name is not None and owner.instance_name == conn.instance_name)

        @rule(name=NAMES)
        def connect(self, name):
            if name in ("master",):
                return  # the protocol refuses this NAME before the bookkeeping sees it
            conn = FakeConnection(name)  # a server-side connection
            self.live.append(conn)
            if name is not None:
                self.books.named(conn, name)

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def lose(self, data):
            conn = data.draw(st.sampled_from(self.live))
            owned = {i for i, c in self.books._owners.items() if c is conn}
            self.live.remove(conn)
            self.books.connection_lost(conn)
            for instance in owned:
                assert instance not in self.books.user_syncs

        @precondition(lambda self: self.live)
        @rule(data=st.data(), instance=IDS, user=USERS, syncing=st.booleans(),
              clear=st.booleans())
        def user_sync(self, data, instance, user, syncing, clear):
            conn = data.draw(st.sampled_from(self.live))
            allowed = self.may_change(conn, instance)
            full = len(self.books._owned.get(conn, ())) >= 16
            before = self.tables()
            if clear:
                why = self.books.clear_user_sync(conn, ClearUserSyncCommand(instance))
            else:
                why = self.books.user_sync(conn, UserSyncCommand(
                    instance, user, None, syncing, 1))
            if why is not None:
                assert self.tables() == before, why
                assert not allowed or full, (conn, instance, why)
                return
            assert allowed, (conn, instance)
            assert self.books._owners[instance] is conn
            syncs = self.books.user_syncs.get(instance, {})
            if clear:
                assert instance not in self.books.user_syncs
            elif syncing:
                assert (user, None) in syncs
            else:
                assert (user, None) not in syncs

        @precondition(lambda self: self.live)
        @rule(data=st.data(), instance=IDS, token=st.integers(0, 100))
        def federation_ack(self, data, instance, token):
            conn = data.draw(st.sampled_from(self.live))
            before = self.tables()
            why = self.books.federation_ack(conn, FederationAckCommand(instance, token))
            if instance == conn.instance_name:
                assert why is None and self.books.federation_acks[instance] == token
            else:
                assert why is not None and self.tables() == before

        @rule(user=USERS, device=st.sampled_from(["D1", "D2"]))
        def user_ip(self, user, device):
            self.books.user_ip(None, UserIpCommand(user, "tok", "10.0.0.1", "UA", device, 1))
            assert self.books.user_ips[(user, device)]["ip"] == "10.0.0.1"

        @rule(seconds=st.sampled_from([1.0, 50.0, 101.0]))
        def time_passes(self, seconds):
            self.clock.advance(seconds)
            self.books.expire()
            limit = self.clock.seconds() - CAPS["max_age"]
            assert all(t >= limit for t in self.books._ip_times.values())
            assert all(t >= limit for t in self.books._ack_times.values())

        @invariant()
        def bounded_and_consistent(self):
            b = self.books
            assert len(b._sync_order) <= CAPS["max_user_syncs"]
            assert len(b.user_ips) <= CAPS["max_user_ips"]
            assert len(b.federation_acks) <= CAPS["max_federation_acks"]
            assert set(b._sync_order) == {(i, u) for i, users in b.user_syncs.items()
                                          for u in users}
            assert all(b.user_syncs.values())  # no empty instance left behind
            assert set(b._ip_times) == set(b.user_ips)
            assert set(b._ack_times) == set(b.federation_acks)
            for instance, owner in b._owners.items():
                assert owner in self.live and instance in b._owned[owner]
            for conn, owned in b._owned.items():
                assert len(owned) <= 16
                assert all(b._owners.get(i) is conn for i in owned)
            # Every ID with users syncing is owned by a live connection.
            assert set(b.user_syncs) <= set(b._owners)

    return BookkeepingMachine


class BookkeepingStateTests(SynchronousTestCase):
    def test_random_peers_keep_the_rules(self):
        from hypothesis import settings

        machine = settings(max_examples=150, stateful_step_count=50, deadline=None)(
            bookkeeping_machine())
        machine.TestCase().runTest()
