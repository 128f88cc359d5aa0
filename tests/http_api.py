"""The HTTP API in the test's own process, for the tests of it: on a real
socket and PostgreSQL (:class:`HttpTestCase`) or in memory
(:class:`InMemoryHttpTestCase`, on :mod:`tests.harness`), with what they
share: the API's secret and its header (:data:`SECRET`, :data:`AUTH`),
the streams (:data:`STREAMS`), :func:`instance_config`, request body
producers, a raw client and a stand-in for what the site asks of the
API (:class:`SiteApi`).  Test modules take them from here, never
from one another."""

import io

import orjson
import psycopg2
from twisted.internet import defer, endpoints, protocol, reactor
from twisted.logger import formatEvent
from twisted.trial.unittest import TestCase
from twisted.web.client import (
    UNKNOWN_LENGTH,
    Agent,
    FileBodyProducer,
    HTTPConnectionPool,
    readBody,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from replicator.config import parse_instance, parse_streams
from replicator.consumers import MemoryConsumer
from replicator.http import HttpApi
from replicator.observe import metrics
from replicator.observe.instance_metrics import InstanceMetrics
from replicator.replication.core.handler import ReplicationHandler
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from tests.harness import Harness
from tests.servers import PostgresServer
from tests.support import LogWatch, create_stream_tables, until

SECRET = "Hunter2-correct-horse-battery-staple"
AUTH = {"Authorization": f"Bearer {SECRET}"}
FACTS = "/_replicator/v1/streams/{}/facts"
STREAMS = [
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": ["master", "worker1"]},
    {"name": "events", "table": "event_stream",
     "columns": [{"event_id": "text"}], "writers": ["worker1"]},
]


def instance_config(name, dsn, replication=None, **overrides):
    return parse_instance({
        "server_name": "hs.test", "instance_name": name,
        "database": {"postgres": dsn, "pool_max": 3},
        "streams": STREAMS, "replication": replication or {},
        "http": {"listen": "tcp:0:interface=127.0.0.1", "secret": SECRET},
        **overrides,
    })


@implementer(IBodyProducer)
class ChunkedProducer:
    """A body of unknown length: the Agent sends it chunked."""

    length = UNKNOWN_LENGTH

    def __init__(self, data: bytes, piece: int = 64 * 1024):
        self.data = data
        self.piece = piece

    def startProducing(self, consumer):
        for i in range(0, len(self.data), self.piece):
            consumer.write(self.data[i:i + self.piece])
        return defer.succeed(None)

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def stopProducing(self):
        pass


@implementer(IBodyProducer)
class BytesProducer:
    """A request body written whole as the request starts."""

    def __init__(self, body: bytes):
        self.body = body
        self.length = len(body)

    def startProducing(self, consumer):
        consumer.write(self.body)
        return defer.succeed(None)

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def stopProducing(self):
        pass


class RawClient(protocol.Protocol):
    """Sends bytes, keeps what comes back, fires ``closed`` at disconnect."""

    def __init__(self, data: bytes):
        self.data = data
        self.received = b""
        self.closed = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.data)

    def dataReceived(self, data):
        self.received += data

    def connectionLost(self, reason):
        self.closed.callback(self.received)


class BlockingConsumer(MemoryConsumer):
    """Holds every fact until the test releases it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.waiting = []

    def on_facts(self, stream, writer, token, rows):
        d = defer.Deferred()
        d.addCallback(lambda _: super(BlockingConsumer, self).on_facts(stream, writer, token, rows))
        self.waiting.append(d)
        return d


class HttpTestCase(TestCase):
    """An API on a real socket and the helpers to call it (no tests)."""

    timeout = 120

    def setUp(self):
        self.log = LogWatch(self)
        self.events = self.log.events
        self.addCleanup(self.assert_secret_never_logged)
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.agent = Agent(reactor, pool=pool)
        self.addCleanup(pool.closeCachedConnections)
        self.status = (True, "connected to master")

    def assert_secret_never_logged(self):
        self.assertTrue(self.events)
        for event in self.events:
            text = formatEvent(event) + repr(event)
            failure = event.get("log_failure")
            if failure is not None:
                text += failure.getTraceback()
            self.assertNotIn(SECRET, text)

    def access_lines(self):
        return [formatEvent(e) for e in self.events
                if e.get("log_namespace") == "replicator.http.access"]

    async def start(self, name="master", dsn=None, replication=None, consumers=(),
                    stop_registry=True, config_overrides=None, config=None, **api_kw):
        if not config_overrides and dsn is None:
            dsn = PostgresServer.shared().create_database()
        if config is None:
            config = instance_config(name, dsn, replication, **(config_overrides or {}))
        if config.database.engine == "postgres":
            try:  # the tables of the streams other instances write
                create_stream_tables(config.database.dsn, config.streams)
            except psycopg2.OperationalError:
                pass  # a database that is down on purpose
        db = Database(config.database)
        self.addCleanup(db.close)
        registry = StreamRegistry(db, name, config.streams, reactor=reactor)
        await registry.start()
        if stop_registry:
            self.addCleanup(registry.stop)
        else:
            # Its database is down on purpose: a position persist still
            # scheduled (e.g. the one start schedules) is not run.
            self.addCleanup(lambda: [s._persist_call.cancel() for s in registry
                                     if s._persist_call is not None
                                     and s._persist_call.active()])
        handler = ReplicationHandler(registry, name, "hs.test", consumers=consumers,
                                     max_line_length=config.replication.max_line_length)
        handler.start()
        self.addCleanup(until, handler.idle)
        api = HttpApi(config=config, registry=registry, handler=handler, db=db,
                      replication_status=lambda: self.status,
                      **{"clock": reactor, **api_kw})
        port = await endpoints.serverFromString(reactor, config.http.listen).listen(api.site())
        self.addCleanup(port.stopListening)
        # The live metrics an instance gives (positions, bookkeeping, ...).
        live = InstanceMetrics(registry=registry, handler=handler)
        metrics.add_source(live)
        self.addCleanup(metrics.remove_source, live)
        self.port = port.getHost().port
        self.db, self.registry, self.handler, self.api = db, registry, handler, api
        return api

    async def call(self, method, path, body=None, headers=None, producer=None):
        h = Headers()
        for name, value in (headers or {}).items():
            h.addRawHeader(name, value)
        if body is not None:
            producer = FileBodyProducer(io.BytesIO(body))
        response = await self.agent.request(
            method.encode(), f"http://127.0.0.1:{self.port}{path}".encode(), h, producer)
        data = await readBody(response)
        self.assertNotIn(SECRET.encode(), data)
        for name, values in response.headers.getAllRawHeaders():
            for value in values:
                self.assertNotIn(SECRET.encode(), value)
        return response, data

    async def json(self, method, path, body=None, headers=None, producer=None):
        response, data = await self.call(method, path, body, headers, producer)
        if method != "HEAD":
            self.assertEqual(response.headers.getRawHeaders(b"content-type"),
                             [b"application/json"])
            self.assertTrue(data.endswith(b"\n"))
            self.assertEqual(data.count(b"\n"), 1)
            return response, orjson.loads(data)
        return response, data

    async def post(self, stream, doc, headers=AUTH, raw=None):
        body = raw if raw is not None else orjson.dumps(doc)
        response, answer = await self.json("POST", FACTS.format(stream), body, headers)
        return response.code, answer

    async def count(self, table="cache_stream"):
        rows = await self.db.runQuery(f"SELECT count(*) FROM {table}")
        return rows[0][0]

    def snapshot(self):
        """Everything a write could move: tokens and in-flight IDs."""
        return {s.name: (s.id_gen.get_positions(), s.id_gen.get_linear_token(),
                         s.id_gen.in_flight()) for s in self.registry}



class InMemoryHttpTestCase(HttpTestCase):
    """The API in memory (:mod:`tests.harness`): twisted.web's server and
    Agent joined by in-memory TCP, streams on SQLite run inline; each call
    runs to its answer on the harness's clock (no tests)."""

    def setUp(self):
        super().setUp()
        self.h = Harness(parse_streams(STREAMS), self.addCleanup)
        self.agent = Agent(self.h.clock, pool=HTTPConnectionPool(self.h.clock, persistent=False))

    def start(self, name="master", replication=None, consumers=(), config_overrides=None,
              validated=False, **api_kw):
        """The API of instance ``name``; ``validated``: its configuration
        checked against its files (the readers' secrets read from theirs)."""
        config = instance_config(name, "dbname=unused", replication, **(config_overrides or {}))
        if validated:
            from replicator.config import validate

            config = validate(config, self.h.clock)
        self.h.create_tables()  # of the streams other instances write
        self.node = self.h.instance(name, consumers,
                                    max_line_length=config.replication.max_line_length)
        self.db, self.registry, self.handler = self.node.db, self.node.registry, \
            self.node.handler
        self.api = HttpApi(config=config, registry=self.registry, handler=self.handler,
                           db=self.db, replication_status=lambda: self.status,
                           **{"clock": self.h.clock, **api_kw})
        port = self.h.run(endpoints.serverFromString(self.h.clock, config.http.listen)
                          .listen(self.api.site()))
        self.port = port.getHost().port
        live = InstanceMetrics(registry=self.registry, handler=self.handler)
        metrics.add_source(live)
        self.addCleanup(metrics.remove_source, live)
        return self.api

    def call(self, method, path, body=None, headers=None, producer=None):
        if body is not None:  # written at once (FileBodyProducer runs on the global reactor)
            body, producer = None, BytesProducer(body)
        return super().call(method, path, body, headers, producer)

    def open(self, proto):
        """``proto`` connected to the API."""
        return self.h.run(endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(self.h.clock, "127.0.0.1", self.port), proto),
            settle=False)

    def answer(self, *args, **kwargs):
        """:meth:`json`, run to its answer (what it started may still run)."""
        return self.h.run(self.json(*args, **kwargs), settle=False)

    def write(self, stream, doc):
        """:meth:`post`, run to its answer and what it started to its end."""
        return self.h.run(self.post(stream, doc))


class SiteApi:
    """What the site asks of the API (its limits, its counts and logs), for
    the tests of the site alone."""

    header_timeout = 10.0
    body_timeout = 30.0

    def __init__(self, **limits):
        self.open_connections = 0
        self.max_connections = limits.get("max_connections", 256)
        self.max_connections_per_address = limits.get("max_connections_per_address", 64)
        self.reserved_for_health = limits.get("reserved_for_health", 0)
        self.reserved_for_writers = limits.get("reserved_for_writers", 0)
        self.write_secret = limits.get("write_secret")
        self.refusals = []

    def log_refusal(self, transport, code, length, message, method, path):
        self.refusals.append((code, message))

    def log_access(self, request, code=None, note=""):
        pass
