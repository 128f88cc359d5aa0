"""A database outage seen by the fan-out and by a reader: retries back off
(the project's policy) and the log has one line when it starts and one when
it ends, not a traceback per key per retry."""

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from replicator.replication.core.fanout import Fanout
from replicator.replication.core.reader import Reader
from tests.fakes import FakeConnection


class Outage:
    """A source that fails ``failures`` times, then answers."""

    def __init__(self, failures):
        self.failures = failures
        self.attempts = 0

    def __call__(self, writer, since, until, limit):
        self.attempts += 1
        if self.attempts <= self.failures:
            return defer.fail(ConnectionError("database down"))
        return defer.succeed(([], until, False))


class _IdGen:
    token = 0

    def get_current_token(self, writer):
        return self.token


class _Stream:
    name = "caches"

    def __init__(self, source):
        self.id_gen = _IdGen()
        self.updates_since = source

    def keep_recent_facts(self):
        pass

    def forget(self, writer, upto):
        pass

    def encoded_since(self, writer, since, until, limit):
        return None  # memory never answers: the fetch is the test's


class RetryTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def outage_lines(self):
        return [e for e in self.events if "outage" in e.get("log_format", "")
                or e.get("log_failure") is not None]

    def run_for(self, seconds):
        for _ in range(int(seconds * 10)):
            self.clock.advance(0.1)

    def check(self, outage, done):
        self.run_for(10)
        # 1 s, then 2 s, 4 s, ... (less a jitter of at most a quarter): at
        # most 5 attempts in 10 s, where a fixed 1 s delay makes 11.
        self.assertLessEqual(outage.attempts, 5)
        self.assertGreaterEqual(outage.attempts, 3)
        outage.failures = 0
        self.run_for(30)
        self.assertTrue(done())
        lines = self.outage_lines()
        self.assertEqual([e["log_level"].name for e in lines], ["warn", "info"])

    def test_reader(self):
        outage = Outage(1000)
        reader = Reader("caches", "worker1", 0, source=outage, clock=self.clock,
                        deliver=lambda token, rows: None, retry_delay=1.0)
        reader.position_line(FakeConnection("peer"), 5, 5)
        self.check(outage, lambda: reader.position == 5)

    def test_fanout(self):
        outage = Outage(1000)
        sent = []
        stream = _Stream(outage)
        fanout = Fanout(lambda lines, name: sent.extend(lines), self.clock, retry_delay=1.0)
        fanout.add_writer(stream, "master")
        stream.id_gen.token = 5
        fanout.advanced(stream, "master")
        self.check(outage, lambda: fanout.announced[("caches", "master")] == 5)

    def test_admission_sequence_read(self):
        """A claim above the stream's sequence waits for a read of it; while
        the database is down the reads back off, and the log has one line
        when that starts and one when it ends."""
        from replicator.config import ColumnConfig
        from replicator.replication.core.admission import Admission
        from replicator.replication.wire.commands import PositionCommand

        outage = Outage(1000)

        class Stream(_Stream):
            class config:
                columns = (ColumnConfig("key", "text"),)

            async def sequence_value(self):
                await outage(None, 0, 0, 0)
                return 5

        self.id_gen_known = 0
        stream = Stream(outage)
        stream.id_gen.get_max_known = lambda: 0
        accepted = []
        admission = Admission(None, lambda conn, key, cmd, line: accepted.append(cmd),
                              lambda *a: None, self.clock, retry_delay=1.0)
        conn = FakeConnection("worker1")
        admission.offer(conn, stream, ("caches", "worker1"),
                        PositionCommand("caches", "worker1", 0, 5), None)
        self.check(outage, lambda: len(accepted) == 1)

    def test_jsonl_consumer_writes(self):
        """A JSON-lines file that cannot be written (a full disk) is retried
        with the same backoff and two log lines, not once a second with a
        traceback each."""
        import errno
        import os
        import tempfile

        from replicator.consumers import JsonlConsumer, run_inline

        path = os.path.join(tempfile.mkdtemp(), "facts.jsonl")
        consumer = JsonlConsumer(path, self.clock, run_io=run_inline)
        self.addCleanup(consumer.close)
        outage = Outage(1000)
        real_pwrite = os.pwrite

        def pwrite(fd, data, offset):
            outage.attempts += 1
            if outage.attempts <= outage.failures:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwrite(fd, data, offset)

        self.patch(os, "pwrite", pwrite)
        consumer.on_facts("caches", "master", 1, [["a"]])
        outage.attempts = 0
        self.check(outage, lambda: consumer.positions() == {("caches", "master"): 1})
