"""Group commit's queue (replicator.streams.group) without a database.

Transactions are played by hand: ``run`` records each started group and
returns a Deferred the test fires, after calling ``take`` as the database
thread would.  A hypothesis state machine checks that every write is
answered exactly once, that no group exceeds the bound, and that no write
is left queued without a transaction on its way.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from twisted.internet import defer
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from replicator.streams.group import StatementFailed, Write, WriteGroups


class Harness:
    def __init__(self, max_facts=4, max_rows=10_000):
        self.started = []  # (group, deferred) not fired yet
        self.answers = {}  # id(write) -> list of outcomes
        self.groups = WriteGroups(self._run, self._finish, max_facts, max_rows)
        self.next_id = 1

    def _run(self, group):
        d = defer.Deferred()
        self.started.append((group, d))
        return d

    def _finish(self, group, outcome):
        if isinstance(outcome, Failure) and outcome.check(StatementFailed) \
                and len(group.writes) > 1:
            for w in group.writes:
                self.groups.retry_alone(w)
            return
        for w in group.writes:
            if isinstance(outcome, Failure):
                w.deferred.errback(outcome)
            else:
                w.deferred.callback(w.ids)

    def submit(self, n_facts=1, rows=1):
        w = Write([[["r"]] * rows] * n_facts, None, [], 0.0)
        self.answers[id(w)] = []
        d = self.groups.submit(w)
        d.addBoth(lambda r: self.answers[id(w)].append(r))
        return w

    def run_one(self, fail=None):
        """Take and finish the oldest started transaction: ``fail`` is None
        (commit), "statement" (fails before commit), "commit", or
        "unrun" (never got a connection)."""
        group, d = self.started.pop(0)
        if fail == "unrun":
            d.errback(RuntimeError("no connection"))
            return group
        writes = self.groups.take(group)
        for w in writes:
            w.ids = list(range(self.next_id, self.next_id + len(w.facts)))
            self.next_id += len(w.facts)
        if fail == "statement":
            d.errback(StatementFailed(Failure(ValueError("bad row"))))
        elif fail == "commit":
            d.errback(ConnectionError("lost while committing"))
        else:
            d.callback(None)
        return group


class WriteGroupTests(SynchronousTestCase):
    def test_writes_waiting_go_into_one_transaction(self):
        h = Harness(max_facts=100)
        writes = [h.submit() for _ in range(5)]
        self.assertEqual(len(h.started), 1)
        group = h.run_one()
        self.assertEqual(group.writes, writes)
        self.assertEqual([h.answers[id(w)] for w in writes], [[[i]] for i in range(1, 6)])

    def test_bound_starts_more_transactions(self):
        h = Harness(max_facts=4)
        for _ in range(10):
            h.submit()
        self.assertEqual(len(h.started), 3)
        self.assertEqual([len(h.run_one().writes) for _ in range(3)], [4, 4, 2])
        self.assertEqual(h.groups.queued, 0)

    def test_a_bad_write_is_retried_alone(self):
        h = Harness()
        writes = [h.submit() for _ in range(3)]
        h.run_one(fail="statement")
        self.assertEqual(len(h.started), 3)  # one transaction per write
        h.run_one()
        h.run_one(fail="statement")
        h.run_one()
        self.assertEqual(len(h.answers[id(writes[0])]), 1)
        self.assertIsInstance(h.answers[id(writes[1])][0], Failure)
        self.assertEqual(h.answers[id(writes[2])], [[6]])

    def test_a_failed_commit_answers_every_write_without_retry(self):
        h = Harness()
        writes = [h.submit() for _ in range(3)]
        h.run_one(fail="commit")
        self.assertEqual(h.started, [])
        for w in writes:
            (answer,) = h.answers[id(w)]
            self.assertTrue(answer.check(ConnectionError))
        for w in writes:
            h.answers[id(w)][0].trap(ConnectionError)

    def test_a_transaction_that_never_ran_fails_its_waiting_writes(self):
        h = Harness()
        writes = [h.submit() for _ in range(3)]
        h.run_one(fail="unrun")
        for w in writes:
            (answer,) = h.answers[id(w)]
            answer.trap(RuntimeError)
        self.assertEqual(h.groups.queued, 0)
        h.submit()
        self.assertEqual(len(h.started), 1)


class GroupMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.h = Harness(max_facts=5, max_rows=8)
        self.writes = []

    @rule(n_facts=st.integers(1, 3), rows=st.integers(0, 4))
    def submit(self, n_facts, rows):
        self.writes.append(self.h.submit(n_facts, rows))

    @rule(fail=st.sampled_from([None, None, None, "statement", "commit", "unrun"]))
    def run(self, fail):
        if not self.h.started:
            return
        group = self.h.run_one(fail)
        if fail != "unrun" and len(group.writes) > 1:
            facts = sum(len(w.facts) for w in group.writes)
            rows = sum(w.rows for w in group.writes)
            assert facts <= 5 and rows <= 8, (facts, rows)

    @invariant()
    def answered_at_most_once(self):
        for w in self.writes:
            assert len(self.h.answers[id(w)]) <= 1

    @invariant()
    def nothing_stranded(self):
        # A write queued or in a started group is on its way to an answer.
        if self.h.groups.queued:
            assert any(not g.taken for g, _ in self.h.started)

    def teardown(self):
        for _ in range(1000):
            if not self.h.started:
                break
            self.h.run_one()
        for w in self.writes:
            answers = self.h.answers[id(w)]
            assert len(answers) == 1, answers
            if isinstance(answers[0], Failure):
                answers[0].trap(StatementFailed, ConnectionError, RuntimeError)


class GroupMachineTests(SynchronousTestCase):
    def test_every_write_answered_once_within_bounds(self):
        machine = settings(max_examples=150, stateful_step_count=40, deadline=None)(
            GroupMachine)
        machine.TestCase().runTest()
