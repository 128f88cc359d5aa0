"""``Idempotency-Key`` on the write API (:mod:`replicator.http.idempotent`,
:mod:`replicator.streams.idempotency`): a retry answers the first write's
``stream_id`` and writes nothing.

In memory (:mod:`tests.harness`): a retry, another body (422), a retry
while the first is in flight (409), the window, malformed keys, pruning.
On a real PostgreSQL with two instances of one deployment: a retry that
reaches the other instance, one that waits there for the first's
transaction, many at once.  Over real processes
(:class:`IdempotentDaemonTests`): a client that timed out while the daemon
was stopped (SIGSTOP) retries after SIGCONT; a retry after a restart.
"""

import json
import signal
import urllib.error
import urllib.request

import orjson
import psycopg2
from twisted.internet import defer
from twisted.trial.unittest import SynchronousTestCase

from replicator.streams import idempotency
from replicator.streams.idempotency import (
    PRUNE_INTERVAL,
    IdempotencyKeys,
    IdempotencyPruner,
    fingerprint,
)
from tests.daemon import CACHES, SECRET, Daemon, base_config, cli
from tests.http_api import (
    AUTH,
    FACTS,
    HttpTestCase,
    InMemoryHttpTestCase,
    RawClient,
)
from tests.servers import PostgresServer, free_port, wait_for
from tests.support import until

KEY = "3f0b6a8e-5f4c-4d1e-9a8f-2b7c1d0e9f11"
ROWS = {"rows": [["get_user", ["@alice:hs.test"], 1000]]}


def keyed(key=KEY):
    return {**AUTH, "Idempotency-Key": key}


class InMemoryIdempotencyTests(InMemoryHttpTestCase):
    """The API in memory: SQLite, the harness's clock."""

    def post_keyed(self, doc, key=KEY, stream="caches"):
        response, answer = self.h.run(self.json("POST", FACTS.format(stream),
                                                orjson.dumps(doc), keyed(key)))
        return response.code, answer, response.headers.getRawHeaders(b"idempotent-replayed")

    def facts(self, table="cache_stream"):
        return self.h.run(self.db.runQuery(
            f"SELECT stream_id, cache_func FROM {table} ORDER BY stream_id"))

    def records(self):
        return self.h.run(self.db.runQuery(
            "SELECT table_name, idem_key, stream_id FROM stream_idempotency "
            "ORDER BY table_name, idem_key"))

    def test_a_retry_answers_the_first_write_and_writes_nothing(self):
        self.start()
        self.assertEqual(self.post_keyed(ROWS), (200, {"stream_id": 1}, None))
        self.assertEqual(self.post_keyed(ROWS), (200, {"stream_id": 1}, [b"true"]))
        # The same rows spelled otherwise (spacing) are the same write.
        spelled = b'{ "rows" : [ ["get_user", ["@alice:hs.test"], 1000] ] }'
        response, answer = self.h.run(self.json("POST", FACTS.format("caches"), spelled,
                                                keyed()))
        self.assertEqual((response.code, answer), (200, {"stream_id": 1}))
        self.assertEqual(self.facts(), [(1, "get_user")])
        self.assertEqual(self.records(), [("cache_stream", KEY, 1)])
        # Without a key, or with another one, a write is a new fact (a
        # retry that found its key took an ID and rolled back: IDs are
        # not consecutive).
        code, second = self.write("caches", ROWS)
        code3, third, replayed = self.post_keyed(ROWS, key="other")
        self.assertEqual((code, code3, replayed), (200, 200, None))
        self.assertEqual(self.facts(), [(1, "get_user"), (second["stream_id"], "get_user"),
                                        (third["stream_id"], "get_user")])
        self.assertEqual(self.post_keyed(ROWS, key="other"), (200, third, [b"true"]))

    def test_the_same_key_with_another_body_is_422(self):
        self.start()
        self.assertEqual(self.post_keyed(ROWS), (200, {"stream_id": 1}, None))
        before = self.snapshot()
        for doc in ({"rows": [["get_user", ["@bob:hs.test"], 1000]]},
                    {"rows": [*ROWS["rows"], *ROWS["rows"]]}, {"rows": []}):
            code, answer, _ = self.post_keyed(doc)
            self.assertEqual((code, answer), (422, {
                "error": "Idempotency-Key was used for another write (stream caches, other "
                         "rows): use a new key for a new write"}), doc)
        self.assertEqual(self.facts(), [(1, "get_user")])
        # The refused writes took IDs and rolled back: no position moved
        # past a fact, nothing is left in flight.
        self.assertEqual({name: gen[2] for name, gen in self.snapshot().items()},
                         {name: gen[2] for name, gen in before.items()})
        # The first write is still answered.
        self.assertEqual(self.post_keyed(ROWS), (200, {"stream_id": 1}, [b"true"]))

    def test_a_retry_while_the_first_is_in_flight_is_409_then_answered(self):
        self.start()
        caches = self.registry.get("caches")
        gate, entered = defer.Deferred(), []
        original = caches.write_prepared

        async def held(prepared, hooks=()):
            entered.append(prepared)
            if len(entered) == 1:
                await gate
            return await original(prepared, hooks)

        caches.write_prepared = held
        first = defer.ensureDeferred(self.json("POST", FACTS.format("caches"),
                                               orjson.dumps(ROWS), keyed()))
        self.h.flush()
        self.assertEqual(len(entered), 1)
        response, answer = self.answer("POST", FACTS.format("caches"), orjson.dumps(ROWS),
                                       keyed())
        self.assertEqual((response.code, answer), (409, {
            "error": "a request with this Idempotency-Key is still in flight: retry it later"}))
        self.assertEqual(response.headers.getRawHeaders(b"retry-after"), [b"1"])
        self.assertEqual(len(entered), 1)  # the second never reached the stream
        gate.callback(None)
        response, answer = self.h.run(first)
        self.assertEqual((response.code, answer), (200, {"stream_id": 1}))
        self.assertEqual(self.post_keyed(ROWS), (200, {"stream_id": 1}, [b"true"]))
        self.assertEqual(self.facts(), [(1, "get_user")])

    def test_a_key_is_scoped_per_stream(self):
        self.start("worker1")  # a writer of both streams
        self.assertEqual(self.post_keyed(ROWS), (200, {"stream_id": 1}, None))
        self.assertEqual(self.post_keyed({"rows": [["$event"]]}, stream="events"),
                         (200, {"stream_id": 1}, None))
        self.assertEqual(self.post_keyed(ROWS), (200, {"stream_id": 1}, [b"true"]))
        self.assertEqual(self.records(), [("cache_stream", KEY, 1), ("event_stream", KEY, 1)])

    def test_a_key_reused_after_the_window_is_a_new_write(self):
        self.start(config_overrides={"http": {"listen": "tcp:0:interface=127.0.0.1",
                                              "secret": AUTH["Authorization"][7:],
                                              "idempotency_window": 60}})
        self.assertEqual(self.post_keyed(ROWS), (200, {"stream_id": 1}, None))
        self.h.advance(59)
        self.assertEqual(self.post_keyed(ROWS), (200, {"stream_id": 1}, [b"true"]))
        self.h.advance(2)  # 61 s after the first write
        code, second, replayed = self.post_keyed(ROWS)
        self.assertEqual((code, replayed), (200, None))
        self.assertGreater(second["stream_id"], 1)
        self.assertEqual(self.records(), [("cache_stream", KEY, second["stream_id"])])
        # Now the key answers the new write, with any body it had.
        self.assertEqual(self.post_keyed(ROWS), (200, second, [b"true"]))
        other = {"rows": [["get_rooms", None, 1]]}
        self.assertEqual(self.post_keyed(other)[0], 422)
        self.h.advance(61)
        code, third, replayed = self.post_keyed(other)
        self.assertEqual((code, replayed), (200, None))
        self.assertEqual(self.facts(), [(1, "get_user"), (second["stream_id"], "get_user"),
                                        (third["stream_id"], "get_rooms")])

    def test_malformed_keys_are_400_naming_the_header(self):
        self.start()
        before = self.snapshot()
        why = ("Idempotency-Key header must be 1 to 255 printable ASCII characters without "
               "space (e.g. a UUID), got ")
        cases = [(b"", why + "0 bytes"), (b"k" * 256, why + "256 bytes"),
                 (b"a b", why + "a space, control or non-ASCII byte"),
                 (b"caf\xc3\xa9", why + "a space, control or non-ASCII byte"),
                 (b"a\x01b", why + "a space, control or non-ASCII byte")]
        for value, error in cases:
            response, answer = self.answer("POST", FACTS.format("caches"),
                                           orjson.dumps(ROWS), {**AUTH, "Idempotency-Key": value})
            self.assertEqual((response.code, answer), (400, {"error": error}), value)
        # Given twice.
        self.assertEqual(self.raw_post([b"Idempotency-Key: a", b"Idempotency-Key: a"]),
                         (400, {"error": "Idempotency-Key header given more than once"}))
        self.assertEqual(self.snapshot(), before)
        self.assertEqual(self.facts(), [])
        # The longest key and every printable character are fine.
        for value in ("k" * 255, "".join(chr(c) for c in range(0x21, 0x7F))):
            self.assertEqual(self.post_keyed(ROWS, key=value)[0], 200)

    def raw_post(self, header_lines):
        body = orjson.dumps(ROWS)
        request = (b"POST " + FACTS.format("caches").encode() + b" HTTP/1.1\r\nHost: x\r\n"
                   b"Authorization: " + AUTH["Authorization"].encode() + b"\r\n"
                   + b"".join(line + b"\r\n" for line in header_lines)
                   + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        client = RawClient(request)
        self.open(client)
        received = self.h.run(client.closed)
        head, _, data = received.partition(b"\r\n\r\n")
        return int(head.split(b" ")[1]), orjson.loads(data)

    def test_records_out_of_the_window_are_pruned(self):
        self.start(config_overrides={"http": {"listen": "tcp:0:interface=127.0.0.1",
                                              "secret": AUTH["Authorization"][7:],
                                              "idempotency_window": 120}})
        keys = self.api.streams.idempotent.keys
        pruner = IdempotencyPruner(keys, self.h.clock)
        pruner.startService()
        self.addCleanup(pruner.stopService)
        self.assertEqual(pruner.interval, 120)
        self.assertEqual(self.post_keyed(ROWS, key="old")[0], 200)
        self.h.advance(60)
        self.assertEqual(self.post_keyed(ROWS, key="young")[0], 200)
        self.h.advance(60)  # the first pass: "old" is 120 s old, not older
        self.assertEqual([r[1] for r in self.records()], ["old", "young"])
        self.h.advance(120)  # the second: both are older than the window
        self.assertEqual(self.records(), [])
        self.assertEqual(len(self.facts()), 2)  # facts are retention's business

    def test_prune_goes_in_batches(self):
        self.start()
        self.assertEqual(self.post_keyed(ROWS, key="k0"), (200, {"stream_id": 1}, None))
        keys = IdempotencyKeys(self.db, 60, self.h.clock)
        self.patch(idempotency, "PRUNE_BATCH", 3)
        for i in range(1, 7):
            self.h.run(self.db.runOperation(
                "INSERT INTO stream_idempotency VALUES (?, ?, ?, ?, ?)",
                ("cache_stream", f"k{i}", "x", i, 0)))
        self.h.advance(61)
        self.assertEqual(self.h.run(keys.prune()), 7)
        self.assertEqual(self.records(), [])
        self.assertEqual(PRUNE_INTERVAL, 300)



class PostgresIdempotencyTests(HttpTestCase):
    """Two instances of one deployment (both writers of ``caches``) on one
    PostgreSQL database: a retry may reach either."""

    async def start_both(self):
        dsn = PostgresServer.shared().create_database()
        await self.start("master", dsn=dsn)
        self.ports = {"master": self.port}
        await self.start("worker1", dsn=dsn)
        self.ports["worker1"] = self.port
        self.dsn = dsn

    def post_at(self, instance, doc, key=KEY):
        """The answer's ``(code, body, replayed)`` (a Deferred: the request
        is on its way when this returns)."""
        self.port = self.ports[instance]

        async def post():
            response, answer = await self.json("POST", FACTS.format("caches"),
                                               orjson.dumps(doc), keyed(key))
            return response.code, answer, response.headers.getRawHeaders(
                b"idempotent-replayed")

        return defer.ensureDeferred(post())

    async def facts(self, func):
        rows = await self.db.runQuery(
            "SELECT stream_id FROM cache_stream WHERE cache_func = %s ORDER BY 1", (func,))
        return [r[0] for r in rows]

    async def test_a_retry_on_the_other_instance_answers_the_first_write(self):
        await self.start_both()
        self.assertEqual(await self.post_at("master", ROWS), (200, {"stream_id": 1}, None))
        self.assertEqual(await self.post_at("worker1", ROWS), (200, {"stream_id": 1}, [b"true"]))
        code, answer, _ = await self.post_at("worker1", {"rows": [["other", None, 1]]})
        self.assertEqual(code, 422)
        self.assertEqual(await self.facts("get_user"), [1])
        self.assertEqual(await self.facts("other"), [])

    def hold_key(self, key, rows, stream_id):
        """Another instance's transaction that recorded ``key`` and has not
        committed yet: its connection (commit or roll it back)."""
        conn = psycopg2.connect(self.dsn)
        self.addCleanup(conn.close)
        prepared = self.registry.get("caches").prepare([rows], "worker1")
        with conn.cursor() as cur:
            cur.execute("INSERT INTO stream_idempotency VALUES (%s, %s, %s, %s, "
                        "(extract(epoch from now()) * 1000)::bigint)",
                        ("cache_stream", key, fingerprint("caches", prepared.lines[0]),
                         stream_id))
        return conn

    def waiting_for_a_lock(self):
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a "
                        "ON a.pid = l.pid WHERE NOT l.granted "
                        "AND a.datname = current_database()")
            waiting = cur.fetchone()[0]
        conn.close()
        return waiting > 0

    async def test_a_retry_waits_for_the_first_transaction_elsewhere(self):
        await self.start_both()
        # The first attempt's transaction commits: the retry answers its ID.
        other = self.hold_key("committed", ROWS["rows"], 4242)
        answer = self.post_at("worker1", ROWS, key="committed")
        await until(self.waiting_for_a_lock, timeout=30)
        self.assertFalse(answer.called)
        other.commit()
        self.assertEqual(await answer, (200, {"stream_id": 4242}, [b"true"]))
        self.assertEqual(await self.facts("get_user"), [])
        # It rolls back: the retry writes the fact.
        other = self.hold_key("rolled-back", ROWS["rows"], 4343)
        answer = self.post_at("worker1", ROWS, key="rolled-back")
        await until(self.waiting_for_a_lock, timeout=30)
        other.rollback()
        code, body, replayed = await answer
        self.assertEqual((code, replayed), (200, None))
        self.assertEqual(await self.facts("get_user"), [body["stream_id"]])
        rows = await self.db.runQuery("SELECT stream_id FROM stream_idempotency "
                                      "WHERE idem_key = 'rolled-back'")
        self.assertEqual(rows, [(body["stream_id"],)])

    async def test_many_at_once_on_both_instances_write_one_fact(self):
        await self.start_both()
        answers = await defer.gatherResults(
            [self.post_at(("master", "worker1")[i % 2], ROWS) for i in range(12)])
        written = await self.facts("get_user")
        self.assertEqual(len(written), 1, answers)
        for code, body, replayed in answers:
            if code == 200:
                self.assertEqual(body, {"stream_id": written[0]})
            else:
                self.assertEqual(code, 409, body)
        self.assertEqual(sum(1 for code, _, replayed in answers
                             if code == 200 and replayed is None), 1, answers)
        # Retried now, on either instance, it is answered the first write's ID.
        for instance in ("master", "worker1"):
            self.assertEqual(await self.post_at(instance, ROWS),
                             (200, {"stream_id": written[0]}, [b"true"]))
        self.assertEqual(await self.facts("get_user"), written)


    async def test_a_retry_in_a_group_commit_fails_alone(self):
        await self.start_both()
        self.assertEqual(await self.post_at("worker1", ROWS), (200, {"stream_id": 1}, None))
        # Sent at once, they may share a transaction: the retry's finding its
        # key rolls that transaction back; each write is then retried alone.
        others = [{"rows": [[f"other{i}", None, i]]} for i in range(6)]
        answers = await defer.gatherResults(
            [self.post_at("worker1", ROWS)]
            + [self.post_at("worker1", doc, key=f"key-{i}") for i, doc in enumerate(others)])
        self.assertEqual(answers[0], (200, {"stream_id": 1}, [b"true"]))
        for i, (code, body, replayed) in enumerate(answers[1:]):
            self.assertEqual((code, replayed), (200, None))
            self.assertEqual(await self.facts(f"other{i}"), [body["stream_id"]])
        self.assertEqual(await self.facts("get_user"), [1])


def http_post(base, rows, key=None, timeout=30.0):
    """``(status, body)`` of a write by a plain HTTP client (urllib)."""
    request = urllib.request.Request(f"{base}{FACTS.format('caches')}", method="POST",
                                     data=json.dumps({"rows": rows}).encode())
    request.add_header("Authorization", f"Bearer {SECRET}")
    if key is not None:
        request.add_header("Idempotency-Key", key)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class IdempotentDaemonTests(SynchronousTestCase):
    """``replicator run`` on PostgreSQL, clients in other processes."""

    def start_daemon(self):
        self.dsn = PostgresServer.shared().create_database()
        config = base_config("master", free_port(), [CACHES], database={"postgres": self.dsn})
        self.daemon = Daemon(self, config, "master").start()
        return self.daemon

    def facts(self, func):
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT stream_id FROM cache_invalidation_stream "
                        "WHERE cache_func = %s ORDER BY 1", (func,))
            found = [r[0] for r in cur.fetchall()]
        conn.close()
        return found

    def test_a_client_that_timed_out_during_sigstop_retries_once(self):
        daemon = self.start_daemon()
        base = daemon.http_base
        keyed_row, plain_row = ["keyed", None, 1], ["plain", None, 2]
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            # Both requests reach the stopped daemon's socket; their
            # clients give up.
            for row, key in ((keyed_row, KEY), (plain_row, None)):
                with self.assertRaises(OSError):  # (TimeoutError, URLError)
                    http_post(base, [row], key, timeout=1.0)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        # The daemon reads them when it runs again, and commits them.
        wait_for(lambda: self.facts("keyed") and self.facts("plain"), timeout=60,
                 what="the timed-out writes committed")
        (first,) = self.facts("keyed")
        # Each client retries as HTTP client libraries do.
        self.assertEqual(http_post(base, [keyed_row], KEY), (200, {"stream_id": first}))
        self.assertEqual(http_post(base, [plain_row])[0], 200)
        self.assertEqual(self.facts("keyed"), [first])
        self.assertEqual(len(self.facts("plain")), 2)  # without a key: a second fact
        # The CLI retries with its key by itself; given the same key, it
        # answers the first write's ID.
        written = cli("write", "-c", daemon.path, "caches", json.dumps(keyed_row),
                      "--idempotency-key", KEY, cwd=daemon.dir)
        self.assertEqual((written.returncode, written.stdout), (0, f"{first}\n"),
                         written.stderr)
        self.assertEqual(self.facts("keyed"), [first])

    def test_a_retry_after_a_restart_answers_the_first_write(self):
        daemon = self.start_daemon()
        row = json.dumps(["restarted", None, 1])
        written = cli("write", "-c", daemon.path, "caches", row, "--idempotency-key", KEY,
                      cwd=daemon.dir)
        self.assertEqual(written.returncode, 0, written.stderr)
        daemon.proc.send_signal(signal.SIGTERM)
        self.assertEqual(daemon.proc.wait(30), 0, daemon.output()[-2000:])
        daemon.start()
        again = cli("write", "-c", daemon.path, "caches", row, "--idempotency-key", KEY,
                    cwd=daemon.dir)
        self.assertEqual((again.returncode, again.stdout), (0, written.stdout), again.stderr)
        self.assertEqual(self.facts("restarted"), [int(written.stdout)])
        # Another body under the key is refused, not written.
        other = cli("write", "-c", daemon.path, "caches", json.dumps(["other", None, 2]),
                    "--idempotency-key", KEY, cwd=daemon.dir)
        self.assertEqual(other.returncode, 1)
        self.assertIn(": 422 Idempotency-Key was used for another write", other.stderr)
        self.assertEqual(self.facts("other"), [])


class TableNameTests(SynchronousTestCase):
    def test_a_stream_cannot_take_the_table_of_the_keys(self):
        from replicator.config import ConfigError
        from replicator.config.streams import parse_stream

        with self.assertRaises(ConfigError) as caught:
            parse_stream(dict(CACHES, table="Stream_Idempotency"), "streams[0]")
        self.assertEqual(str(caught.exception), "config: streams[0].table: "
                         "'Stream_Idempotency' is the replicator's own table")
