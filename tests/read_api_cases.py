"""The read API (docs/read-api.md) in the test's own process, for the
tests of it: in memory (:class:`InMemoryReadTestCase`) or on a real socket
and PostgreSQL (:class:`ReadTestCase`), each with a reader ``one`` of
``events``; an event stream's raw client (:class:`SseSocket`) and the
paths.  Test modules take them from here, never from one another."""

import os

import orjson
from twisted.internet import defer, protocol, reactor

from tests.http_api import AUTH, SECRET, HttpTestCase, InMemoryHttpTestCase
from tests.support import Waits

READER_SECRET = "reader-one-secret-0123456789"
PAGES = "/_replicator/v1/streams/{}/facts"
EVENTS = "/_replicator/v1/streams/{}/events"
#: Longer than the live feed's interval between two reads under load: what
#: :meth:`InMemoryReadTestCase.write` lets pass after each write (as an
#: HTTP round trip does), so that event streams have been handed it.
LIVE_ROUND = 0.05


async def until_deferred(read, predicate, timeout: float = 10.0) -> None:
    """Until ``predicate(await read())``."""
    from tests.support import sleep

    for _ in range(int(timeout / 0.05)):
        if predicate(await read()):
            return
        await sleep(0.05)
    raise AssertionError("condition not reached in time")


class ReadTestCase(HttpTestCase):
    """An API with a reader ``one`` of ``events`` (no tests)."""

    async def start_reading(self, **http):
        secret_dir = self.mktemp()
        os.makedirs(secret_dir)
        path = os.path.join(secret_dir, "reader")
        with open(path, "w") as f:
            f.write(READER_SECRET + "\n")
        from replicator.config import validate

        readers = [{"name": "one", "secret_file": path, "streams": ["events"]}]
        overrides = {"http": {"listen": "tcp:0:interface=127.0.0.1", "secret": SECRET,
                              "readers": readers, **http}}
        from tests.http_api import instance_config
        from tests.servers import PostgresServer

        dsn = PostgresServer.shared().create_database()
        self.dsn = dsn
        config = validate(instance_config("worker1", dsn, **overrides), reactor)
        return await self.start(name="worker1", dsn=dsn, config=config)

    async def page(self, stream, query="", headers=AUTH):
        response, data = await self.call("GET", PAGES.format(stream) + query, headers=headers)
        return response, (orjson.loads(data) if data else None)

    async def write(self, stream, n, rows=1):
        ids = []
        for i in range(n):
            code, answer = await self.post(stream, {"rows": [[f"$e{i}.{r}"] if stream == "events"
                                                             else ["f", None, i]
                                                             for r in range(rows)]})
            self.assertEqual(code, 200, answer)
            ids.append(answer["stream_id"])
        return ids





def write_reader_secret(test) -> str:
    """The path of a file holding :data:`READER_SECRET`."""
    secret_dir = test.mktemp()
    os.makedirs(secret_dir)
    path = os.path.join(secret_dir, "reader")
    with open(path, "w") as f:
        f.write(READER_SECRET + "\n")
    return path


class InMemoryReadTestCase(InMemoryHttpTestCase):
    """The API of ``worker1`` in memory with a reader ``one`` of ``events``;
    each helper runs its call to its answer on the harness's clock (no
    tests)."""

    def start_reading(self, **http):
        readers = [{"name": "one", "secret_file": write_reader_secret(self),
                    "streams": ["events"]}]
        return self.start("worker1", validated=True, config_overrides={"http": {
            "listen": "tcp:0:interface=127.0.0.1", "secret": SECRET,
            "readers": readers, **http}})

    async def _page(self, stream, query, headers):
        response, data = await self.call("GET", PAGES.format(stream) + query, headers=headers)
        return response, (orjson.loads(data) if data else None)

    def page(self, stream, query="", headers=AUTH):
        """One page: the response and its JSON document."""
        return self.h.run(self._page(stream, query, headers), settle=False)

    def page_later(self, stream, query="", headers=AUTH):
        """A page asked for and not yet run: a Deferred of :meth:`page`'s
        answer."""
        d = defer.ensureDeferred(self._page(stream, query, headers))
        self.h.flush()
        return d

    def get(self, path, headers=None):
        return self.h.run(self.call("GET", path, headers=headers), settle=False)

    def write(self, stream, n, rows=1):
        """``n`` facts through the write API: their IDs."""
        ids = []
        for i in range(n):
            code, answer = self.h.run(self.post(stream, {"rows": [
                [f"$e{i}.{r}"] if stream == "events" else ["f", None, i]
                for r in range(rows)]}))
            self.assertEqual(code, 200, answer)
            ids.append(answer["stream_id"])
            self.h.advance(LIVE_ROUND)
        return ids

    def connect(self, stream="events", query="", headers=None):
        """An event stream's client, connected and its request sent."""
        client = SseSocket(EVENTS.format(stream) + query, {**AUTH, **(headers or {})})
        self.open(client)
        self.h.flush()
        return client

    def close(self, client):
        client.transport.loseConnection()
        self.h.run(client.closed, settle=False)


class SseSocket(protocol.Protocol):
    """A raw HTTP/1.0 event-stream client: keeps the events it parsed."""

    def __init__(self, path: str, headers: dict):
        self.request = (f"GET {path} HTTP/1.0\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
        self.buffer = b""
        self.head = None
        self.events = []
        self.comments = 0
        self.closed = defer.Deferred()
        self._waits = Waits()

    def until(self, predicate, timeout: float = 30.0):
        """A Deferred that fires once ``predicate()`` holds, woken by each
        read of the socket and by its close (not a poll)."""
        return self._waits.wait(predicate, timeout, "event stream condition")

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.buffer += data
        if self.head is None:
            head, sep, rest = self.buffer.partition(b"\r\n\r\n")
            if not sep:
                return
            self.head, self.buffer = head, rest
        while b"\n\n" in self.buffer:
            block, _, self.buffer = self.buffer.partition(b"\n\n")
            fields = {}
            for line in block.split(b"\n"):
                if line.startswith(b":"):
                    self.comments += 1
                    continue
                name, _, value = line.partition(b": ")
                fields[name.decode()] = value.decode()
            if fields.get("event") == "fact":
                self.events.append((fields["id"], orjson.loads(fields["data"])))
            elif fields:
                self.events.append(("meta", fields))
        self._waits.check()

    def connectionLost(self, reason):
        self.closed.callback(None)
        self._waits.check()

    def facts(self):
        return [e for e in self.events if e[0] != "meta"]
