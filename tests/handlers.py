"""Handlers that tests hand to the transports: each a
:class:`~replicator.replication.transport.base_handler.BaseHandler` (so a
whole :class:`~replicator.replication.interfaces.IReplicationHandler`,
checked in ``tests/test_interfaces.py``) that records what it is told.
Test modules import them from here, never from one another."""

from types import SimpleNamespace

from replicator.replication.transport.base_handler import BaseHandler


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
