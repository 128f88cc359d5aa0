"""Beside a Synapse: what replicator may never do to it (issue 12).

* A stream this instance only reads gets no DDL and no writes: its table and
  sequence belong to someone else (Synapse, or another replicator).
* With a ``synapse:`` section, a local writer of a stream Synapse owns is a
  config error, and our own streams travel on a Redis channel of our own:
  nothing we publish reaches Synapse's channel, and Synapse's REPLICATE gets
  no answer from us, while Synapse's facts still reach our consumers.
* Presets fill in Synapse's tables; streams held in its memory are refused.
"""


from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator import synapse
from replicator.config import ConfigError, parse_database, parse_instance, parse_streams, validate
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from tests.redis_nodes import Node
from tests.servers import PostgresServer, RedisServer
from tests.support import WatchedConsumer, until, until_handled
from tests.synapse_side import (
    OWN,
    READER,
    SYNAPSE_CACHES_DDL,
    SYNAPSE_EXPORT_DDL,
    ChannelRecorder,
    _pg,
    redis_call,
    tokens,
)


def instance_doc(**extra):
    doc = {"server_name": "example.org", "instance_name": "app1",
           "database": {"postgres": "dbname=x"},
           "streams": [{"name": "app_events", "table": "app_events",
                        "columns": [{"body": "text"}], "writers": ["app1"]}]}
    doc.update(extra)
    return doc


class SynapseSectionConfigTests(SynchronousTestCase):
    def assertKey(self, doc, key, *words):
        with self.assertRaises(ConfigError) as cm:
            validate(parse_instance(doc), reactor)  # what the CLI runs
        self.assertEqual(cm.exception.key, key, str(cm.exception))
        for word in words:
            self.assertIn(word, str(cm.exception))
        self.assertNotIn("\n", str(cm.exception))

    def test_the_section_is_parsed(self):
        config = parse_instance(instance_doc(synapse={
            "server_name": "matrix.example.org", "database": "dbname=synapse",
            "redis": "tcp:127.0.0.1:6379"}))
        self.assertEqual(config.synapse.server_name, "matrix.example.org")
        self.assertEqual(config.synapse.database, "dbname=synapse")
        self.assertEqual(config.synapse.redis, "tcp:127.0.0.1:6379")
        self.assertIsNone(parse_instance(instance_doc()).synapse)

    def test_section_errors_name_the_key(self):
        self.assertKey(instance_doc(synapse={}), "synapse.server_name", "missing")
        self.assertKey(instance_doc(synapse={"server_name": "a b"}), "synapse.server_name")
        self.assertKey(instance_doc(synapse={"server_name": "hs", "x": 1}), "synapse.x")
        self.assertKey(instance_doc(synapse={"server_name": "hs", "redis": "nope:"}),
                       "synapse.redis")

    def test_writing_a_synapse_stream_is_refused(self):
        for name in ("caches", "account_data", "presence", "receipts", "events",
                     "un_partial_stated_room", "thread_subscriptions"):
            doc = instance_doc(synapse={"server_name": "example.org"})
            doc["streams"].append({"name": name, "table": "t_" + name,
                                   "columns": [{"x": "text"}], "writers": ["master", "app1"]})
            self.assertKey(doc, "streams[1].writers", repr(name), "Synapse")

    def test_reading_a_synapse_stream_is_allowed(self):
        doc = instance_doc(synapse={"server_name": "example.org"})
        doc["streams"].append(dict(READER))
        config = parse_instance(doc)
        self.assertNotIn(config.instance_name, config.streams[1].writers)

    def test_our_instance_cannot_take_a_synapse_writer_name(self):
        doc = instance_doc(synapse={"server_name": "example.org"}, instance_name="master")
        doc["streams"][0]["writers"] = ["master"]
        doc["streams"].append(dict(READER))
        self.assertKey(doc, "streams[1].writers", "'caches'")

    def test_the_stream_names_match_synapse(self):
        # Synapse 1.163.2's stream names (synapse/replication/tcp/streams).
        for name in ("events", "backfill", "presence", "presence_federation", "typing",
                     "receipts", "push_rules", "pushers", "caches", "device_lists",
                     "to_device", "federation", "account_data", "un_partial_stated_room",
                     "un_partial_stated_event", "thread_subscriptions", "profile_updates",
                     "sticky_events", "quarantined_media"):
            self.assertIn(name, synapse.STREAM_NAMES)


class PresetTests(SynchronousTestCase):
    def test_a_reader_needs_three_lines(self):
        (stream,) = parse_streams([{"preset": "synapse/caches"}])
        self.assertEqual(stream.name, "caches")
        self.assertEqual(stream.table, "cache_invalidation_stream_by_instance")
        self.assertEqual(stream.id_column, "stream_id")
        self.assertEqual(stream.writer_column, "instance_name")
        self.assertEqual(stream.sequence, "cache_invalidation_stream_seq")
        self.assertEqual([(c.name, c.type, c.nullable) for c in stream.columns],
                         [("cache_func", "text", False), ("keys", "json", True),
                          ("invalidation_ts", "bigint", True)])
        self.assertEqual(stream.writers, ("master",))
        self.assertFalse(stream.create)

    def test_presets(self):
        for preset in synapse.PRESETS:
            (stream,) = parse_streams([{"preset": "synapse/" + preset}])
            self.assertEqual(stream.name, preset)
            self.assertEqual(stream.writers, ("master",))
        (receipts,) = parse_streams([{"preset": "synapse/receipts",
                                      "writers": ["master", "receipts1"]}])
        self.assertEqual(receipts.writers, ("master", "receipts1"))
        self.assertTrue(receipts.columns[-1].json_text)

    def assertKey(self, streams, key, *words):
        with self.assertRaises(ConfigError) as cm:
            parse_streams(streams)
        self.assertEqual(cm.exception.key, key, str(cm.exception))
        for word in words:
            self.assertIn(word, str(cm.exception))

    def test_streams_not_in_one_table_are_refused_with_the_reason(self):
        self.assertKey([{"preset": "synapse/typing"}], "streams[0].preset", "memory")
        self.assertKey([{"preset": "synapse/federation"}], "streams[0].preset", "memory")
        self.assertKey([{"preset": "synapse/events"}], "streams[0].preset", "table")
        self.assertKey([{"preset": "synapse/nonsense"}], "streams[0].preset", "unknown")
        self.assertKey([{"preset": "caches"}], "streams[0].preset", "unknown")

    def test_a_preset_owns_the_table_layout(self):
        self.assertKey([{"preset": "synapse/caches", "table": "x"}], "streams[0].table",
                       "preset")
        self.assertKey([{"preset": "synapse/caches", "name": "other"}], "streams[0].name",
                       "'caches'")
        self.assertKey([{"preset": "synapse/caches", "create": True}], "streams[0].create")

    def test_a_preset_stream_has_no_local_writer(self):
        doc = instance_doc()
        doc["streams"].append({"preset": "synapse/caches", "writers": ["master", "app1"]})
        with self.assertRaises(ConfigError) as cm:
            parse_instance(doc)
        self.assertEqual(cm.exception.key, "streams[1].writers")

    def test_single_writer_tables_take_one_writer(self):
        self.assertKey([{"preset": "synapse/push_rules", "writers": ["master", "w1"]}],
                       "streams[0].writers", "one writer")


SNAPSHOT = ("SELECT relname, relkind FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = 'public' ORDER BY 1")


class ReadOnlyStreamTests(TestCase):
    """A stream with no local writer: no DDL, no setval, no position rows."""

    timeout = 120

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database("synro")

    async def start(self, streams, instance="reader"):
        db = Database(parse_database({"postgres": self.dsn, "pool_max": 2}))
        self.addCleanup(db.close)
        registry = StreamRegistry(db, instance, parse_streams(streams), reactor=reactor)
        await registry.start()
        return registry

    def state(self):
        return (_pg(self.dsn, query=SNAPSHOT),
                _pg(self.dsn, query="SELECT last_value, is_called FROM "
                                    "cache_invalidation_stream_seq"),
                _pg(self.dsn, query="SELECT * FROM stream_positions ORDER BY 1, 2"))

    async def test_a_reader_changes_nothing_in_synapse_s_database(self):
        _pg(self.dsn, SYNAPSE_CACHES_DDL + [
            # The table is ahead of the sequence (as after a restore): a
            # writer would move the sequence; a reader must not.
            "INSERT INTO cache_invalidation_stream_by_instance VALUES "
            "(7, 'master', 'get_user', '{@a:hs}', 1)",
            "INSERT INTO stream_positions VALUES ('caches', 'master', 7)"])
        before = self.state()
        for create in (True, False):
            registry = await self.start([dict(READER, create=create)])
            stream = registry.get("caches")
            self.assertEqual(stream.id_gen.get_current_token("master"), 7)
            await registry.stop()
        self.assertEqual(self.state(), before)

    async def test_a_reader_starts_at_synapse_s_persisted_positions(self):
        """Synapse keeps presence's and push_rules' positions under its ID
        generators' names: a reader of the presets starts there, not at 0."""
        _pg(self.dsn, SYNAPSE_EXPORT_DDL + [
            "INSERT INTO stream_positions VALUES ('presence_stream', 'master', 16), "
            "('push_rules_stream', 'master', 10), ('receipts', 'master', 12)"])
        registry = await self.start([{"preset": f"synapse/{p}"} for p in
                                     ("presence", "push_rules", "receipts")])
        self.addCleanup(registry.stop)
        self.assertEqual({s.name: s.id_gen.get_current_token("master") for s in registry},
                         {"presence": 16, "push_rules": 10, "receipts": 12})

    async def test_a_reader_of_a_missing_table_is_one_config_line(self):
        _pg(self.dsn, ["CREATE SEQUENCE cache_invalidation_stream_seq"])
        before = _pg(self.dsn, query=SNAPSHOT)
        with self.assertRaises(ConfigError) as cm:
            await self.start([READER])
        self.assertEqual(cm.exception.key, "streams[0].table")
        self.assertIn("cache_invalidation_stream_by_instance", str(cm.exception))
        self.assertEqual(_pg(self.dsn, query=SNAPSHOT), before)

    async def test_a_reader_of_a_missing_sequence_is_one_config_line(self):
        _pg(self.dsn, SYNAPSE_CACHES_DDL[1:])
        before = _pg(self.dsn, query=SNAPSHOT)
        with self.assertRaises(ConfigError) as cm:
            await self.start([READER])
        self.assertEqual(cm.exception.key, "streams[0].sequence")
        self.assertEqual(_pg(self.dsn, query=SNAPSHOT), before)

    async def test_a_preset_reads_json_kept_as_text(self):
        # receipts_linearized as Synapse's schema has it: data is TEXT.
        _pg(self.dsn, [
            "CREATE SEQUENCE receipts_sequence",
            "CREATE TABLE receipts_linearized (stream_id BIGINT NOT NULL, room_id TEXT NOT NULL, "
            "receipt_type TEXT NOT NULL, user_id TEXT NOT NULL, event_id TEXT NOT NULL, "
            "thread_id TEXT, event_stream_ordering BIGINT, data TEXT NOT NULL, "
            "instance_name TEXT)",
            "INSERT INTO receipts_linearized VALUES (nextval('receipts_sequence'), '!r:hs', "
            "'m.read', '@u:hs', '$e', NULL, 3, '{\"ts\": 5}', 'master')"])
        before = _pg(self.dsn, query=SNAPSHOT)
        registry = await self.start([{"preset": "synapse/receipts"}])
        updates, upto, _ = await registry.get("receipts").updates_since("master", 0, 1)
        self.assertEqual(updates, [(1, ["!r:hs", "m.read", "@u:hs", "$e", None, {"ts": 5}])])
        await registry.stop()
        self.assertEqual(_pg(self.dsn, query=SNAPSHOT), before)

    async def test_a_writer_still_creates_its_stream(self):
        registry = await self.start([{"name": "app", "table": "app_stream",
                                      "columns": [{"body": "text"}], "writers": ["reader"]}])
        await registry.get("app").write_fact([["hello"]])
        await registry.stop()
        names = {name for name, _ in _pg(self.dsn, query=SNAPSHOT)}
        self.assertTrue({"app_stream", "app_stream_seq", "stream_positions"} <= names)


class SynapseChannelTests(TestCase):
    """Two replicator instances and a stand-in for Synapse's channel traffic."""

    timeout = 120

    def setUp(self):
        self.redis = RedisServer.shared()
        self.dsn = PostgresServer.shared().create_database("synch")
        _pg(self.dsn, SYNAPSE_CACHES_DDL)

    async def node(self, name, consumer):
        node = await Node(self, self.dsn, name, self.redis, consumer,
                          streams=parse_streams([OWN, READER]), server_name="example.org",
                          ping_timeout=2, synapse_server_name="example.org").start()
        await until_handled([node.link.handler], lambda: node.link.connected, timeout=30)
        return node.registry, node.link

    async def test_synapse_hears_nothing_from_us_and_we_hear_synapse(self):
        synapse_side = ChannelRecorder(self.redis.port, ["example.org", "example.org/USER_IP"])
        self.addCleanup(synapse_side.close)
        c1, c2 = WatchedConsumer(), WatchedConsumer()
        r1, link1 = await self.node("app1", c1)
        r2, link2 = await self.node("app2", c2)
        self.assertNotEqual(link1.channel, "example.org")
        # Our own stream between our instances.
        for i in range(20):
            await r1.get("app_events").write_fact([[f"m{i}"]])
        await c2.until(lambda: len(tokens(c2, "app_events", "app1")) == 20)
        # Synapse asks everyone on its channel for positions; its own facts
        # arrive there.
        _pg(self.dsn, ["INSERT INTO cache_invalidation_stream_by_instance VALUES "
                       "(nextval('cache_invalidation_stream_seq'), 'master', 'get_user', "
                       "'{@a:hs}', 1)"])
        redis_call(self.redis.port, "PUBLISH", "example.org", "REPLICATE ")
        # What Synapse answers to a REPLICATE, then a new fact of its own.
        redis_call(self.redis.port, "PUBLISH", "example.org", "POSITION caches master 0 0")
        redis_call(self.redis.port, "PUBLISH", "example.org",
                   'RDATA caches master 1 ["get_user",["@a:hs"],1]')
        for consumer in (c1, c2):
            await consumer.until(lambda: tokens(consumer, "caches", "master"))
        # A last write of ours, then a round trip on Synapse's channel: what
        # we would have answered is out by now.
        await r1.get("app_events").write_fact([["last"]])
        await c2.until(lambda: len(tokens(c2, "app_events", "app1")) == 21)
        redis_call(self.redis.port, "PUBLISH", "example.org", "PING marker")
        await until(lambda: any(m == "PING marker" for _, m in synapse_side.messages()),
                    timeout=30)
        ours = [m for _, m in synapse_side.messages()
                if m not in ("REPLICATE ", "PING marker", "POSITION caches master 0 0")
                and not m.startswith("RDATA caches master")]
        # We asked Synapse for its positions (REPLICATE), and nothing else.
        self.assertEqual(set(ours), {"REPLICATE"})
        self.assertEqual(tokens(c1, "caches", "master"), [1])
        self.assertEqual(tokens(c2, "caches", "master"), [1])


# ------------------------------------------------------- Synapse's row parser
#: What Synapse 1.163.2 takes from an RDATA line of these streams (its
#: documented row types; it builds ``RowType(*row)``, so the arity must be
#: exact): per field the JSON types it accepts.  Checked live by ``make
#: interop`` (f); this is the always-run check without Synapse.
SYNAPSE_ROWS = {
    "caches": [(str,), (list, type(None)), (int, type(None))],
    "receipts": [(str,), (str,), (str,), (str,), (str, type(None)), (dict,)],
    "push_rules": [(str,)],
    "presence": [(str,), (str,), (int,), (int,), (int,), (str, type(None)), (bool,)],
}


def parse_like_synapse(line: bytes):
    """An RDATA line as Synapse's parser reads it: ``RDATA stream instance
    token row_json``, the token decimal or ``batch``, the row a JSON array
    of exactly its row type's fields, each of a type that field takes."""
    import json

    assert line.endswith(b"\n") and b"\n" not in line[:-1], line
    name, stream, instance, token, row_json = line[:-1].decode("utf-8").split(" ", 4)
    assert name == "RDATA", line
    assert token == "batch" or int(token) > 0, line
    row = json.loads(row_json)
    spec = SYNAPSE_ROWS[stream]
    assert isinstance(row, list) and len(row) == len(spec), (stream, row)
    for value, types in zip(row, spec):
        # bool is an int in Python: an int field must not get true/false.
        ok = type(value) in types or (dict in types and isinstance(value, dict))
        assert ok, (stream, value, types)
    return stream, instance, token, row


class SynapseRowLayoutTests(TestCase):
    """Our server's RDATA of streams laid out like Synapse's (a writer of
    ours, as in ``make interop`` (f)) is what Synapse's row parser takes."""

    timeout = 120

    async def test_our_rdata_parses_as_synapse_rows(self):
        dsn = PostgresServer.shared().create_database("synrows")
        db = Database(parse_database({"postgres": dsn, "pool_max": 2}))
        self.addCleanup(db.close)
        streams = [{"name": name, "table": f"our_{name}",
                    "columns": [dict(c) for c in synapse.PRESETS[name]["columns"]],
                    "writers": ["app1"]} for name in SYNAPSE_ROWS]
        registry = StreamRegistry(db, "app1", parse_streams(streams), reactor=reactor)
        await registry.start()
        self.addCleanup(registry.stop)
        facts = {
            "caches": [[["get_user_by_id", ["@a:hs"], 1700000000000]],
                       [["get_users_in_room", None, None], ["get_user_by_id", ["@b:hs"], 1]]],
            "receipts": [[["!r:hs", "m.read", "@a:hs", "$e", None, {"ts": 5}]],
                         [["!r:hs", "m.read.private", "@b:hs", "$f", "main", {}]]],
            "push_rules": [[["@a:hs"]], [["@b:hs"]]],
            "presence": [[["@a:hs", "online", 1, 2, 3, "hi", True]],
                         [["@b:hs", "offline", 4, 5, 6, None, False]]],
        }
        from replicator.replication.wire.encoding import encode_rdata_lines

        for name, rows_of_facts in facts.items():
            stream = registry.get(name)
            for rows in rows_of_facts:
                await stream.write_fact(rows)
            top = stream.id_gen.get_current_token("app1")
            updates, _, _ = await stream.updates_since("app1", 0, top)
            lines = list(encode_rdata_lines(name, "app1", updates))
            parsed = [parse_like_synapse(line) for line in lines]
            self.assertEqual([row for _, _, _, row in parsed],
                             [row for rows in rows_of_facts for row in rows])
            self.assertEqual([t for _, _, t, _ in parsed][-1], str(top))

    def test_the_check_refuses_what_synapse_would(self):
        for line in (b'RDATA presence m 1 ["@a:hs","online",1,2,3,null,1]\n',  # 1 for a bool
                     b'RDATA push_rules m 1 ["@a:hs",2]\n',  # one field too many
                     b'RDATA caches m 1 ["f",["k"],true]\n'):  # bool for an int
            with self.assertRaises(AssertionError):
                parse_like_synapse(line)


class PresetExportBoundTests(TestCase):
    """``replicator-export`` on a preset stream stops at Synapse's persisted
    position: a fact above it (in flight, or committed but not yet persisted
    by Synapse's writer) is never exported."""

    timeout = 120

    def test_the_bound_is_synapse_s_persisted_position(self):
        from replicator.export.options import ExportOptions
        from replicator.export.plan import plan_stream
        from replicator.export.source import MIN_TOKEN, Metadata

        dsn = PostgresServer.shared().create_database("synexp")
        inserts = []
        for i in range(1, 21):
            inserts.append(f"INSERT INTO presence_stream VALUES ({i}, '@u{i}:hs', 'online', "
                           f"1, 2, 3, NULL, true, 'master')")
            inserts.append(f"INSERT INTO push_rules_stream VALUES ({i}, 1, '@u{i}:hs', 'r', "
                           f"'ADD', 1, 1, '[]', '[]', 'master')")
            inserts.append(f"INSERT INTO receipts_linearized VALUES ({i}, '!r:hs', 'm.read', "
                           f"'@u{i}:hs', '$e', NULL, 1, '{{}}', 'master')")
            inserts.append(f"INSERT INTO cache_invalidation_stream_by_instance VALUES "
                           f"({i}, 'master', 'get_user_by_id', '{{@u{i}:hs}}', 1)")
        _pg(dsn, SYNAPSE_EXPORT_DDL + inserts + [
            "INSERT INTO stream_positions VALUES ('presence_stream', 'master', 16), "
            "('push_rules_stream', 'master', 10), ('receipts', 'master', 12)"])
        streams = parse_streams([{"preset": f"synapse/{p}"} for p in
                                 ("presence", "push_rules", "receipts", "caches")])
        meta = Metadata(parse_database({"postgres": dsn}))
        self.addCleanup(meta.close)
        upper = {}
        for stream in streams:
            plan = plan_stream(meta, stream, None, ExportOptions(output="unused"), 0)
            upper[stream.name] = plan.upper
        # caches: Synapse persists no position for a one-process deployment:
        # nothing is known persisted, nothing is exported.
        self.assertEqual(upper, {"presence": 16, "push_rules": 10, "receipts": 12,
                                 "caches": MIN_TOKEN})
