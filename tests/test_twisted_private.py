"""The Twisted internals :mod:`replicator.net.twisted_private` reads: the
installed Twisted is in the range setup.cfg declares (the range the module
was checked against), and the internals are there and behave as it
assumes, on a real loopback connection and an in-memory HTTP channel."""

import configparser
import os

import twisted
from packaging.requirements import Requirement
from twisted.internet import defer, endpoints, interfaces, protocol, reactor
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web import http
from zope.interface import implementer

from replicator.net import twisted_private

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def declared_twisted() -> Requirement:
    """setup.cfg's requirement on Twisted."""
    config = configparser.ConfigParser()
    with open(os.path.join(ROOT, "setup.cfg"), encoding="utf-8") as f:
        config.read_file(f)
    found = [Requirement(line.strip()) for line in config["options"]["install_requires"]
             .splitlines() if line.strip().startswith("twisted")]
    assert len(found) == 1, found
    return found[0]


class VersionTests(SynchronousTestCase):
    def test_declared_range_is_the_checked_one(self):
        """Widening the declared range means checking the internals again
        (then this module's CHECKED and docstring follow)."""
        self.assertEqual(str(declared_twisted().specifier), twisted_private.CHECKED)

    def test_installed_twisted_in_range(self):
        self.assertIn(twisted.__version__, declared_twisted().specifier)


@implementer(interfaces.IHalfCloseableProtocol)
class Client(protocol.Protocol):
    """Counts what it receives; fires ``got`` when ``want`` bytes are in and
    ``closed`` when the peer shuts its write half."""

    def __init__(self) -> None:
        self.received = 0
        self.want = 0
        self.got: defer.Deferred = defer.Deferred()
        self.closed: defer.Deferred = defer.Deferred()

    def expect(self, count: int) -> defer.Deferred:
        self.want, self.got = self.received + count, defer.Deferred()
        return self.got

    def dataReceived(self, data: bytes) -> None:
        self.received += len(data)
        if self.received >= self.want and not self.got.called:
            self.got.callback(None)

    def readConnectionLost(self) -> None:
        self.closed.callback(None)

    def writeConnectionLost(self) -> None:
        pass


class Server(protocol.Protocol):
    def connectionMade(self) -> None:
        self.factory.made.callback(self)


class TcpTests(TestCase):
    async def connect(self):
        factory = protocol.Factory.forProtocol(Server)
        factory.made = defer.Deferred()
        port = await endpoints.TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1") \
            .listen(factory)
        self.addCleanup(port.stopListening)
        client = Client()
        await endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port), client)
        self.addCleanup(client.transport.abortConnection)
        server = await factory.made
        self.addCleanup(server.transport.abortConnection)
        return server.transport, client

    async def test_write_buffer(self):
        transport, client = await self.connect()
        self.assertIs(twisted_private.plain_tcp(transport), transport)
        self.assertEqual((twisted_private.queued(transport),
                          twisted_private.unsent_bytes(transport)), (False, 0))

        # write() keeps the bytes until the reactor's doWrite: queued.
        got = client.expect(10)
        transport.write(b"x" * 10)
        self.assertEqual(transport._tempDataLen, 10)
        self.assertEqual((twisted_private.queued(transport),
                          twisted_private.unsent_bytes(transport)), (True, 10))
        await got
        self.assertEqual((twisted_private.queued(transport),
                          twisted_private.unsent_bytes(transport)), (False, 0))

        # writeSomeData sends at once and says how much.
        got = client.expect(3)
        self.assertEqual(transport.writeSomeData(b"abc"), 3)
        await got
        self.assertEqual(client.received, 13)

        # A shut write half is queued (nothing may go straight to the socket).
        self.assertFalse(transport._writeDisconnected)
        transport.loseWriteConnection()
        await client.closed
        self.assertTrue(transport._writeDisconnected)
        self.assertTrue(twisted_private.queued(transport))

    async def test_disconnecting_is_queued(self):
        transport, client = await self.connect()
        transport.loseConnection()
        self.assertTrue(transport.disconnecting)
        self.assertTrue(twisted_private.queued(transport))

    def test_not_plain_tcp(self):
        for transport in (StringTransport(), None, object()):
            self.assertIsNone(twisted_private.plain_tcp(transport))
            self.assertEqual(twisted_private.unsent_bytes(transport), 0)


@implementer(interfaces.IPushProducer)
class Producer:
    paused = False

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        pass


class ChannelTests(SynchronousTestCase):
    def test_waiting_for_transport(self):
        channel = http.HTTPChannel()
        channel.makeConnection(StringTransport())
        self.addCleanup(channel.connectionLost, None)
        self.assertFalse(twisted_private.waiting_for_transport(channel))
        channel.pauseProducing()  # the transport's buffer is full
        self.assertTrue(twisted_private.waiting_for_transport(channel))
        # A producer registered now is not paused by the channel: the
        # caller must look (what the event stream does at its start).
        producer = Producer()
        channel.registerProducer(producer, True)
        self.assertFalse(producer.paused)
        channel.resumeProducing()
        self.assertFalse(twisted_private.waiting_for_transport(channel))
        channel.unregisterProducer()

    def test_not_a_channel(self):
        self.assertFalse(twisted_private.waiting_for_transport(None))
        self.assertFalse(twisted_private.waiting_for_transport(object()))
