"""The reader pipeline of one (stream, writer), without a database.

A hypothesis state machine plays a writer (its table, the lines it sends,
links that drop) against one :class:`Reader` whose catch-up source reads
the model's table, and checks what reaches the consumer: every fact exactly
once, in token order, whole; gaps caught up; nothing at or below the
position delivered again.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from replicator.replication.core.reader import Reader
from replicator.replication.core.relay import Relay
from replicator.replication.wire.commands import parse_line
from replicator.replication.wire.encoding import encode_position_line, encode_rdata_lines
from tests.fakes import FakeConnection
from tests.support import updates_since

STREAM, WRITER = "s", "w"
RETRY = 1.0


class ReadFailed(Exception):
    pass


def Conn(n):
    """A connection as the reader sees it: only its identity matters."""
    return FakeConnection(f"conn{n}")


class ReaderMachine(RuleBasedStateMachine):
    """The writer's side is a model: ``table`` (token -> rows, committed),
    ``announced`` (what its fan-out has sent), and ``pipe``, the lines on
    their way to the reader as chunks written in one call each
    ``(lines, announced_after)``.
    """

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.table = {}
        self.last_id = 0  # the sequence
        self.announced = 0
        # [(line, announced_before, announced_after, starts, ends)]; a link
        # starts with the writer's position (the answer to REPLICATE).
        self.pipe = [(encode_position_line(STREAM, WRITER, 0, 0), 0, 0, True, True)]
        self.conns = 0
        self.conn = self.new_conn()
        self.delivered = []  # (token, rows) as the consumer got them
        self.fail_reads = 0
        self.async_reads = False
        self.pending_reads = []  # (deferred, args)
        self.reader = self.make_reader(0)

    # ----------------------------------------------------------- plumbing
    def new_conn(self):
        self.conns += 1
        return Conn(self.conns)

    def make_reader(self, position):
        return Reader(STREAM, WRITER, position, source=self.source, deliver=self.deliver,
                      clock=self.clock, fetch_limit=3, retry_delay=RETRY)

    def source(self, writer, from_token, to_token, limit):
        assert writer == WRITER
        if self.fail_reads:
            self.fail_reads -= 1
            return defer.fail(ReadFailed("database went away"))
        if self.async_reads:
            d = defer.Deferred()
            self.pending_reads.append((d, (from_token, to_token, limit)))
            return d
        return defer.succeed(updates_since(self.table, from_token, to_token, limit))

    def deliver(self, token, rows):
        self.delivered.append((token, rows))

    def queue_chunk(self, lines, before):
        """Lines written in one call; ``before``: announced before them."""
        for i, line in enumerate(lines):
            self.pipe.append((line, before, self.announced, i == 0, i == len(lines) - 1))

    def send_line(self, line):
        self.to_reader(line)

    def to_reader(self, line):
        cmd = parse_line(line.decode().rstrip("\n"))
        if cmd.NAME == "RDATA":
            self.reader.rdata(self.conn, cmd.token, cmd.row)
        else:
            self.reader.position_line(self.conn, cmd.prev_token, cmd.new_token)

    # ------------------------------------------------------------ writer
    @rule(rows=st.integers(1, 5), skipped=st.integers(0, 2), too_big=st.booleans())
    def write_fact(self, rows, skipped, too_big):
        """A fact committed and fanned out: its RDATA lines in one chunk.
        ``skipped`` IDs went to other writers (no rows of this writer); a
        fact ``too_big`` for one batch goes out as ``POSITION t t``."""
        self.last_id += skipped + 1
        token = self.last_id
        fact = [[f"r{token}.{i}", token] for i in range(rows)]
        self.table[token] = fact
        prev = self.announced
        self.announced = token
        if too_big:
            lines = [encode_position_line(STREAM, WRITER, token, token)]
        else:
            lines = list(encode_rdata_lines(STREAM, WRITER, [(token, r) for r in fact]))
        self.queue_chunk(lines, prev)

    @rule(empty=st.integers(1, 3))
    def empty_advance(self, empty):
        """Rolled-back or other writers' IDs: a POSITION with a gap."""
        prev = self.announced
        self.last_id += empty
        self.announced = self.last_id
        self.queue_chunk([encode_position_line(STREAM, WRITER, prev, self.announced)], prev)

    @precondition(lambda self: self.pipe)
    @rule(n=st.integers(1, 8))
    def transmit(self, n):
        for _ in range(min(n, len(self.pipe))):
            line = self.pipe.pop(0)[0]
            self.send_line(line)

    @rule(lost=st.integers(0, 8))
    def writer_link_drops(self, lost):
        """Redis: the writer's link dropped (the reader's did not); lines it
        had not published yet are lost, even in the middle of a fact. Back,
        it announces its position on the same channel."""
        keep = max(0, len(self.pipe) - lost)
        del self.pipe[keep:]
        self.queue_chunk([encode_position_line(STREAM, WRITER, self.announced, self.announced)],
                         self.announced)

    @rule(data=st.data())
    def reader_reconnects(self, data):
        """The reader's link dropped: what was on the way is lost, mid-fact
        or not; on the new link lines published meanwhile (whole chunks) may
        arrive before the answer to REPLICATE, the writer's position then."""
        self.reader.connection_lost(self.conn)
        self.conn = self.new_conn()
        boundaries = [i + 1 for i, entry in enumerate(self.pipe) if entry[4]]
        if not self.pipe or self.pipe[0][3]:
            boundaries.insert(0, 0)
        if not boundaries:  # the head of the pipe is the tail of a chunk: lost
            boundaries = [len(self.pipe)]
        start = data.draw(st.sampled_from(boundaries))
        answer = data.draw(st.sampled_from([b for b in boundaries if b >= start]))
        if answer:
            announced = self.pipe[answer - 1][2]
        elif self.pipe:
            announced = self.pipe[0][1]
        else:
            announced = self.announced
        line = encode_position_line(STREAM, WRITER, announced, announced)
        self.pipe = self.pipe[start:answer] + [(line, announced, announced, True, True)] \
            + self.pipe[answer:]

    @rule()
    def reader_restarts(self):
        """The reader process restarts from its consumer's position."""
        self.reader.stop()
        self.reader = self.make_reader(self.reader.position)
        self.conn = self.new_conn()
        self.pipe = [(encode_position_line(STREAM, WRITER, self.announced, self.announced),
                      self.announced, self.announced, True, True)]

    # ------------------------------------------------------ catch-up reads
    @rule(n=st.integers(1, 3))
    def reads_fail(self, n):
        self.fail_reads = n

    @rule(on=st.booleans())
    def reads_take_time(self, on):
        self.async_reads = on

    @precondition(lambda self: self.pending_reads)
    @rule(ok=st.booleans())
    def read_returns(self, ok):
        d, (since, until, limit) = self.pending_reads.pop(0)
        if ok:
            d.callback(updates_since(self.table, since, until, limit))
        else:
            d.errback(ReadFailed("connection lost during the read"))

    @rule()
    def time_passes(self):
        self.clock.advance(RETRY)

    # ------------------------------------------------------------ checks
    @invariant()
    def exactly_once_in_order_whole(self):
        tokens = [t for t, _ in self.delivered]
        assert tokens == sorted(set(tokens)), tokens
        for token, rows in self.delivered:
            assert rows == self.table[token], (token, rows, self.table[token])
        if self.reader.position is not None and tokens:
            assert tokens[-1] <= self.reader.position

    @rule()
    def settle(self):
        """Links heal and reads work: the reader gets to the writer's
        position with every fact of the table, once each."""
        self.fail_reads = 0
        self.async_reads = False
        while self.pipe or self.pending_reads or not self.reader.idle() or self.in_transit():
            self.transmit(len(self.pipe))
            self.flush_transit()
            for d, (since, until, limit) in self.pending_reads:
                d.callback(updates_since(self.table, since, until, limit))
            self.pending_reads = []
            self.clock.advance(RETRY)
        self.exactly_once_in_order_whole()
        assert self.reader.position == self.announced, (self.reader.position, self.announced)
        assert [t for t, _ in self.delivered] == sorted(self.table), (
            [t for t, _ in self.delivered], sorted(self.table))

    def in_transit(self):
        return False

    def flush_transit(self):
        pass

    def teardown(self):
        self.settle()


class HubReaderMachine(ReaderMachine):
    """The same writer behind a TCP hub: its lines go to a :class:`Relay`
    on the hub's connection from the writer; what the relay passes on, and
    the hub's answer to REPLICATE (``relayed``), go to the reader."""

    def __init__(self):
        self.down = []  # lines from the hub to the reader
        self.relay = Relay(lambda lines, name, exclude=None: self.down.extend(lines))
        self.hub_conns = 0
        self.hub_conn = "w0"
        super().__init__()
        # The reader's link starts with the hub's answer to REPLICATE.
        self.down.append(encode_position_line(STREAM, WRITER, 0, 0))

    def send_line(self, line):
        cmd = parse_line(line.decode().rstrip("\n"))
        if cmd.NAME == "RDATA":
            self.relay.rdata(self.hub_conn, (STREAM, WRITER), cmd.token, line)
        else:
            self.relay.position(self.hub_conn, (STREAM, WRITER), cmd.new_token, line)

    def hub_answer(self):
        token = self.relay.relayed.get((STREAM, WRITER), 0)
        return encode_position_line(STREAM, WRITER, token, token)

    @precondition(lambda self: self.down)
    @rule(n=st.integers(1, 8))
    def hub_transmits(self, n):
        for _ in range(min(n, len(self.down))):
            self.to_reader(self.down.pop(0))

    @rule(arrived=st.integers(0, 8))
    def writer_link_drops(self, arrived):
        """TCP: the writer's link to the hub dropped; what was on the way
        arrived up to some point (mid-fact or not), the rest is lost. The
        writer connects again and announces its position."""
        self.transmit(arrived)
        self.relay.connection_lost(self.hub_conn)
        self.hub_conns += 1
        self.hub_conn = f"w{self.hub_conns}"
        line = encode_position_line(STREAM, WRITER, self.announced, self.announced)
        self.pipe = [(line, self.announced, self.announced, True, True)]

    @rule()
    def reader_reconnects(self):
        """The reader's link to the hub dropped: what was on the way is
        lost; on the new link the hub answers REPLICATE first."""
        self.reader.connection_lost(self.conn)
        self.conn = self.new_conn()
        self.down = [self.hub_answer()]

    @rule()
    def reader_restarts(self):
        self.reader.stop()
        self.reader = self.make_reader(self.reader.position)
        self.conn = self.new_conn()
        self.down = [self.hub_answer()]

    def in_transit(self):
        return bool(self.down)

    def flush_transit(self):
        self.hub_transmits(len(self.down))


class PagedReaderMachine(ReaderMachine):
    """The same, with a consumer that takes catch-up pages whole (and skips
    facts it has, as the JSON-lines consumer does)."""

    def make_reader(self, position):
        return Reader(STREAM, WRITER, position, source=self.source, deliver=self.deliver,
                      deliver_many=self.deliver_many, clock=self.clock, fetch_limit=3,
                      retry_delay=RETRY)

    def deliver_many(self, facts):
        for token, rows in facts:
            if not self.delivered or token > self.delivered[-1][0]:
                self.delivered.append((token, rows))


class ReaderStateTests(SynchronousTestCase):
    def check(self, machine):
        try:
            run_state_machine_as_test(machine, settings=settings(
                max_examples=300, stateful_step_count=50, deadline=None))
        finally:
            self.flushLoggedErrors(ReadFailed)

    def test_reader_against_model(self):
        self.check(ReaderMachine)

    def test_reader_behind_a_hub_against_model(self):
        self.check(HubReaderMachine)

    def test_reader_taking_pages_against_model(self):
        self.check(PagedReaderMachine)


class ReaderTests(SynchronousTestCase):
    """Cases step by step."""

    def test_writer_position_ends_its_partial_batch(self):
        table = {1: [["a", 1], ["b", 1]], 2: [["c", 2]]}
        delivered = []
        reader = Reader(STREAM, WRITER, 0, clock=Clock(), fetch_limit=10,
                        source=lambda w, f, t, n: defer.succeed(updates_since(table, f, t, n)),
                        deliver=lambda token, rows: delivered.append((token, rows)))
        conn = Conn(1)
        reader.position_line(conn, 0, 0)
        reader.rdata(conn, None, ["a", 1])  # "RDATA s w batch a"; then the writer's link drops
        reader.position_line(conn, 1, 1)    # back, it re-announces its position
        reader.rdata(conn, 2, ["c", 2])
        self.assertEqual(delivered, [(1, [["a", 1], ["b", 1]]), (2, [["c", 2]])])

    def test_stopped_reader_is_idle_once_its_work_in_hand_ends(self):
        """At shutdown the handler waits for readers to be idle: what is
        still queued will not run, so only the work in hand counts."""
        pending = []
        reader = Reader(STREAM, WRITER, 0, clock=Clock(), fetch_limit=10,
                        source=lambda *args: pending.append(defer.Deferred()) or pending[-1],
                        deliver=lambda token, rows: None)
        conn = Conn(1)
        reader.position_line(conn, 5, 5)  # catch-up: the read is under way
        reader.position_line(conn, 6, 6)
        self.assertFalse(reader.idle())
        reader.stop()
        self.assertFalse(reader.idle())
        pending[0].callback(([(3, [["c", 3]])], 5, False))
        self.assertTrue(reader.idle())
        self.assertEqual(reader.position, 0)  # nothing handed on after stop

    def test_catch_up_yields_to_the_reactor_between_pages(self):
        """A long catch-up hands on one page, then lets the reactor run (PINGs,
        /health) before the next, even when the next page is already in hand
        (read ahead, or a source that answers at once)."""
        table = {t: [[f"r{t}", t]] + ([[f"r{t}b", t]] if t % 3 == 0 else []) for t in range(1, 10)}
        delivered = []
        clock = Clock()
        reader = Reader(STREAM, WRITER, 0, clock=clock, fetch_limit=4,
                        source=lambda w, f, t, n: defer.succeed(updates_since(table, f, t, n)),
                        deliver=lambda token, rows: delivered.append((token, rows)))
        reader.position_line(Conn(1), 9, 9)
        pages = [[t for t, _ in delivered]]
        while not reader.idle():
            self.assertTrue(clock.calls, "a pause between pages")
            call = clock.calls.pop(0)  # one turn of the reactor
            call.called = 1
            call.func(*call.args, **call.kw)
            pages.append([t for t, _ in delivered][sum(map(len, pages)):])
        self.assertEqual(pages, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
        self.assertEqual(delivered, sorted(table.items()))
        self.assertEqual(reader.position, 9)
