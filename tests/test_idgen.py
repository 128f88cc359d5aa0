"""The ID generator against the definitions of seeds/streams.md."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)
from twisted.trial.unittest import SynchronousTestCase

from replicator.streams.idgen import StreamIdGenerator, UnknownWriter


class SeedExampleTests(SynchronousTestCase):
    """The worked example of seeds/streams.md, replayed step by step."""

    def test_example_table(self):
        gen = StreamIdGenerator("s", {"master": 1}, ["master"])
        seen = []
        gen.add_listener(lambda w, old, new: seen.append((w, old, new)))
        steps = [
            ("reserve", 2, 1), ("reserve", 3, 1), ("complete", 3, 1),
            ("complete", 2, 3), ("reserve", 4, 3), ("reserve", 5, 3),
            ("reserve", 6, 3), ("complete", 5, 3), ("complete", 4, 5),
            ("complete", 6, 6),
        ]
        self.assertEqual(gen.get_current_token("master"), 1)
        for action, stream_id, expected in steps:
            if action == "reserve":
                gen.reserved("master", [stream_id], pending=False)
            else:
                gen.complete("master", stream_id)
            self.assertEqual(
                (gen.get_current_token("master"), gen.get_linear_token()),
                (expected, expected), f"after {action} {stream_id}",
            )
        self.assertEqual(seen, [("master", 1, 3), ("master", 3, 5), ("master", 5, 6)])
        self.assertEqual(gen.in_flight(), 0)

    def test_rollback_is_completion(self):
        gen = StreamIdGenerator("s", {"m": 10}, ["m"])
        gen.reserved("m", [11, 12], pending=False)
        gen.complete("m", 12)
        gen.complete("m", 11)  # rolled back: no rows, still complete
        self.assertEqual(gen.get_current_token("m"), 12)

    def test_completing_an_id_not_in_flight_changes_nothing(self):
        """One way to complete, one check: a transaction's IDs complete
        together or, if one was never reserved, not at all."""
        gen = StreamIdGenerator("s", {"m": 10}, ["m"])
        gen.reserved("m", [11, 12], pending=False)
        with self.assertRaises(ValueError) as e:
            gen.complete_many("m", [11, 13])
        self.assertIn("stream s: ID 13 of m is not in flight", str(e.exception))
        self.assertEqual((gen.in_flight("m"), gen.get_current_token("m")), (2, 10))
        gen.complete_many("m", [11, 12])
        self.assertEqual((gen.in_flight("m"), gen.get_current_token("m")), (0, 12))

    def test_idle_writer_follows_linear_not_past_inflight(self):
        gen = StreamIdGenerator("s", {"a": 0, "b": 0}, ["a", "b"])
        gen.reserved("a", [1], pending=False)
        gen.reserved("b", [2], pending=False)
        gen.complete("b", 2)
        # b is idle but a's 1 is unfinished: nobody may claim 1.
        self.assertEqual(gen.get_positions(), {"a": 0, "b": 2})
        self.assertEqual(gen.get_linear_token(), 0)
        gen.complete("a", 1)
        self.assertEqual(gen.get_linear_token(), 2)
        self.assertEqual(gen.get_positions(), {"a": 2, "b": 2})

    def test_remote_writer_bounds_linear(self):
        gen = StreamIdGenerator("s", {"a": 0, "r": 0}, ["a"])
        gen.reserved("a", [1, 3], pending=False)
        gen.complete_many("a", [1, 3])
        self.assertEqual(gen.get_current_token("a"), 3)
        self.assertEqual(gen.get_linear_token(), 0)
        gen.advance("r", 2)
        self.assertEqual(gen.get_linear_token(), 2)
        gen.advance("r", 1)  # stale: ignored
        self.assertEqual(gen.get_current_token("r"), 2)
        gen.advance("r", 5)
        # Nothing local is unfinished below 5 and r is at 5: an idle local
        # writer follows the linear token.
        self.assertEqual(gen.get_linear_token(), 5)
        self.assertEqual(gen.get_positions(), {"a": 5, "r": 5})

    def test_two_instances_agree_after_exchanging_positions(self):
        one = StreamIdGenerator("s", {"a": 0, "b": 0}, ["a"])
        two = StreamIdGenerator("s", {"a": 0, "b": 0}, ["b"])
        one.reserved("a", [1, 2, 3], pending=False)
        two.reserved("b", [4], pending=False)
        one.complete_many("a", [1, 2, 3])
        two.complete("b", 4)
        for _ in range(2):
            two.advance("a", one.get_current_token("a"))
            one.advance("b", two.get_current_token("b"))
        self.assertEqual(one.get_linear_token(), 4)
        self.assertEqual(two.get_linear_token(), 4)

    def test_pending_reservation_freezes_positions(self):
        gen = StreamIdGenerator("s", {"a": 0, "r": 0}, ["a"])
        gen.begin_reservation()  # nextval under way: it will return 1
        gen.advance("r", 2)      # meanwhile r took 2 and completed it
        self.assertEqual(gen.get_linear_token(), 0)
        gen.reserved("a", [1])
        self.assertEqual(gen.get_linear_token(), 0)
        self.assertEqual(gen.get_current_token("a"), 0)
        gen.complete("a", 1)
        self.assertEqual(gen.get_linear_token(), 2)

    def test_misuse_is_refused(self):
        gen = StreamIdGenerator("s", {"a": 5, "r": 0}, ["a"])
        self.assertRaises(ValueError, gen.reserved, "a", [5], False)
        self.assertRaises(ValueError, gen.complete, "a", 9)
        self.assertRaises(ValueError, gen.advance, "a", 9)
        self.assertRaises(UnknownWriter, gen.advance, "x", 9)
        self.assertRaises(UnknownWriter, gen.get_current_token, "x")
        gen.reserved("a", [6], pending=False)
        self.assertRaises(ValueError, gen.reserved, "a", [6], False)


def machine_for(LOCAL, REMOTE):
    class GeneratorMachine(RuleBasedStateMachine):
        """Random interleavings checked against a direct model of the definitions."""

        def __init__(self):
            super().__init__()
            self.counter = 0  # the shared sequence
            self.start = {w: 0 for w in LOCAL + REMOTE}
            self.gen = StreamIdGenerator("s", dict(self.start), LOCAL)
            self.reserved = {w: set() for w in LOCAL}
            self.done = {w: set() for w in LOCAL}
            self.remote = {w: 0 for w in REMOTE}
            self.advanced = set()
            self.pending = []  # (writer, id): nextval returned, not yet registered
            self.last = (0, dict(self.gen.get_positions()))
            self.idle_floor = {w: 0 for w in LOCAL}

        # ----------------------------------------------------------- model
        def known(self):
            k = set(self.start.values()) | self.advanced
            for w in LOCAL:
                k |= self.reserved[w]
            return k

        def unfinished(self, writers=LOCAL):
            out = set()
            for w in writers:
                out |= self.reserved[w] - self.done[w]
            for w, i in self.pending:
                if w in writers:
                    out.add(i)
            return out

        def model_linear(self):
            floor = min(self.unfinished(), default=None)
            bound = min(self.remote.values(), default=float("inf"))
            return max(x for x in self.known()
                       if (floor is None or x < floor) and x <= bound)

        def model_current(self, writer):
            linear = self.model_linear()
            floor = min(self.unfinished([writer]), default=None)
            own = {self.start[writer], linear, self.idle_floor[writer]} | self.reserved[writer]
            return max(x for x in own if floor is None or x < floor)

        def note_idle(self):
            """An idle writer (nothing in flight, no reservation under way)
            is at least at the largest finished ID: its next ID comes from
            the sequence, above every known one."""
            if self.pending:
                return
            finished = set(self.start.values()) | self.advanced
            for w in LOCAL:
                finished |= self.done[w]
            for w in LOCAL:
                if not self.unfinished([w]):
                    self.idle_floor[w] = max(finished)

        # ----------------------------------------------------------- rules
        @rule(writer=st.sampled_from(LOCAL), n=st.integers(1, 4))
        def reserve(self, writer, n):
            ids = list(range(self.counter + 1, self.counter + n + 1))
            self.counter += n
            self.gen.reserved(writer, ids, pending=False)
            self.reserved[writer].update(ids)

        @rule(writer=st.sampled_from(LOCAL), data=st.data())
        def complete(self, writer, data):
            todo = sorted(self.reserved[writer] - self.done[writer])
            if not todo:
                return
            stream_id = data.draw(st.sampled_from(todo))
            self.gen.complete(writer, stream_id)
            self.done[writer].add(stream_id)

        @rule(writer=st.sampled_from(LOCAL), data=st.data())
        def rollback_many(self, writer, data):
            todo = sorted(self.reserved[writer] - self.done[writer])
            if not todo:
                return
            ids = data.draw(st.lists(st.sampled_from(todo), min_size=1, unique=True))
            self.gen.complete_many(writer, ids)
            self.done[writer].update(ids)

        @precondition(lambda self: bool(REMOTE))
        @rule(writer=st.sampled_from(REMOTE or ["-"]), taken=st.integers(0, 3), data=st.data())
        def advance(self, writer, taken, data):
            # The remote writer takes IDs from the shared sequence, finishes some.
            self.counter += taken
            token = data.draw(st.integers(self.remote[writer], self.counter))
            self.gen.advance(writer, token)
            self.remote[writer] = max(self.remote[writer], token)
            self.advanced.add(token)

        @precondition(lambda self: len(self.pending) < 3)
        @rule(writer=st.sampled_from(LOCAL))
        def begin_pending(self, writer):
            self.counter += 1
            self.gen.begin_reservation()
            self.pending.append((writer, self.counter))

        @precondition(lambda self: self.pending)
        @rule(data=st.data())
        def finish_pending(self, data):
            writer, stream_id = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
            self.gen.reserved(writer, [stream_id])
            self.reserved[writer].add(stream_id)

        @rule(writer=st.sampled_from(LOCAL), data=st.data())
        def prospective(self, writer, data):
            """What a writing transaction persists in ``stream_positions``
            for the IDs it is about to complete: never at or above an ID of
            the writer still unfinished afterwards (a reservation under way
            included), never above the writer's token once they are done."""
            todo = sorted(self.reserved[writer] - self.done[writer])
            if not todo:
                return
            ids = data.draw(st.lists(st.sampled_from(todo), min_size=1, unique=True))
            token = self.gen.prospective_token(writer, ids)
            after = self.unfinished([writer]) - set(ids)
            assert all(token < i for i in after), (token, after)
            self.done[writer].update(ids)
            try:
                assert token <= self.model_current(writer), (token, self.model_current(writer))
            finally:
                self.done[writer].difference_update(ids)

        # ----------------------------------------------------------- checks
        @invariant()
        def matches_model(self):
            self.note_idle()
            gen = self.gen
            linear = gen.get_linear_token()
            positions = gen.get_positions()
            prev_linear, prev_positions = self.last
            assert linear >= prev_linear, (linear, prev_linear)
            for w, p in positions.items():
                assert p >= prev_positions[w], (w, p, prev_positions[w])
            self.last = (linear, positions)
            unfinished = self.unfinished()
            assert all(linear < i for i in unfinished), (linear, unfinished)
            for w in LOCAL:
                own = self.unfinished([w])
                assert all(positions[w] < i for i in own), (w, positions[w], own)
            if self.pending:
                # A reservation under way freezes positions: never ahead.
                assert linear <= self.model_linear()
                for w in LOCAL:
                    assert positions[w] <= self.model_current(w)
                return
            assert linear == self.model_linear(), (linear, self.model_linear())
            for w in LOCAL:
                assert positions[w] == self.model_current(w), (w, positions[w],
                                                               self.model_current(w))
            for w in REMOTE:
                assert positions[w] == self.remote[w]
            assert gen.in_flight() == len(unfinished)

    return GeneratorMachine


def cluster_machine(INSTANCES):
    """Several instances, each with its own generator over its local writers,
    all taking IDs from one shared sequence; a writer's token reaches the
    other instances when its instance announces it (any delay, in order).

    What is checked, on every instance, after every step: the linear token
    never passes an unfinished ID of any writer (remote reservations
    included, which that instance cannot see), nor a writer's token one of
    its own.  Once every writer is idle and the instances have exchanged
    positions (the idle-advance step), every linear token and every
    writer's token is the highest finished ID: idle writers do not hold
    each other in place."""
    OWNER = {w: inst for inst, writers in INSTANCES.items() for w in writers}
    WRITERS = sorted(OWNER)

    class ClusterMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.counter = 0  # the shared sequence
            self.gens = {inst: StreamIdGenerator("s", {w: 0 for w in WRITERS}, writers)
                         for inst, writers in INSTANCES.items()}
            self.reserved = {w: set() for w in WRITERS}
            self.done = {w: set() for w in WRITERS}
            self.pending = {inst: [] for inst in INSTANCES}  # (writer, id) of a nextval under way
            self.last = {inst: (0, dict(g.get_positions())) for inst, g in self.gens.items()}

        def unfinished(self, writers=WRITERS):
            out = set()
            for w in writers:
                out |= self.reserved[w] - self.done[w]
            for entries in self.pending.values():
                out |= {i for w, i in entries if w in writers}
            return out

        def token(self, writer):
            return self.gens[OWNER[writer]].get_current_token(writer)

        @rule(writer=st.sampled_from(WRITERS), n=st.integers(1, 3))
        def reserve(self, writer, n):
            ids = list(range(self.counter + 1, self.counter + n + 1))
            self.counter += n
            self.gens[OWNER[writer]].reserved(writer, ids, pending=False)
            self.reserved[writer].update(ids)

        @precondition(lambda self: sum(map(len, self.pending.values())) < 3)
        @rule(writer=st.sampled_from(WRITERS))
        def begin_pending(self, writer):
            self.counter += 1
            inst = OWNER[writer]
            self.gens[inst].begin_reservation()
            self.pending[inst].append((writer, self.counter))

        @precondition(lambda self: any(self.pending.values()))
        @rule(data=st.data())
        def finish_pending(self, data):
            inst = data.draw(st.sampled_from(sorted(i for i, p in self.pending.items() if p)))
            writer, stream_id = self.pending[inst].pop(0)
            self.gens[inst].reserved(writer, [stream_id])
            self.reserved[writer].add(stream_id)

        @rule(writer=st.sampled_from(WRITERS), data=st.data())
        def complete(self, writer, data):
            todo = sorted(self.reserved[writer] - self.done[writer])
            if not todo:
                return
            stream_id = data.draw(st.sampled_from(todo))
            self.gens[OWNER[writer]].complete(writer, stream_id)
            self.done[writer].add(stream_id)

        @rule(writer=st.sampled_from(WRITERS), to=st.sampled_from(sorted(INSTANCES)))
        def announce(self, writer, to):
            if OWNER[writer] != to:
                self.gens[to].advance(writer, self.token(writer))

        @rule(data=st.data())
        def idle_everywhere(self, data):
            """Every writer finishes what it has in flight (in any order) and
            writes nothing more: after a few rounds of announcements every
            instance is at the highest finished ID."""
            for inst, entries in self.pending.items():
                while entries:
                    writer, stream_id = entries.pop(0)
                    self.gens[inst].reserved(writer, [stream_id])
                    self.reserved[writer].add(stream_id)
            todo = sorted((w, i) for w in WRITERS for i in self.reserved[w] - self.done[w])
            for writer, stream_id in data.draw(st.permutations(todo)):
                self.gens[OWNER[writer]].complete(writer, stream_id)
                self.done[writer].add(stream_id)
            for _ in range(len(INSTANCES) + 1):
                for writer in WRITERS:
                    for inst in INSTANCES:
                        if OWNER[writer] != inst:
                            self.gens[inst].advance(writer, self.token(writer))
            top = max(max(ids, default=0) for ids in self.done.values())
            for inst, gen in self.gens.items():
                assert gen.get_linear_token() == top, (inst, gen.get_linear_token(), top)
                assert gen.get_positions() == {w: top for w in WRITERS}, (
                    inst, gen.get_positions(), top)

        @invariant()
        def never_past_unfinished(self):
            unfinished = self.unfinished()
            for inst, gen in self.gens.items():
                linear = gen.get_linear_token()
                positions = gen.get_positions()
                prev_linear, prev_positions = self.last[inst]
                assert linear >= prev_linear, (inst, linear, prev_linear)
                for w, p in positions.items():
                    assert p >= prev_positions[w], (inst, w, p, prev_positions[w])
                self.last[inst] = (linear, positions)
                assert all(linear < i for i in unfinished), (inst, linear, unfinished)
                for w in WRITERS:
                    own = self.unfinished([w])
                    assert all(positions[w] < i for i in own), (inst, w, positions[w], own)

    return ClusterMachine


class GeneratorStateTests(SynchronousTestCase):
    def check(self, local, remote):
        machine = settings(max_examples=150, stateful_step_count=60, deadline=None)(
            machine_for(local, remote)
        )
        machine.TestCase().runTest()

    def test_several_local_and_remote_writers(self):
        self.check(["w1", "w2", "w3"], ["r1", "r2"])

    def test_one_writer_alone(self):
        self.check(["w1"], [])

    def check_cluster(self, instances):
        machine = settings(max_examples=150, stateful_step_count=60, deadline=None)(
            cluster_machine(instances)
        )
        machine.TestCase().runTest()

    def test_three_instances_two_of_them_idle_at_times(self):
        """Master, worker1, worker2 writing one stream (issue: two idle
        writers held each other, and so the linear token, in place)."""
        self.check_cluster({"master": ["master"], "worker1": ["worker1"],
                            "worker2": ["worker2"]})

    def test_instances_with_several_local_writers(self):
        self.check_cluster({"one": ["a", "b"], "two": ["c"], "three": ["d"]})


class ReloadWritersTests(SynchronousTestCase):
    """Another instance's writer joins or leaves a running stream (a reload)."""

    def test_a_joining_writer_holds_the_linear_token_until_it_advances(self):
        gen = StreamIdGenerator("s", {"w1": 5, "r1": 5}, ["w1"])
        with self.assertRaises(UnknownWriter):
            gen.advance("r2", 7)
        gen.add_remote("r2", 5)
        gen.advance("r1", 10)
        self.assertEqual(gen.get_linear_token(), 5)  # r2 is still at 5
        gen.advance("r2", 12)
        self.assertEqual(gen.get_current_token("r2"), 12)
        self.assertEqual(gen.get_linear_token(), 10)

    def test_a_leaving_writer_no_longer_holds_it(self):
        gen = StreamIdGenerator("s", {"r1": 3, "r2": 3}, [])
        gen.advance("r1", 9)
        self.assertEqual(gen.get_linear_token(), 3)
        gen.remove_remote("r2")
        self.assertEqual(gen.get_linear_token(), 9)
        self.assertEqual(gen.writers, ["r1"])

    def test_a_stream_written_here_alone_takes_no_other_writer(self):
        gen = StreamIdGenerator("s", {"w1": 5}, ["w1"])
        with self.assertRaises(ValueError):
            gen.add_remote("r1", 5)
