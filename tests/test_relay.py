"""The server's relay of writer clients' facts, without a database."""

from twisted.trial.unittest import SynchronousTestCase

from replicator.replication.core.relay import Relay
from replicator.replication.wire.commands import parse_line


class RelayTests(SynchronousTestCase):
    def setUp(self):
        self.sent = []
        self.relay = Relay(lambda lines, name, exclude=None: self.sent.append(
            (b"".join(lines).decode(), exclude)))

    def feed(self, conn, line):
        cmd = parse_line(line)
        key = (cmd.stream_name, cmd.instance_name)
        wire = line.encode() + b"\n"  # what is relayed is the line received
        if cmd.NAME == "RDATA":
            self.relay.rdata(conn, key, cmd.token, wire)
        else:
            self.relay.position(conn, key, cmd.new_token, wire)

    def test_whole_facts_only(self):
        self.feed("w1", 'RDATA s w1 batch ["a"]')
        self.assertEqual(self.sent, [])
        self.feed("w1", 'RDATA s w1 3 ["b"]')
        self.assertEqual(self.sent, [('RDATA s w1 batch ["a"]\nRDATA s w1 3 ["b"]\n', "w1")])
        self.assertEqual(self.relay.relayed, {("s", "w1"): 3})

    def test_writer_position_ends_its_partial_batch(self):
        # The writer's link dropped after "batch a"; back, it announces its
        # position and writes its next fact: the relay passes on {c}, not {a, c}.
        self.feed("w1", 'RDATA s w1 batch ["a"]')
        self.feed("w1", "POSITION s w1 2 2")
        self.feed("w1", 'RDATA s w1 3 ["c"]')
        self.assertEqual(self.sent, [("POSITION s w1 2 2\n", "w1"),
                                     ('RDATA s w1 3 ["c"]\n', "w1")])

    def test_partial_batch_dies_with_its_connection(self):
        self.feed("old", 'RDATA s w1 batch ["a"]')
        self.relay.connection_lost("old")
        self.feed("new", "POSITION s w1 2 2")
        self.feed("new", 'RDATA s w1 3 ["c"]')
        self.assertEqual(self.sent[-1], ('RDATA s w1 3 ["c"]\n', "new"))
