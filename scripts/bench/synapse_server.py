#!/usr/bin/env python3
"""Synapse's own replication server protocol as a benchmark baseline.

Run with the Python of the Synapse virtualenv (``make synapse-deps``), as a
separate process: Synapse is AGPL, so it is only imported and run, nothing
of it is copied.  It listens on a loopback port and serves the benchmark's
reader processes with ``synapse.replication.tcp.protocol.
ServerReplicationStreamProtocol``, the class a Synapse main process uses for
its TCP replication.  What Synapse's ``ReplicationCommandHandler`` does on
an update is done here the same way: one ``RdataCommand`` per row, handed to
``send_command`` of every connection (which formats, JSON-encodes and
writes it per connection, and queues it while the transport is paused).
The rest of a homeserver (database, streams, Redis) is not started: the
figure is the protocol's cost of the same rows in memory, as ours is.

Driven over stdin/stdout, one JSON object per line:

* at start it prints ``{"port": N}``;
* ``wait N``: answers ``{"ready": N}`` once N connections sent REPLICATE;
* ``run ROWS CHUNK``: feeds rows 1..ROWS (``benchrows.row``), CHUNK rows,
  then one trip through the reactor, waiting while any connection is
  paused, like the pump of ours; answers ``{"start", "fed", "cpu"}``
  (wall-clock seconds, this process's CPU seconds);
* ``close``: closes every connection, answers ``{"closed": N}``.

EOF on stdin stops it.
"""

import json
import logging
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchrows import POOL, row  # noqa: E402
from synapse.replication.tcp.commands import PositionCommand, RdataCommand  # noqa: E402
from synapse.replication.tcp.protocol import (  # noqa: E402
    ConnectionStates,
    ServerReplicationStreamProtocol,
)
from synapse.util.clock import Clock  # noqa: E402
from twisted.internet import defer, protocol, reactor, stdio, task  # noqa: E402
from twisted.protocols.basic import LineReceiver  # noqa: E402

SERVER_NAME = "bench"
WRITER = "master"
STREAM = "caches"


class HomeServerStub:
    """What the protocol asks of a homeserver when a handler method returns
    an awaitable (ours never does)."""

    def run_as_background_process(self, desc, func, *args, **kwargs):
        return defer.ensureDeferred(func(*args, **kwargs))


class Handler:
    """The part of Synapse's ReplicationCommandHandler a server connection
    talks to: connections, REPLICATE answered with a POSITION."""

    def __init__(self):
        self.connections = []
        self.replicating = set()

    def new_connection(self, conn):
        self.connections.append(conn)

    def lost_connection(self, conn):
        if conn in self.connections:
            self.connections.remove(conn)
        self.replicating.discard(conn)

    def on_REPLICATE(self, conn, cmd):
        conn.send_command(PositionCommand(STREAM, WRITER, 0, 0))
        self.replicating.add(conn)

    def stream_update(self, token, data):
        cmd = RdataCommand(STREAM, WRITER, token, data)
        for conn in self.connections:
            conn.send_command(cmd)

    def busy(self):
        return any(c.state == ConnectionStates.PAUSED for c in self.connections)


class Factory(protocol.Factory):
    def __init__(self, handler):
        self.handler = handler
        self.hs = HomeServerStub()
        self.clock = Clock(reactor, SERVER_NAME)

    def buildProtocol(self, addr):
        return ServerReplicationStreamProtocol(self.hs, SERVER_NAME, self.clock, self.handler)


def tick():
    return task.deferLater(reactor, 0, lambda: None)


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Control(LineReceiver):
    delimiter = b"\n"

    def __init__(self, handler):
        self.handler = handler
        self.pool = [row(i) for i in range(POOL)]

    def reply(self, obj):
        self.transport.write(json.dumps(obj).encode() + b"\n")

    def lineReceived(self, line):
        words = line.decode().split()
        if not words:
            return
        if words[0] == "wait":
            defer.ensureDeferred(self.wait(int(words[1])))
        elif words[0] == "run":
            defer.ensureDeferred(self.run(int(words[1]), int(words[2])))
        elif words[0] == "close":
            n = len(self.handler.connections)
            for c in list(self.handler.connections):
                c.transport.loseConnection()
            self.reply({"closed": n})

    async def wait(self, n):
        while len(self.handler.replicating) < n:
            await task.deferLater(reactor, 0.01, lambda: None)
        self.reply({"ready": n})

    async def run(self, rows, chunk):
        handler = self.handler
        pool = self.pool
        cpu0 = cpu_seconds()
        start = time.time()
        token = 0
        while token < rows:
            first = token + 1
            for token in range(first, min(rows, first + chunk - 1) + 1):
                handler.stream_update(token, pool[token % POOL])
            await tick()
            while handler.busy():
                await tick()
        self.reply({"start": start, "fed": time.time(), "cpu": cpu_seconds() - cpu0})

    def connectionLost(self, reason):
        if reactor.running:
            reactor.stop()


def main():
    # Synapse's loggers are not configured here (no homeserver): without
    # this, Python's last-resort handler prints its complaints (errors, with
    # a stack) about the log contexts of closed connections, which have no
    # homeserver's background process around them, into the bench's output.
    # Its debug/info calls still run; only CRITICAL is printed.
    logging.disable(logging.ERROR)
    handler = Handler()
    port = reactor.listenTCP(0, Factory(handler), backlog=256, interface="127.0.0.1")
    stdio.StandardIO(Control(handler))
    sys.stdout.write(json.dumps({"port": port.getHost().port}) + "\n")
    sys.stdout.flush()
    reactor.run()


if __name__ == "__main__":
    main()
