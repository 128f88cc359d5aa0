"""The replication core in memory: instances, connections, a database and
a clock, with no socket, no thread and no wait.

What a test gets from :class:`Harness`:

* **A reactor and clock** (:class:`MemoryReactor`, a
  :class:`~twisted.internet.testing.MemoryReactorClock` whose TCP
  connects reach its listeners in memory) that
  moves only when the test moves it: every instance, protocol and timer of
  the harness runs on it.  :meth:`Harness.flush` runs what is due now;
  :meth:`Harness.advance` moves time; :meth:`Harness.settle` moves it from
  one scheduled call to the next while some handler is not
  :meth:`~replicator.replication.core.handler.ReplicationHandler.idle`.
* **A database**: one SQLite database in memory, shared by every instance
  of the harness (as instances share their PostgreSQL database), behind a
  :class:`SyncPool`: each interaction runs inline, in its own transaction,
  and its Deferred has fired when the call returns.
* **Instances** (:meth:`Harness.instance`): a registry and a handler
  assembled as :class:`replicator.daemon.service.Instance` assembles them, minus
  listeners and HTTP.
* **Connections**: :meth:`Harness.serve` gives a server-side protocol on a
  :class:`~twisted.internet.testing.StringTransport`, for a test that
  speaks the peer's lines itself; :meth:`Harness.client` the same for the
  client side; :meth:`Harness.connect` joins a server instance and a client
  instance with :mod:`twisted.test.iosim` (bytes move at each flush).

So an assertion follows a :meth:`Harness.settle` (or :meth:`Harness.run` of
a write), never a poll: when it returns, everything the instances could do
has been done.  Real servers stay for what is integration (PostgreSQL's
concurrency and sequences, TLS, sockets, Redis).

SQLite differs from PostgreSQL where a test may care.  A stream's sequence
is an instance's own counter on SQLite; the harness makes it one per stream
for all its instances, as PostgreSQL's is, by bringing every instance's
counter up to the largest at each flush (so two instances writing one
stream in the same turn would take the same IDs: a test writes on one
instance per :meth:`Harness.run`).  :meth:`Harness.sequence_taken` says
that a writer outside the harness took IDs.  An instance that only reads a
stream creates no table, so the writer's instance is made first (or
:meth:`Harness.create_tables` called).
"""

import sqlite3
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from twisted.internet import defer, error
from twisted.internet.address import IPv4Address
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.test import iosim

from replicator.config import DatabaseConfig, StreamConfig
from replicator.consumers import Consumer
from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.transport.protocol import (
    ClientReplicationProtocol,
    ServerReplicationProtocol,
)
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from replicator.streams.stream import Stream
from tests.support import create_sqlite_tables

SERVER_NAME = "hs.test"
#: How far :meth:`Harness.settle` moves the clock at most, by default:
#: longer than any retry or fan-out interval a test waits for.
SETTLE_LIMIT = 60.0


class MemoryReactor(MemoryReactorClock):
    """:class:`~twisted.internet.testing.MemoryReactorClock` whose TCP
    connects reach its listeners in memory, and that takes
    ``callFromThread``.

    * ``listenTCP(port, factory)`` listens (``tcp:PORT`` endpoint strings
      too); ``connectTCP(host, port, factory)`` is accepted at the clock's
      next turn (as a listener accepts when its reactor gets to it): the
      protocol it builds is joined to what the listener's factory builds
      (:meth:`Harness.join`; bytes move at each flush), or, with nothing
      listening on the port, the connect fails (connection refused).  A
      connect stopped before it is accepted is forgotten.  So reconnecting
      services and endpoint strings (``tcp:host=127.0.0.1:port=PORT``)
      run as they do on sockets.
    * There is no thread but the test's, so a call "from a thread" (a
      metrics scrape asking the reactor for a verdict) runs at once.
    """

    def __init__(self, harness: "Harness"):
        super().__init__()
        self._harness = harness
        self.listening: dict[int, Factory] = {}

    def callFromThread(self, f: Callable, *args: Any, **kwargs: Any) -> None:
        f(*args, **kwargs)

    def listenTCP(self, port: int, factory: Factory, backlog: int = 50,
                  interface: str = "") -> Any:
        listening = super().listenTCP(port, factory, backlog, interface)
        self.listening[port] = factory
        stop = listening.stopListening

        def stop_listening() -> Any:
            self.listening.pop(port, None)
            return stop()
        listening.stopListening = stop_listening
        return listening

    def connectTCP(self, host: str, port: int, factory: Any, timeout: float = 30,
                   bindAddress: Any = None) -> Any:
        connector = super().connectTCP(host, port, factory, timeout, bindAddress)
        source = IPv4Address("TCP", "127.0.0.1", 50000 + len(self.connectors))

        def accept() -> None:
            listener = self.listening.get(port)
            if listener is None:
                factory.clientConnectionFailed(
                    connector, Failure(error.ConnectionRefusedError()))
                return
            client = factory.buildProtocol(connector.getDestination())
            server = listener.buildProtocol(source)
            self._harness.join(server, client, client_address=source, flush=False)

        call = self.callLater(0, accept)

        def stop_connecting() -> None:
            connector.stoppedConnecting = True
            if call.active():
                call.cancel()
                factory.clientConnectionFailed(connector, Failure(error.UserError()))
        connector.stopConnecting = stop_connecting
        return connector


class SyncPool:
    """What :class:`replicator.storage.database.Database` uses of an
    :class:`twisted.enterprise.adbapi.ConnectionPool`, run inline on one
    sqlite3 connection.

    Each call is one transaction, committed when ``fn`` returns and rolled
    back when it raises, exactly as the pool does in its threads; the
    Deferred returned has already fired (with the result or the failure).
    Several pools may share one connection (instances sharing a database):
    with no thread, transactions never overlap.
    """

    def __init__(self, connection: sqlite3.Connection):
        self.connection = connection
        self.closed = False

    def runWithConnection(self, fn: Callable, *args: Any, **kwargs: Any) -> defer.Deferred:
        return self._run(lambda: fn(self.connection, *args, **kwargs))

    def runInteraction(self, fn: Callable, *args: Any, **kwargs: Any) -> defer.Deferred:
        def interaction() -> Any:
            cursor = self.connection.cursor()
            try:
                return fn(cursor, *args, **kwargs)
            finally:
                cursor.close()
        return self._run(interaction)

    def runQuery(self, sql: str, *args: Any) -> defer.Deferred:
        def query(cursor: sqlite3.Cursor) -> list[tuple]:
            cursor.execute(sql, *args)
            return cursor.fetchall()
        return self.runInteraction(query)

    def runOperation(self, sql: str, *args: Any) -> defer.Deferred:
        def operation(cursor: sqlite3.Cursor) -> None:
            cursor.execute(sql, *args)
        return self.runInteraction(operation)

    def close(self) -> None:
        self.closed = True  # the connection is the harness's, shared

    def _run(self, work: Callable[[], Any]) -> defer.Deferred:
        if self.closed:
            return defer.fail(RuntimeError("pool closed"))
        try:
            result = work()
        except BaseException:
            failure = Failure()
            self.connection.rollback()
            return defer.fail(failure)
        self.connection.commit()
        return defer.succeed(result)


class Node:
    """One instance of the harness: its database handle, streams, handler
    and consumers."""

    def __init__(self, name: str, db: Database, registry: StreamRegistry,
                 handler: ReplicationHandler, consumers: Sequence[Consumer]):
        self.name = name
        self.db = db
        self.registry = registry
        self.handler = handler
        self.consumers = list(consumers)

    def stream(self, name: str) -> Stream:
        return self.registry.get(name)


class Link:
    """A server protocol and a client protocol joined by iosim transports;
    ``pump`` moves the bytes (the harness does at every flush)."""

    def __init__(self, server: Protocol, client: Protocol, pump: iosim.IOPump):
        self.server = server
        self.client = client
        self.pump = pump

    def cut(self) -> None:
        """Both ends see the connection lost (a cut link)."""
        self.server.transport.abortConnection()


class Harness:
    """Instances of one deployment, in memory (see the module docstring).

    ``cleanup`` is given what to undo at the end (``TestCase.addCleanup``).
    """

    def __init__(self, streams: Sequence[StreamConfig], cleanup: Callable[..., None],
                 server_name: str = SERVER_NAME):
        self.streams = list(streams)
        self.server_name = server_name
        self.clock = MemoryReactor(self)
        self.connection = sqlite3.connect(":memory:")
        self._cleanup = cleanup
        self.nodes: list[Node] = []
        self.links: list[Link] = []
        self._protocols: list[Any] = []
        cleanup(self.close)

    # ------------------------------------------------------------ assembling
    def database(self) -> Database:
        """A handle on the harness's database, as an instance opens its own."""
        config = DatabaseConfig("sqlite", path=":memory:", pool_min=1, pool_max=1,
                                write_group_max=256)
        return Database(config, pool=SyncPool(self.connection))

    def create_tables(self) -> None:
        """Create every stream's table, as its writers do at start: for a
        test whose instances only read some of them (a reader creates
        nothing, and refuses to start without its table)."""
        create_sqlite_tables(self.connection, self.streams)

    def instance(self, name: str, consumers: Iterable[Consumer] = (),
                 streams: Sequence[StreamConfig] | None = None,
                 **handler_kwargs: Any) -> Node:
        """Instance ``name``: its streams loaded, its handler started."""
        consumers = list(consumers)
        db = self.database()
        registry = StreamRegistry(db, name, streams if streams is not None else self.streams,
                                  call_from_thread=self._call_from_thread, reactor=self.clock)
        self.run(registry.start())
        handler = ReplicationHandler(registry, name, self.server_name, consumers=consumers,
                                     **handler_kwargs)
        self.run(handler.load_findings())
        handler.start()
        node = Node(name, db, registry, handler, consumers)
        self.nodes.append(node)
        return node

    def _call_from_thread(self, fn: Callable, *args: Any, **kwargs: Any) -> None:
        # There is no other thread: "back on the reactor" is the next turn.
        self.clock.callLater(0, fn, *args, **kwargs)

    # ------------------------------------------------------------ connections
    def serve(self, node: Node, name: str | None = None, replicate: bool = False,
              clear: bool = True, **kwargs: Any) -> tuple[ServerReplicationProtocol,
                                                          StringTransport]:
        """A connection accepted by ``node`` whose peer is the test: what
        the peer says goes to ``proto.dataReceived``, what it is sent is in
        the transport.  ``name``: the peer's NAME; ``replicate``: it sent
        REPLICATE; ``clear``: the transport is emptied of the handshake."""
        proto = ServerReplicationProtocol(node.handler, self.server_name, clock=self.clock,
                                          **kwargs)
        transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
        proto.makeConnection(transport)
        self._protocols.append(proto)
        if name:
            proto.dataReceived(f"NAME {name}\n".encode())
        if replicate:
            proto.dataReceived(b"REPLICATE\n")
        if clear:
            transport.clear()
        return proto, transport

    def client(self, node: Node, server_name: str | None = None, handshake: bool = True,
               clear: bool = True, **kwargs: Any) -> tuple[ClientReplicationProtocol,
                                                           StringTransport]:
        """``node``'s connection to an upstream that is the test;
        ``handshake``: the upstream already said ``SERVER``."""
        proto = ClientReplicationProtocol(node.handler, node.name, self.server_name,
                                          clock=self.clock, **kwargs)
        transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 9092))
        proto.makeConnection(transport)
        self._protocols.append(proto)
        if handshake:
            proto.dataReceived(f"SERVER {server_name or self.server_name}\n".encode())
        if clear:
            transport.clear()
        return proto, transport

    def connect(self, server: Node, client: Node) -> Link:
        """``client`` connected to ``server`` as its upstream, through
        in-memory transports; the handshake done."""
        sp = ServerReplicationProtocol(server.handler, self.server_name, clock=self.clock)
        cp = ClientReplicationProtocol(client.handler, client.name, self.server_name,
                                       clock=self.clock)
        return self.join(sp, cp)

    def accept(self, factory: Factory, peer: Protocol, host: str = "127.0.0.1") -> Link:
        """A connection from ``peer`` (at ``host``) accepted by a listener's
        ``factory``: what the factory builds for it, joined to ``peer``."""
        address = IPv4Address("TCP", host, 40000 + len(self.links))
        return self.join(factory.buildProtocol(address), peer, client_address=address)

    def join(self, server: Protocol, client: Protocol,
             client_address: IPv4Address | None = None, flush: bool = True) -> Link:
        """Two protocols joined by iosim transports (bytes move at each
        :meth:`flush`); flushed once, unless not asked, so the greetings
        are exchanged."""
        if client_address is None:
            client_address = IPv4Address("TCP", "127.0.0.1", 40000 + len(self.links))
        server_address = IPv4Address("TCP", "127.0.0.1", 9092)
        st = iosim.FakeTransport(server, isServer=True, hostAddress=server_address,
                                 peerAddress=client_address)
        ct = iosim.FakeTransport(client, isServer=False, hostAddress=client_address,
                                 peerAddress=server_address)
        pump = iosim.connect(server, st, client, ct, greet=False, clock=self.clock)
        link = Link(server, client, pump)
        self.links.append(link)
        self._protocols.extend([server, client])
        if flush:
            self.flush()
        return link

    # ----------------------------------------------------------------- time
    def flush(self) -> None:
        """Run everything due now: calls scheduled for the current time and
        bytes in flight on the links, until neither is left."""
        while True:
            self._share_sequences()
            moved = False
            for link in list(self.links):
                while link.pump.pump(advanceClock=False):
                    moved = True
            now = self.clock.seconds()
            if any(call.getTime() <= now for call in self.clock.getDelayedCalls()):
                self.clock.advance(0)
                moved = True
            if not moved:
                return

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward, running each call at its
        time (and flushing after it)."""
        end = self.clock.seconds() + seconds
        self.flush()
        while True:
            due = [c.getTime() for c in self.clock.getDelayedCalls() if c.getTime() <= end]
            if not due:
                break
            self.clock.advance(max(0.0, min(due) - self.clock.seconds()))
            self.flush()
        self.clock.advance(max(0.0, end - self.clock.seconds()))
        self.flush()

    def idle(self) -> bool:
        """Whether every handler is idle (nothing queued, running or due)."""
        return all(node.handler.idle() for node in self.nodes)

    def settle(self, limit: float = SETTLE_LIMIT) -> None:
        """Run until every handler is idle: flush, and while some handler is
        busy, move the clock to the next scheduled call (at most ``limit``
        seconds in all).  Raises AssertionError if they are still busy."""
        end = self.clock.seconds() + limit
        self.flush()
        while not self.idle():
            calls = [c.getTime() for c in self.clock.getDelayedCalls() if c.getTime() <= end]
            if not calls:
                raise AssertionError("the instances are busy with nothing left to run")
            self.clock.advance(max(0.0, min(calls) - self.clock.seconds()))
            self.flush()

    def run(self, work: Coroutine | defer.Deferred, settle: bool = True) -> Any:
        """The result of ``work`` (a coroutine or a Deferred), run to its end
        on the harness's clock (and then :meth:`settle`, unless not asked).
        Raises what it raised; AssertionError if it cannot end in memory."""
        d = defer.ensureDeferred(work) if not isinstance(work, defer.Deferred) else work
        self.flush()
        end = self.clock.seconds() + SETTLE_LIMIT
        while not d.called:
            calls = [c.getTime() for c in self.clock.getDelayedCalls() if c.getTime() <= end]
            if not calls:
                break
            self.clock.advance(max(0.0, min(calls) - self.clock.seconds()))
            self.flush()
        if settle:
            self.settle()
        return result_of(d)

    def sequence_taken(self, stream_name: str, value: int) -> None:
        """A writer outside the harness took the IDs of ``stream_name`` up
        to ``value`` (PostgreSQL's ``setval``)."""
        self._share_sequences({stream_name: value})

    def _share_sequences(self, taken: dict[str, int] | None = None) -> None:
        """Every instance's SQLite counter of a stream (``sqlite_last`` of
        :class:`replicator.streams.writes.WriteTransaction`, what
        ``Stream.sequence_value`` reads there) brought up to the largest:
        one sequence per stream, as on PostgreSQL."""
        streams: dict[str, list[Stream]] = {}
        for node in self.nodes:
            for stream in node.registry:
                streams.setdefault(stream.name, []).append(stream)
        for name, same in streams.items():
            top = max([(taken or {}).get(name, 0)] + [s._txn.sqlite_last for s in same])
            for s in same:
                s._txn.sqlite_last = top

    # ------------------------------------------------------------- teardown
    def close(self) -> None:
        """The end of the test: links cut, connections lost, instances
        stopped (positions flushed), timers cancelled, database closed."""
        for link in self.links:
            if not link.pump.serverIO.disconnected:
                link.server.transport.abortConnection()
        self.flush()
        for proto in self._protocols:
            if getattr(proto, "_connected", False):
                proto.connectionLost(Failure(ConnectionError("harness closed")))
        for node in self.nodes:
            node.handler.stop()
            self.run(node.registry.stop(), settle=False)
        for call in self.clock.getDelayedCalls():
            if call.active():
                call.cancel()
        self.connection.close()


def result_of(d: defer.Deferred) -> Any:
    """The result of a Deferred that has fired (its failure raised);
    AssertionError if it has not: in memory, nothing fires later by itself."""
    outcome: list[Any] = []
    d.addBoth(outcome.append)
    if not outcome:
        raise AssertionError(f"{d!r} has not fired: it waits for something the harness "
                             "does not run")
    result = outcome[0]
    if isinstance(result, Failure):
        result.raiseException()
    return result


def lines(transport: StringTransport) -> list[str]:
    """What was written to ``transport``, as text lines (lone surrogates
    kept, as the wire may carry them)."""
    return transport.value().decode("utf-8", "surrogatepass").splitlines()
