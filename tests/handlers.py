"""Handlers that tests hand to the transports: each a
:class:`~replicator.replication.transport.base_handler.BaseHandler` (so a
whole :class:`~replicator.replication.interfaces.IReplicationHandler`,
checked in ``tests/test_interfaces.py``) that records what it is told;
and a real handler on a registry of two streams (:func:`handler`) with
connections to its server side (:class:`Peers`).  Test modules import
them from here, never from one another."""

from types import SimpleNamespace

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.transport.base_handler import BaseHandler
from replicator.replication.transport.protocol import ServerReplicationProtocol
from replicator.replication.transport.tcp import ReplicationServerFactory


class RecordingHandler(BaseHandler):
    """Records everything the protocol tells it, in order; clients may
    write the ``(stream, writer)`` pairs of ``writers``."""

    def __init__(self, writers=(), **kwargs):
        super().__init__(**kwargs)
        self.events = []
        self.writers = set(writers)
        self.inbound = []
        self.outbound = []
        self.dropped = []

    def new_connection(self, conn):
        self.events.append(("new_connection", conn.transport.value()))

    def lost_connection(self, conn, reason):
        self.events.append(("lost_connection", reason))

    def client_may_write(self, stream_name, instance_name):
        return (stream_name, instance_name) in self.writers

    def count_inbound(self, conn, name):
        self.inbound.append(name)

    def count_outbound(self, conn, name, n):
        self.outbound.append((name, n))

    def count_dropped(self, conn, name, n):
        self.dropped.append((name, n))

    def __getattr__(self, attr):
        if attr.startswith("on_"):
            return lambda conn, cmd: self.events.append((attr[3:], cmd))
        raise AttributeError(attr)

    def commands(self):
        return [e for e in self.events if e[0] not in ("new_connection", "lost_connection")]


class MasterHandler(RecordingHandler):
    """A recording handler of instance ``master`` writing one stream, with
    ``worker1`` a remote writer of it."""

    registry = [SimpleNamespace(local_writers=["master"])]

    def __init__(self):
        super().__init__(writers=[("caches", "worker1")], instance_name="master",
                         known_names=frozenset({"master", "worker1"}))


class CommandRecorder(BaseHandler):
    """Records the line of every command a Redis link hands on; ``registry``
    the streams it subscribes for (each a name and its writers)."""

    def __init__(self, streams=(), registry=None):
        super().__init__()
        self.registry = registry if registry is not None else [
            SimpleNamespace(name=name, config=SimpleNamespace(writers=("master",)))
            for name in streams]
        self.received = []

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda conn, cmd: self.received.append(cmd.to_line())
        raise AttributeError(name)


class FakeRegistry:
    """Two streams: ``caches`` written by master and worker1, ``events`` by
    master (this instance).  The bookkeeping needs nothing else."""

    def __init__(self):
        self.streams = [
            SimpleNamespace(name=name, config=SimpleNamespace(writers=writers),
                            local_writers=["master"])
            for name, writers in (("caches", ("master", "worker1")), ("events", ("master",)))
        ]

    def __iter__(self):
        return iter(self.streams)

    def find(self, name):
        return next((s for s in self.streams if s.name == name), None)


def handler(**kwargs):
    """A real handler of ``master`` on a :class:`FakeRegistry`, its clock at
    1000 s: ``(handler, clock)``."""
    clock = Clock()
    clock.advance(1000)
    return ReplicationHandler(FakeRegistry(), "master", "hs.test", clock=clock, **kwargs), clock


class Peers:
    """Connections to one handler's server side, through its factory."""

    def __init__(self, test, handler):
        # The factory's default policy: nobody takes the master's name.
        self.policy = ReplicationServerFactory(handler, "hs.test", clock=Clock()).policy
        self.handler = handler
        self.test = test

    def connect(self, name=None):
        # Each connection on its own clock (keepalive timers): the
        # bookkeeping's time is the handler's clock.
        proto = ServerReplicationProtocol(self.handler, "hs.test", policy=self.policy,
                                          clock=Clock())
        transport = StringTransport()
        proto.makeConnection(transport)
        self.test.addCleanup(self._lose, proto)
        if name:
            proto.dataReceived(f"NAME {name}\n".encode())
        transport.clear()
        return proto, transport

    def _lose(self, proto):
        if proto in self.handler.connections:
            proto.connectionLost(None)
