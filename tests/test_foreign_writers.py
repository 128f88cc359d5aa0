"""Plain-SQL writers of a stream with ``foreign_writers: true``, through real
daemons (PostgreSQL; a master and a worker over TCP, the worker's ``jsonl``
file its consumer): a transaction of another program that holds its ID for
a while, beside the master's own writes and quick plain-SQL inserts, is
delivered once and in order when it commits; one that rolls back stalls
nothing once it ends; a stranger's open transaction on another table, and
one on the stream's table that inserted nothing, delays nothing; a holder
that stays is named on the master's ``/health`` and released when it ends.

What every test checks at its end: the worker's facts of writer master are
exactly the table's facts, in ID order, each once (no audit finding).
"""

import io
import json
import os
import signal

import psycopg2
from twisted.trial.unittest import SynchronousTestCase

from tests.daemon import SECRET, Daemon, base_config, http
from tests.servers import PostgresServer, free_port, wait_for
from tests.support import jsonl_facts

ORDERS = {"name": "orders", "table": "orders_stream", "columns": [{"item": "text"}],
          "writers": ["master"], "foreign_writers": True}
#: A finding about a holder after a second (the default is 10).
HEALTH = {"lag_grace": 1, "check_interval": 1}


class _Daemons(SynchronousTestCase):
    """A master and a worker on a database of :meth:`server` (no tests)."""

    def server(self):
        return PostgresServer.shared()

    def setUp(self):
        self.dsn = self.server().create_database()
        rep_port = free_port()
        link = {"ping_interval": 1, "ping_timeout": 10}
        self.master = Daemon(self, base_config(
            "master", free_port(), [ORDERS], database={"postgres": self.dsn}, health=HEALTH,
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1", **link}),
            "master").start()
        self.worker = Daemon(self, base_config(
            "worker1", free_port(), [ORDERS], database={"postgres": self.dsn}, health=HEALTH,
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}", **link},
            consumers=[{"type": "jsonl", "path": "facts.jsonl"}]), "worker1").start()
        wait_for(lambda: http(self.worker.http_base + "/health")[0] == 200, 60, "worker linked")
        self.file = os.path.join(self.worker.dir, "facts.jsonl")

    # ------------------------------------------------------------ helpers
    def connect(self, application_name="legacy-app"):
        conn = psycopg2.connect(self.dsn, application_name=application_name)
        self.addCleanup(conn.close)
        return conn

    def plain_insert(self, conn, item):
        """A plain-SQL row (the ID and the writer column from their defaults)."""
        cur = conn.cursor()
        cur.execute("INSERT INTO orders_stream (item) VALUES (%s) RETURNING stream_id", (item,))
        return cur.fetchone()[0]

    def api_write(self, item):
        status, body = http(f"{self.master.http_base}/_replicator/v1/streams/orders/facts",
                            json.dumps({"rows": [[item]]}).encode(), SECRET)
        self.assertEqual(status, 200, body)
        return json.loads(body)["stream_id"]

    def table(self):
        conn = psycopg2.connect(self.dsn, application_name="check")
        try:
            cur = conn.cursor()
            cur.execute("SELECT stream_id, item FROM orders_stream ORDER BY stream_id, ctid")
            facts: list = []
            for i, item in cur.fetchall():
                if facts and facts[-1][0] == i:
                    facts[-1][1].append([item])
                else:
                    facts.append((i, [[item]]))
            return facts
        finally:
            conn.close()

    def delivered(self):
        return jsonl_facts(self.file).get(("orders", "master"), [])

    def delivered_ids(self):
        return [t for t, _ in self.delivered()]

    def health(self, daemon):
        try:
            return http(daemon.http_base + "/health")
        except Exception as e:  # a 503
            return getattr(e, "code", None), getattr(e, "read", lambda: b"")()

    def held_texts(self):
        status, body = self.health(self.master)
        return json.loads(body).get("foreign_held", []) if status == 200 else []

    def assert_delivered_is_table(self):
        wait_for(lambda: self.delivered() == self.table(), 60, "the table at the worker")
        facts = self.delivered()
        ids = [t for t, _ in facts]
        self.assertEqual(ids, sorted(set(ids)))  # in order, each once
        self.assertEqual(facts, self.table())
        self.assertEqual(self.health(self.worker)[0], 200)  # no audit finding
        self.assertNotIn("is not what the table holds", self.worker.output())



class ForeignWriterTests(_Daemons):
    def test_a_held_plain_sql_transaction_is_delivered_once_in_order(self):
        before = self.api_write("api-0")
        held = self.connect()
        held_id = self.plain_insert(held, "held")
        self.plain_insert(held, "held-2")  # a second row of that transaction
        quick = self.connect()
        quick.autocommit = True
        later = [self.api_write("api-1"), self.plain_insert(quick, "quick"),
                 self.api_write("api-2")]
        self.assertTrue(before < held_id < min(later))
        wait_for(lambda: self.held_texts(), 60, "the holder named on /health")
        text = self.held_texts()[0]
        self.assertIn(f"held ID {held_id}", text)
        self.assertIn("legacy-app", text)
        status = json.loads(http(self.master.http_base + "/status.json")[1])
        self.assertIn(text, [f["text"] for f in status["findings"]
                             if f["kind"] == "foreign_held"])
        # A reader says what holds it back, and stays healthy: no reader
        # can have these facts before the transaction ends.
        def worker_held():
            status, body = self.health(self.worker)
            held = json.loads(body).get("foreign_held", []) if body else []
            return (status, held) if held else None
        wait_for(worker_held, 60, "the holder named on the worker's /health")
        status, [worker_text] = worker_held()
        self.assertEqual(status, 200)
        self.assertIn(f"held back by a plain-SQL transaction holding ID {held_id}", worker_text)
        self.assertIn("'legacy-app'", worker_text)
        # Everything before it is there; nothing from its ID on went out.
        wait_for(lambda: before in self.delivered_ids(), 60, "the fact before it")
        self.assertEqual([i for i in self.delivered_ids() if i >= held_id], [])
        held.commit()
        self.assert_delivered_is_table()
        self.assertEqual(self.delivered_ids()[-len(later) - 2:], sorted(
            [held_id, held_id + 1] + later))
        wait_for(lambda: not self.held_texts(), 60, "the holder gone from /health")

    def test_only_a_transactions_first_row_calls_the_fence(self):
        # The default checks the transaction's setting itself: a row after
        # the first is a nextval, not a PL/pgSQL call.
        conn = self.connect()
        cur = conn.cursor()
        cur.execute("SET LOCAL track_functions = 'pl'")
        ids = [self.plain_insert(conn, f"row-{i}") for i in range(5)]
        cur.execute("SELECT calls FROM pg_stat_xact_user_functions "
                    "WHERE funcname = 'orders_stream_fenced_id'")
        self.assertEqual(cur.fetchall(), [(1,)])
        self.assertEqual(ids, list(range(ids[0], ids[0] + 5)))
        cur.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND pid = pg_backend_pid()")
        self.assertEqual(cur.fetchone()[0], 3)  # the stream's, and the first ID's two
        conn.commit()
        self.assert_delivered_is_table()

    def refused(self, statement, args=(), before=None):
        """``statement`` fails at the insert, in a transaction of its own
        (after ``before``, if given), with the fence's check."""
        conn = self.connect()
        cur = conn.cursor()
        if before:
            cur.execute(before)
        with self.assertRaises(psycopg2.errors.CheckViolation) as caught:
            cur.execute(statement, args)
        conn.rollback()
        return str(caught.exception)

    def test_rows_whose_ids_did_not_come_through_the_fence_are_refused(self):
        # Each of these was a fact the readers skipped in silence: nothing
        # held its commit back.
        text = self.refused("INSERT INTO orders_stream (stream_id, item) "
                            "VALUES (nextval('orders_stream_seq'), 'by hand')")
        self.assertIn("must take stream_id from the column default", text)
        self.refused("INSERT INTO orders_stream (stream_id, item) VALUES (999999, 'ahead')")
        self.refused("INSERT INTO orders_stream (stream_id, item) SELECT "
                     "nextval('orders_stream_seq'), 'x' FROM generate_series(1, 3)")
        # In a transaction that took a fenced ID: below it, or beyond it.
        conn = self.connect()
        first = self.plain_insert(conn, "first")
        conn.rollback()
        text = self.refused("INSERT INTO orders_stream (stream_id, item) VALUES (%s, 'below')",
                            (first,), before="INSERT INTO orders_stream (item) VALUES ('x')")
        self.assertIn("the fence did not give it", text)
        self.refused("INSERT INTO orders_stream (stream_id, item) VALUES "
                     "(currval('orders_stream_seq') + 5, 'beyond')",
                     before="INSERT INTO orders_stream (item) VALUES ('x')")
        # Another writer's name: no fence speaks for it.
        self.refused("INSERT INTO orders_stream (item, instance_name) VALUES ('x', 'worker1')")
        # A default changed by hand to a plain nextval.
        admin = self.connect("admin")
        admin.autocommit = True
        admin.cursor().execute("ALTER TABLE orders_stream ALTER COLUMN stream_id "
                               "SET DEFAULT nextval('orders_stream_seq')")
        self.refused("INSERT INTO orders_stream (item) VALUES ('plain default')")
        self.master.kill(signal.SIGTERM)  # its start puts the fence's default back
        self.master.proc.wait(60)
        self.master.start()
        wait_for(lambda: http(self.worker.http_base + "/health")[0] == 200, 60, "relinked")
        # What a fact of several rows does is allowed: later rows repeat the
        # ID the transaction's first row took, or take more from the default.
        conn = self.connect()
        fact = self.plain_insert(conn, "row-1")
        cur = conn.cursor()
        cur.execute("INSERT INTO orders_stream (stream_id, item) VALUES (%s, 'row-2')", (fact,))
        cur.copy_expert("COPY orders_stream (item) FROM STDIN", io.StringIO("copied\n"))
        conn.commit()
        self.assert_delivered_is_table()
        self.assertEqual([rows for t, rows in self.delivered() if t == fact],
                         [[["row-1"], ["row-2"]]])

    def test_the_fence_lock_taken_by_hand_is_named_as_such(self):
        from replicator.config.streams import parse_stream
        from replicator.streams.fence import lock_classes

        classid = lock_classes(parse_stream(dict(ORDERS), "s"))["stream"]
        squatter = self.connect("squatter")
        squatter.autocommit = True
        squatter.cursor().execute("SELECT pg_advisory_lock(%s, 0)",
                                  (classid - (1 << 32) if classid >= 1 << 31 else classid,))
        wait_for(lambda: self.held_texts(), 60, "the holder named on /health")
        text = self.held_texts()[0]
        self.assertIn("fence lock has been held without an ID", text)
        self.assertIn("'squatter'", text)
        self.assertNotIn("None", text)
        squatter.cursor().execute("SELECT pg_advisory_unlock_all()")
        wait_for(lambda: not self.held_texts(), 60, "the holder gone from /health")

    def test_a_rolled_back_plain_sql_transaction_stalls_nothing_once_it_ends(self):
        held = self.connect()
        held_id = self.plain_insert(held, "rolled back")
        later = [self.api_write("api-1"), self.api_write("api-2")]
        wait_for(lambda: self.held_texts(), 60, "the holder named on /health")
        self.assertEqual([i for i in self.delivered_ids() if i >= held_id], [])
        held.rollback()
        wait_for(lambda: self.delivered_ids()[-2:] == later, 60, "the facts after it")
        self.assert_delivered_is_table()
        self.assertNotIn(held_id, self.delivered_ids())

    def test_strangers_open_transactions_delay_nothing(self):
        stranger = self.connect("stranger")
        cur = stranger.cursor()
        cur.execute("CREATE TABLE elsewhere (x int)")
        stranger.commit()
        cur.execute("INSERT INTO elsewhere VALUES (1)")  # open, on another table
        reader = self.connect("reader")
        reader.cursor().execute("SELECT count(*) FROM orders_stream")  # open, inserted nothing
        quick = self.connect()
        quick.autocommit = True
        written = [self.api_write("api-1"), self.plain_insert(quick, "quick-1"),
                   self.api_write("api-2"), self.plain_insert(quick, "quick-2")]
        wait_for(lambda: self.delivered_ids() == written, 60, "every fact, strangers open")
        self.assert_delivered_is_table()
        self.assertEqual(self.held_texts(), [])

    def test_the_first_writer_starts_again_while_a_plain_sql_transaction_is_open(self):
        """Its start's DDL takes no lock a writer of the table holds (an
        existing index is not created again: that would wait for it)."""
        held = self.connect()
        held_id = self.plain_insert(held, "held across the restart")
        self.master.kill()
        self.master = Daemon(self, self.master.config, "master").start()
        later = self.api_write("api-after")
        self.assertEqual([i for i in self.delivered_ids() if i >= held_id], [])
        held.commit()
        self.assert_delivered_is_table()
        self.assertEqual(self.delivered_ids()[-2:], [held_id, later])


class PreparedTransactionTests(_Daemons):
    """A prepared transaction keeps its locks with no session: it holds the
    stream until ``COMMIT PREPARED``, named as a prepared transaction."""

    _server = None

    def server(self):
        if PreparedTransactionTests._server is None:
            PreparedTransactionTests._server = PostgresServer(
                settings=["max_prepared_transactions=4"])
        return PreparedTransactionTests._server

    @classmethod
    def tearDownClass(cls):
        if cls._server is not None:
            cls._server.stop()
            cls._server = None

    def test_a_prepared_transaction_holds_until_committed(self):
        prepared = self.connect()
        held_id = self.plain_insert(prepared, "prepared")
        prepared.cursor().execute("PREPARE TRANSACTION 'legacy-1'")
        prepared.close()  # the session ends; the transaction stays
        later = [self.api_write("api-1"), self.api_write("api-2")]
        wait_for(lambda: self.held_texts(), 60, "the prepared transaction on /health")
        self.assertIn("prepared transaction", self.held_texts()[0])
        self.assertEqual([i for i in self.delivered_ids() if i >= held_id], [])
        admin = self.connect("admin")
        admin.autocommit = True
        admin.cursor().execute("COMMIT PREPARED 'legacy-1'")
        self.assert_delivered_is_table()
        self.assertEqual(self.delivered_ids()[-3:], [held_id] + later)
        wait_for(lambda: not self.held_texts(), 60, "the holder gone from /health")
