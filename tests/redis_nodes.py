"""Instances joined through a real redis-server, for the integration tests
that need one (``tests/servers.py`` starts it): their streams, a
:class:`Node` (streams on PostgreSQL, a handler, the Redis link) and a
foreign process's PUBLISH.  Test modules import them from here, never from
one another; the link's logic is tested in memory
(``tests/test_redis_memory.py``)."""

import socket

from twisted.internet import reactor

from replicator.config import RedisConfig, parse_database, parse_streams
from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.transport.redis import RedisReplication
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry

STREAMS = parse_streams([
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": ["w1", "w2"]},
])
KEYS = [("caches", "w1"), ("caches", "w2")]


def publish_raw(port, channel, message, password=None):
    """PUBLISH with a plain client, as a foreign Synapse process would."""
    def bulk(s):
        b = s.encode()
        return b"$%d\r\n%s\r\n" % (len(b), b)
    with socket.create_connection(("127.0.0.1", port)) as s:
        if password:
            s.sendall(b"*2\r\n" + bulk("AUTH") + bulk(password))
            s.recv(100)
        s.sendall(b"*3\r\n" + bulk("PUBLISH") + bulk(channel) + bulk(message))
        s.recv(100)


class Node:
    """One instance joined through Redis: its streams (default: this
    module's) on PostgreSQL, a handler, the Redis link (fast keepalive and
    backoff unless ``link_options`` say otherwise)."""

    def __init__(self, test, dsn, name, redis, consumer=None, endpoint=None, *,
                 streams=STREAMS, server_name="hs.test", channels="single", **link_options):
        self.test, self.dsn, self.name, self.redis = test, dsn, name, redis
        self.consumer = consumer
        self.endpoint = endpoint or redis.endpoint  # e.g. through a proxy
        self.streams, self.server_name, self.channels = streams, server_name, channels
        self.link_options = {"ping_interval": 0.5, "ping_timeout": 0.5, "initial_delay": 0.05,
                             "max_delay": 0.3, **link_options}

    async def start(self):
        self.db = Database(parse_database({"postgres": self.dsn, "pool_max": 3}))
        self.registry = StreamRegistry(self.db, self.name, self.streams, reactor=reactor)
        await self.registry.start()
        consumers = [self.consumer] if self.consumer is not None else []
        self.handler = ReplicationHandler(self.registry, self.name, self.server_name, consumers)
        self.handler.start()
        self.link = RedisReplication(
            reactor, self.redis_config(), self.handler,
            self.server_name, self.name, **self.link_options)
        self.link.startService()
        self.test.addCleanup(self.stop)
        return self

    def redis_config(self) -> RedisConfig:
        return RedisConfig(self.endpoint, self.redis.password, channels=self.channels)

    async def stop(self):
        if getattr(self, "stopped", False):
            return
        self.stopped = True
        self.handler.stop()
        await self.link.stopService()
        await self.handler.drain()
        await self.registry.stop()
        self.db.close()


TABLES = [("caches", "cache_stream", "cache_func, keys, ts")]
