"""``replicator_transport_buffer_bytes`` counts exactly the bytes a
connection has written that have not left the process, over real sockets.

A peer that does not read is the case the gauge exists for: the sender's
kernel send queue and the receiver's receive queue fill, and the rest waits
in the transport.  What was written must then be exactly the transport's
unsent bytes plus what the two kernels hold (``SIOCOUTQ`` on the sender,
``FIONREAD`` on the receiver) plus what the receiver read before it stopped.
"""

import fcntl
import os
import struct
import tempfile
import termios

from twisted.internet import defer, endpoints, protocol, reactor, task
from twisted.trial.unittest import TestCase

from replicator.net.twisted_private import unsent_bytes
from tests.pki import make_pki

#: What the sender writes: far more than two kernel socket buffers hold.
WRITTEN = 24 * 1024 * 1024


def _queued(sock, request) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0"))[0]


class Sink(protocol.Protocol):
    """Stops reading at its first bytes (under TLS: after the handshake)."""

    received = 0

    def connectionMade(self):
        self.factory.connected.callback(self)

    def dataReceived(self, data):
        self.received += len(data)
        self.transport.pauseProducing()


class Source(protocol.Protocol):
    def connectionMade(self):
        self.factory.connected.callback(self)


def _factory(cls):
    f = protocol.Factory.forProtocol(cls)
    f.connected = defer.Deferred()
    return f


def _socket(transport):
    """The socket of a connection (a TLS transport hands on attributes it
    does not have to the TCP connection underneath)."""
    return transport.socket


class UnsentBytesTests(TestCase):
    timeout = 60

    async def _connect(self, server_string, client_string):
        sinks = _factory(Sink)
        port = await endpoints.serverFromString(reactor, server_string).listen(sinks)
        self.addCleanup(port.stopListening)
        host = port.getHost()
        sources = _factory(Source)
        await endpoints.clientFromString(
            reactor, client_string.format(port=host.port)).connect(sources)
        source = await sources.connected
        sink = await sinks.connected
        self.addCleanup(sink.transport.abortConnection)
        self.addCleanup(source.transport.abortConnection)
        return source, sink

    async def _write_until_stuck(self, source):
        # Chunks, as a connection writes lines: some land in the transport's
        # list of later writes, the first ones in its buffer proper.
        chunk = b"x" * 65536
        for _ in range(WRITTEN // len(chunk)):
            source.transport.write(chunk)
        # Let the reactor write until the kernel takes no more.
        last = None
        while True:
            await task.deferLater(reactor, 0.05, lambda: None)
            now = unsent_bytes(source.transport)
            if now == last:
                return now
            last = now

    async def test_tcp_peer_not_reading(self):
        source, sink = await self._connect("tcp:0:interface=127.0.0.1",
                                           "tcp:host=127.0.0.1:port={port}")
        unsent = await self._write_until_stuck(source)
        self.assertGreater(unsent, 0)
        self.assertEqual(unsent + self._elsewhere(source, sink), WRITTEN)

    def _elsewhere(self, source, sink):
        """Bytes in the two kernels' queues and read by the sink."""
        return (_queued(_socket(source.transport), termios.TIOCOUTQ)
                + _queued(_socket(sink.transport), termios.FIONREAD) + sink.received)

    async def test_tls_counts_the_connection_underneath(self):
        tmp = tempfile.mkdtemp()
        pki = make_pki(tmp)
        source, sink = await self._connect(
            f"ssl:0:interface=127.0.0.1:privateKey={pki['server.key']}"
            f":certKey={pki['server.crt']}",
            "ssl:host=127.0.0.1:port={port}:caCertsDir=" + os.path.dirname(pki["ca.crt"])
            + ":hostname=localhost")
        unsent = await self._write_until_stuck(source)
        # What is unsent is ciphertext, a little longer than the plaintext
        # (a record header and tag per 16 KB record, under 1 %), and the
        # kernels hold ciphertext too; the sink counts plaintext.
        total = unsent + self._elsewhere(source, sink)
        self.assertGreaterEqual(total, WRITTEN)
        self.assertLess(total, WRITTEN * 1.01)

    def test_no_transport_attributes(self):
        # A transport that is not a file descriptor (tests' StringTransport,
        # a closed connection) has nothing unsent that can be seen.
        self.assertEqual(unsent_bytes(object()), 0)
        self.assertEqual(unsent_bytes(None), 0)
