#!/usr/bin/env python3
"""Synapse's own replication client protocol as a benchmark baseline.

Run with the Python of the Synapse virtualenv (``make synapse-deps``), as a
separate process: Synapse is AGPL, so it is only imported and run, nothing
of it is copied.  It connects to a replication server (ours: the master of
the ``follow`` phase, see ``follow.py``) with ``synapse.replication.tcp.
protocol.ClientReplicationStreamProtocol``, the class a Synapse worker
uses to follow its main process over TCP, and is fed the same lines as our
worker beside it.  What a connection hands its command handler is taken
the way Synapse's ``ReplicationCommandHandler`` takes it: ``batch`` rows
held per stream and writer until the row with the token, then the fact's
rows handed on (here: counted; a Synapse worker would notify its caches).
The rest of a homeserver (database, streams, caches) is not started: the
figure is the protocol's cost of the same lines, as a lower bound of what
a Synapse worker spends on them.

Arguments: ``HOST PORT SERVER_NAME``.  Driven over stdin/stdout, one JSON
object per line: at start nothing; ``state`` answers ``{"facts", "last",
"cpu"}`` (facts completed, the largest token seen, this process's CPU
seconds).  EOF on stdin stops it.
"""

import json
import logging
import resource
import sys

from synapse.replication.tcp.protocol import ClientReplicationStreamProtocol
from synapse.util.clock import Clock
from twisted.internet import defer, protocol, reactor, stdio
from twisted.protocols.basic import LineReceiver


class HomeServerStub:
    """What the protocol asks of a homeserver when a handler method returns
    an awaitable (ours never does)."""

    def run_as_background_process(self, desc, func, *args, **kwargs):
        return defer.ensureDeferred(func(*args, **kwargs))


class Handler:
    """The part of Synapse's ReplicationCommandHandler a client connection
    talks to: RDATA rows gathered per fact, POSITIONs noted."""

    def __init__(self):
        self.pending = {}
        self.facts = 0
        self.last = 0

    def new_connection(self, conn):
        pass

    def lost_connection(self, conn):
        self.pending.clear()

    def on_RDATA(self, conn, cmd):
        key = (cmd.stream_name, cmd.instance_name)
        if cmd.token is None:
            self.pending.setdefault(key, []).append(cmd.row)
            return
        rows = self.pending.pop(key, [])
        rows.append(cmd.row)
        self.facts += 1
        if cmd.token > self.last:
            self.last = cmd.token

    def on_POSITION(self, conn, cmd):
        self.pending.pop((cmd.stream_name, cmd.instance_name), None)
        if cmd.new_token > self.last:
            self.last = cmd.new_token


class Factory(protocol.ClientFactory):
    def __init__(self, handler, server_name):
        self.handler = handler
        self.server_name = server_name
        self.hs = HomeServerStub()
        self.clock = Clock(reactor, server_name)

    def buildProtocol(self, addr):
        return ClientReplicationStreamProtocol(self.hs, "synapse-baseline", self.server_name,
                                               self.clock, self.handler)

    def clientConnectionFailed(self, connector, reason):
        sys.stderr.write(f"synapse_client: connection failed: {reason.getErrorMessage()}\n")
        reactor.stop()


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Control(LineReceiver):
    delimiter = b"\n"

    def __init__(self, handler):
        self.handler = handler

    def lineReceived(self, line):
        if line.strip() == b"state":
            self.transport.write(json.dumps({
                "facts": self.handler.facts, "last": self.handler.last, "cpu": cpu_seconds(),
            }).encode() + b"\n")

    def connectionLost(self, reason):
        if reactor.running:
            reactor.stop()


def main():
    # No homeserver configures Synapse's loggers: only CRITICAL is printed
    # (its debug/info calls still run).
    logging.disable(logging.ERROR)
    host, port, server_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    handler = Handler()
    reactor.connectTCP(host, port, Factory(handler, server_name))
    stdio.StandardIO(Control(handler))
    reactor.run()


if __name__ == "__main__":
    main()
