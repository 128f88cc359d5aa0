"""The declared interfaces of replication (:mod:`replicator.replication.interfaces`)
and of consumers: every implementation, and every test double standing in
for one, provides what it declares (``verifyObject``), and the handler
tells transports apart by what they declare, not by the methods they have."""

import os
import tempfile

from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from replicator.config import RedisConfig
from replicator.consumers import JsonlConsumer, LogConsumer, MemoryConsumer, run_inline
from replicator.consumers.base import IBatchConsumer, IConsumer
from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.interfaces import (
    IPeerConnection,
    IRedisBus,
    IReplicationConnection,
    IReplicationHandler,
    IReplicationView,
)
from replicator.replication.transport.base_handler import BaseHandler
from replicator.replication.transport.protocol import (
    ClientReplicationProtocol,
    ServerReplicationProtocol,
)
from replicator.replication.transport.redis import RedisReplication
from replicator.replication.transport.redis_bus import RedisConnection
from tests.fakes import FakeBus, FakeConnection, FakeView
from tests.handlers import CommandRecorder, MasterHandler, RecordingHandler


class _Registry(list):
    """No streams."""

    reactor = None

    def find(self, name):
        return None


def handler():
    return ReplicationHandler(_Registry(), "master", "hs.test", clock=Clock())


class ConnectionTests(SynchronousTestCase):
    def connected(self, proto):
        proto.makeConnection(StringTransport())
        self.addCleanup(proto.connectionLost, None)
        return proto

    def test_server_protocol(self):
        p = self.connected(ServerReplicationProtocol(handler(), "hs.test", clock=Clock()))
        self.assertTrue(verifyObject(IPeerConnection, p))
        self.assertTrue(verifyObject(IReplicationConnection, p))
        self.assertTrue(p.accepted)
        self.assertEqual(p.role, "client")

    def test_client_protocol(self):
        p = self.connected(ClientReplicationProtocol(handler(), "worker1", "hs.test",
                                                     clock=Clock()))
        self.assertTrue(verifyObject(IPeerConnection, p))
        self.assertFalse(p.accepted)
        self.assertEqual(p.role, "upstream")

    def test_redis_connection(self):
        conn = RedisConnection(FakeBus())
        self.assertTrue(verifyObject(IReplicationConnection, conn))
        self.assertFalse(IPeerConnection.providedBy(conn))  # no one peer to refuse
        self.assertFalse(conn.accepted)
        self.assertEqual(conn.role, "redis")

    def test_redis_connection_reads_through_its_owner(self):
        bus = FakeBus()
        conn = RedisConnection(bus)
        conn.pause_reading()
        self.assertTrue(bus.paused)
        conn.resume_reading()
        self.assertFalse(bus.paused)

    def test_fakes(self):
        self.assertTrue(verifyObject(IReplicationConnection, FakeConnection("worker1")))
        self.assertTrue(verifyObject(IRedisBus, FakeBus()))


class OwnerTests(SynchronousTestCase):
    def test_handler(self):
        self.assertTrue(verifyObject(IReplicationHandler, handler()))

    def test_handler_is_what_observers_see(self):
        """Observers (observe/, http/) see the core through this view alone."""
        self.assertTrue(verifyObject(IReplicationView, handler()))

    def test_view_double(self):
        self.assertTrue(verifyObject(IReplicationView, FakeView()))

    def test_base_handler_and_its_doubles_are_whole_handlers(self):
        """``replicator tail``'s printer and the tests' recorders subclass
        the base handler: the transports call every hook unconditionally."""
        for h in (BaseHandler(), RecordingHandler(), MasterHandler(), CommandRecorder(["a"])):
            self.assertTrue(verifyObject(IReplicationHandler, h), h)

    def test_redis_replication(self):
        owner = RedisReplication(MemoryReactorClock(), RedisConfig("tcp:127.0.0.1:1"),
                                 BaseHandler(), "hs.test", "master")
        self.assertTrue(verifyObject(IRedisBus, owner))


class ConsumerTests(SynchronousTestCase):
    def test_memory_and_log_consumers(self):
        for consumer in (MemoryConsumer(), LogConsumer()):
            self.assertTrue(verifyObject(IConsumer, consumer))
            self.assertFalse(IBatchConsumer.providedBy(consumer))

    def test_jsonl_consumer_takes_pages(self):
        path = os.path.join(tempfile.mkdtemp(), "facts.jsonl")
        consumer = JsonlConsumer(path, Clock(), run_io=run_inline)
        self.addCleanup(consumer.close)
        self.assertTrue(verifyObject(IBatchConsumer, consumer))
        self.assertTrue(verifyObject(IConsumer, consumer))
