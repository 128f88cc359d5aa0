"""``replication.redis.channels: per_stream``: a channel per stream
(docs/protocol.md, "Redis"; :mod:`replicator.replication.transport.redis_channels`).

In memory: where each line goes, what an instance subscribes to, a write's
lines in one MULTI/EXEC each on its stream's channel, the config key.  That a
reader of one stream of three receives that stream's lines only, and that a
stream added at a reload is subscribed to before its REPLICATE, is tested on
the in-memory Redis (``tests/test_redis_memory.py``).  And the page's config
for this topology passes ``replicator check``."""

import os
import subprocess
import sys
import tempfile

import yaml
from twisted.internet import task
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import TestCase

from replicator.config import ConfigError, RedisConfig, parse_instance, parse_streams
from replicator.replication.transport.redis import RedisReplication, _Publisher, _RedisFactory
from replicator.replication.transport.redis_channels import ChannelLayout
from tests.handlers import CommandRecorder
from tests.operations_doc import ROOT, doc_block
from tests.servers import PostgresServer
from tests.support import create_stream_tables


class _Config:
    def __init__(self, preset=None):
        self.preset = preset


class _Stream:
    def __init__(self, name, preset=None):
        self.name, self.config = name, _Config(preset)


class LayoutTests(TestCase):
    def test_single_is_the_layout_of_before(self):
        layout = ChannelLayout("hs.test")
        self.assertEqual(layout.channel, "hs.test")
        self.assertEqual(layout.route(b'RDATA caches w1 1 ["a"]'), b"hs.test")
        self.assertEqual(layout.route(b"USER_IP w1 @u:hs 1.2.3.4 ua dev 5"), b"hs.test/USER_IP")
        self.assertEqual(layout.subscriptions([_Stream("caches")]), ["hs.test", "hs.test/USER_IP"])
        beside = ChannelLayout("hs.test", "hs.test")
        self.assertEqual(beside.subscriptions([_Stream("caches")]),
                         ["hs.test/replicator", "hs.test/replicator/USER_IP", "hs.test"])

    def test_per_stream_routes_stream_lines_to_their_stream_and_the_rest_to_control(self):
        layout = ChannelLayout("hs.test", layout="per_stream")
        self.assertEqual(layout.channel, "hs.test/replicator")  # never Synapse's channel
        self.assertEqual(layout.route(b'RDATA caches w1 batch ["a"]'),
                         b"hs.test/replicator/stream/caches")
        self.assertEqual(layout.route(b"POSITION events w1 1 2"),
                         b"hs.test/replicator/stream/events")
        for line in (b"REPLICATE", b"USER_SYNC w1 @u:hs DEV start 1", b"CLEAR_USER_SYNC w1",
                     b"FEDERATION_ACK w1 3", b"POSITION", b"PING 5"):
            self.assertEqual(layout.route(line), b"hs.test/replicator", line)
        self.assertEqual(layout.route(b"USER_IP w1 @u:hs 1.2.3.4 ua dev 5"),
                         b"hs.test/replicator/USER_IP")
        self.assertEqual(layout.subscriptions([_Stream("caches"), _Stream("events")]),
                         ["hs.test/replicator", "hs.test/replicator/USER_IP",
                          "hs.test/replicator/stream/caches", "hs.test/replicator/stream/events"])

    def test_beside_a_synapse_its_streams_stay_on_its_channel(self):
        layout = ChannelLayout("hs.test", "hs.test", layout="per_stream")
        self.assertEqual(
            layout.subscriptions([_Stream("caches"), _Stream("events", "synapse/events")]),
            ["hs.test/replicator", "hs.test/replicator/USER_IP",
             "hs.test/replicator/stream/caches", "hs.test"])

    def test_the_config_key(self):
        doc = {"server_name": "hs.test", "instance_name": "w1", "database": {"sqlite": "x.db"},
               "streams": [{"name": "caches", "table": "t", "columns": [{"a": "text"}],
                            "writers": ["w1"]}],
               "replication": {"redis": {"endpoint": "tcp:host=127.0.0.1:port=6379"}}}
        self.assertEqual(parse_instance(doc).replication.redis.channels, "single")
        doc["replication"]["redis"]["channels"] = "per_stream"
        self.assertEqual(parse_instance(doc).replication.redis.channels, "per_stream")
        doc["replication"]["redis"]["channels"] = "per-stream"
        with self.assertRaises(ConfigError) as e:
            parse_instance(doc)
        self.assertIn("replication.redis.channels", str(e.exception))


class PerStreamBlockTests(TestCase):
    """One write of two streams' lines: one MULTI/EXEC, each line PUBLISHed
    on its stream's channel, in the order written."""

    def test_one_block_each_line_on_its_channel(self):
        config = RedisConfig("tcp:host=127.0.0.1:port=1", channels="per_stream")
        link = RedisReplication(task.Clock(), config, CommandRecorder(["a", "b"]), "hs", "w1")
        publisher = _RedisFactory(_Publisher, config, link, "publisher").buildProtocol(None)
        transport = StringTransport()
        publisher.makeConnection(transport)
        link.publish_lines([b"POSITION a w1 1 1\n", b"POSITION b w1 2 2\n", b"REPLICATE\n"])

        def publish(channel, payload):
            return b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
                len(channel), channel, len(payload), payload)
        self.assertEqual(transport.value(),
                         b"*1\r\n$5\r\nMULTI\r\n"
                         + publish(b"hs/replicator/stream/a", b"POSITION a w1 1 1")
                         + publish(b"hs/replicator/stream/b", b"POSITION b w1 2 2")
                         + publish(b"hs/replicator", b"REPLICATE")
                         + b"*1\r\n$4\r\nEXEC\r\n")
        self.assertIsNone(link.watch)  # our channels are never Synapse's


class DocumentedConfigTests(TestCase):
    """docs/operations.md's per-stream and cluster sections, applied to the
    worker example, pass ``replicator check``."""

    def test_replicator_check_accepts_the_documented_section(self):
        self.check("redis-per-stream", "per_stream")

    def test_replicator_check_accepts_the_documented_cluster_section(self):
        section = self.check("redis-cluster", "per_stream")
        self.assertEqual(len(section["redis"]["cluster"]), 3)

    def check(self, step, channels):
        with open(os.path.join(ROOT, "conf", "worker.yaml")) as f:
            doc = yaml.safe_load(f)
        tmp = tempfile.mkdtemp()
        self.addCleanup(lambda: subprocess.run(["rm", "-rf", tmp]))
        section = yaml.safe_load(doc_block(step))["replication"]
        doc["replication"] = section
        dsn = PostgresServer.shared().create_database()
        create_stream_tables(dsn, parse_streams(doc["streams"]))  # the master's, made
        doc["database"] = {"postgres": dsn}
        secret = os.path.join(tmp, "http-secret")
        with open(secret, "w") as f:
            f.write("s" * 32)
        os.chmod(secret, 0o600)
        doc["http"]["secret_file"] = secret
        doc["consumers"][0]["path"] = os.path.join(tmp, "facts.jsonl")
        path = os.path.join(tmp, "worker1.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(doc, f)
        done = subprocess.run([sys.executable, "-m", "replicator.cli", "check", "-c", path],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("config ok", done.stdout + done.stderr)
        self.assertEqual(parse_instance(doc).replication.redis.channels, channels)
        return section
