"""The fault suite (tests.chaos): its checker on crafted data, its seeded
schedules, and a short seeded slice of real runs (the full suite is
``make chaos``), including one with a planted defect that must be caught."""

import asyncio
import os

from twisted.trial.unittest import SynchronousTestCase

from tests.chaos import checker
from tests.chaos.clients import make_rows, row_tag
from tests.chaos.nemesis import SCENARIOS, make_schedule

CACHES_M = ("caches", "master")
CACHES_W = ("caches", "worker1")


def write(tag, n, instance, stream, rows, outcome, stream_id=None):
    record = {"client": tag, "n": n, "instance": instance, "stream": stream, "rows": rows,
              "outcome": outcome}
    if stream_id is not None:
        record["stream_id"] = stream_id
    return record


class CheckerTests(SynchronousTestCase):
    """Each kind of violation is found, and a clean history has none."""

    def setUp(self):
        self.a = make_rows("caches", "m", 1, 2)  # two rows, one fact
        self.b = make_rows("caches", "m", 2, 1)
        self.c = make_rows("caches", "w", 1, 1)
        self.table = {CACHES_M: {3: self.a, 5: self.b}, CACHES_W: {4: self.c}}

    def deliveries(self, delivered, keys=(CACHES_M,)):
        v = checker.Violations()
        checker.check_deliveries(v, "worker2", keys, delivered, self.table)
        return v.as_dict()

    def only(self, **counts):
        out = dict.fromkeys(checker.KINDS, 0)
        out.update(counts)
        return out

    def test_clean_deliveries(self):
        # Rows of a fact may come in any order: a fact is a set of rows.
        got = {CACHES_M: [(3, list(reversed(self.a))), (5, self.b)]}
        self.assertEqual(self.deliveries(got), self.only())

    def test_lost_duplicated_reordered_split_phantom(self):
        self.assertEqual(self.deliveries({CACHES_M: [(5, self.b)]}), self.only(lost=1))
        self.assertEqual(self.deliveries({CACHES_M: [(3, self.a), (3, self.a), (5, self.b)]}),
                         self.only(duplicated=1))
        self.assertEqual(self.deliveries({CACHES_M: [(5, self.b), (3, self.a)]}),
                         self.only(reordered=1))
        self.assertEqual(self.deliveries({CACHES_M: [(3, self.a[:1]), (5, self.b)]}),
                         self.only(split=1))
        # Rows of fact 3 leaking into fact 5 (a half-published batch).
        self.assertEqual(self.deliveries({CACHES_M: [(3, self.a[:1]),
                                                     (5, self.a[1:] + self.b)]}),
                         self.only(split=2))
        self.assertEqual(self.deliveries({CACHES_M: [(3, self.a), (4, self.c), (5, self.b)]}),
                         self.only(phantom=1))
        # A reader given facts of a writer it hosts itself.
        self.assertEqual(self.deliveries({CACHES_M: [(3, self.a), (5, self.b)],
                                          CACHES_W: [(4, self.c)]}), self.only(phantom=1))

    def history(self, writes):
        v = checker.Violations()
        checker.check_writes(v, writes, self.table, row_tag)
        return v

    def test_clean_history(self):
        writes = [write("m", 1, "master", "caches", self.a, "acked", 3),
                  write("m", 2, "master", "caches", self.b, "timeout"),
                  write("w", 1, "worker1", "caches", self.c, "failed"),
                  write("m", 3, "master", "caches", [], "acked", 6),
                  write("m", 4, "master", "caches", make_rows("caches", "m", 4, 2), "failed")]
        self.assertEqual(self.history(writes).total(), 0)

    def test_history_violations(self):
        base = [write("m", 2, "master", "caches", self.b, "acked", 5),
                write("w", 1, "worker1", "caches", self.c, "acked", 4)]
        cases = [
            # acked with another ID
            [write("m", 1, "master", "caches", self.a, "acked", 4)],
            # acked, not in the table
            [write("m", 1, "master", "caches", self.a, "acked", 3),
             write("m", 9, "master", "caches", make_rows("caches", "m", 9, 1), "acked", 9)],
            # acked empty fact whose ID holds rows
            [write("m", 1, "master", "caches", self.a, "acked", 3),
             write("m", 8, "master", "caches", [], "acked", 3)],
        ]
        for extra in cases:
            self.assertEqual(self.history(base + extra).counts["history"], 1, extra)
        # A timed-out write partly there.
        self.table[CACHES_M][3] = self.a[:1]
        self.assertEqual(self.history(base + [write("m", 1, "master", "caches", self.a,
                                                    "timeout")]).counts["history"], 1)
        # Rows no request sent, and one ID holding rows of two requests.
        self.table[CACHES_M][3] = self.a + self.b
        v = self.history([write("m", 1, "master", "caches", self.a, "acked", 3)]
                         + base[1:])
        self.assertEqual(v.counts["history"], 2)  # ID 3 mixed; m.2's rows never sent

    def test_claims(self):
        first_seen = {CACHES_M: {3: 0, 5: 2, 7: 4}}
        # Position 5 claimed before snapshot 1, fact 5 not committed until snapshot 2.
        claims = {CACHES_M: [(0, 3, "ok"), (1, 5, "early claim"), (4, 7, "ok")]}
        v = checker.Violations()
        checker.check_claims(v, first_seen, claims, [0.0, 0.1, 0.2, 0.3, 0.4], 5)
        self.assertEqual(v.counts["claim"], 1)
        self.assertIn("early claim", v.examples["claim"][0])
        # Claimed in the same round as the snapshot that first saw it: fine.
        v = checker.Violations()
        checker.check_claims(v, first_seen, {CACHES_M: [(2, 5, "ok"), (4, 7, "ok")]},
                             [0.0, 0.1, 0.2, 0.3, 0.4], 5)
        self.assertEqual(v.total(), 0)

    def test_frozen(self):
        writers = {"caches": ["master", "worker1", "worker2"]}
        at_last = {("caches", w): 7 for w in writers["caches"]}
        v = checker.Violations()
        checker.check_frozen(v, {"caches": 7}, {("master", "caches"): 7,
                                                ("worker1", "caches"): 9}, at_last, writers)
        self.assertEqual(v.total(), 0)
        # An idle writer's row behind, a linear token behind, an instance
        # that did not answer, and a writer with no row at all.
        v = checker.Violations()
        checker.check_frozen(v, {"caches": 7},
                             {("master", "caches"): 5, ("worker1", "caches"): None},
                             {**at_last, ("caches", "worker1"): 6}, writers)
        self.assertEqual(v.counts["frozen"], 3)
        v = checker.Violations()
        checker.check_frozen(v, {"caches": 7}, {}, {("caches", "master"): 7}, writers)
        self.assertEqual(v.counts["frozen"], 2)

    def test_processes(self):
        v = checker.Violations()
        checker.check_processes(v, {"master": [1], "worker1": []},
                                {"master": (200, ""), "worker1": (503, "lagging")},
                                {"master": 0, "worker1": -9, "worker2": None})
        self.assertEqual((v.counts["exit"], v.counts["health"]), (2, 1))


class ScheduleTests(SynchronousTestCase):
    def test_same_seed_same_schedule(self):
        for scenario in SCENARIOS:
            for transport in ("tcp", "redis"):
                a = make_schedule(scenario, transport, 42, 30)
                self.assertEqual(a, make_schedule(scenario, transport, 42, 30))
                self.assertNotEqual(a, make_schedule(scenario, transport, 43, 30))
                self.assertTrue(a and all(0 < f.at < 30 for f in a))
        kinds = {f.kind for f in make_schedule("all", "redis", 7, 300)}
        self.assertEqual(kinds, {"kill9", "redis_restart", "pause", "cut", "partition",
                                 "stall", "slow_cut", "hold_release", "pg_restart_immediate",
                                 "pg_restart_fast", "pg_down"})
        # Hold-release is a Redis fault: over TCP the held link's bytes would
        # reach a master that dropped the connection they came on.
        self.assertNotIn("hold_release", {f.kind for f in make_schedule("net", "tcp", 7, 300)})
        self.assertEqual(make_schedule("none", "tcp", 1, 30), [])


def run(scenario, transport, seed, duration, **kwargs):
    from tests.chaos.run import run_once

    lines = []
    result = asyncio.run(run_once(scenario, transport, seed, duration, say=lines.append,
                                  **kwargs))
    return result, "\n".join(lines)


class SliceTests(SynchronousTestCase):
    """A short seeded slice of ``make chaos`` (fixed seeds, 10 s of faults
    each), limited to scenarios that pass reliably on main."""

    SLICE = [("crash", "tcp", 101), ("net", "tcp", 102), ("pause", "redis", 103)]

    def test_slice(self):
        for scenario, transport, seed in self.SLICE:
            result, out = run(scenario, transport, seed, 10.0)
            self.assertGreater(result["faults"], 0, out)
            self.assertGreater(result["outcomes"].get("acked", 0), 100, out)
            self.assertTrue(result["quiescent"], out)
            self.assertEqual(result["violations"], dict.fromkeys(checker.KINDS, 0), out)

    def test_planted_defect_is_caught(self):
        """Every 100th row dropped at the readers: facts lost or split, and
        nothing else blamed."""
        result, out = run("none", "tcp", 104, 6.0, plant="drop-rdata",
                          quiescence_timeout=30.0)
        violations = result["violations"]
        self.assertGreater(violations["lost"] + violations["split"], 0, out)
        self.assertEqual({k: n for k, n in violations.items() if n and k not in
                          ("lost", "split")}, {}, out)
        import shutil

        shutil.rmtree(result["dir"], ignore_errors=True)


class AuditTripTests(SynchronousTestCase):
    """The faults the delivery audit and the checked POSITIONs exist for,
    planted in real runs: each must trip them within its bound (and
    ``make chaos`` without a plant counts any trip as a violation)."""

    def tripped(self, plant, transport, seed, duration):
        from tests.chaos.run import TRIP_BOUND

        result, out = run("none", transport, seed, duration, plant=plant,
                          quiescence_timeout=15.0, health_timeout=2.0)
        import shutil

        shutil.rmtree(result.get("dir", ""), ignore_errors=True)
        self.assertIsNotNone(result["trip_s"], out)
        self.assertLessEqual(result["trip_s"], TRIP_BOUND[plant], out)
        return result, out

    def test_a_skip_planted_in_the_reader_is_found_by_the_audit(self):
        result, out = self.tripped("skip-fact", "tcp", 105, 6.0)
        self.assertGreater(sum(c["mismatch"] for c in result["audit"].values()), 0, out)

    def test_forged_positions_on_redis_lose_no_committed_fact(self):
        result, out = self.tripped("forge-position", "redis", 106, 6.0)
        self.assertGreater(result["planted"], 0, out)
        # Every POSITION over committed facts was caught up from the table;
        # a forged one over a fact still in flight stopped the stream
        # (audit mismatch) rather than skip it: never a silent loss.
        v = result["violations"]
        if not sum(c["mismatch"] for c in result["audit"].values()):
            self.assertEqual(v["lost"], 0, out)

    def test_a_late_plain_sql_commit_below_the_readers_is_found(self):
        result, out = self.tripped("late-sql", "tcp", 107, 16.0)
        self.assertGreater(result["planted"], 0, out)
        self.assertGreater(sum(c["mismatch"] for c in result["audit"].values()), 0, out)


class ProxyTests(SynchronousTestCase):
    """The proxy's faults, on real loopback sockets (an echo server behind it)."""

    def run_async(self, body):
        async def main():
            from tests.chaos.proxy import Proxy

            echoes = set()

            async def echo(reader, writer):
                echoes.add(asyncio.current_task())
                try:
                    while True:
                        data = await reader.read(65536)
                        if not data:
                            break
                        writer.write(data)
                        await writer.drain()
                except ConnectionError:
                    pass
                finally:
                    writer.close()

            server = await asyncio.start_server(echo, "127.0.0.1", 0)
            proxy = await Proxy("p", server.sockets[0].getsockname()[1]).start()
            try:
                await asyncio.wait_for(body(proxy), 30)
            finally:
                await proxy.close()
                server.close()
                # Let each echo see its connection end, rather than be
                # cancelled by the loop's shutdown (reported as unhandled).
                if echoes:
                    await asyncio.wait(echoes, timeout=5)
        asyncio.run(main())

    def test_pass_and_cut(self):
        async def body(proxy):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"hello\n")
            self.assertEqual(await reader.readline(), b"hello\n")
            self.assertEqual(proxy.cut(), 1)
            self.assertEqual(await reader.read(), b"")  # closed
            # New connections pass again.
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"again\n")
            self.assertEqual(await reader.readline(), b"again\n")
            writer.close()
        self.run_async(body)

    def test_the_quiescence_check_leaves_the_proxy_forwarding(self):
        # At a million facts a round of the check is tens of seconds of
        # CPU; the replication links pass through proxies on the same
        # event loop, and must go on meanwhile.
        from tests.chaos.run import wait_quiescent

        gate = os.path.join(self.mktemp())

        async def body(proxy):
            check = asyncio.ensure_future(wait_quiescent({}, gate, 5, states=states_once_told))
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"ping\n")
            self.assertEqual(await reader.readline(), b"ping\n")
            self.assertFalse(check.done())  # (the round is still waiting)
            with open(gate, "w"):
                pass
            self.assertTrue(await check)
            writer.close()
        self.run_async(body)

    def test_stall_holds_bytes_until_it_ends(self):
        async def body(proxy):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            stall = asyncio.ensure_future(proxy.stall(60))
            await asyncio.sleep(0)
            writer.write(b"held\n")
            with self.assertRaises(asyncio.TimeoutError):
                await asyncio.wait_for(reader.readline(), 0.3)
            stall.cancel()  # ends the stall early
            self.assertEqual(await reader.readline(), b"held\n")
            writer.close()
        self.run_async(body)

    def test_slow_cut_trickles_then_cuts(self):
        async def body(proxy):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            slow = asyncio.ensure_future(proxy.slow_cut(60))
            await asyncio.sleep(0)
            writer.write(b"x" * 64)
            chunks = []
            while sum(map(len, chunks)) < 64:
                chunks.append(await reader.read(64))
            self.assertGreater(len(chunks), 1)  # it came in pieces
            self.assertTrue(all(len(c) <= 8 for c in chunks), chunks)
            slow.cancel()  # ends it: the connection is cut
            self.assertEqual(await reader.read(), b"")
        self.run_async(body)

    def test_partition_blackholes_new_connections(self):
        async def body(proxy):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"up\n")
            self.assertEqual(await reader.readline(), b"up\n")
            part = asyncio.ensure_future(proxy.partition(60))
            self.assertEqual(await reader.read(), b"")  # the existing one is cut
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"lost?\n")
            with self.assertRaises(asyncio.TimeoutError):
                await asyncio.wait_for(reader.readline(), 0.3)
            part.cancel()  # healed: the blackholed connection is cut too
            self.assertEqual(await reader.read(), b"")
        self.run_async(body)

    def test_hold_release_forwards_a_prefix_late_after_the_client_is_gone(self):
        async def main():
            from tests.chaos.proxy import Proxy

            received = asyncio.Queue()

            async def record(reader, writer):  # what each connection sent, at its end
                received.put_nowait(await reader.read())
                writer.close()

            async def until(predicate):
                while not predicate():
                    await asyncio.sleep(0.01)

            server = await asyncio.start_server(record, "127.0.0.1", 0)
            proxy = await Proxy("p", server.sockets[0].getsockname()[1]).start()
            try:
                _, old = await asyncio.open_connection("127.0.0.1", proxy.port)
                await asyncio.wait_for(until(lambda: proxy.links), 10)
                self.assertEqual(proxy.hold(), 1)
                (link,) = proxy.links
                old.write(b"one\ntwo\n")
                await asyncio.wait_for(until(lambda: link.held == b"one\ntwo\n"), 10)
                old.transport.abort()  # the client gives up on the link
                await asyncio.wait_for(until(lambda: link.client_gone), 10)
                # Its replacement passes at once...
                _, new = await asyncio.open_connection("127.0.0.1", proxy.port)
                new.write(b"new\n")
                new.close()
                self.assertEqual(await asyncio.wait_for(received.get(), 10), b"new\n")
                # ...and only then does the old link's prefix arrive.
                self.assertEqual(await proxy.release(lambda held: held.index(b"\n") + 1), 4)
                self.assertEqual(await asyncio.wait_for(received.get(), 10), b"one\n")
            finally:
                await proxy.close()
                server.close()
        asyncio.run(main())


def states_once_told(gate: str, readers) -> set:
    """A round of the quiescence check that lasts until ``gate`` exists
    (in the check's own process), or gives up after 10 s."""
    import time

    deadline = time.monotonic() + 10
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            return {"gave up"}
        time.sleep(0.01)
    return {"match"}


class ObserverSnapshotTests(SynchronousTestCase):
    """The observer reads, at each poll, only rows committed since its last
    read of the table, whatever their IDs (real PostgreSQL)."""

    def setUp(self):
        import psycopg2

        from tests.servers import PostgresServer

        self.dsn = PostgresServer.shared().create_database("observer")
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        cur = conn.cursor()
        cur.execute("CREATE TABLE stream_positions (stream_name text, instance_name text, "
                    "stream_id bigint)")
        cur.execute("CREATE TABLE cache_invalidation_stream (stream_id bigint, "
                    "instance_name text, cache_func text, keys json, invalidation_ts bigint)")
        cur.execute("CREATE TABLE account_data_stream (stream_id bigint, user_id text, "
                    "room_id text, data_type text)")
        self.conns = [conn]
        self.addCleanup(lambda: [c.close() for c in self.conns])

    def connection(self, autocommit=True):
        import psycopg2

        conn = psycopg2.connect(self.dsn)
        conn.autocommit = autocommit
        self.conns.append(conn)
        return conn

    def insert(self, conn, stream_id, writer="master"):
        conn.cursor().execute(
            "INSERT INTO cache_invalidation_stream VALUES (%s, %s, 'f', NULL, 0)",
            (stream_id, writer))

    def test_each_row_once_in_commit_order(self):
        from tests.chaos.observer import Observer

        observer = Observer(self.dsn, {})
        self.addCleanup(observer.close)
        now = self.connection()
        self.insert(now, 1)
        self.assertEqual(observer._snapshot()[2], {("caches", "master"): [1]})
        held = self.connection(autocommit=False)
        self.insert(held, 2)  # committed later than 3
        self.insert(now, 3, "worker1")
        self.insert(now, 4)
        self.assertEqual(observer._snapshot()[2],
                         {("caches", "master"): [4], ("caches", "worker1"): [3]})
        held.commit()
        self.assertEqual(observer._snapshot()[2], {("caches", "master"): [2]})
        self.assertEqual(observer._snapshot()[2], {})
        rolled_back = self.connection(autocommit=False)
        self.insert(rolled_back, 5)
        rolled_back.rollback()
        now.cursor().execute("INSERT INTO account_data_stream VALUES (6, 'u', NULL, 't')")
        self.assertEqual(observer._snapshot()[2], {("account_data", "worker2"): [6]})
