"""Helpers shared by the tests: waiting on the real reactor (on the
events that make a condition true where there are some: :class:`Waits`,
:class:`WatchedConsumer`, :class:`LogWatch`, :func:`until_handled`,
:class:`Progress`; else by polling: :func:`until`), reading what the
backing tables hold, fact by fact, a temporary directory and a model of a
stream's pages (:func:`updates_since`)."""

import shutil
import tempfile

import psycopg2
from twisted.internet import defer, reactor, task
from twisted.logger import globalLogPublisher
from twisted.python import threadable

from replicator.consumers import MemoryConsumer
from replicator.logs.formats import TEXT_TIME

# Clock start: a realistic epoch with an exact millisecond value.
T0 = 1490197665.5
T0_MS = b"1490197665500"


def sleep(seconds: float):
    return task.deferLater(reactor, seconds, lambda: None)


async def until(predicate, timeout: float = 10.0, step: float = 0.005) -> None:
    """Let the reactor run (DB threads, sockets, callbacks) until ``predicate()``,
    at most ``timeout`` seconds of elapsed time (not of summed steps: on a
    loaded machine each step takes longer than asked)."""
    deadline = reactor.seconds() + timeout
    while not predicate():
        if reactor.seconds() > deadline:
            raise AssertionError("condition not reached in time")
        await sleep(step)


class Waits:
    """Conditions waited on by the events that can make them true, not by
    polling: :meth:`wait` returns a Deferred that fires (on the next turn
    of the reactor, never inside the event's own call) once ``predicate()``
    holds after an event (:meth:`check`), or fails with AssertionError
    after ``timeout`` seconds."""

    def __init__(self) -> None:
        self._waiting: list = []

    def wait(self, predicate, timeout: float = 10.0, what: str = "condition"):
        if predicate():
            return defer.succeed(None)
        d = defer.Deferred()
        entry = (predicate, d)
        self._waiting.append(entry)

        def expired() -> None:
            if entry in self._waiting:
                self._waiting.remove(entry)
                d.errback(AssertionError(f"{what} not reached in {timeout}s"))

        call = reactor.callLater(timeout, expired)

        def done(result):
            if call.active():
                call.cancel()
            return result
        return d.addBoth(done)

    def check(self) -> None:
        """An event happened: fire the waits whose condition now holds."""
        if not threadable.isInIOThread():
            reactor.callFromThread(self.check)
            return
        for entry in list(self._waiting):
            predicate, d = entry
            if predicate():
                self._waiting.remove(entry)
                reactor.callLater(0, d.callback, None)


class WatchedConsumer(MemoryConsumer):
    """A :class:`MemoryConsumer` a test can wait on: ``await
    consumer.until(lambda: consumer.facts)`` is woken by the facts and
    positions it is handed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._waits = Waits()

    def until(self, predicate, timeout: float = 30.0):
        return self._waits.wait(predicate, timeout, "consumer condition")

    def on_facts(self, stream, writer, token, rows):
        super().on_facts(stream, writer, token, rows)
        self._waits.check()

    def on_position(self, stream, writer, token):
        super().on_position(stream, writer, token)
        self._waits.check()


#: The waits on handlers' state (:func:`until_handled`), checked by every
#: handler and consumer :func:`watch_handler` hooked.
_HANDLED = Waits()


def _after(obj, name: str, hook) -> None:
    """``obj.name(...)`` calls ``hook()`` after it returned (or raised)."""
    original = getattr(obj, name)

    def called(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            hook()
    setattr(obj, name, called)


def watch_handler(handler) -> None:
    """Have ``handler`` wake :func:`until_handled`'s waits: at each of its
    connections' changes (``new_connection``, ``lost_connection``: a Redis
    link's ``connected``, the handler's ``connections``) and at each fact
    and position it hands its consumers (its readers' positions).  The
    condition is evaluated on the next turn of the reactor, once the reader
    that handed them on has moved its position.  Hooked once per handler."""
    if handler.__dict__.get("_watched_by_tests"):
        return
    handler._watched_by_tests = True

    def soon() -> None:
        reactor.callLater(0, _HANDLED.check)
    _after(handler, "new_connection", soon)
    _after(handler, "lost_connection", soon)
    for consumer in getattr(handler, "consumers", ()):
        for name in ("on_facts", "on_position", "on_facts_many"):
            if callable(getattr(consumer, name, None)):
                _after(consumer, name, soon)


def until_handled(handlers, predicate, timeout: float = 30.0):
    """A Deferred that fires once ``predicate()`` holds, a condition on the
    state of ``handlers`` (replication handlers): woken by their events
    (:func:`watch_handler`), not by a poll."""
    for handler in handlers:
        watch_handler(handler)
    return _HANDLED.wait(predicate, timeout, "handler condition")


class LogWatch:
    """The events of the global log from now on (``events``), which a test
    can wait on: ``await log.until(lambda: ...)`` is woken by each event
    logged.  Removed from the log at the test's cleanup."""

    def __init__(self, test):
        self.events: list = []
        self._waits = Waits()
        globalLogPublisher.addObserver(self._observe)
        test.addCleanup(globalLogPublisher.removeObserver, self._observe)

    def _observe(self, event) -> None:
        self.events.append(event)
        self._waits.check()

    def until(self, predicate, timeout: float = 30.0):
        return self._waits.wait(predicate, timeout, "log condition")


def create_stream_tables(dsn: str, streams) -> None:
    """Create the streams' tables and sequences in a PostgreSQL database, as
    their writers do at start: for tests that start an instance which only
    reads some of them (a reader never creates anything)."""
    from replicator.storage import schema

    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        cur = conn.cursor()
        cur.execute(schema.POSITIONS_DDL)
        for stream in streams:
            for statement in schema.table_ddl(stream, True):
                cur.execute(statement)
    finally:
        conn.close()


def create_sqlite_stream_tables(path: str, streams) -> None:
    """:func:`create_stream_tables` for a SQLite file."""
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        create_sqlite_tables(conn, streams)
    finally:
        conn.close()


def create_sqlite_tables(conn, streams) -> None:
    """:func:`create_stream_tables` on an open sqlite3 connection."""
    from replicator.storage import schema

    conn.execute(schema.POSITIONS_DDL)
    for stream in streams:
        for statement in schema.table_ddl(stream, False):
            conn.execute(statement)
    conn.commit()


def table_facts(dsn: str, tables) -> dict:
    """Every fact per (stream, writer) from the tables, in token order, rows
    in insertion order: ``{(stream, writer): [(token, [row, ...]), ...]}``.

    ``tables`` is ``[(stream, table, "col1, col2, ...")]``; the tables have
    ``stream_id`` and ``instance_name`` columns.
    """
    conn = psycopg2.connect(dsn)
    try:
        cur = conn.cursor()
        facts: dict = {}
        for stream, table, cols in tables:
            cur.execute(f"SELECT stream_id, instance_name, {cols} FROM {table} "
                        "ORDER BY stream_id, ctid")
            for stream_id, writer, *row in cur.fetchall():
                entries = facts.setdefault((stream, writer), [])
                if entries and entries[-1][0] == stream_id:
                    entries[-1][1].append(row)
                else:
                    entries.append((stream_id, [row]))
        return facts
    finally:
        conn.close()


def jsonl_facts(path):
    """``{(stream, writer): [(token, rows), ...]}`` of the complete lines
    of a ``jsonl`` file (a line being written is left out)."""
    import json
    import os

    facts: dict = {}
    if not os.path.exists(path):
        return facts
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            entry = json.loads(line)
            if "rows" in entry:
                facts.setdefault((entry["stream"], entry["writer"]), []).append(
                    (entry["token"], entry["rows"]))
    return facts


def as_sets(facts: dict) -> dict:
    """The same facts with each fact's rows in a canonical order: a fact is
    its set of rows (the order within one is the table's physical order on
    catch-up and the writer's order when fanned out from memory)."""
    import json

    def key(row):
        return json.dumps(row, sort_keys=True)

    return {k: [(token, sorted(rows, key=key)) for token, rows in v] for k, v in facts.items()}


class Progress(dict):
    """Counts a writing loop keeps (``written["n"]`` of
    :func:`write_randomly`) that a test can wait on: ``await
    written.until(lambda: written["n"] > 500)`` is woken by each change of
    a count, not by a poll."""

    def __init__(self, **counts):
        super().__init__(**counts)
        self._waits = Waits()

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._waits.check()

    def until(self, predicate, timeout: float = 60.0):
        return self._waits.wait(predicate, timeout, "writing progress")


async def write_randomly(stream, rng, written: dict, target: int, make_row,
                         row_counts=(0, 1, 1, 2, 3), max_facts: int = 20,
                         rollback_share: float = 0.1, pause: bool = False) -> None:
    """Write random facts through ``stream`` until ``written["n"] >= target``:
    1 to ``max_facts`` facts per transaction, each of ``rng.choice(row_counts)``
    rows made by ``make_row(n, j)``; a ``rollback_share`` of the writes fail
    inside the transaction (a reserved ID completed without rows)."""
    def boom(txn, stream_id):
        raise RuntimeError("rollback")

    while written["n"] < target:
        facts = [[make_row(written["n"] + j, j) for _ in range(rng.choice(row_counts))]
                 for j in range(rng.randint(1, max_facts))]
        if rng.random() < rollback_share:
            try:
                async with stream.writer() as fact:
                    fact.add_rows(facts[0])
                    fact.also(boom)
            except RuntimeError:
                pass
            continue
        await stream.write_facts(facts)
        written["n"] += len(facts)
        if pause:
            await sleep(0)


def recv_until(sock, *needles: bytes) -> bytes:
    """What a blocking socket receives until one of ``needles`` is in it
    (or the peer closes): the bytes received."""
    received = b""
    while not any(needle in received for needle in needles):
        data = sock.recv(65536)
        if not data:
            break
        received += data
    return received


def without_time(line: str) -> str:
    """A daemon's ``text`` log line without its leading time, if it has one
    (what the fault and fuzz suites match: ``LEVEL system: message``)."""
    return TEXT_TIME.sub("", line, count=1)


def temp_dir(case):
    """A fresh absolute directory, removed after the test (whatever the cwd)."""
    path = tempfile.mkdtemp(prefix="replicator-test.")
    case.addCleanup(shutil.rmtree, path, True)
    return path


def updates_since(table, from_token, to_token, limit):
    """What ``Stream.facts_since`` answers: facts of ``(from, to]`` in token
    order, at most ``limit`` rows unless one fact alone has more, facts whole."""
    facts = []
    count = 0
    upto = to_token
    limited = False
    for token in sorted(t for t in table if from_token < t <= to_token):
        rows = table[token]
        if facts and count + len(rows) > limit:
            upto, limited = facts[-1][0], True
            break
        facts.append((token, [list(row) for row in rows]))
        count += len(rows)
    return facts, upto, limited
