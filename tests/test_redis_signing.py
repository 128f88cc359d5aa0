"""Signed lines on our own Redis channels (``replication.redis.keys``):
the signer and verifier in memory, the Redis link refusing what does not
verify, the config's keys, and a forged POSITION against a real
redis-server and PostgreSQL (it moved the reader before keys existed); a
forged fact is refused in memory (``tests/test_redis_memory.py``)."""

import os
import tempfile
import types

from cryptography.hazmat.primitives import serialization
from twisted.internet import defer, task
from twisted.trial.unittest import TestCase

from replicator.config import RedisConfig, RedisKeys
from replicator.config.fields import ConfigError
from replicator.observe import metrics
from replicator.replication.transport.redis import RedisReplication
from replicator.replication.transport.redis_signing import Signer, Verifier, load_keys
from tests.handlers import CommandRecorder
from tests.redis_signing_keys import keys_for, refused, write_keys


class SigningTests(TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.paths = write_keys(self.dir, "master", "worker1", "reader")
        private, public = load_keys(keys_for(self.paths, "master"), "k")
        self.master = Signer(private, "master")
        w1_private, _ = load_keys(keys_for(self.paths, "worker1"), "k")
        self.worker1 = Signer(w1_private, "worker1")
        self.verifier = Verifier(public, "reader", False, task.Clock())

    def sign(self, signer, lines, channel=b"hs.test"):
        payloads = [line.encode() for line in lines]
        return signer.sign(payloads, [channel] * len(payloads))

    def check(self, messages, channel=b"hs.test"):
        out = []
        for message in messages:
            verified = self.verifier.check(channel, message)
            if verified is not None:
                out += [verified.before, verified.line]
        return [line for line in out if line is not None]

    def test_signed_lines_verify_and_forged_ones_are_refused(self):
        signed = self.sign(self.master, ["POSITION caches master 3 3",
                                         'RDATA caches master 5 ["a",null,1]'])
        self.assertEqual(self.check(signed),
                         ["POSITION caches master 3 3", 'RDATA caches master 5 ["a",null,1]'])
        before = {r: refused(r) for r in ("unsigned", "bad_signature", "wrong_signer",
                                           "unknown_signer", "malformed")}
        # The forged POSITION of the issue, bare; then the same signed by
        # worker1 (it names master); a signature moved to another line;
        # one by a key no config lists; the signed line on another channel.
        forged_by_worker = self.sign(self.worker1, ["POSITION caches master 5 7"])[0]
        prefix, line = signed[0].rsplit(b" POSITION ", 1)
        self.assertEqual(self.check([
            b"POSITION caches master 5 7",
            forged_by_worker,
            prefix + b" POSITION caches master 5 7",
            b"SIGNED stranger - AAAA POSITION caches master 5 7",
            b"SIGNED master - POSITION",
        ]), [])
        self.assertEqual(self.check([signed[0]], channel=b"hs.test/replicator/stream/caches"), [])
        self.assertEqual(
            {r: refused(r) - n for r, n in before.items()},
            {"unsigned": 1, "bad_signature": 2, "wrong_signer": 1, "unknown_signer": 1,
             "malformed": 1})
        # REPLICATE claims nothing: it goes bare and is taken bare.
        self.assertEqual(self.sign(self.master, ["REPLICATE"]), [b"REPLICATE"])
        self.assertEqual(self.check([b"REPLICATE"]), ["REPLICATE"])
        # As instances and Synapse publish it: with a trailing space.
        self.assertEqual(self.check([b"REPLICATE "]), ["REPLICATE"])
        # Our own echo is dropped before any check, uncounted.
        reader_private, _ = load_keys(keys_for(self.paths, "reader"), "k")
        echo = self.sign(Signer(reader_private, "reader"), ["FEDERATION_ACK reader 3"])
        self.assertEqual(self.check(echo), [])
        self.assertEqual(refused("bad_signature") - before["bad_signature"], 2)

    def test_a_replayed_fact_is_preceded_by_its_writers_position(self):
        """An old fact heard again (after newer ones) comes with the POSITION
        of what preceded it: a reader above it drops both, a reader below
        reads the table up to there first.  In the live order no POSITION
        is added."""
        first = self.sign(self.master, ["POSITION caches master 3 3",
                                        'RDATA caches master 5 ["a",null,1]'])
        second = self.sign(self.master, ['RDATA caches master 8 ["b",null,1]'])
        self.assertEqual(self.check(first + second), [
            "POSITION caches master 3 3", 'RDATA caches master 5 ["a",null,1]',
            'RDATA caches master 8 ["b",null,1]'])
        # Replayed: fact 5 said "nothing of master in (3, 5)".
        self.assertEqual(self.check([first[1]]), [
            "POSITION caches master 3 3", 'RDATA caches master 5 ["a",null,1]'])

    def test_a_replayed_batch_row_cannot_join_another_fact(self):
        fact = self.sign(self.master, ["POSITION caches master 1 1",
                                       'RDATA caches master batch ["x",null,1]',
                                       'RDATA caches master 2 ["y",null,1]'])
        self.assertEqual(self.check(fact), [
            "POSITION caches master 1 1", 'RDATA caches master batch ["x",null,1]',
            'RDATA caches master 2 ["y",null,1]'])
        nxt = self.sign(self.master, ['RDATA caches master 3 ["z",null,1]'])
        out_of_order = refused("out_of_order")
        # The batch row of fact 2 replayed right before fact 3: it opens
        # fact 2 again, so fact 3's start says the writer's POSITION first
        # (the reader drops the stale row with it).
        self.assertEqual(self.check([fact[1]] + nxt), [
            "POSITION caches master 1 1", 'RDATA caches master batch ["x",null,1]',
            "POSITION caches master 2 2", 'RDATA caches master 3 ["z",null,1]'])
        # Fact 2's last row alone: not the next row of any open fact.
        self.assertEqual(self.check([fact[2]]), [])
        self.assertEqual(refused("out_of_order") - out_of_order, 1)

    def test_accept_unsigned_takes_bare_lines_and_counts_them(self):
        _, public = load_keys(keys_for(self.paths, "master"), "k")
        verifier = Verifier(public, "reader", True, task.Clock())
        taken = metrics.REDIS_UNSIGNED_ACCEPTED._value.get()
        verified = verifier.check(b"hs.test", b"POSITION caches master 5 7")
        self.assertEqual(verified.line, "POSITION caches master 5 7")
        self.assertEqual(metrics.REDIS_UNSIGNED_ACCEPTED._value.get() - taken, 1)
        # A signed line that does not verify is refused all the same.
        self.assertIsNone(verifier.check(b"hs.test", self.sign(
            self.worker1, ["POSITION caches master 5 7"])[0]))


class ReplayTests(TestCase):
    """Lines once signed, replayed to a reader that restarted behind: they
    move it past nothing.  A real :class:`Reader` reading a table in
    memory, the lines as the verifier hands them on."""

    def test_replayed_lines_skip_no_fact(self):
        from twisted.internet import defer

        from replicator.replication.core.reader import Reader
        from replicator.replication.wire.commands import parse_line
        from tests.support import updates_since

        paths = write_keys(tempfile.mkdtemp(), "master", "reader")
        private, public = load_keys(keys_for(paths, "master"), "k")
        signer = Signer(private, "master")
        table = {t: [[f"f{t}", None, t]] for t in range(1, 7)}

        def block(*lines):
            payloads = [line.encode() for line in lines]
            return signer.sign(payloads, [b"hs.test"] * len(payloads))

        # As published, live: a REPLICATE answer at 2, then facts 3 to 6.
        answer = block("POSITION caches master 2 2")
        facts = [block('RDATA caches master 3 ["f3",null,3]',
                       'RDATA caches master 4 ["f4",null,4]'),
                 block('RDATA caches master 5 ["f5",null,5]'),
                 block('RDATA caches master batch ["f6",null,6]',
                       'RDATA caches master 6 ["f6b",null,6]')]
        delivered = []
        reader = Reader("caches", "master", 1,
                        source=lambda w, a, b, n: defer.succeed(updates_since(table, a, b, n)),
                        deliver=lambda token, rows: delivered.append(token), clock=task.Clock())
        verifier = Verifier(public, "reader", False, task.Clock())
        conn = object()
        # The reader restarted at 1 (it had fact 1); a replay of the old
        # answer, then of fact 6 alone, then of fact 3's block.
        for message in answer + facts[2] + facts[0]:
            verified = verifier.check(b"hs.test", message)
            for line in (verified.before, verified.line):
                if line is None:
                    continue
                cmd = parse_line(line)
                if cmd.NAME == "POSITION":
                    reader.position_line(conn, cmd.prev_token, cmd.new_token)
                else:
                    reader.rdata(conn, cmd.token, cmd.row)
        self.assertEqual(delivered, [2, 3, 4, 5, 6])
        self.assertEqual(reader.position, 6)


class _Registry(dict):
    """Streams by name, iterated as streams (as a StreamRegistry)."""

    def __iter__(self):
        return iter(self.values())

    def get(self, name):
        return self[name]


class LinkTests(TestCase):
    """The Redis link with keys: what it publishes is signed, what it hears
    on our channels is handed on only if it verifies; Synapse's channel is
    left as it is."""

    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.paths = write_keys(self.dir, "master", "reader")

    def link(self, name, synapse=None):
        handler = CommandRecorder(registry=_Registry({"caches": types.SimpleNamespace(
            name="caches", config=types.SimpleNamespace(writers=("master",)))}))
        link = RedisReplication(task.Clock(), RedisConfig(
            "tcp:host=127.0.0.1:port=1", keys=keys_for(self.paths, name)),
            handler, "hs.test", name, synapse_server_name=synapse)
        link.conn, link.subscriber = types.SimpleNamespace(current_line=None), object()
        return link, handler

    def test_only_verified_lines_reach_the_handler(self):
        master, _ = self.link("master", synapse="hs.test")
        reader, handler = self.link("reader", synapse="hs.test")
        written = []
        master.publisher = types.SimpleNamespace(
            connected=True, transport=types.SimpleNamespace(write=written.append),
            replyQueue=types.SimpleNamespace(get=lambda: _Never()))
        master.publish_lines([b"POSITION caches master 1 1\n",
                              b'RDATA caches master 2 ["a",null,1]\n'])
        master.publish_lines([b"REPLICATE\n"], channel=b"hs.test")
        messages = [m for block in written for m in _published(block)]
        self.assertEqual([c for c, _ in messages],
                         [b"hs.test/replicator"] * 2 + [b"hs.test"])
        self.assertTrue(all(m.startswith(b"SIGNED master ") for _, m in messages[:2]))
        self.assertEqual(messages[2][1], b"REPLICATE")  # Synapse's channel: bare
        for channel, message in messages[:2]:
            reader.message_received(reader.subscriber, channel, message)
        # A forgery on our channel; Synapse's lines on its own, unsigned.
        reader.message_received(reader.subscriber, b"hs.test/replicator",
                                b"POSITION caches master 2 4")
        reader.message_received(reader.subscriber, b"hs.test",
                                b"POSITION events master 9 9")
        # A signed line of a stream not read here is dropped unverified.
        dropped = metrics.COMMANDS_DROPPED.labels("POSITION", "unknown_stream")._value.get()
        other = Signer(load_keys(keys_for(self.paths, "master"), "k")[0], "master").sign(
            [b"POSITION others master 1 2"], [b"hs.test/replicator"])[0]
        reader.message_received(reader.subscriber, b"hs.test/replicator", other)
        self.assertEqual(handler.received, ["POSITION caches master 1 1",
                                            'RDATA caches master 2 ["a",null,1]',
                                            "POSITION events master 9 9"])
        self.assertEqual(
            metrics.COMMANDS_DROPPED.labels("POSITION", "unknown_stream")._value.get(),
            dropped + 1)


    def test_a_signed_line_of_a_writer_the_config_does_not_name_reaches_the_handler(self):
        """A writer with a key whose name ``writers`` lacks (a typo there):
        its signed lines are verified and handed on, for the handler to
        warn of them, not dropped unverified in silence."""
        self.paths = write_keys(self.dir, "master", "reader", "worker1")
        reader, handler = self.link("reader")
        line = Signer(load_keys(keys_for(self.paths, "worker1"), "k")[0], "worker1").sign(
            [b"POSITION caches worker1 1 2"], [b"hs.test/replicator"])[0]
        reader.message_received(reader.subscriber, b"hs.test/replicator", line)
        self.assertEqual(handler.received, ["POSITION caches worker1 1 2"])


class _Never:
    def addCallbacks(self, *a, **kw):
        return self


def _published(block):
    """(channel, message) of each PUBLISH in a RESP block."""
    parts = block.split(b"\r\n")
    out = []
    for i, part in enumerate(parts):
        if part == b"PUBLISH":
            out.append((parts[i + 2], parts[i + 4]))
    return out


class ConfigTests(TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.paths = write_keys(self.dir, "master", "worker1")

    def parse(self, keys, writers=("master", "worker1"), instance="master"):
        from replicator.config.instance import parse_instance
        from replicator.config.validate import validate_redis_keys

        config = parse_instance({
            "server_name": "hs.test", "instance_name": instance,
            "database": {"postgres": "dbname=x"},
            "replication": {"redis": {"endpoint": "tcp:host=127.0.0.1:port=6379",
                                      "keys": keys}},
            "streams": [{"name": "caches", "table": "cache_stream",
                         "columns": [{"k": "text"}], "writers": list(writers)}]})
        validate_redis_keys(config)
        return config

    def problem(self, keys, **kw):
        with self.assertRaises(ConfigError) as e:
            self.parse(keys, **kw)
        self.assertNotIn("\n", str(e.exception))
        return e.exception.key, e.exception.problem

    def test_keys_are_read_and_every_writer_needs_one(self):
        config = self.parse({"private_key": self.paths["master"][0],
                             "public_keys": {"worker1": self.paths["worker1"][1]}})
        self.assertEqual(config.replication.redis.keys, RedisKeys(
            self.paths["master"][0], (("worker1", self.paths["worker1"][1]),), False))
        self.assertEqual(self.problem({"private_key": self.paths["master"][0]})[0],
                         "replication.redis.keys.public_keys")
        self.assertEqual(self.problem({"private_key": os.path.join(self.dir, "none")})[0],
                         "replication.redis.keys.private_key")
        # A public key where the private one goes, and the other way round.
        self.assertEqual(self.problem({"private_key": self.paths["master"][1]})[0],
                         "replication.redis.keys.private_key")
        self.assertEqual(self.problem({"private_key": self.paths["master"][0],
                                       "public_keys": {"worker1": self.paths["worker1"][0]}})[0],
                         "replication.redis.keys.public_keys.worker1")
        self.assertEqual(self.problem({"private_key": self.paths["master"][0],
                                       "accept_unsigned": "yes"})[0],
                         "replication.redis.keys.accept_unsigned")
        self.assertEqual(self.problem({"public_keys": {}})[0],
                         "replication.redis.keys.private_key")
        self.assertEqual(self.problem({"private_key": self.paths["master"][0], "x": 1})[0],
                         "replication.redis.keys.x")

    def test_not_beside_a_tcp_listener(self):
        """A TCP master also on Redis passes its workers' lines on there,
        signed by itself: Redis peers would refuse them all."""
        from replicator.config.instance import parse_instance

        with self.assertRaises(ConfigError) as e:
            parse_instance({
                "server_name": "hs.test", "instance_name": "master",
                "database": {"postgres": "dbname=x"},
                "replication": {"listen": "tcp:9092:interface=127.0.0.1", "redis": {
                    "endpoint": "tcp:host=127.0.0.1:port=6379",
                    "keys": {"private_key": self.paths["master"][0]}}},
                "streams": [{"name": "caches", "table": "cache_stream",
                             "columns": [{"k": "text"}], "writers": ["master"]}]})
        self.assertEqual(e.exception.key, "replication.redis.keys")

    def test_a_key_that_is_not_ed25519_is_refused(self):
        from cryptography.hazmat.primitives.asymmetric import ec

        other = os.path.join(self.dir, "ec.key")
        with open(other, "wb") as f:
            f.write(ec.generate_private_key(ec.SECP256R1()).private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption()))
        key, problem = self.problem({"private_key": other})
        self.assertEqual(key, "replication.redis.keys.private_key")
        self.assertIn("not an Ed25519 key", problem)


class ForgedPositionTests(TestCase):
    """A Redis client that only PUBLISHes, against a writer w1 and a reader
    with keys.  Without keys: a forged ``POSITION caches w1 T T'`` past
    w1's fact still in flight moved the reader past it, and the fact was
    dropped when it came (since POSITIONs are checked against the table,
    the reader stops there instead); a forged RDATA reached the consumer
    and a forged ``batch`` row joined w1's next fact.  With keys all are
    refused and the consumer has the table's facts, exactly."""

    timeout = 120

    def setUp(self):
        from tests.servers import PostgresServer, RedisServer

        self.dsn = PostgresServer.shared().create_database()
        self.redis = RedisServer(password="redis-test-secret")
        self.addCleanup(self.redis.stop)
        self.paths = write_keys(tempfile.mkdtemp(), "w1", "w2", "r")

    async def test_a_forged_position_moves_no_reader(self):
        import threading

        from replicator.consumers import MemoryConsumer
        from tests.redis_nodes import TABLES, Node, publish_raw
        from tests.support import table_facts, until, until_handled

        paths = self.paths

        class SignedNode(Node):
            def redis_config(self):
                return RedisConfig(self.endpoint, self.redis.password,
                                   keys=keys_for(paths, self.name))

        w1 = await SignedNode(self, self.dsn, "w1", self.redis).start()
        consumer = MemoryConsumer(positions={("caches", "w1"): 0})
        reader = await SignedNode(self, self.dsn, "r", self.redis, consumer).start()
        await until_handled([w1.handler, reader.handler],
                            lambda: w1.link.connected and reader.link.connected)
        stream = w1.registry.get("caches")
        first = await stream.write_fact([["first", None, 1]])
        position = lambda: reader.handler.reader_positions()[("caches", "w1")]  # noqa: E731
        await until_handled([reader.handler], lambda: position() == first)

        # w1's next fact: its ID reserved, its transaction held open (in
        # the database pool) while the forger says w1 is past it.
        reserved, release = [], threading.Event()

        def hold(txn, stream_id):
            reserved.append(stream_id)
            release.wait(30)

        async def write():
            async with stream.writer() as fact:
                fact.add_row(["second", None, 2])
                fact.also(hold)
            return fact.stream_id

        writing = defer.ensureDeferred(write())
        await until(lambda: bool(reserved))
        refusals = refused("unsigned")
        publish_raw(self.redis.port, "hs.test", f"POSITION caches w1 {first} {reserved[0]}",
                    self.redis.password)
        await until(lambda: refused("unsigned") > refusals or position() > first)
        release.set()
        second = await writing
        last = await stream.write_fact([["third", None, 3]])
        await until_handled([reader.handler], lambda: position() >= last)
        table = table_facts(self.dsn, TABLES)[("caches", "w1")]
        self.assertEqual([t for t, _ in table], [first, second, last])
        self.assertEqual([t for _, _, t, _ in consumer.facts], [first, second, last])
        self.assertTrue(reader.link.connected)
