"""A reader checks a writer's POSITION against the table, and an audit
compares what it handed on with the table (in memory: a dict is the table).

Each test here failed on the reader that took a POSITION on its word: a
forged ``POSITION s w T T+2`` moved it over committed facts, and a fact of
the range arriving later was dropped as "already handled".
"""

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from replicator.replication.core.audit import Auditor, DeliveredLog, difference
from replicator.replication.core.reader import Reader
from replicator.streams.known import KnownIds
from replicator.streams.tally import tally_of
from tests.fakes import FakeConnection

from .test_reader import updates_since

STREAM, WRITER = "s", "w"


def _now(d):
    """The result of a Deferred that has fired (raised if a failure)."""
    results = []
    d.addBoth(results.append)
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]


class Table:
    """The writer's committed facts (token -> rows) and a trim boundary;
    answers what ``Stream`` answers the reader and the audit."""

    def __init__(self):
        self.facts = {}
        self.boundary = 0
        self.probes = []
        self.name = STREAM
        self.keeps_facts = True
        self.reads = []  # (method, IDs) of each read of facts' rows

    def source(self, writer, since, until, limit):
        return updates_since(self.facts, since, until, limit)

    def probe(self, writer, since, until):
        self.probes.append((since, until))
        found = [t for t in self.facts if since < t <= until and t > self.boundary]
        return defer.succeed(min(found) if found else None)

    def _in(self, since, until):
        return sorted((t, len(r)) for t, r in self.facts.items()
                      if since < t <= until and t > self.boundary)

    def tally(self, writer, since, until):
        return defer.succeed((tally_of(self._in(since, until)), self.boundary))

    def fact_sizes(self, writer, since, until):
        return defer.succeed(self._in(since, until))

    def fact_page(self, writer, since, until, limit):
        self.reads.append(("fact_page", (until,)))
        return defer.succeed(updates_since(self.facts, since, until, limit))

    def facts_at(self, writer, tokens):
        """Like ``Stream.facts_at``: one read for every ID (built on
        ``fact_page``, so that a test's replacement of it fails it too)."""
        self.reads.append(("facts_at", tuple(tokens)))
        reads, self.reads = self.reads, []
        found = {}
        try:
            for token in tokens:
                facts, _, _ = _now(self.fact_page(writer, token - 1, token, 1))
                if facts and facts[0][0] == token:
                    found[token] = facts[0][1]
        except Exception as e:
            return defer.fail(e)
        finally:
            self.reads = reads
        return defer.succeed(found)


class Harness:
    def __init__(self, position=0, known=None):
        self.table = Table()
        self.clock = Clock()
        self.got = []
        self.mismatches = []

        def deliver(token, rows):
            self.got.append(token)

        self.reader = Reader(STREAM, WRITER, position, self.table.source, deliver, self.clock,
                             probe=self.table.probe, known=known, audit=True,
                             on_mismatch=self.mismatches.append)
        self.conn = FakeConnection("c")
        self.reader.position_line(self.conn, position, position)

    def commit(self, token, rows=1):
        self.table.facts[token] = [["r", token, i] for i in range(rows)]

    def rdata(self, token):
        rows = self.table.facts[token]
        for row in rows[:-1]:
            self.reader.rdata(self.conn, None, row)
        self.reader.rdata(self.conn, token, rows[-1])

    def position(self, prev, new):
        self.reader.position_line(self.conn, prev, new)


class VerifiedPositionTests(SynchronousTestCase):
    def test_a_forged_position_over_committed_facts_is_caught_up(self):
        h = Harness()
        for t in (1, 2, 3):
            h.commit(t)
        h.rdata(1)
        h.position(1, 3)  # forged: facts 2 and 3 are in the table
        self.assertEqual(h.got, [1, 2, 3])
        self.assertEqual(h.reader.position, 3)
        self.assertEqual(h.mismatches, [])

    def test_a_fact_arriving_in_a_range_passed_empty_stops_the_reader(self):
        h = Harness()
        h.commit(1)
        h.rdata(1)
        h.position(1, 3)  # an impostor's, while fact 2 is in flight
        self.assertEqual(h.reader.position, 3)
        h.commit(2)
        h.rdata(2)
        self.assertEqual(h.got, [1])
        self.assertEqual(len(h.mismatches), 1)
        found = h.mismatches[0]
        self.assertEqual((found.stream, found.writer, found.since, found.upto, list(found.missing)),
                         (STREAM, WRITER, 1, 3, [2]))
        self.assertTrue(h.reader.stopped)
        self.assertIn("1 fact in the table but never delivered (2)", found.describe())

    def test_a_duplicate_of_a_delivered_fact_is_still_only_dropped(self):
        h = Harness()
        h.commit(1)
        h.rdata(1)
        h.rdata(1)
        h.position(1, 2)  # a hole (rolled back)
        h.position(2, 2)
        self.assertEqual((h.got, h.mismatches, h.reader.stopped), ([1], [], False))

    def test_ids_known_to_be_other_writers_are_not_asked_about(self):
        known = KnownIds()
        known.note([2, 3])
        h = Harness(known=known)
        h.commit(1)
        h.rdata(1)
        h.position(1, 3)
        self.assertEqual(h.table.probes, [])
        h.position(3, 4)  # 4 is nobody's we know of: asked
        self.assertEqual(h.table.probes, [(3, 4)])
        self.assertEqual(h.reader.position, 4)

    def test_delivered_facts_become_known(self):
        known = KnownIds()
        h = Harness(known=known)
        h.commit(1)
        h.commit(2)
        h.position(0, 2)  # caught up
        self.assertTrue(known.covers(0, 2))
        self.assertFalse(known.covers(0, 3))

    def test_known_ids_are_bounded(self):
        known = KnownIds(capacity=3)
        known.note(range(1, 11))
        self.assertEqual(len(known), 3)
        self.assertTrue(known.covers(7, 10))
        self.assertFalse(known.covers(6, 10))


class AuditTests(SynchronousTestCase):
    def make(self, h, **kw):
        auditor = Auditor(lambda: {(STREAM, WRITER): (h.table, h.reader)}, h.mismatches.append,
                          h.clock, interval=1.0, first_check=1.0, recheck=10.0, **kw)
        auditor.startService()
        self.addCleanup(auditor.stopService)
        return auditor

    def test_equal_deliveries_find_nothing_and_are_forgotten(self):
        h = Harness()
        auditor = self.make(h)
        for t in (1, 2, 4):
            h.commit(t, rows=t)
            h.rdata(t)
        h.position(4, 5)
        for _ in range(15):
            h.clock.advance(1)
        self.assertEqual(h.mismatches, [])
        self.assertEqual(auditor.held, 0)

    def test_a_planted_skip_is_found_within_seconds(self):
        h = Harness()
        self.make(h)
        h.commit(1)
        h.rdata(1)
        h.commit(2)
        # The defect: fact 2 reaches no consumer, yet the position moves on.
        h.reader.position = 2
        h.reader._advance(2)
        h.commit(3)
        h.rdata(3)
        h.clock.advance(1)  # sealed
        self.assertEqual(h.mismatches, [])
        h.clock.advance(1)  # checked
        self.assertEqual(len(h.mismatches), 1)
        self.assertEqual((h.mismatches[0].since, h.mismatches[0].upto,
                          list(h.mismatches[0].missing)), (0, 3, [2]))

    def test_a_row_committed_late_below_the_position_is_found_at_the_second_check(self):
        h = Harness()
        self.make(h)
        h.commit(1)
        h.rdata(1)
        h.position(1, 3)  # 2 and 3 empty when asked
        h.clock.pump([1, 1])  # sealed and checked once: equal
        self.assertEqual(h.mismatches, [])
        h.commit(2, rows=2)  # a plain-SQL insert whose transaction commits late
        for _ in range(10):
            h.clock.advance(1)
        self.assertEqual(len(h.mismatches), 1)
        self.assertEqual(list(h.mismatches[0].missing), [2])

    def test_facts_synapse_deleted_from_its_own_table_are_not_a_difference(self):
        """Synapse's tables keep only each user's newest presence and receipt
        (an update deletes the older row) and prune old cache invalidations:
        a delivered fact gone from such a table, or a row of it, is no loss."""
        h = Harness()
        h.table.keeps_facts = False
        self.make(h)
        for t in (1, 2, 3):
            h.commit(t, rows=2)
            h.rdata(t)
        del h.table.facts[2]  # the user's newer presence replaced it
        h.table.facts[3] = h.table.facts[3][:1]
        h.position(3, 4)
        for _ in range(15):
            h.clock.advance(1)
        self.assertEqual(h.mismatches, [])

    def test_a_fact_of_synapse_never_delivered_is_still_a_difference(self):
        h = Harness()
        h.table.keeps_facts = False
        self.make(h)
        h.commit(1)
        h.rdata(1)
        h.commit(2, rows=2)
        h.reader.position = 2  # the defect: fact 2 reaches no consumer
        h.reader._advance(2)
        h.commit(3)
        h.rdata(3)
        h.clock.pump([1, 1])
        self.assertEqual(len(h.mismatches), 1)
        self.assertEqual((list(h.mismatches[0].missing), list(h.mismatches[0].extra)),
                         ([2], []))

    def test_extra_rows_of_a_fact_are_a_difference(self):
        h = Harness()
        self.make(h)
        h.commit(1, rows=2)
        h.reader.rdata(h.conn, None, ["late", "batch", "line"])  # joined to fact 1
        h.rdata(1)
        h.clock.pump([1, 1])
        self.assertEqual(len(h.mismatches), 1)
        self.assertEqual(list(h.mismatches[0].resized), [1])

    def test_rows_replaced_by_others_of_the_same_count_are_a_difference(self):
        """A forged RDATA with the real ID and row count (a publisher without
        a key guessing an ID in flight): the sample compares contents."""
        h = Harness()
        self.make(h)
        h.commit(1)
        h.rdata(1)
        h.reader.rdata(h.conn, 2, ["FAKE", ["@evil:2"], 1])  # before the real fact 2
        h.commit(2)
        h.rdata(2)  # the real one: at the position, dropped as seen
        h.clock.pump([1, 1])
        self.assertEqual(len(h.mismatches), 1)
        self.assertEqual(list(h.mismatches[0].resized), [2])

    def test_the_sample_is_read_from_the_table_in_one_read(self):
        """A window's sampled facts are read back together: one read of the
        table for the sample, not one per fact.  (Each was a trip to a pool
        thread and four statements: at 40 facts/s, 16 reads per window of
        80 facts, and as many again at its second check.)"""
        from replicator.replication.core.audit import SAMPLE

        h = Harness()
        self.make(h)
        for t in range(1, 41):
            h.commit(t)
            h.rdata(t)
        h.clock.pump([1, 1])  # sealed and checked once
        self.assertEqual(h.mismatches, [])
        self.assertEqual(len(h.table.reads), 1)
        method, tokens = h.table.reads[0]
        self.assertEqual((method, len(tokens)), ("facts_at", SAMPLE))
        self.assertEqual(list(tokens), sorted(tokens))

    def test_a_sampled_fact_replaced_is_found_by_the_read_of_the_sample(self):
        h = Harness()
        self.make(h)
        for t in range(1, 5):
            h.commit(t)
            h.rdata(t)
        h.table.facts[3] = [["other", 3, 0]]  # same ID, same count, other rows
        h.clock.pump([1, 1])
        self.assertEqual(len(h.mismatches), 1)
        self.assertEqual(list(h.mismatches[0].resized), [3])

    def test_the_sample_is_bounded_and_drawn_from_the_whole_window(self):
        from replicator.replication.core.audit import SAMPLE

        log = DeliveredLog(0)
        for t in range(1, 2001):
            log.add(t, [["r", t]])
        window = log.seal(2000)
        self.assertEqual(len(window.sample), SAMPLE)
        self.assertGreater(max(window.sample), 1000)  # not only the first ones

    def test_the_delivered_tally_is_the_tally_of_the_facts_above(self):
        from array import array

        from hypothesis import given, settings
        from hypothesis import strategies as st

        from replicator.replication.core.audit import Window, delivered_tally

        @settings(max_examples=200, deadline=None)
        @given(st.lists(st.tuples(st.integers(1, 2 ** 62), st.integers(0, 50)), max_size=40),
               st.integers(0, 2 ** 62))
        def check(facts, above):
            window = Window(0, 2 ** 62, array("q", [i for i, _ in facts]),
                            array("q", [n for _, n in facts]), {})
            self.assertEqual(delivered_tally(window, above),
                             tally_of([(i, n) for i, n in facts if i > above]))
            self.assertEqual(delivered_tally(window, 0), tally_of(facts))

        check()

    def test_facts_at_or_below_the_trim_boundary_are_not_compared(self):
        h = Harness()
        self.make(h)
        for t in (1, 2, 3):
            h.commit(t)
            h.rdata(t)
        h.table.boundary = 2  # retention took 1 and 2
        del h.table.facts[1], h.table.facts[2]
        for _ in range(15):
            h.clock.advance(1)
        self.assertEqual(h.mismatches, [])

    def test_a_sample_trimmed_while_it_is_read_is_not_compared_and_blocks_nothing(self):
        """Retention deleting a sampled fact between the tally and its read
        (a stream keeping seconds of facts): that fact is not compared, the
        window's check is done (not retried for ever, holding every other
        window behind it)."""
        from replicator.streams.trimmed import FactsTrimmed

        h = Harness()
        auditor = self.make(h)
        for t in (1, 2, 3):
            h.commit(t)
            h.rdata(t)

        def trimmed(writer, since, until, limit):
            return defer.fail(FactsTrimmed(STREAM, writer, since, until))
        h.table.fact_page = trimmed
        h.clock.pump([1, 1])
        self.assertEqual(h.mismatches, [])
        self.assertEqual(self.flushLoggedErrors(), [])
        self.assertEqual(len(auditor._due), 0)  # checked once, waiting for the second

    def test_held_facts_are_bounded_by_an_earlier_second_check(self):
        h = Harness()
        auditor = self.make(h, max_held=2)
        for t in (1, 2, 3):
            h.commit(t)
            h.rdata(t)
        h.clock.pump([1, 1])  # first check passes; 3 facts held > 2: second check at once
        self.assertEqual(auditor.held, 0)

    def test_a_failed_check_is_tried_again(self):
        h = Harness()
        self.make(h)
        h.commit(1)
        h.rdata(1)
        calls = []
        tally = h.table.tally

        def failing(*args):
            calls.append(args)
            if len(calls) == 1:
                return defer.fail(RuntimeError("database down"))
            return tally(*args)
        h.table.tally = failing
        h.commit(2)
        h.reader.position = 2  # planted skip of fact 2
        h.clock.pump([1, 1])
        self.assertEqual(h.mismatches, [])
        h.clock.advance(1)
        self.assertEqual(len(h.mismatches), 1)
        self.flushLoggedErrors()

    def test_a_rewind_starts_a_new_window(self):
        log = DeliveredLog(0)
        log.add(1, [["r"]])
        log.restart(0)
        self.assertIsNone(log.seal(0))
        log.add(1, [["r"]])
        window = log.seal(1)
        self.assertEqual((window.lo, window.hi, list(window.ids)), (0, 1, [1]))

    def test_difference_names_each_kind(self):
        log = DeliveredLog(0)
        for t, n in ((1, 1), (2, 2), (4, 1)):
            log.add(t, [["r", i] for i in range(n)])
        found = difference(STREAM, WRITER, 0, 5, log.seal(5), [(1, 1), (2, 3), (3, 1)])
        self.assertEqual((list(found.missing), list(found.extra), list(found.resized)),
                         ([3], [4], [2]))
        self.assertEqual(found.first, 2)



class MismatchReportTests(SynchronousTestCase):
    def test_a_mismatch_is_logged_by_the_audit_once_and_fails_health(self):
        from twisted.logger import globalLogPublisher

        from replicator.replication.core.audit import Mismatch
        from replicator.replication.core.gaps import TrimGaps

        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        gaps = TrimGaps("/etc/replicator/w.yaml")
        found = Mismatch(STREAM, WRITER, 10, 20, [13], [], [], (1, 0, 0), "audit")

        class FileConsumer:
            path = "/var/lib/replicator/facts.jsonl"
        gaps.report_mismatch(found, [FileConsumer()])
        gaps.report_mismatch(found, [FileConsumer()])
        errors = [e for e in events if e.get("log_namespace") == "replicator.audit"]
        self.assertEqual(len(errors), 1)
        self.assertIn("`replicator rewind -c /etc/replicator/w.yaml "
                      "/var/lib/replicator/facts.jsonl --stream s --to 13`", errors[0]["text"])
        [finding] = gaps.findings()
        self.assertEqual((finding.kind, finding.stream, finding.writer, finding.fails_health),
                         ("audit", STREAM, WRITER, True))
        self.assertTrue(gaps.stopped(STREAM))


class KeptFindingTests(SynchronousTestCase):
    """A finding outlives a restart (in the database) until the operator's
    rewind puts every consumer below it."""

    def test_a_restart_stops_the_stream_again_until_the_consumers_are_rewound(self):
        from replicator.consumers import MemoryConsumer
        from replicator.replication.core.audit import Mismatch
        from tests.harness import Harness
        from tests.stream_sets import HANDLER_STREAMS as STREAMS

        h = Harness(STREAMS, self.addCleanup)
        key = ("caches", "worker1")
        first = h.instance("master", [MemoryConsumer(positions={key: 50})])
        first.handler._mismatch(Mismatch("caches", "worker1", 10, 50, [13], [], [], (1, 0, 0),
                                         "audit"))
        h.settle()
        self.flushLoggedErrors()
        # A restart (a new handler on the same database): the consumer is
        # still at 50, past the fact: stopped again, said again.
        again = h.instance("master", [MemoryConsumer(positions={key: 50})])
        found = again.handler.gaps.mismatch("caches", "worker1")
        self.assertIsNotNone(found)
        self.assertEqual(list(found.missing), [13])
        self.assertTrue(again.handler.gaps.stopped("caches"))
        self.assertTrue(all(r.stopped for (s, _), r in again.handler._readers.items()
                            if s == "caches"))
        [finding] = [f for f in again.handler.gaps.findings() if f.kind == "audit"]
        self.assertIn("before this instance restarted", finding.text)
        # The operator rewound the consumer below 13: resolved, dropped.
        rewound = h.instance("master", [MemoryConsumer(positions={key: 12})])
        self.assertIsNone(rewound.handler.gaps.mismatch("caches", "worker1"))
        self.assertFalse(rewound.handler.gaps.stopped("caches"))
        after = h.instance("master", [MemoryConsumer(positions={key: 60})])
        self.assertIsNone(after.handler.gaps.mismatch("caches", "worker1"))


class AuditTableNameTests(SynchronousTestCase):
    def test_a_stream_cannot_take_the_table_of_the_findings(self):
        from replicator.config import ConfigError
        from replicator.config.streams import parse_stream

        with self.assertRaises(ConfigError) as caught:
            parse_stream({"name": "s", "table": "Stream_Audit", "columns": [{"v": "text"}],
                          "writers": ["master"]}, "streams[0]")
        self.assertEqual(str(caught.exception), "config: streams[0].table: "
                         "'Stream_Audit' is the replicator's own table")


class GapTextTests(SynchronousTestCase):
    def test_consumers_at_different_positions_are_each_named_with_theirs(self):
        from replicator.replication.core.gaps import TrimGaps
        from replicator.streams.trimmed import FactsTrimmed

        class At:
            def __init__(self, path, position):
                self.path, self.position = path, position

            def positions(self):
                return {("caches", "master"): self.position}

        text = TrimGaps("/etc/w.yaml").report(FactsTrimmed("caches", "master", 2116, 2739),
                                             [At("/a.jsonl", 2512), At("/b.jsonl", 2116)])
        self.assertIn("consumer /a.jsonl (at 2512), consumer /b.jsonl (at 2116) need facts "
                      "of writer master after 2116", text)
        self.flushLoggedErrors()
