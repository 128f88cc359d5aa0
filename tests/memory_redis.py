"""A Redis pub/sub server in memory: enough RESP for our Redis transports.

:class:`MemoryRedis` is a :class:`~twisted.internet.protocol.Factory` a
test listens with on the harness's reactor (:class:`tests.harness.MemoryReactor`,
``listenTCP(6379, redis)``): the links that
:class:`~replicator.replication.transport.redis.RedisReplication` opens to
``tcp:host=127.0.0.1:port=6379`` reach it through in-memory transports,
and bytes move at each :meth:`tests.harness.Harness.flush`.  No socket, no
thread, no wait: what a real ``redis-server`` is still needed for stays in
the integration tests (``tests/servers.py``).

What it speaks, as Redis does (RESP 2, requests as arrays of bulk strings):
``AUTH`` (``password``; a wrong one is ``-WRONGPASS``), ``SELECT``,
``PING`` (``+PONG``; inside a subscription ``*2 pong ""``), ``ROLE``
(``master``), ``CLIENT`` (``+OK``), ``SUBSCRIBE``/``UNSUBSCRIBE``,
``PUBLISH`` (delivered to every subscriber of the channel, in order, at
once: a ``MULTI`` block is delivered whole at its ``EXEC``), ``MULTI``,
``EXEC``, ``DISCARD`` and ``QUIT``; anything else is ``-ERR unknown
command``.  ``published`` keeps every ``(channel, payload)`` published, in
order; :meth:`MemoryRedis.drop_all` closes every client (a server restart).
"""


from twisted.internet.protocol import Factory, Protocol


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _array(items: list[bytes]) -> bytes:
    """An array of already encoded replies."""
    return b"*%d\r\n" % len(items) + b"".join(items)


def _integer(n: int) -> bytes:
    return b":%d\r\n" % n


class RespError(Exception):
    """A request that is not RESP: the connection is closed (as Redis does)."""


def parse_requests(buffer: bytes) -> tuple[list[list[bytes]], bytes]:
    """The whole requests at the start of ``buffer`` (each a list of
    arguments) and what is left of it."""
    requests = []
    while buffer:
        if not buffer.startswith(b"*"):
            raise RespError("expected an array")
        end = buffer.find(b"\r\n")
        if end < 0:
            break
        count = int(buffer[1:end])
        pos = end + 2
        args: list[bytes] | None = []
        for _ in range(count):
            if not buffer.startswith(b"$", pos):
                if pos >= len(buffer):
                    args = None
                    break
                raise RespError("expected a bulk string")
            end = buffer.find(b"\r\n", pos)
            if end < 0:
                args = None
                break
            size = int(buffer[pos + 1:end])
            if len(buffer) < end + 2 + size + 2:
                args = None
                break
            assert args is not None
            args.append(buffer[end + 2:end + 2 + size])
            pos = end + 2 + size + 2
        if args is None:
            break
        requests.append(args)
        buffer = buffer[pos:]
    return requests, buffer


class RedisClient(Protocol):
    """One client's connection to :class:`MemoryRedis`."""

    factory: "MemoryRedis"

    def __init__(self) -> None:
        self._buffer = b""
        self.authenticated = False
        self.channels: set[bytes] = set()
        self._block: list[list[bytes]] | None = None  # inside MULTI

    def connectionMade(self) -> None:
        self.authenticated = self.factory.password is None
        self.factory.clients.append(self)

    def connectionLost(self, reason: object = None) -> None:
        if self in self.factory.clients:
            self.factory.clients.remove(self)

    def dataReceived(self, data: bytes) -> None:
        try:
            requests, self._buffer = parse_requests(self._buffer + data)
        except (RespError, ValueError):
            self.transport.loseConnection()
            return
        for args in requests:
            self.transport.write(self._answer(args))

    # ------------------------------------------------------------ commands
    def _answer(self, args: list[bytes]) -> bytes:
        if not args:
            return b"-ERR empty command\r\n"
        name = args[0].upper()
        if name == b"AUTH":
            if args[-1].decode("utf-8", "replace") == self.factory.password:
                self.authenticated = True
                return b"+OK\r\n"
            return b"-WRONGPASS invalid username-password pair\r\n"
        if not self.authenticated:
            return b"-NOAUTH Authentication required.\r\n"
        if self._block is not None and name not in (b"EXEC", b"DISCARD", b"MULTI"):
            self._block.append(args)
            return b"+QUEUED\r\n"
        if name == b"MULTI":
            if self._block is not None:
                return b"-ERR MULTI calls can not be nested\r\n"
            self._block = []
            return b"+OK\r\n"
        if name == b"EXEC":
            block, self._block = self._block, None
            if block is None:
                return b"-ERR EXEC without MULTI\r\n"
            return _array([self._run(a) for a in block])
        if name == b"DISCARD":
            self._block = None
            return b"+OK\r\n"
        if name == b"QUIT":
            self.transport.loseConnection()
            return b"+OK\r\n"
        return self._run(args)

    def _run(self, args: list[bytes]) -> bytes:
        name = args[0].upper()
        if name in (b"SELECT", b"CLIENT"):
            return b"+OK\r\n"
        if name == b"PING":
            if self.channels:
                return _array([_bulk(b"pong"), _bulk(args[1] if len(args) > 1 else b"")])
            return b"+PONG\r\n"
        if name == b"ROLE":
            return _array([_bulk(b"master"), _integer(0), _array([])])
        if name == b"SUBSCRIBE":
            out = b""
            for channel in args[1:]:
                self.channels.add(channel)
                out += _array([_bulk(b"subscribe"), _bulk(channel), _integer(len(self.channels))])
            return out
        if name == b"UNSUBSCRIBE":
            out = b""
            for channel in args[1:] or sorted(self.channels):
                self.channels.discard(channel)
                out += _array([_bulk(b"unsubscribe"), _bulk(channel),
                               _integer(len(self.channels))])
            return out
        if name == b"PUBLISH" and len(args) == 3:
            return _integer(self.factory.publish(args[1], args[2]))
        return b"-ERR unknown command '%s'\r\n" % args[0][:64]


class MemoryRedis(Factory):
    """The server: its clients, and what was published (see the module)."""

    protocol = RedisClient
    noisy = False

    def __init__(self, password: str | None = None) -> None:
        self.password = password
        self.clients: list[RedisClient] = []
        self.published: list[tuple[bytes, bytes]] = []

    def publish(self, channel: bytes, payload: bytes) -> int:
        """``payload`` to every subscriber of ``channel``; how many got it."""
        self.published.append((channel, payload))
        message = _array([_bulk(b"message"), _bulk(channel), _bulk(payload)])
        receivers = [c for c in self.clients if channel in c.channels]
        for client in receivers:
            client.transport.write(message)
        return len(receivers)

    def subscribers(self) -> dict[bytes, int]:
        """Channel -> how many clients are subscribed to it."""
        out: dict[bytes, int] = {}
        for client in self.clients:
            for channel in client.channels:
                out[channel] = out.get(channel, 0) + 1
        return out

    def drop_all(self) -> None:
        """Close every client's connection (as a restarted server would)."""
        for client in list(self.clients):
            client.transport.loseConnection()
