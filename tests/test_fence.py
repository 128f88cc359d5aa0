"""The fence of plain-SQL writers (:mod:`replicator.streams.fence`) in memory:
the watermark from the sequence and the lock holders, the cap it puts on
the first writer's token (:meth:`StreamIdGenerator.fence`), and the
``foreign_writers`` key of a stream."""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import ConfigError, parse_instance
from replicator.streams.fence import Fence, Holder, function_ddl, lock_classes, watermark
from replicator.streams.idgen import StreamIdGenerator


def holder(vxid, first_id, pid=10):
    return Holder(vxid, first_id, pid, "app", "2026-01-01 00:00:00+00", "idle in transaction")


class WatermarkTests(SynchronousTestCase):
    def test_nobody_holding_means_everything_up_to_the_sequence(self):
        self.assertEqual(watermark(40, []), 40)

    def test_the_least_held_id_bounds_it(self):
        self.assertEqual(watermark(40, [holder("3/1", 31), holder("4/1", 17)]), 16)

    def test_a_holder_above_the_sequence_read_is_not_below_it(self):
        # It took its ID after the sequence was read: nothing up to it is its.
        self.assertEqual(watermark(40, [holder("3/1", 45)]), 40)

    def test_a_holder_without_its_id_yet_means_read_again(self):
        self.assertIsNone(watermark(40, [holder("3/1", 31), holder("4/1", None)]))


class CapTests(SynchronousTestCase):
    def gen(self, start=5, cap=5):
        gen = StreamIdGenerator("s", {"master": start}, ["master"], fenced={"master": cap})
        seen = []
        gen.add_listener(lambda w, old, new: seen.append(new))
        return gen, seen

    def test_the_writers_own_facts_wait_for_the_cap(self):
        gen, seen = self.gen()
        gen.reserved("master", [6, 7], pending=False)
        self.assertEqual(gen.prospective_token("master", [6, 7]), 5)  # persisted: capped
        gen.complete_many("master", [6, 7])
        self.assertEqual((gen.get_current_token("master"), gen.get_linear_token()), (5, 5))
        gen.fence("master", 6)  # a plain-SQL transaction holds 7
        self.assertEqual((gen.get_current_token("master"), gen.get_linear_token()), (6, 6))
        gen.fence("master", 9)
        self.assertEqual(gen.get_current_token("master"), 9)
        self.assertEqual(seen, [6, 9])

    def test_the_cap_never_passes_the_writers_own_reservation(self):
        gen, seen = self.gen()
        gen.reserved("master", [6], pending=False)
        gen.fence("master", 8)  # 7, 8 plain SQL, committed; 6 ours, in flight
        self.assertEqual(gen.get_current_token("master"), 5)
        gen.complete("master", 6)
        self.assertEqual(gen.get_current_token("master"), 8)

    def test_plain_sql_facts_alone_move_an_idle_writer(self):
        gen, seen = self.gen()
        gen.fence("master", 12)  # no write of ours since the start
        self.assertEqual(gen.get_current_token("master"), 12)
        self.assertEqual(gen.get_max_known(), 12)

    def test_the_cap_only_moves_up(self):
        gen, seen = self.gen(cap=10)
        gen.fence("master", 7)
        self.assertEqual(gen.cap("master"), 10)
        self.assertEqual(seen, [])

    def test_a_cap_below_a_remote_writer_holds_the_linear_token(self):
        gen = StreamIdGenerator("s", {"master": 5, "worker1": 20}, ["master"],
                                fenced={"master": 5})
        gen.fence("master", 9)
        self.assertEqual((gen.get_current_token("master"), gen.get_linear_token()), (9, 9))

    def test_an_unfenced_generator_is_as_before(self):
        gen = StreamIdGenerator("s", {"master": 5}, ["master"])
        gen.reserved("master", [6], pending=False)
        gen.complete("master", 6)
        self.assertEqual(gen.get_current_token("master"), 6)
        self.assertIsNone(gen.cap("master"))
        gen.fence("master", 100)  # not fenced: nothing
        self.assertEqual(gen.get_current_token("master"), 6)


class _Gen:
    def __init__(self):
        self.caps = []

    def get_current_token(self, writer):
        return 0

    def cap(self, writer):
        return 0

    def fence(self, writer, cap):
        self.caps.append(cap)


class _Db:
    def __init__(self, answers):
        self.answers = answers

    def runInteraction(self, fn, *args, **kwargs):
        from twisted.internet import defer
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            return defer.fail(answer)
        return defer.succeed(answer)


class _Stream:
    def __init__(self, answers):
        from replicator.config.streams import parse_stream
        self.config = parse_stream(dict(ORDERS), "streams[0]")
        self.name = self.config.name
        self.db = _Db(answers)
        self.id_gen = _Gen()
        self.upsert_sql = "UPSERT"


ORDERS = {"name": "orders", "table": "orders_stream", "columns": [{"item": "text"}],
          "writers": ["master"], "foreign_writers": True}


class FenceTests(SynchronousTestCase):
    def test_holders_are_named_after_the_grace_and_forgotten_when_gone(self):
        clock = Clock()
        h = holder("3/7", 31, pid=4242)
        stream = _Stream([(30, 40, [h]), (30, 40, [h]), (40, 40, [])])
        fence = Fence(stream, clock, poll=1.0)
        fence.start()  # first poll at once
        self.assertEqual(stream.id_gen.caps, [30])
        self.assertEqual(fence.hung(5), [])
        clock.advance(6)  # the second poll: still held
        self.assertEqual([(x.pid, since) for x, since in fence.hung(5)], [(4242, 0)])
        clock.advance(1)  # gone
        self.assertEqual(fence.hung(5), [])
        self.assertEqual(stream.id_gen.caps, [30, 40])
        fence.stop()

    def test_an_unknown_id_keeps_the_cap_and_a_failed_poll_moves_nothing(self):
        clock = Clock()
        stream = _Stream([(None, 40, [holder("3/7", None)]), RuntimeError("down"),
                          (40, 40, [])])
        fence = Fence(stream, clock, poll=1.0)
        fence.start()
        clock.advance(1)
        self.assertEqual(stream.id_gen.caps, [])
        clock.advance(1)
        self.assertEqual(stream.id_gen.caps, [40])
        fence.stop()
        self.flushLoggedErrors()


class DdlTests(SynchronousTestCase):
    def test_keys_differ_per_table_and_role(self):
        from replicator.config.streams import parse_stream
        a = lock_classes(parse_stream(dict(ORDERS), "s"))
        b = lock_classes(parse_stream(dict(ORDERS, table="other"), "s"))
        self.assertEqual(len(set(a.values()) | set(b.values())), 6)

    def test_the_function_takes_the_stream_lock_before_nextval(self):
        from replicator.config.streams import parse_stream
        ddl = function_ddl(parse_stream(dict(ORDERS), "s"))
        self.assertLess(ddl.index("pg_try_advisory_xact_lock_shared"),
                        ddl.index("id := nextval"))


def doc(stream, database=None):
    return {"server_name": "hs", "instance_name": "master",
            "database": database or {"postgres": "dbname=x"}, "streams": [stream]}


class ConfigTests(SynchronousTestCase):
    def test_off_by_default(self):
        config = parse_instance(doc(dict(ORDERS, foreign_writers=False)))
        self.assertFalse(config.streams[0].foreign_writers)
        self.assertIsNone(config.streams[0].foreign_writer)
        config = parse_instance(doc({k: v for k, v in ORDERS.items()
                                     if k != "foreign_writers"}))
        self.assertFalse(config.streams[0].foreign_writers)

    def test_on_names_the_first_writer(self):
        config = parse_instance(doc(dict(ORDERS, writers=["master", "worker1"])))
        self.assertEqual(config.streams[0].foreign_writer, "master")

    def test_bad_values_name_the_key(self):
        cases = [
            (doc(dict(ORDERS, foreign_writers="yes")),
             "config: streams[0].foreign_writers: expected true or false, got str"),
            (doc(dict(ORDERS), {"sqlite": "x.db"}),
             "config: streams[0].foreign_writers: needs PostgreSQL: an embedded SQLite "
             "database has no sequence a plain-SQL writer could take IDs from"),
            (doc({"preset": "synapse/caches", "foreign_writers": True}),
             "config: streams[0].foreign_writers: 'synapse/caches' is Synapse's table: its "
             "writers are Synapse's"),
        ]
        for config, message in cases:
            with self.assertRaises(ConfigError, msg=message) as raised:
                parse_instance(config)
            self.assertEqual(str(raised.exception), message)
