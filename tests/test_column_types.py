"""A stream's declared column types against its table's, at start (issue:
a ``text`` column declared over a ``bigint`` one passed, and then every
live RDATA of it was refused).

The check (:func:`replicator.storage.schema.ensure_schema`, what ``run``
and ``check`` both call) on real PostgreSQL and SQLite tables: each
declared type against the database types that fit it and some that do not,
for a stream only read here and one written here; Synapse's own tables
through the presets; then ``replicator check`` and ``replicator run``
refusing a mismatch with one line and exit 2.
"""

import dataclasses
import os
import sqlite3
import subprocess
import tempfile

import psycopg2
import yaml
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import ColumnConfig, ConfigError, parse_streams
from replicator.storage import schema
from tests.daemon import cli
from tests.servers import PostgresServer
from tests.synapse_side import SYNAPSE_EXPORT_DDL

#: (declared type, the table's type, fits when only read, fits when written).
POSTGRES_CASES = [
    ("bigint", "bigint", True, True),
    ("bigint", "integer", True, False),
    ("bigint", "smallint", True, False),
    ("bigint", "numeric", False, False),
    ("bigint", "text", False, False),
    ("bigint", "boolean", False, False),
    ("text", "text", True, True),
    ("text", "varchar", True, True),
    ("text", "varchar(20)", True, False),
    ("text", "char(3)", True, False),
    ("text", "bigint", False, False),
    ("text", "jsonb", False, False),
    ("text", "text[]", False, False),
    ("boolean", "boolean", True, True),
    ("boolean", "smallint", False, False),
    ("boolean", "text", False, False),
    ("json", "jsonb", True, True),
    ("json", "json", True, True),
    ("json", "text[]", True, False),
    ("json", "bigint[]", True, False),
    ("json", "text", False, False),
    ("json", "bigint", False, False),
    ("json", "numeric[]", False, False),
]

SQLITE_CASES = [
    ("bigint", "INTEGER", True),
    ("bigint", "BIGINT", True),
    ("bigint", "TEXT", False),
    ("bigint", "REAL", False),
    ("bigint", "BOOLEAN", False),
    ("bigint", "", False),
    ("text", "TEXT", True),
    ("text", "VARCHAR(20)", True),
    ("text", "INTEGER", False),
    ("text", "BLOB", False),
    ("boolean", "INTEGER", True),
    ("boolean", "BOOLEAN", True),
    ("boolean", "TEXT", False),
    ("json", "TEXT", True),
    # NUMERIC affinity: the JSON text "1" would be stored as the number 1.
    ("json", "JSON", False),
    ("json", "INTEGER", False),
]


def stream_of(declared: str, json_text: bool = False, name: str = "facts"):
    """A stream ``facts`` over table ``facts``: ``key text`` and ``v`` of
    the declared type (written by ``master``)."""
    (stream,) = parse_streams([{"name": name, "table": "facts", "writers": ["master"],
                                "columns": [{"key": "text"}, {"v": declared + "?"}]}])
    columns = (stream.columns[0], ColumnConfig("v", declared, True, json_text))
    return dataclasses.replace(stream, columns=columns)


def check(cur, stream, postgres: bool, written: bool) -> None:
    """What a start checks of ``stream`` (``check``'s dry run: nothing is
    created, so the table as the test made it is what is checked)."""
    schema.ensure_schema(cur, [stream], postgres, {stream.name: "streams[0]"},
                         {stream.name} if written else set(), dry_run=True)


class TypeMatrix:
    """Mixin: ``table(cur, type)`` makes ``facts`` with ``v`` of that type."""

    postgres: bool

    def outcome(self, cur, declared, table_type, written, json_text=False):
        """None if the check passes, else the ConfigError's (key, text)."""
        self.table(cur, table_type)
        try:
            check(cur, stream_of(declared, json_text), self.postgres, written)
        except ConfigError as e:
            return e.key, e.problem
        return None

    def assert_cases(self, cur, cases):
        wrong = []
        for declared, table_type, written, fits in cases:
            got = self.outcome(cur, declared, table_type, written)
            if fits and got is not None or not fits and (
                    got is None or got[0] != "streams[0].columns[1]"
                    or f"declares column 'v' {declared}, but table 'facts' has it as "
                       not in got[1]):
                wrong.append((declared, table_type, "written" if written else "read", got))
        self.assertEqual(wrong, [])


class PostgresTypeTests(TypeMatrix, SynchronousTestCase):
    postgres = True

    def setUp(self):
        self.conn = psycopg2.connect(PostgresServer.shared().create_database("coltypes"))
        self.conn.autocommit = True
        self.addCleanup(self.conn.close)
        self.cur = self.conn.cursor()
        self.cur.execute("CREATE SEQUENCE facts_seq")

    def table(self, cur, table_type):
        cur.execute("DROP TABLE IF EXISTS facts")
        cur.execute(f"CREATE TABLE facts (stream_id bigint NOT NULL, instance_name text "
                    f"NOT NULL, key text NOT NULL, v {table_type})")

    def test_each_declared_type_against_table_types(self):
        cases = [(d, t, written, fits[written]) for d, t, *fits in POSTGRES_CASES
                 for written in (False, True)]
        self.assert_cases(self.cur, cases)

    def test_a_mismatch_says_stream_column_and_both_types(self):
        self.assertEqual(
            self.outcome(self.cur, "text", "bigint", written=False),
            ("streams[0].columns[1]", "stream 'facts' declares column 'v' text, but table "
                                      "'facts' has it as bigint (text reads from text, "
                                      "character varying or character)"))
        self.assertEqual(
            self.outcome(self.cur, "bigint", "integer", written=True),
            ("streams[0].columns[1]", "stream 'facts' declares column 'v' bigint, but table "
                                      "'facts' has it as integer (written here, bigint needs "
                                      "bigint)"))
        self.assertEqual(
            self.outcome(self.cur, "json", "varchar(40)", written=False),
            ("streams[0].columns[1]", "stream 'facts' declares column 'v' json, but table "
                                      "'facts' has it as character varying(40) (json reads "
                                      "from json, jsonb or an array of text, integers, "
                                      "booleans or JSON)"))

    def test_json_kept_as_text_only_in_a_preset_column(self):
        """A preset's JSON-in-text column (Synapse's receipts ``data``) is
        decoded when read; a json column of one's own in a text column
        would be read back as a string, and is refused above."""
        for table_type, written, fits in (("text", False, True), ("text", True, True),
                                          ("varchar(10)", False, True),
                                          ("varchar(10)", True, False),
                                          ("jsonb", True, True), ("bigint", False, False)):
            got = self.outcome(self.cur, "json", table_type, written, json_text=True)
            self.assertEqual(got is None, fits, (table_type, written, got))

    def test_the_id_and_writer_columns(self):
        self.cur.execute("DROP TABLE IF EXISTS facts")
        self.cur.execute("CREATE TABLE facts (stream_id text, instance_name bigint, key text, "
                         "v bigint)")
        with self.assertRaises(ConfigError) as cm:
            check(self.cur, stream_of("bigint"), True, False)
        self.assertEqual((cm.exception.key, cm.exception.problem), (
            "streams[0].id_column", "stream 'facts' needs id_column 'stream_id' bigint, but "
                                    "table 'facts' has it as text (bigint reads from bigint, "
                                    "integer or smallint)"))
        self.cur.execute("ALTER TABLE facts ALTER COLUMN stream_id TYPE integer USING 0")
        with self.assertRaises(ConfigError) as cm:
            check(self.cur, stream_of("bigint"), True, False)
        self.assertEqual(cm.exception.key, "streams[0].writer_column")
        self.assertIn("has it as bigint (text reads from", cm.exception.problem)
        # Written here, the sequence's bigint IDs need a bigint column.
        self.cur.execute("ALTER TABLE facts ALTER COLUMN instance_name TYPE text")
        check(self.cur, stream_of("bigint"), True, False)
        with self.assertRaises(ConfigError) as cm:
            check(self.cur, stream_of("bigint"), True, True)
        self.assertEqual(cm.exception.key, "streams[0].id_column")

    def test_a_domain_is_its_underlying_type(self):
        self.cur.execute("CREATE DOMAIN millis AS bigint CHECK (VALUE >= 0)")
        self.assertIsNone(self.outcome(self.cur, "bigint", "millis", written=True))
        self.assertIsNotNone(self.outcome(self.cur, "text", "millis", written=False))

    def test_synapse_tables_fit_the_presets(self):
        """Synapse's own tables (its schema's types: TEXT[] cache keys, JSON
        in TEXT receipts, BOOLEAN presence) pass; the same preset over a
        table with another type is refused naming the preset's stream."""
        for statement in SYNAPSE_EXPORT_DDL + [
                "CREATE SEQUENCE un_partial_stated_room_stream_sequence",
                "CREATE TABLE un_partial_stated_room_stream (stream_id BIGINT PRIMARY KEY, "
                "instance_name TEXT NOT NULL, room_id TEXT NOT NULL)",
                "CREATE SEQUENCE un_partial_stated_event_stream_sequence",
                "CREATE TABLE un_partial_stated_event_stream (stream_id BIGINT PRIMARY KEY, "
                "instance_name TEXT NOT NULL, event_id TEXT NOT NULL, "
                "rejection_status_changed BOOLEAN NOT NULL)"]:
            self.cur.execute(statement)
        names = ("caches", "presence", "receipts", "push_rules", "un_partial_stated_room",
                 "un_partial_stated_event")
        streams = parse_streams([{"preset": f"synapse/{n}"} for n in names])
        keys = {s.name: f"streams[{i}]" for i, s in enumerate(streams)}
        schema.ensure_schema(self.cur, list(streams), True, keys, set(), dry_run=True)
        self.cur.execute("ALTER TABLE receipts_linearized ALTER COLUMN data TYPE bigint "
                         "USING 0")
        with self.assertRaises(ConfigError) as cm:
            schema.ensure_schema(self.cur, list(streams), True, keys, set(), dry_run=True)
        self.assertEqual((cm.exception.key, cm.exception.problem), (
            "streams[2].columns[5]", "stream 'receipts' declares column 'data' json, but "
                                     "table 'receipts_linearized' has it as bigint (json "
                                     "reads from text, character varying, character, json "
                                     "or jsonb)"))

    def test_tables_the_replicator_creates_fit(self):
        stream = stream_of("json")
        stream = dataclasses.replace(stream, columns=stream.columns + tuple(
            ColumnConfig(f"c_{t}", t) for t in ("text", "bigint", "boolean", "json")))
        schema.ensure_schema(self.cur, [stream], True, {"facts": "streams[0]"})
        schema.ensure_schema(self.cur, [stream], True, {"facts": "streams[0]"}, set())


class SqliteTypeTests(TypeMatrix, SynchronousTestCase):
    postgres = False

    def setUp(self):
        self.conn = sqlite3.connect(":memory:")
        self.addCleanup(self.conn.close)
        self.cur = self.conn.cursor()

    def table(self, cur, table_type):
        cur.execute("DROP TABLE IF EXISTS facts")
        cur.execute(f"CREATE TABLE facts (stream_id BIGINT NOT NULL, instance_name TEXT "
                    f"NOT NULL, key TEXT NOT NULL, v {table_type})")

    def test_each_declared_type_against_table_types(self):
        cases = [(d, t, written, fits) for d, t, fits in SQLITE_CASES
                 for written in (False, True)]
        self.assert_cases(self.cur, cases)

    def test_a_mismatch_says_stream_column_and_both_types(self):
        self.assertEqual(
            self.outcome(self.cur, "bigint", "TEXT", written=True),
            ("streams[0].columns[1]", "stream 'facts' declares column 'v' bigint, but table "
                                      "'facts' has it as TEXT (bigint reads from INTEGER "
                                      "affinity (a type with INT in its name))"))
        self.assertEqual(
            self.outcome(self.cur, "boolean", "", written=False),
            ("streams[0].columns[1]", "stream 'facts' declares column 'v' boolean, but table "
                                      "'facts' has it as no declared type (boolean reads "
                                      "from INTEGER affinity (a type with INT in its name) "
                                      "or BOOLEAN)"))

    def test_synapse_tables_fit_the_presets(self):
        """Synapse's SQLite schema declares its booleans BOOLEAN (0 and 1)
        and keeps receipts' JSON in TEXT."""
        for statement in (
                "CREATE TABLE presence_stream (stream_id BIGINT, user_id TEXT, state TEXT, "
                "last_active_ts BIGINT, last_federation_update_ts BIGINT, "
                "last_user_sync_ts BIGINT, status_msg TEXT, currently_active BOOLEAN, "
                "instance_name TEXT)",
                "CREATE TABLE receipts_linearized (stream_id BIGINT NOT NULL, room_id TEXT "
                "NOT NULL, receipt_type TEXT NOT NULL, user_id TEXT NOT NULL, event_id TEXT "
                "NOT NULL, thread_id TEXT, event_stream_ordering BIGINT, data TEXT NOT NULL, "
                "instance_name TEXT)",
                "CREATE TABLE un_partial_stated_event_stream (stream_id BIGINT PRIMARY KEY "
                "NOT NULL, instance_name TEXT NOT NULL, event_id TEXT NOT NULL, "
                "rejection_status_changed BOOLEAN NOT NULL)"):
            self.cur.execute(statement)
        streams = parse_streams([{"preset": f"synapse/{n}"} for n in
                                 ("presence", "receipts", "un_partial_stated_event")])
        keys = {s.name: f"streams[{i}]" for i, s in enumerate(streams)}
        schema.ensure_schema(self.cur, list(streams), False, keys, set(), dry_run=True)

    def test_tables_the_replicator_creates_fit(self):
        stream = stream_of("json")
        stream = dataclasses.replace(stream, columns=stream.columns + tuple(
            ColumnConfig(f"c_{t}", t) for t in ("text", "bigint", "boolean", "json")))
        schema.ensure_schema(self.cur, [stream], False, {"facts": "streams[0]"})
        schema.ensure_schema(self.cur, [stream], False, {"facts": "streams[0]"}, set())


# ------------------------------------------------------------------ the CLI
MISMATCH = ("replicator: config: streams[0].columns[1]: stream 'facts' declares column "
            "'v' text, but table 'facts' has it as {shown} (written here, text needs text)\n")
SQLITE_MISMATCH = ("replicator: config: streams[0].columns[1]: stream 'facts' declares column "
                   "'v' text, but table 'facts' has it as BIGINT (text reads from TEXT "
                   "affinity (a type with CHAR, CLOB or TEXT in its name))\n")


class CommandTests(SynchronousTestCase):
    """``check`` and ``run`` refuse a declared type the table does not
    hold: exit 2, one line, and ``run`` never starts."""

    def config(self, database) -> str:
        directory = tempfile.mkdtemp(prefix="replicator-coltypes-")
        path = os.path.join(directory, "c.yaml")
        with open(path, "w") as f:
            yaml.safe_dump({"server_name": "hs", "instance_name": "master",
                            "database": database,
                            "streams": [{"name": "facts", "table": "facts", "writers": ["master"],
                                         "columns": [{"key": "text"}, {"v": "text"}]}]}, f)
        return path

    def refused(self, command, path, line):
        try:
            result = cli(command, "-c", path, cwd=os.path.dirname(path), timeout=30)
        except subprocess.TimeoutExpired:
            self.fail(f"{command} started instead of refusing")
        self.assertEqual((result.returncode, result.stderr), (2, line))
        self.assertNotIn("Traceback", result.stdout)

    def postgres(self) -> str:
        dsn = PostgresServer.shared().create_database("coltypes")
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE facts (stream_id bigint NOT NULL, instance_name text "
                        "NOT NULL, key text NOT NULL, v bigint NOT NULL)")
        conn.close()
        return self.config({"postgres": dsn})

    def sqlite(self) -> str:
        path = self.config({"sqlite": "state.db"})
        with sqlite3.connect(os.path.join(os.path.dirname(path), "state.db")) as conn:
            conn.execute("CREATE TABLE facts (stream_id BIGINT NOT NULL, instance_name TEXT "
                         "NOT NULL, key TEXT NOT NULL, v BIGINT NOT NULL)")
        conn.close()
        return path

    def test_check_postgres(self):
        self.refused("check", self.postgres(), MISMATCH.format(shown="bigint"))

    def test_run_postgres(self):
        self.refused("run", self.postgres(), MISMATCH.format(shown="bigint"))

    def test_check_sqlite(self):
        self.refused("check", self.sqlite(), SQLITE_MISMATCH)

    def test_run_sqlite(self):
        self.refused("run", self.sqlite(), SQLITE_MISMATCH)
