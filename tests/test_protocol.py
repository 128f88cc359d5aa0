"""Tests for replicator.replication.transport.protocol on StringTransport and a Clock."""

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from replicator.replication.transport.base_handler import BaseHandler
from replicator.replication.transport.protocol import (
    ClientReplicationProtocol,
    ServerReplicationProtocol,
)
from replicator.replication.wire.commands import (
    ErrorCommand,
    NameCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    ReplicateCommand,
    ServerCommand,
    UserSyncCommand,
)
from replicator.replication.wire.encoding import encode_rdata_lines
from tests.handlers import RecordingHandler
from tests.support import T0, T0_MS, LogWatch


class NoDelayTransport(StringTransport):
    no_delay = None

    def setTcpNoDelay(self, enabled):
        self.no_delay = enabled


def connect(proto, transport=None):
    transport = transport if transport is not None else StringTransport()
    proto.makeConnection(transport)
    return transport


def make_server(handler=None, **kwargs):
    clock = Clock()
    clock.advance(T0)
    handler = handler if handler is not None else RecordingHandler()
    proto = ServerReplicationProtocol(handler, "hs.example", clock=clock, **kwargs)
    transport = connect(proto)
    return proto, transport, clock, handler


def make_client(handler=None, client_name="worker1", **kwargs):
    clock = Clock()
    clock.advance(T0)
    handler = handler if handler is not None else RecordingHandler()
    proto = ClientReplicationProtocol(handler, client_name, "hs.example", clock=clock, **kwargs)
    transport = connect(proto)
    return proto, transport, clock, handler


def lose(proto):
    proto.connectionLost(Failure(ConnectionDone()))


class HandshakeTests(SynchronousTestCase):
    def test_server_handshake(self):
        proto, transport, clock, handler = make_server()
        self.assertEqual(transport.value(), b"SERVER hs.example\nPING " + T0_MS + b"\n")
        # new_connection comes after the handshake lines were written.
        self.assertEqual(handler.events, [("new_connection", transport.value())])
        self.assertIs(transport.producer, proto)
        self.assertTrue(transport.streaming)
        self.assertEqual(handler.outbound, [("SERVER", 1), ("PING", 1)])

    def test_client_handshake(self):
        proto, transport, clock, handler = make_client()
        self.assertEqual(transport.value(), b"NAME worker1\nPING " + T0_MS + b"\nREPLICATE \n")
        self.assertEqual(handler.events, [("new_connection", transport.value())])
        self.assertIs(transport.producer, proto)

    def test_client_handshake_without_name(self):
        proto, transport, clock, handler = make_client(client_name=None)
        self.assertEqual(transport.value(), b"PING " + T0_MS + b"\nREPLICATE \n")

    def test_tcp_nodelay(self):
        proto = ServerReplicationProtocol(RecordingHandler(), "hs", clock=Clock())
        transport = connect(proto, NoDelayTransport())
        self.assertIs(transport.no_delay, True)

    def test_right_remote(self):
        proto, transport, clock, handler = make_client()
        transport.clear()
        proto.dataReceived(b"SERVER hs.example\n")
        self.assertEqual(transport.value(), b"")
        self.assertFalse(transport.disconnecting)
        self.assertEqual(handler.commands(), [("SERVER", ServerCommand("hs.example"))])
        self.assertEqual(proto.instance_name, "hs.example")

    def test_wrong_remote(self):
        proto, transport, clock, handler = make_client()
        transport.clear()
        proto.dataReceived(b"SERVER other.example\nPOSITION events master 1 1\n")
        self.assertEqual(transport.value(), b"ERROR Wrong remote\n")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(proto.close_reason, "wrong_remote")
        self.assertEqual(handler.commands(), [])
        self.assertIsNone(proto.instance_name)
        lose(proto)
        self.assertEqual(handler.events[-1], ("lost_connection", "wrong_remote"))

    def test_name_and_instance_name(self):
        proto, transport, clock, handler = make_server()
        self.assertEqual(proto.name, "192.168.1.1:54321")
        self.assertIsNone(proto.instance_name)
        proto.dataReceived(b"NAME worker1\n")
        self.assertEqual((proto.name, proto.instance_name), ("worker1", "worker1"))
        self.assertEqual(handler.commands(), [("NAME", NameCommand("worker1"))])

    def test_server_and_client_talk(self):
        server, st, sclock, shandler = make_server()
        client, ct, cclock, chandler = make_client()
        client.dataReceived(st.value())
        server.dataReceived(ct.value())
        self.assertEqual(
            [e[0] for e in chandler.commands()],
            ["SERVER", "PING"],
        )
        self.assertEqual(
            [e[0] for e in shandler.commands()],
            ["NAME", "PING", "REPLICATE"],
        )
        self.assertFalse(st.disconnecting or ct.disconnecting)
        self.assertEqual(shandler.inbound, ["NAME", "PING", "REPLICATE"])
        self.assertEqual(chandler.inbound, ["SERVER", "PING"])


class FramingTests(SynchronousTestCase):
    def test_crlf_and_blank_lines(self):
        proto, transport, clock, handler = make_server()
        transport.clear()
        proto.dataReceived(b"NAME w1\r\n\r\n\n   \n\t\nPING 1\r\nREPLICATE \r\n")
        self.assertEqual(
            handler.commands(),
            [("NAME", NameCommand("w1")), ("PING", PingCommand("1")), ("REPLICATE",
                                                                       ReplicateCommand())],
        )
        self.assertEqual(transport.value(), b"")
        self.assertFalse(transport.disconnecting)

    def test_lines_split_across_chunks(self):
        proto, transport, clock, handler = make_server()
        for chunk in (b"REPLI", b"CATE", b"\r", b"\nNAME ", b"w", b"1\n"):
            proto.dataReceived(chunk)
        self.assertEqual(handler.commands(), [("REPLICATE", ReplicateCommand()), ("NAME",
                                                                                  NameCommand("w1"))])

    def test_over_long_line(self):
        proto, transport, clock, handler = make_server(max_line_length=100)
        transport.clear()
        proto.dataReceived(b"PING " + b"x" * 96 + b"\nREPLICATE\n")
        self.assertEqual(transport.value(), b"ERROR Line length exceeded\n")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(proto.close_reason, "line_too_long")
        self.assertEqual(handler.commands(), [])

    def test_over_long_partial_line(self):
        proto, transport, clock, handler = make_server(max_line_length=100)
        transport.clear()
        proto.dataReceived(b"PING " + b"x" * 200)
        self.assertEqual(transport.value(), b"ERROR Line length exceeded\n")
        self.assertEqual(proto.close_reason, "line_too_long")

    def test_line_at_the_limit_is_accepted_with_or_without_cr(self):
        proto, transport, clock, handler = make_server(max_line_length=100)
        transport.clear()
        data = "x" * 95
        proto.dataReceived(b"PING " + data.encode() + b"\n")
        proto.dataReceived(b"PING " + data.encode() + b"\r\n")
        self.assertEqual(handler.commands(), [("PING", PingCommand(data))] * 2)
        self.assertFalse(transport.disconnecting)

    def test_default_limit_is_16k(self):
        proto, transport, clock, handler = make_server()
        proto.dataReceived(b"PING " + b"x" * (16384 - 5) + b"\n")
        self.assertFalse(transport.disconnecting)
        proto.dataReceived(b"PING " + b"x" * (16384 - 4) + b"\n")
        self.assertEqual(proto.close_reason, "line_too_long")

    def test_parse_error(self):
        proto, transport, clock, handler = make_server()
        transport.clear()
        proto.dataReceived(b"FOO bar\nREPLICATE\n")
        self.assertEqual(transport.value(), b"ERROR failed to parse line: unknown command 'FOO'\n")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(proto.close_reason, "parse_error")
        # The REPLICATE after the bad line is never dispatched.
        self.assertEqual(handler.commands(), [])

    def test_parse_errors_of_every_shape_close(self):
        lines = [
            b"USER_SYNC w @u None middle 1",
            b"FEDERATION_ACK w x",
            b"USER_IP @u [",
            b"NAME",
            b"\xff\xfe",
        ]
        for line in lines:
            proto, transport, clock, handler = make_server()
            transport.clear()
            proto.dataReceived(line + b"\n")
            self.assertTrue(transport.value().startswith(b"ERROR failed to parse line: "), line)
            self.assertEqual(transport.value().count(b"\n"), 1)
            self.assertEqual(proto.close_reason, "parse_error")
            self.assertEqual(handler.commands(), [])

    def test_rdata_parse_error_on_client(self):
        proto, transport, clock, handler = make_client()
        transport.clear()
        proto.dataReceived(b"RDATA events master x []\n")
        self.assertEqual(
            transport.value(),
            b"ERROR failed to parse line: RDATA: token is not an integer: 'x'\n",
        )
        self.assertEqual(proto.close_reason, "parse_error")

    def test_the_base_handler_takes_every_command_quietly(self):
        proto = ServerReplicationProtocol(BaseHandler(), "hs", clock=Clock())
        transport = connect(proto)
        transport.clear()
        proto.dataReceived(b"NAME w\nPING 1\nREPLICATE\nUSER_SYNC w @u None start 1\nERROR oops\n")
        self.assertEqual(transport.value(), b"")
        self.assertFalse(transport.disconnecting)
        lose(proto)
        self.assertEqual(proto.close_reason, "remote_error")

    def test_handler_exception_is_logged_and_connection_stays(self):
        handler = RecordingHandler()
        calls = []

        def broken(conn, cmd):
            calls.append(cmd)
            1 / 0

        handler.on_REPLICATE = broken
        proto, transport, clock, _ = make_server(handler)
        transport.clear()
        proto.dataReceived(b"REPLICATE\nREPLICATE\nNAME w\n")
        self.assertEqual(len(calls), 2)
        self.assertEqual(handler.commands(), [("NAME", NameCommand("w"))])
        self.assertFalse(transport.disconnecting)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 2)


class DirectionTests(SynchronousTestCase):
    def test_client_may_not_send_server_commands(self):
        for line in (b"SERVER hs", b"RDATA events w 1 []", b"POSITION events w 1 1"):
            proto, transport, clock, handler = make_server()
            transport.clear()
            proto.dataReceived(line + b"\n")
            name = line.split(b" ")[0]
            self.assertEqual(transport.value(), b"ERROR invalid command: SERVER\n"
                             if name == b"SERVER" else
                             b"ERROR " + name + b" of events/w refused: no NAME sent\n")
            self.assertTrue(transport.disconnecting)
            self.assertEqual(proto.close_reason, "invalid_command")
            self.assertEqual(handler.commands(), [])

    def test_server_may_not_send_client_commands(self):
        for line in (b"NAME x", b"REPLICATE", b"USER_SYNC w @u None start 1",
                     b"FEDERATION_ACK w 1"):
            proto, transport, clock, handler = make_client()
            transport.clear()
            proto.dataReceived(line + b"\n")
            name = line.split(b" ")[0]
            self.assertEqual(transport.value(), b"ERROR invalid command: " + name + b"\n")
            self.assertEqual(proto.close_reason, "invalid_command")

    def test_writer_client_may_send_rdata_and_position_for_its_streams(self):
        handler = RecordingHandler(writers={("events", "w1")})
        proto, transport, clock, _ = make_server(handler)
        transport.clear()
        proto.dataReceived(
            b"NAME w1\n"
            b'RDATA events w1 batch ["a"]\n'
            b'RDATA events w1 7 ["b"]\n'
            b"POSITION events w1 7 9\n"
        )
        self.assertEqual(transport.value(), b"")
        self.assertEqual(
            handler.commands()[1:],
            [
                ("RDATA", RdataCommand("events", "w1", None, ["a"])),
                ("RDATA", RdataCommand("events", "w1", 7, ["b"])),
                ("POSITION", PositionCommand("events", "w1", 7, 9)),
            ],
        )

    def test_writer_check_rejects(self):
        handler = RecordingHandler(writers={("events", "w1")})
        cases = [
            b"NAME w1\nRDATA caches w1 1 []\n",  # stream it does not write
            b"NAME w1\nPOSITION caches w1 1 2\n",
            b"NAME w1\nRDATA events master 1 []\n",  # rows of another instance
            b"NAME w2\nRDATA events w2 1 []\n",  # not a writer at all
            b"RDATA events w1 1 []\n",  # never said who it is
        ]
        for data in cases:
            proto, transport, clock, _ = make_server(handler)
            handler.events.clear()
            transport.clear()
            proto.dataReceived(data)
            name = data.split(b"\n")[-2].split(b" ")[0]
            self.assertTrue(transport.value().startswith(b"ERROR " + name + b" of "), data)
            self.assertIn(b" refused: ", transport.value())
            self.assertEqual(proto.close_reason, "invalid_command")
            self.assertNotIn("RDATA", [e[0] for e in handler.events])
            self.assertNotIn("POSITION", [e[0] for e in handler.events])

    def test_a_refused_writer_command_says_why(self):
        """A worker the master's config no longer names as a writer of a
        stream is told so (its retry line says it), not "invalid command"."""
        handler = RecordingHandler(writers={("events", "w1")})
        cases = [
            (b"NAME w1\nPOSITION caches w1 1 2\n",
             b"ERROR POSITION of caches/w1 refused: w1 is not a writer of caches here\n"),
            (b"NAME w1\nRDATA caches w1 1 []\n",
             b"ERROR RDATA of caches/w1 refused: w1 is not a writer of caches here\n"),
            (b"NAME w1\nRDATA events master 1 []\n",
             b"ERROR RDATA of events/master refused: this connection is w1\n"),
            (b"RDATA events w1 1 []\n",
             b"ERROR RDATA of events/w1 refused: no NAME sent\n"),
        ]
        for data, error in cases:
            proto, transport, clock, _ = make_server(handler)
            handler.events.clear()
            transport.clear()
            proto.dataReceived(data)
            self.assertEqual(transport.value(), error, data)
            self.assertTrue(transport.disconnecting)
            self.assertEqual(proto.close_reason, "invalid_command")
            self.assertNotIn("RDATA", [e[0] for e in handler.events])
            self.assertNotIn("POSITION", [e[0] for e in handler.events])

    def test_the_base_handler_lets_no_client_write(self):
        proto = ServerReplicationProtocol(BaseHandler(), "hs", clock=Clock())
        transport = connect(proto)
        transport.clear()
        proto.dataReceived(b"NAME w1\nRDATA events w1 1 []\n")
        self.assertEqual(transport.value(),
                         b"ERROR RDATA of events/w1 refused: w1 is not a writer of events here\n")

    def test_relayed_commands_go_both_ways(self):
        both = [
            b"REMOTE_SERVER_UP example.org",
            b'LOCK_RELEASED ["a","b","c"]',
            b"NEW_ACTIVE_TASK t1",
            b"CANCEL_TASK t1",
            b"ERROR oops",
            b"PING 1",
        ]
        for make in (make_server, make_client):
            proto, transport, clock, handler = make()
            transport.clear()
            proto.dataReceived(b"\n".join(both) + b"\n")
            self.assertEqual(transport.value(), b"")
            self.assertEqual(
                [e[0] for e in handler.commands()],
                ["REMOTE_SERVER_UP", "LOCK_RELEASED", "NEW_ACTIVE_TASK", "CANCEL_TASK", "ERROR",
                 "PING"],
            )


class KeepaliveTests(SynchronousTestCase):
    def pings(self, transport):
        return [line for line in transport.value().split(b"\n") if line.startswith(b"PING")]

    def test_ping_after_five_idle_seconds(self):
        proto, transport, clock, handler = make_server()
        transport.clear()
        clock.advance(4.9)
        self.assertEqual(transport.value(), b"")
        clock.advance(0.1)
        self.assertEqual(transport.value(), b"PING 1490197670500\n")
        transport.clear()
        # Output at +7 s postpones the next ping to +12 s.
        clock.advance(2)
        proto.send_command(PositionCommand("events", "master", 1, 2))
        clock.advance(4.9)
        self.assertEqual(self.pings(transport), [])
        clock.advance(0.1)
        self.assertEqual(self.pings(transport), [b"PING 1490197677500"])

    def test_no_ping_while_output_flows(self):
        proto, transport, clock, handler = make_server(idle_timeout=1000)
        transport.clear()
        for i in range(60):
            clock.advance(1)
            proto.send_lines([b"POSITION events master %d %d\n" % (i, i + 1)], "POSITION")
        self.assertEqual(self.pings(transport), [])
        self.assertEqual(transport.value().count(b"\n"), 60)
        clock.advance(5)
        self.assertEqual(len(self.pings(transport)), 1)

    def test_ping_cadence_when_idle(self):
        proto, transport, clock, handler = make_client(ping_timeout=1000)
        transport.clear()
        clock.pump([1] * 60)
        self.assertEqual(len(self.pings(transport)), 12)

    def test_netcat_peer_that_never_pings_stays_while_it_sends_commands(self):
        proto, transport, clock, handler = make_server()
        proto.dataReceived(b"NAME netcat-user\nREPLICATE\n")
        for _ in range(100):  # well over an hour, a command every 59 s
            clock.advance(59)
            proto.dataReceived(b"REPLICATE\n")
        self.assertFalse(transport.disconnecting)
        self.assertIsNone(proto.close_reason)
        self.assertNotIn(b"ERROR", transport.value())

    def test_server_closes_a_peer_that_sent_no_command_for_the_idle_timeout(self):
        proto, transport, clock, handler = make_server()
        proto.dataReceived(b"NAME quiet\nREPLICATE\n")
        transport.clear()
        clock.pump([1] * 59 + [0.9])
        self.assertFalse(transport.disconnecting)
        clock.advance(0.1)
        self.assertTrue(transport.value().endswith(
            b"ERROR idle timeout: no command for 60s (send PING now and then to keep a quiet "
            b"connection open)\n"), transport.value())
        self.assertTrue(transport.disconnecting)
        self.assertEqual(proto.close_reason, "idle_timeout")
        lose(proto)
        self.assertEqual(handler.events[-1], ("lost_connection", "idle_timeout"))

    def test_server_closes_a_peer_that_never_sent_anything(self):
        proto, transport, clock, handler = make_server(idle_timeout=30)
        clock.advance(29.9)
        self.assertFalse(transport.disconnecting)
        clock.advance(0.1)
        self.assertEqual(proto.close_reason, "idle_timeout")

    def test_bytes_without_a_complete_command_do_not_keep_a_peer(self):
        # A byte every few seconds, never a whole line (slowloris).
        proto, transport, clock, handler = make_server()
        for _ in range(12):
            clock.advance(5)
            proto.dataReceived(b"R")
        self.assertEqual(proto.close_reason, "idle_timeout")

    def dribble(self, proto, clock, seconds: int, every: int = 5):
        """A byte of a line every ``every`` seconds, never its end; the
        log events meanwhile."""
        events = LogWatch(self).events
        for _ in range(seconds // every):
            clock.advance(every)
            if proto.close_reason is not None:
                break
            proto.dataReceived(b"R")
        return [formatEvent(e) for e in events]

    def test_a_peer_that_pinged_and_then_dribbles_is_told_why(self):
        # Bytes keep the ping timeout away; they are not a command.
        proto, transport, clock, handler = make_server()
        proto.dataReceived(b"NAME worker1\nPING 1\n")
        transport.clear()
        lines = self.dribble(proto, clock, 300)
        self.assertEqual(proto.close_reason, "idle_timeout")
        self.assertEqual(clock.seconds(), T0 + 60)
        self.assertTrue(transport.disconnecting)
        self.assertTrue(transport.value().endswith(
            b"ERROR idle timeout: no whole command for 60s, only 11 bytes of an unfinished "
            b"line\n"), transport.value())
        closing = [line for line in lines if line.startswith("Closing")]
        self.assertEqual(closing, [
            "Closing replication connection worker1 (192.168.1.1:54321) (idle_timeout): no "
            "whole command for 60.0s; 11 bytes of an unfinished line, the last 5.0s ago (a "
            "peer dribbling bytes)"])
        lose(proto)
        self.assertEqual(handler.events[-1], ("lost_connection", "idle_timeout"))

    def test_an_upstream_that_dribbles_is_told_why(self):
        proto, transport, clock, handler = make_client()
        proto.dataReceived(b"SERVER hs.example\nPING 1\n")
        transport.clear()
        self.dribble(proto, clock, 300)
        self.assertEqual(proto.close_reason, "idle_timeout")
        self.assertEqual(clock.seconds(), T0 + 60)
        self.assertTrue(transport.value().endswith(
            b"ERROR idle timeout: no whole command for 60s, only 11 bytes of an unfinished "
            b"line\n"), transport.value())

    def test_a_pinging_peer_outlives_a_short_idle_timeout(self):
        # Under the ping timeout a command is due every max(idle_timeout,
        # ping_timeout) seconds: a peer PINGing every 10 s stays.
        proto, transport, clock, handler = make_server(idle_timeout=1)
        proto.dataReceived(b"PING 1\n")
        for _ in range(30):
            clock.advance(10)
            proto.dataReceived(b"PING 1\n")
        self.assertIsNone(proto.close_reason)
        clock.advance(5)
        proto.dataReceived(b"PI")  # bytes: not a command
        clock.advance(9.9)
        self.assertIsNone(proto.close_reason)
        clock.advance(0.1)
        self.assertEqual(proto.close_reason, "idle_timeout")

    def test_client_times_out_a_silent_upstream(self):
        # The server sends SERVER and PING at once; one that sends nothing
        # at all is dead from the client's point of view.
        proto, transport, clock, handler = make_client()
        transport.clear()
        clock.pump([1] * 14 + [0.9])
        self.assertFalse(transport.disconnecting)
        clock.advance(0.1)
        self.assertTrue(transport.value().endswith(b"ERROR ping timeout\n"))
        self.assertEqual(proto.close_reason, "ping_timeout")

    def test_client_times_out_an_upstream_that_stops_talking(self):
        proto, transport, clock, handler = make_client()
        proto.dataReceived(b"SERVER hs.example\n")
        clock.advance(10)
        proto.dataReceived(b"POSITION events master 1 1\n")
        clock.advance(14.9)
        self.assertFalse(transport.disconnecting)
        clock.advance(0.1)
        self.assertEqual(proto.close_reason, "ping_timeout")

    def test_timeout_after_the_peer_pinged(self):
        proto, transport, clock, handler = make_server(idle_timeout=1000)
        clock.advance(100)
        proto.dataReceived(b"PING 1\n")
        transport.clear()
        clock.pump([1] * 14 + [0.9])
        self.assertFalse(transport.disconnecting)
        clock.advance(0.1)
        # Our own PINGs went on meanwhile; the timeout fired at +15 s exactly.
        self.assertEqual(self.pings(transport), [b"PING 1490197770500", b"PING 1490197775500"])
        self.assertTrue(transport.value().endswith(b"ERROR ping timeout\n"))
        self.assertTrue(transport.disconnecting)
        self.assertEqual(proto.close_reason, "ping_timeout")
        lose(proto)
        self.assertEqual(handler.events[-1], ("lost_connection", "ping_timeout"))

    def test_a_process_stopped_past_the_timeout_reads_before_it_blames(self):
        # SIGSTOP for 25 s: at the SIGCONT the silence check is long overdue,
        # while the peer's PINGs wait unread in the socket.  The check looks
        # again once the reactor has had its turn to read them.
        proto, transport, clock, handler = make_server(idle_timeout=1000)
        proto.dataReceived(b"PING 1\n")
        clock.advance(25)  # (one jump: nothing of this process ran meanwhile)
        self.assertFalse(transport.disconnecting)
        proto.dataReceived(b"PING 2\nPING 3\n")  # what waited in the socket
        clock.advance(0.1)
        self.assertFalse(transport.disconnecting)
        # A peer that really went silent is still timed out, once looked at again.
        proto2, transport2, clock2, _ = make_server(idle_timeout=1000)
        proto2.dataReceived(b"PING 1\n")
        clock2.advance(25)
        self.assertFalse(transport2.disconnecting)
        clock2.advance(0.1)
        self.assertTrue(transport2.disconnecting)
        self.assertEqual(proto2.close_reason, "ping_timeout")

    def test_any_line_resets_the_timeout(self):
        proto, transport, clock, handler = make_server()
        proto.dataReceived(b"PING 1\n")
        # A Synapse client may skip one PING (10 s gap); never timed out.
        for _ in range(20):
            clock.advance(10)
            proto.dataReceived(b"USER_SYNC w @u None start 1\n")
        self.assertFalse(transport.disconnecting)
        clock.advance(14.9)
        self.assertFalse(transport.disconnecting)
        clock.advance(0.1)
        self.assertEqual(proto.close_reason, "ping_timeout")

    def test_first_ping_brings_the_deadline_forward(self):
        proto, transport, clock, handler = make_server()
        clock.advance(1)
        proto.dataReceived(b"PING 1\n")
        clock.advance(14.9)
        self.assertIsNone(proto.close_reason)
        clock.advance(0.1)  # 15 s after the PING, not the idle timeout's 60
        self.assertEqual(proto.close_reason, "ping_timeout")

    def test_configurable_timeout(self):
        proto, transport, clock, handler = make_client(ping_timeout=30)
        proto.dataReceived(b"PING 1\n")
        clock.advance(29.9)
        self.assertFalse(transport.disconnecting)
        clock.advance(0.1)
        self.assertEqual(proto.close_reason, "ping_timeout")

    def test_abort_when_close_does_not_complete(self):
        proto, transport, clock, handler = make_server()
        transport.clear()
        proto.stop()
        self.assertEqual(transport.value(), b"ERROR server stopping\n")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(proto.close_reason, "shutdown")
        clock.advance(14.9)
        self.assertFalse(transport.disconnected)
        clock.advance(0.1)
        self.assertTrue(transport.disconnected)  # abortConnection was called
        lose(proto)
        self.assertEqual(handler.events[-1], ("lost_connection", "shutdown"))

    def test_no_abort_when_close_completes(self):
        proto, transport, clock, handler = make_server()
        proto.stop("bye")
        lose(proto)
        clock.advance(100)
        self.assertFalse(transport.disconnected)
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertEqual([e for e in handler.events if e[0] == "lost_connection"],
                         [("lost_connection", "shutdown")])

    def test_client_reports_healthy_after_handshake_and_a_ping_interval(self):
        healthy = []
        proto, transport, clock, handler = make_client(
            on_healthy=lambda: healthy.append(clock.seconds()))
        self.assertFalse(proto.established)
        clock.advance(3)
        proto.dataReceived(b"SERVER hs.example\nPING 1\n")
        self.assertTrue(proto.established)
        clock.advance(4.9)
        self.assertEqual(healthy, [])
        clock.advance(0.1)
        self.assertEqual(healthy, [T0 + 8])
        clock.pump([1] * 30)
        self.assertEqual(len(healthy), 1)

    def test_client_that_dies_early_is_never_healthy(self):
        healthy = []
        proto, transport, clock, handler = make_client(on_healthy=lambda: healthy.append(1))
        proto.dataReceived(b"SERVER hs.example\n")
        clock.advance(4)
        lose(proto)
        self.assertFalse(proto.established)
        clock.advance(100)
        self.assertEqual(healthy, [])
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_wrong_remote_is_never_established(self):
        healthy = []
        proto, transport, clock, handler = make_client(on_healthy=lambda: healthy.append(1))
        proto.dataReceived(b"SERVER other\n")
        clock.advance(10)
        self.assertEqual((proto.established, healthy), (False, []))

    def test_connection_lost_cancels_timers(self):
        proto, transport, clock, handler = make_server()
        proto.dataReceived(b"PING 1\n")
        lose(proto)
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertEqual(proto.close_reason, "connection_lost")
        self.assertEqual(handler.events[-1], ("lost_connection", "connection_lost"))


class CongestionTests(SynchronousTestCase):
    def test_queued_bytes_are_bounded_too(self):
        proto, transport, clock, handler = make_server(max_queued_bytes=1000)
        transport.clear()
        proto.pauseProducing()
        line = b"RDATA s w 1 [\"" + b"x" * 383 + b"\"]\n"  # 400 bytes
        self.assertTrue(proto.send_lines([line, line]))
        self.assertEqual(proto.queued_bytes, 800)
        # A 400-byte line would make 1,200 bytes: too many, though only 3 lines.
        self.assertFalse(proto.send_lines([line]))
        self.assertEqual(transport.value(), b"ERROR Failed to keep up\n")
        self.assertEqual(proto.close_reason, "congestion")
        self.assertEqual((proto.queued, proto.queued_bytes), (0, 0))

    def test_drained_bytes_no_longer_count(self):
        proto, transport, clock, handler = make_server(max_queued_bytes=1000)
        line = b"RDATA s w 1 [\"" + b"x" * 383 + b"\"]\n"
        for _ in range(10):
            proto.pauseProducing()
            self.assertTrue(proto.send_lines([line, line]))
            proto.resumeProducing()
            self.assertEqual(proto.queued_bytes, 0)
        self.assertIsNone(proto.close_reason)

    def test_pause_queue_and_disconnect_exactly_at_the_bound(self):
        proto, transport, clock, handler = make_server(max_queued_lines=10)
        transport.clear()
        proto.pauseProducing()
        for i in range(10):
            self.assertTrue(proto.send_command(PositionCommand("events", "master", i, i + 1)))
        self.assertEqual(proto.queued, 10)
        self.assertEqual(transport.value(), b"")
        self.assertFalse(transport.disconnecting)
        self.assertIsNone(proto.close_reason)
        # The eleventh is one too many.
        self.assertFalse(proto.send_command(PositionCommand("events", "master", 10, 11)))
        self.assertEqual(transport.value(), b"ERROR Failed to keep up\n")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(proto.close_reason, "congestion")
        self.assertEqual(proto.queued, 0)
        # The producer was unregistered so that the close can complete.
        self.assertIsNone(transport.producer)
        # Nothing more is written.
        self.assertFalse(proto.send_command(PingCommand("x")))
        self.assertEqual(transport.value(), b"ERROR Failed to keep up\n")
        lose(proto)
        self.assertEqual(handler.events[-1], ("lost_connection", "congestion"))

    def test_bulk_lines_count_toward_the_bound(self):
        proto, transport, clock, handler = make_server(max_queued_lines=10)
        transport.clear()
        proto.pauseProducing()
        self.assertTrue(proto.send_lines([b"RDATA s w %d []\n" % i for i in range(8)]))
        self.assertTrue(proto.send_lines([b"RDATA s w 8 []\n", b"RDATA s w 9 []\n"]))
        self.assertEqual(proto.queued, 10)
        self.assertFalse(transport.disconnecting)
        self.assertFalse(proto.send_lines([b"RDATA s w 10 []\n"]))
        self.assertEqual(transport.value(), b"ERROR Failed to keep up\n")
        self.assertEqual(proto.close_reason, "congestion")

    def test_batch_overflowing_the_bound(self):
        proto, transport, clock, handler = make_server(max_queued_lines=10)
        proto.pauseProducing()
        self.assertTrue(proto.send_lines([b"RDATA s w 1 []\n"] * 5))
        self.assertFalse(proto.send_lines([b"RDATA s w 2 []\n"] * 6))
        self.assertEqual(proto.close_reason, "congestion")

    def test_resume_drains_in_order(self):
        proto, transport, clock, handler = make_server()
        transport.clear()
        proto.pauseProducing()
        expected = []
        for i in range(5):
            proto.send_command(PositionCommand("events", "master", i, i + 1))
            expected.append(b"POSITION events master %d %d\n" % (i, i + 1))
        lines = encode_rdata_lines("caches", "master", [(6, ["a"]), (6, ["b"])])
        proto.send_lines(lines)
        expected.extend(lines)
        self.assertEqual(transport.value(), b"")
        proto.resumeProducing()
        self.assertEqual(transport.value(), b"".join(expected))
        self.assertEqual(proto.queued, 0)
        # Not paused any more: written directly.
        proto.send_command(ErrorCommand("x"))
        self.assertTrue(transport.value().endswith(b"ERROR x\n"))

    def test_pause_during_drain_keeps_the_rest_in_order(self):
        class PausingTransport(StringTransport):
            """Pauses its producer after the first write of a drain."""

            pause_after_next_write = False

            def write(self, data):
                super().write(data)
                if self.pause_after_next_write:
                    self.pause_after_next_write = False
                    self.producer.pauseProducing()

        proto = ServerReplicationProtocol(RecordingHandler(), "hs", clock=Clock())
        transport = connect(proto, PausingTransport())
        transport.clear()
        proto.pauseProducing()
        lines = [b"RDATA s w %d []\n" % i for i in range(2000)]
        for line in lines[:1500]:
            proto.send_lines([line])
        transport.pause_after_next_write = True
        proto.resumeProducing()
        written = transport.value().count(b"\n")
        self.assertTrue(0 < written < 1500, written)
        self.assertEqual(proto.queued, 1500 - written)
        proto.send_lines(lines[1500:])
        self.assertEqual(transport.value().count(b"\n"), written)
        proto.resumeProducing()
        self.assertEqual(transport.value(), b"".join(lines))

    def test_no_ping_while_paused(self):
        proto, transport, clock, handler = make_server(idle_timeout=1000)
        proto.pauseProducing()
        clock.pump([1] * 60)
        self.assertEqual(proto.queued, 0)
        self.assertFalse(transport.disconnecting)

    def test_stop_while_paused_writes_error_past_the_queue(self):
        proto, transport, clock, handler = make_server()
        transport.clear()
        proto.pauseProducing()
        proto.send_command(PingCommand("queued"))
        proto.stop()
        self.assertEqual(transport.value(), b"ERROR server stopping\n")
        self.assertEqual(proto.queued, 0)


class OutboundTests(SynchronousTestCase):
    def test_send_lines_is_one_write_and_one_count(self):
        writes = []

        class CountingTransport(StringTransport):
            def write(self, data):
                writes.append(data)
                super().write(data)

            def writeSequence(self, data):
                writes.append(list(data))
                super().writeSequence(data)

        handler = RecordingHandler()
        proto = ServerReplicationProtocol(handler, "hs", clock=Clock())
        transport = connect(proto, CountingTransport())
        transport.clear()
        handler.outbound.clear()
        del writes[:]
        lines = encode_rdata_lines("caches", "master", [(1, ["a"]), (1, ["b"]), (2, ["c"])])
        self.assertTrue(proto.send_lines(lines))
        # One write of the lines joined (no writeSequence: its cost grows
        # with the number of lines, per connection).
        self.assertEqual(writes, [b"".join(lines)])
        self.assertEqual(handler.outbound, [("RDATA", 3)])
        self.assertEqual(
            transport.value(),
            b'RDATA caches master batch ["a"]\nRDATA caches master 1 ["b"]\n'
            b'RDATA caches master 2 ["c"]\n',
        )

    def test_send_command_counts(self):
        proto, transport, clock, handler = make_client()
        handler.outbound.clear()
        proto.send_command(UserSyncCommand("w1", "@u:hs", None, True, 5))
        self.assertEqual(handler.outbound, [("USER_SYNC", 1)])
        self.assertTrue(transport.value().endswith(b"USER_SYNC w1 @u:hs None start 5\n"))

    def test_over_long_command_is_dropped(self):
        proto, transport, clock, handler = make_server(max_line_length=50)
        transport.clear()
        self.assertFalse(proto.send_command(RdataCommand("s", "w", 1, ["x" * 50])))
        self.assertFalse(proto.send_command(ErrorCommand("two\nlines")))
        self.assertEqual(transport.value(), b"")
        self.assertEqual(handler.dropped, [("RDATA", 1), ("ERROR", 1)])
        self.assertFalse(transport.disconnecting)
        self.assertEqual(len(self.flushLoggedErrors()), 0)

    def test_inbound_counts(self):
        proto, transport, clock, handler = make_server()
        proto.dataReceived(b"NAME w\nPING 1\nREPLICATE\nREPLICATE\n")
        self.assertEqual(handler.inbound, ["NAME", "PING", "REPLICATE", "REPLICATE"])

    def test_remote_error_reason(self):
        proto, transport, clock, handler = make_client()
        proto.dataReceived(b"ERROR server stopping\n")
        self.assertFalse(transport.disconnecting)
        self.assertEqual(handler.commands(), [("ERROR", ErrorCommand("server stopping"))])
        lose(proto)
        self.assertEqual(proto.close_reason, "remote_error")
        self.assertEqual(handler.events[-1], ("lost_connection", "remote_error"))

    def test_nothing_is_dispatched_after_close(self):
        proto, transport, clock, handler = make_server()
        proto.stop()
        proto.lineReceived(b"REPLICATE")
        self.assertEqual(handler.commands(), [])

    def test_send_command_goes_through_the_queue(self):
        proto, transport, clock, handler = make_server(max_line_length=50)
        transport.clear()
        proto.pauseProducing()
        self.assertTrue(proto.send_command(PingCommand("a")))
        self.assertFalse(proto.send_command(PingCommand("x" * 50)))
        self.assertEqual((transport.value(), proto.queued), (b"", 1))
        proto.resumeProducing()
        self.assertEqual(transport.value(), b"PING a\n")
        self.assertEqual(handler.dropped, [("PING", 1)])


class CapturedLogs:
    """Every log event published while in use, formatted as the daemon's
    observer writes it (one line each)."""

    def __init__(self):
        self.events = []

    def __enter__(self):
        from twisted.logger import globalLogPublisher

        globalLogPublisher.addObserver(self.events.append)
        return self

    def __exit__(self, *exc):
        from twisted.logger import globalLogPublisher

        globalLogPublisher.removeObserver(self.events.append)

    def lines(self):
        from twisted.logger import formatEvent

        return [formatEvent(e) for e in self.events]


class HostileInputTests(SynchronousTestCase):
    """Whatever a peer sends: ERROR + close and one log line, never a
    traceback; peer text in logs has its control characters escaped."""

    def test_huge_number_is_error_and_close_with_one_log_line(self):
        fields = [
            b"FEDERATION_ACK w " + b"1" * 5000,
            b"USER_SYNC w @u None start " + b"7" * 4301,
        ]
        for line in fields:
            proto, transport, clock, handler = make_server()
            transport.clear()
            with CapturedLogs() as logs:
                proto.dataReceived(line + b"\nREPLICATE\n")
            self.assertTrue(transport.value().startswith(b"ERROR failed to parse line: "),
                            line[:30])
            self.assertEqual(transport.value().count(b"\n"), 1)
            self.assertTrue(transport.disconnecting)
            self.assertEqual(proto.close_reason, "parse_error")
            self.assertEqual(handler.commands(), [])
            failures = [e for e in logs.events if "log_failure" in e]
            self.assertEqual(failures, [])
            self.assertEqual(len(logs.events), 1, logs.lines())
            self.assertIn("failed to parse line", logs.lines()[0])
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_huge_token_on_the_client_side(self):
        proto, transport, clock, handler = make_client()
        transport.clear()
        proto.dataReceived(b"SERVER hs.example\nRDATA events master " + b"9" * 4400 + b" []\n")
        self.assertTrue(transport.value().startswith(b"ERROR failed to parse line: RDATA: token "))
        self.assertEqual(proto.close_reason, "parse_error")
        self.assertEqual(self.flushLoggedErrors(), [])

    CONTROL = b"a\x00b\rc\x1b[31md\x7fe\xc2\x85f\xe2\x80\xaeg"

    def assertEscaped(self, lines):
        text = "\n".join(lines)
        for bad in ("\x00", "\r", "\x1b", "\x7f", "\x85", "\u202e"):
            self.assertNotIn(bad, text)
        self.assertIn("a\\x00b\\rc\\x1b[31md\\x7fe\\x85f\\u202eg", text)

    def test_peer_name_is_logged_escaped(self):
        proto, transport, clock, handler = make_server()
        with CapturedLogs() as logs:
            proto.dataReceived(b"NAME " + self.CONTROL + b"\n")
            proto.close("shutdown", "bye")
        self.assertEscaped(logs.lines())
        self.assertIn("a\\x00b", repr(proto))

    def test_peer_error_is_logged_escaped(self):
        proto, transport, clock, handler = make_client()
        with CapturedLogs() as logs:
            proto.dataReceived(b"ERROR " + self.CONTROL + b"\n")
        self.assertEscaped(logs.lines())

    def test_wrong_remote_is_logged_escaped(self):
        proto, transport, clock, handler = make_client()
        with CapturedLogs() as logs:
            proto.dataReceived(b"SERVER " + self.CONTROL + b"\n")
        self.assertEqual(proto.close_reason, "wrong_remote")
        self.assertEscaped(logs.lines())


class FramingPropertyTests(SynchronousTestCase):
    """However the byte stream is cut into reads, the same commands come
    out in the same order."""

    LINES = [
        b"NAME worker1",
        b"PING 1490197665500",
        b"REPLICATE ",
        b"USER_SYNC worker1 @alice:hs DEV start 1490197665500\r",
        b"FEDERATION_ACK worker1 42",
        b'USER_IP @alice:hs ["tok","10.0.0.1","ua \\u00e9 \xc3\xa9",null,17]',
        b"",
        b'LOCK_RELEASED ["worker1","lock","k\\n\xe2\x82\xac"]',
        b"CLEAR_USER_SYNC worker1",
        b"   ",
        b"REMOTE_SERVER_UP other.example",
        b"NEW_ACTIVE_TASK t1",
        b"CANCEL_TASK t1",
    ]

    @settings(max_examples=300, deadline=None)
    @given(
        st.lists(st.sampled_from(LINES), min_size=1, max_size=40),
        st.lists(st.integers(min_value=0, max_value=2000), max_size=30),
    )
    def test_random_splits_give_the_same_commands(self, lines, cuts):
        data = b"".join(line + b"\n" for line in lines)
        whole, _, _, whole_handler = make_server()
        whole.dataReceived(data)
        split, transport, _, split_handler = make_server()
        offsets = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
        for start, end in zip(offsets, offsets[1:]):
            split.dataReceived(data[start:end])
        self.assertEqual(split_handler.commands(), whole_handler.commands())
        expected = len([line for line in lines if line.strip()])
        self.assertEqual(len(split_handler.commands()), expected)
        self.assertFalse(transport.disconnecting)
        # A byte at a time, too.
        single, _, _, single_handler = make_server()
        for i in range(len(data)):
            single.dataReceived(data[i:i + 1])
        self.assertEqual(single_handler.commands(), whole_handler.commands())
