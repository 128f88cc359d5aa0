"""Redis Sentinel on loopback: a master, a replica and three Sentinels
(Debian's ``redis-sentinel``) started by the test.  Instances find the
master through Sentinel; the master is killed (by PID) under load,
Sentinel promotes the replica, every instance follows; a ``replicator
run`` reader configured from docs/operations.md's "Redis Sentinel" section
says on ``/health`` what happened meanwhile, and ``replicator verify``
finds each fact in its file exactly once."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

import txredisapi
import yaml
from twisted.internet import defer, endpoints, reactor, threads
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import TestCase

from replicator.config import ConfigError, RedisConfig, parse_redis, parse_replication
from replicator.net.backoff import Backoff
from replicator.replication.transport.redis_sentinel import (
    NotMaster,
    SentinelEndpoint,
    SentinelError,
    SentinelWatch,
    check_master,
)
from tests.daemon import SECRET
from tests.operations_doc import doc_block
from tests.redis_nodes import KEYS, STREAMS, Node
from tests.sentinel_servers import SentinelSetup
from tests.servers import PostgresServer, free_port
from tests.support import (
    LogWatch,
    Progress,
    WatchedConsumer,
    create_stream_tables,
    until_handled,
    write_randomly,
)

PASSWORD = "the-requirepass-of-redis"
#: The streams of :mod:`tests.test_replication_redis`, as a config file says them.
CACHES = {"name": "caches", "table": "cache_stream",
          "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
          "writers": ["w1", "w2"]}


def doc_sentinel_config(master_port: int) -> str:
    """The page's sentinel.conf, on loopback, with a master down after
    500 ms instead of 5 s (and a failover timeout to match)."""
    text = doc_block("redis-sentinel-server")
    text = text.replace("10.0.0.21 6379", f"127.0.0.1 {master_port}")
    text = text.replace("down-after-milliseconds replicator 5000",
                        "down-after-milliseconds replicator 500")
    return text.replace("failover-timeout replicator 60000", "failover-timeout replicator 3000")


def doc_redis_section(sentinels) -> dict:
    """The page's ``replication`` block with the test's Sentinels."""
    doc = yaml.safe_load(doc_block("redis-sentinel"))
    doc["replication"]["redis"]["sentinels"] = list(sentinels)
    return doc["replication"]


def cli(*args, cwd=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "replicator.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def get(url: str, secret: str = None):
    """``(status, JSON body)`` of a GET (blocking: call it in a thread)."""
    request = urllib.request.Request(url)
    if secret:
        request.add_header("Authorization", f"Bearer {secret}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class SentinelNode(Node):
    """A :class:`Node` whose links find the master through the Sentinels."""

    def __init__(self, *args, sentinels, **kwargs):
        self.sentinels = sentinels
        super().__init__(*args, **kwargs)

    def redis_config(self) -> RedisConfig:
        return parse_redis({"sentinels": self.sentinels, "master_name": "replicator",
                            "password": PASSWORD}, "replication.redis")


class SentinelConfigTests(TestCase):
    def refused(self, redis: dict, key: str) -> str:
        with self.assertRaises(ConfigError) as e:
            parse_replication({"redis": redis})
        text = str(e.exception)
        self.assertTrue(text.startswith(f"config: replication.redis.{key}: "), text)
        return text

    def test_sentinels_and_master_name(self):
        config = parse_replication({"redis": {"sentinels": ["127.0.0.1:26379", "[::1]:26380"],
                                              "master_name": "replicator"}}).redis
        self.assertEqual(config.sentinels, (("127.0.0.1", 26379), ("::1", 26380)))
        self.assertEqual((config.endpoint, config.master_name), (None, "replicator"))
        self.assertIn("missing", self.refused({"sentinels": ["127.0.0.1:26379"]},
                                              "master_name"))
        self.assertIn("needs sentinels", self.refused(
            {"endpoint": "tcp:host=127.0.0.1:port=6379", "master_name": "replicator"},
            "master_name"))
        self.assertIn("not with endpoint", self.refused(
            {"endpoint": "tcp:host=127.0.0.1:port=6379", "sentinels": ["127.0.0.1:26379"],
             "master_name": "replicator"}, "sentinels"))
        self.assertIn("expected host:port", self.refused(
            {"sentinels": ["127.0.0.1"], "master_name": "replicator"}, "sentinels[0]"))
        self.assertIn("expected host:port", self.refused(
            {"sentinels": ["127.0.0.1:99999"], "master_name": "replicator"}, "sentinels[0]"))
        self.assertIn("names no Sentinel", self.refused(
            {"sentinels": [], "master_name": "replicator"}, "sentinels"))
        self.assertIn("missing", self.refused({}, "endpoint"))


class SwitchMasterTests(TestCase):
    """What a ``+switch-master`` message moves (in memory)."""

    def test_only_a_move_of_our_master_away_from_the_links_is_followed(self):
        clock = MemoryReactorClock()
        endpoint = SentinelEndpoint(clock, [("127.0.0.1", 26379)], "replicator", clock, 5)
        moves = []
        watch = SentinelWatch(clock, endpoint, Backoff(0.1, 1), moves.append, clock)
        watch.announced(b"replicator 127.0.0.1 6379 127.0.0.1 6380")
        self.assertEqual(moves, [])  # the links have not connected yet: they will ask
        endpoint.master = ("127.0.0.1", 6379)
        for message in (b"other 127.0.0.1 6379 127.0.0.1 6380",  # another master
                        b"replicator 127.0.0.1 6380 127.0.0.1 6379",  # to where the links are
                        b"replicator 127.0.0.1 6379",  # not a +switch-master line
                        "replicator 127.0.0.1 6379 127.0.0.1 6380"):
            watch.announced(message)
        self.assertEqual(moves, [("127.0.0.1", 6380)])


class SentinelFailoverTests(TestCase):
    timeout = 240

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="replicator-sentinel-test-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.dsn = PostgresServer.shared().create_database()
        self.setup = SentinelSetup(PASSWORD, "replicator", doc_sentinel_config)
        self.addCleanup(self.setup.stop)
        self.procs = []
        self.addCleanup(self._stop_procs)

    def _stop_procs(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def reader_config(self) -> str:
        """The reader ``r``: the page's Redis section (with the test's
        Sentinels, quick keepalive and backoff), a jsonl consumer, HTTP."""
        replication = doc_redis_section(self.setup.addresses)
        replication.update(ping_interval=0.5, ping_timeout=1, reconnect_initial_delay=0.05,
                           reconnect_max_delay=0.3)
        self.http_port = free_port()
        config = {"server_name": "hs.test", "instance_name": "r",
                  "database": {"postgres": self.dsn},
                  "replication": replication,
                  "http": {"listen": f"tcp:{self.http_port}:interface=127.0.0.1",
                           "secret": SECRET},
                  "health": {"lag_grace": 1, "check_interval": 0.5},
                  "streams": [CACHES],
                  "consumers": [{"type": "jsonl", "path": "facts-r.jsonl"}]}
        path = os.path.join(self.tmp, "r.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        return path

    def reader_healthy(self) -> bool:
        return get(f"http://127.0.0.1:{self.http_port}/health")[0] == 200

    async def health(self):
        return await threads.deferToThread(get, f"http://127.0.0.1:{self.http_port}/health")

    async def test_every_instance_follows_a_failover_under_load(self):
        path = self.reader_config()
        create_stream_tables(self.dsn, STREAMS)  # the reader creates none
        checked = cli("check", "-c", path, cwd=self.tmp)
        self.assertEqual(checked.returncode, 0, checked.stderr)
        log = open(os.path.join(self.tmp, "r.log"), "wb")
        self.addCleanup(log.close)
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "replicator.cli", "run", "-c", path], cwd=self.tmp,
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        old = ("127.0.0.1", self.setup.master.port)
        new = ("127.0.0.1", self.setup.replica.port)
        writers = [await SentinelNode(self, self.dsn, name, self.setup.master,
                                      sentinels=self.setup.addresses).start()
                   for name in ("w1", "w2")]
        await until_handled([w.handler for w in writers],
                            lambda: all(w.link.connected for w in writers), timeout=30)
        self.assertEqual({w.link.sentinel.master for w in writers}, {old})

        await threads.deferToThread(self._poll, self.reader_healthy)

        events = LogWatch(self).events
        rng = random.Random(26)
        written = Progress(n=0)
        target = 3000
        seen = []  # /health answers while the master was away
        outage = {}  # facts written when the master was killed, when all followed

        async def writer_loop(node):
            await write_randomly(node.registry.get("caches"), rng, written, target,
                                 lambda n, j: [f"f{n}", rng.choice([None, ["@k:hs"]]), j],
                                 max_facts=20, pause=True)

        async def failover():
            await written.until(lambda: written["n"] > target // 4, timeout=60)
            self.setup.master.kill()  # SIGKILL, by PID
            outage["killed"] = written["n"]
            # The reader says so while the master is away ...
            while True:
                status, body = await self.health()
                seen.append((status, body))
                if status == 503 and "not connected to redis master replicator" in str(body):
                    break
            # ... and every instance follows Sentinel to the promoted replica.
            await until_handled([w.handler for w in writers], lambda: all(
                w.link.connected and w.link.sentinel.master == new for w in writers), timeout=60)
            outage["followed"] = written["n"]

        await defer.gatherResults([defer.ensureDeferred(writer_loop(w)) for w in writers]
                                  + [defer.ensureDeferred(failover())])
        self.assertEqual(self.setup.master_port(), new[1])
        # Facts were written while no instance could publish them.
        self.assertGreater(outage["followed"], outage["killed"])
        status, body = seen[-1]
        self.assertIn(f"not connected to redis master replicator at 127.0.0.1:{old[1]} "
                      "(Sentinel)", json.dumps(body))

        # The reader catches up on every writer's last fact, then is healthy.
        tokens = {w.name: w.registry.get("caches").id_gen.get_current_token(w.name)
                  for w in writers}

        def caught_up():
            _, answer = get(f"http://127.0.0.1:{self.http_port}/_replicator/v1/positions",
                            SECRET)
            entries = answer["streams"]["caches"]["writers"]
            return all((entries[name]["reader_position"] or 0) >= token
                       for name, token in tokens.items())

        await threads.deferToThread(self._poll, caught_up)
        await threads.deferToThread(self._poll, self.reader_healthy)
        # Nothing lost or doubled: the reader's file against the table.
        verify = cli("verify", "-c", path, "0", cwd=self.tmp)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("verify: EQUAL", verify.stdout)
        # The writers' links said where they went and why they retried.
        lines = [e.get("log_format", "") for e in events]
        self.assertTrue(any("retry" in line for line in lines), lines[-20:])
        with open(os.path.join(self.tmp, "r.log")) as f:
            reader_log = f.read()
        self.assertRegex(reader_log, re.escape(f"redis: publisher connected to master replicator "
                                               f"at 127.0.0.1:{new[1]} (Sentinel)"))

    @staticmethod
    def _poll(predicate, timeout: float = 60.0):
        from tests.servers import wait_for

        wait_for(predicate, timeout=timeout, what="the reader's condition")


class SentinelFollowTests(TestCase):
    """A failover Sentinel is asked for (``SENTINEL FAILOVER``: the old
    master lives on, demoted), and what a link learns from Sentinel and
    ``ROLE`` when things are not as expected."""

    timeout = 120

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        self.setup = SentinelSetup(PASSWORD, "replicator")
        self.addCleanup(self.setup.stop)

    async def test_a_manual_failover_is_followed_and_a_replica_is_refused(self):
        """(One setup of five servers for all of it: they take seconds to
        know each other.)"""
        await self._what_a_connect_says_when_sentinel_cannot_name_the_master()
        consumer = WatchedConsumer(positions={k: 0 for k in KEYS})
        nodes = [await SentinelNode(self, self.dsn, "w1", self.setup.master,
                                    sentinels=self.setup.addresses).start(),
                 await SentinelNode(self, self.dsn, "r", self.setup.master, consumer,
                                    sentinels=self.setup.addresses).start()]
        await until_handled([n.handler for n in nodes],
                            lambda: all(n.link.connected for n in nodes), timeout=30)
        old = ("127.0.0.1", self.setup.master.port)
        new = ("127.0.0.1", self.setup.replica.port)
        # A replica says so: a link that reached it is not used.
        with self.assertRaises(NotMaster) as e:
            await self._check_role(new)
        self.assertIn(f"127.0.0.1:{new[1]} is not the master (ROLE slave)", str(e.exception))
        await self._check_role(old)
        self.assertEqual(self.setup.sentinels[0].ask("failover", "replicator"), ["OK"])
        await until_handled([n.handler for n in nodes], lambda: all(
            n.link.connected and n.link.sentinel.master == new for n in nodes), timeout=60)
        await nodes[0].registry.get("caches").write_fact([["after the switch", None, 1]])
        await consumer.until(lambda: consumer.facts)
        self.assertEqual(consumer.facts, [("caches", "w1", 1, [["after the switch", None, 1]])])
        await self._check_role(new)

    async def _check_role(self, address):
        protocol = await endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, *address),
            txredisapi.RedisProtocol(password=PASSWORD, replyTimeout=None))
        self.addCleanup(protocol.transport.loseConnection)
        await protocol.whenConnected()
        await check_master(protocol, 5, reactor)

    async def _what_a_connect_says_when_sentinel_cannot_name_the_master(self):
        unknown = SentinelEndpoint(reactor, [("127.0.0.1", self.setup.sentinels[0].port)],
                                   "nobody", reactor, 5)
        with self.assertRaises(SentinelError) as e:
            await unknown.master_address()
        self.assertEqual(str(e.exception), f"no sentinel named master nobody: "
                                           f"127.0.0.1:{self.setup.sentinels[0].port} does not "
                                           "know it")
        dead = free_port()
        endpoint = SentinelEndpoint(reactor, [("127.0.0.1", dead)] + [
            ("127.0.0.1", s.port) for s in self.setup.sentinels], "replicator", reactor, 5)
        self.assertEqual(await endpoint.master_address(),
                         ("127.0.0.1", self.setup.master.port))
        # The one that answered is asked first from now on.
        self.assertEqual(endpoint.sentinels[0], ("127.0.0.1", self.setup.sentinels[0].port))
        endpoint.sentinels = [("127.0.0.1", dead)]
        with self.assertRaises(SentinelError) as e:
            await endpoint.master_address()
        self.assertEqual(str(e.exception), f"no sentinel named master replicator: "
                                           f"127.0.0.1:{dead} connection refused")
