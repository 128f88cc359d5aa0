"""The fence that lets plain-SQL writers insert into a stream's table
(``foreign_writers: true``, PostgreSQL), gap-safe, without a replication slot.

A row inserted by plain SQL bypasses the in-flight bookkeeping of
:mod:`.idgen`: nothing in this process knows its transaction is open, so
without a fence a position could pass its ID before it commits, and
readers skip it.  The fence makes every such transaction visible at once:

* the ID column's default becomes :func:`function_ddl`'s function.  On a
  transaction's first defaulted ID for this table it takes a *shared*
  transaction-scoped advisory lock keyed to the stream (``stream``), then
  calls ``nextval``, then takes two more shared ones that spell that ID
  (``high``: its bits 31 and up, ``low``: its 31 low bits; an advisory
  lock has 64 bits of key, the stream's name and a 63-bit ID do not fit in
  one).  A transaction-local setting skips all of it for the later rows
  of the same transaction (their IDs are larger: the first is its least):
  the default (:func:`default_expression`) checks it and calls the
  sequence itself, so those rows make no function call;
* the instance that writes the stream reads, every ``POLL`` seconds, the
  sequence's last value ``S`` and *then* the holders of those locks
  (``pg_locks``, which shows a lock the moment it is granted, while the
  rows are not visible until commit).  A transaction whose ID is at or
  below ``S`` called ``nextval`` before ``S`` was read, so it held the
  stream lock before ``pg_locks`` was read, and PostgreSQL releases a
  transaction's locks only after its commit (or abort) is visible to every
  later snapshot.  So (:func:`watermark`): nobody holds the stream lock →
  every ID up to ``S`` is final; otherwise nothing at or above the least
  held ID is, and the watermark is that ID - 1; a holder seen with the
  stream lock and not yet both ID locks is between its lock and its
  ``nextval``: its ID is unknown, the poll is made again (a moment later);
* the watermark becomes a *cap* on the first writer's token
  (:meth:`.idgen.StreamIdGenerator.fence`): its position, fan-out and
  persisted row never pass it.  Plain-SQL rows are that writer's facts
  (its name in the writer column, if the table has one): the fan-out reads
  them from the table like any fact it did not write itself and sends them
  as RDATA to every reader, TCP or Redis.

Before a watermark is used, the poll that found it commits a write (the
writer's row in ``stream_positions``, a lower bound, rewritten): the
commit flushes the WAL up to it, the sequence's record covering ``S``
included, so a crash restart never hands out again an ID at or below a
position already announced (a value whose transaction never committed is
otherwise handed out again after a crash).

Only transactions that took a defaulted ID of this table hold the lock: a
long transaction on another table, or one on this table that inserted
nothing, never delays anything (an xmin/snapshot watermark would).  A
holder that stays (an open transaction, a prepared one: its locks pass to
the prepared transaction, ``pid`` none) holds only this stream's first
writer; it is named in :meth:`Fence.hung` (``/health``, status page).
A backend that crashes or is killed releases its locks as it aborts.
"""

import time
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

from twisted.internet import task
from twisted.logger import Logger

from ..config import StreamConfig
from ..net.backoff import Outage
from ..storage import schema
from ..storage.database import OWN_WRITES_SETTING

log = Logger()

#: Seconds between two polls of the fence (the plain-SQL facts' delivery
#: delay, at most, when nothing is held).
POLL = 0.05
#: Polls of one pass, at most, while a holder is between its stream lock
#: and its ID locks (microseconds, normally); then the pass keeps the last
#: watermark and the next one tries again.
RETRIES = 20
#: Polls between two looks at the locks while the sequence stands still
#: (about one a second): the stream lock taken by hand is named too.
LOOK_EVERY = 20
#: The three lock roles (the first int4 of each two-int4 advisory key).
ROLES = ("stream", "high", "low")
LOW_BITS = 31
LOW_MASK = (1 << LOW_BITS) - 1


def lock_classes(config: StreamConfig) -> dict[str, int]:
    """Per role, the first key (unsigned 32 bits, as ``pg_locks.classid``
    shows it) of the stream's advisory locks: from the table's name (two
    deployments with a stream of one name have tables of their own)."""
    table = config.table.lower()
    return {role: zlib.crc32(f"replicator fence {role} {table}".encode())
            for role in ROLES}


def _signed(u: int) -> int:
    return u - (1 << 32) if u >= 1 << 31 else u


def function_name(config: StreamConfig) -> str:
    return f"{config.table}_fenced_id"


def setting_name(config: StreamConfig) -> str:
    return f"replicator_fenced.{config.table.lower()}"


def function_ddl(config: StreamConfig) -> str:
    """The ID default that takes the fence (module docstring)."""
    k = {role: _signed(u) for role, u in lock_classes(config).items()}
    seq = config.sequence
    flag = setting_name(config)
    return f"""
CREATE OR REPLACE FUNCTION {function_name(config)}() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $fence$
DECLARE
    id bigint;
    flag text;
BEGIN
    IF current_setting('{flag}', true) <> '' THEN
        RETURN nextval('{seq}'::regclass);
    END IF;
    -- Expressions, not PERFORM (a query each): a shared lock nobody takes
    -- exclusively is granted at once; if one is not, wait for it.
    IF NOT pg_try_advisory_xact_lock_shared({k['stream']}, 0) THEN
        PERFORM pg_advisory_xact_lock_shared({k['stream']}, 0);
    END IF;
    id := nextval('{seq}'::regclass);
    IF NOT (pg_try_advisory_xact_lock_shared({k['high']}, ((id >> {LOW_BITS})::bit(32))::int4)
            AND pg_try_advisory_xact_lock_shared({k['low']}, (id & {LOW_MASK})::int4)) THEN
        PERFORM pg_advisory_xact_lock_shared({k['high']}, ((id >> {LOW_BITS})::bit(32))::int4),
                pg_advisory_xact_lock_shared({k['low']}, (id & {LOW_MASK})::int4);
    END IF;
    flag := set_config('{flag}', id::text, true);
    RETURN id;
END
$fence$"""


def check_name(config: StreamConfig) -> str:
    return f"{config.table}_fence_check"


def check_ddl(config: StreamConfig) -> str:
    """The function of the trigger that refuses, at the insert, the rows
    of a session that is not replicator's whose IDs did not come through
    the fence: an ID set by hand or by a ``nextval`` of its own (the
    transaction took no fenced ID: nothing holds its commit back from the
    readers), one below the transaction's first fenced ID or beyond what
    the sequence gave it, and (in a table with a writer column) a row that
    names another writer than the first (no fence speaks for it).  An
    error at the writer, where a row that passed would be a fact the
    readers skip in silence.  It runs only for such rows: the trigger's
    condition (:func:`trigger_ddl`) finds them."""
    flag = setting_name(config)
    c = config.id_column
    return f"""
CREATE OR REPLACE FUNCTION {check_name(config)}() RETURNS trigger
LANGUAGE plpgsql AS $check$
BEGIN
    IF coalesce(current_setting('{flag}', true), '') = '' THEN
        RAISE EXCEPTION '{config.table}: a plain-SQL insert must take {c} from the column default'
            USING ERRCODE = 'check_violation',
                  DETAIL = 'This transaction took no {c} through the default, so nothing holds '
                           'its commit back from the stream''s readers: they would skip it.',
                  HINT = 'Leave {c} out of the INSERT (no nextval() of your own).';
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'check_violation',
          MESSAGE = '{config.table}: a plain-SQL row has a {c} or writer '
                    'the fence did not give it',
          DETAIL = 'Its {c} must come from the column default (or repeat one this '
                   'transaction took), and its writer column must be left to its default.',
          HINT = 'Leave {c} and the writer column out of the INSERT.';
END
$check$"""


def trigger_ddl(config: StreamConfig) -> str:
    """The row trigger of :func:`check_ddl`, before each row inserted (or
    copied).  Its condition is evaluated by the executor, with no call:
    a session of replicator's (a setting of its connections says so: its
    writes give their IDs) and a row whose ID the transaction took from
    the fence pass at the cost of a few setting lookups; only a row to
    refuse calls the function."""
    flag = setting_name(config)
    c = config.id_column
    other_writer = (f" OR NEW.{config.writer_column} IS DISTINCT FROM '{config.writers[0]}'"
                    if config.writer_column else "")
    return (f"CREATE TRIGGER {check_name(config)} BEFORE INSERT ON {config.table} "
            f"FOR EACH ROW WHEN (coalesce(current_setting('{OWN_WRITES_SETTING}', true), '') "
            f"<> 'on' AND (coalesce(current_setting('{flag}', true), '') = '' "
            f"OR NEW.{c} < current_setting('{flag}', true)::bigint "
            f"OR NEW.{c} > currval('{config.sequence}'::regclass){other_writer})) "
            f"EXECUTE FUNCTION {check_name(config)}()")


def default_expression(config: StreamConfig) -> str:
    """The ID column's default: the sequence straight away once this
    transaction holds the fence (its setting says so), else the function.
    The check is the executor's, per row: a PL/pgSQL call per row cost
    100-row transactions 14% of their rate."""
    return (f"CASE WHEN current_setting('{setting_name(config)}', true) <> '' "
            f"THEN nextval('{config.sequence}'::regclass) ELSE {function_name(config)}() END")


def _is_default(expression: str | None, config: StreamConfig) -> bool:
    """Whether ``expression`` (as PostgreSQL shows a default) is
    :func:`default_expression`'s (PostgreSQL adds casts and brackets)."""
    return expression is not None and all(
        part in expression for part in (
            f"{function_name(config).lower()}()", f"'{setting_name(config)}'",
            "current_setting(", "<> ''", f"nextval('{config.sequence.lower()}'"))


def install(txn: Any, config: StreamConfig, key: str) -> None:
    """The fence on the stream's table (pool thread, at start of its first
    writer): the function, the ID column's default, and in a table with a
    writer column, that column's default (the first writer's name), so a
    plain ``INSERT`` naming neither is right.  The sequence must hand out
    one value at a time (``CACHE 1``): a session's cached values were
    taken from the sequence before the session took the stream lock."""
    txn.execute("SELECT cache_size FROM pg_sequences WHERE schemaname = current_schema() "
                "AND sequencename = %s", (config.sequence.lower(),))
    row = txn.fetchone()
    if row is not None and int(row[0]) != 1:
        from ..config import ConfigError
        raise ConfigError(f"{key}.foreign_writers",
                          f"sequence {config.sequence!r} has CACHE {row[0]}: plain-SQL writers "
                          f"need CACHE 1 (ALTER SEQUENCE {config.sequence} CACHE 1)")
    _function(txn, function_name(config), function_ddl(config), "$fence$")
    # An ALTER TABLE waits for every open transaction on the table (and
    # holds up the ones after it): made only when the default differs.
    defaults = _defaults(txn, config.table)
    if not _is_default(defaults.get(config.id_column.lower()), config):
        txn.execute(f"ALTER TABLE {config.table} ALTER COLUMN {config.id_column} "
                    f"SET DEFAULT {default_expression(config)}")
    _function(txn, check_name(config), check_ddl(config), "$check$")
    # CREATE TRIGGER waits for the table's open transactions, as ALTER does:
    # made only when it is not there as it should be.
    txn.execute("SELECT pg_get_triggerdef(oid) FROM pg_trigger "
                "WHERE tgrelid = %s::regclass AND tgname = %s",
                (config.table, check_name(config).lower()))
    row = txn.fetchone()
    if row is None or "BEFORE INSERT" not in row[0] or "currval(" not in row[0]:
        if row is not None:
            txn.execute(f"DROP TRIGGER {check_name(config)} ON {config.table}")
        txn.execute(trigger_ddl(config))
    if config.writer_column and defaults.get(config.writer_column.lower()) != \
            f"'{config.writers[0]}'::text":
        txn.execute(f"ALTER TABLE {config.table} ALTER COLUMN {config.writer_column} "
                    f"SET DEFAULT %s", (config.writers[0],))


def _function(txn: Any, name: str, ddl: str, quote: str) -> None:
    """``ddl`` (a ``CREATE OR REPLACE FUNCTION`` whose body is between two
    ``quote``) run unless the function ``name`` has that body already."""
    txn.execute("SELECT prosrc FROM pg_proc WHERE proname = %s "
                "AND pronamespace = current_schema()::regnamespace", (name.lower(),))
    row = txn.fetchone()
    if row is None or row[0] != ddl.split(quote)[1]:
        txn.execute(ddl)


def _defaults(txn: Any, table: str) -> dict[str, str]:
    """Each column of ``table`` that has a default, with it (as PostgreSQL
    shows it)."""
    txn.execute("SELECT a.attname, pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d "
                "JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum "
                "WHERE d.adrelid = %s::regclass", (table,))
    return {name.lower(): expr for name, expr in txn.fetchall()}


class Holder(NamedTuple):
    """A transaction holding the stream lock: its first ID (None: not yet
    taken), and who it is (``pid`` None: a prepared transaction)."""

    vxid: str
    first_id: int | None
    pid: int | None
    application_name: str | None
    xact_start: str | None
    state: str | None


def watermark(sequence: int, holders: list[Holder]) -> int | None:
    """The largest ID at or below which every fenced transaction ended,
    from the sequence's value read *before* the holders; None when a
    holder's ID is not known yet (read again)."""
    ids = [h.first_id for h in holders]
    if not ids:
        return sequence
    least = None
    for first_id in ids:
        if first_id is None:
            return None
        least = first_id if least is None or first_id < least else least
    assert least is not None
    return min(sequence, least - 1)


class Poller:
    """The fence's statements (pool thread)."""

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        classes = lock_classes(config)
        self._classes = classes
        self._locks = (
            "SELECT l.virtualtransaction, l.classid::bigint, l.objid::bigint, l.pid, "
            "a.application_name, a.xact_start::text, a.state "
            "FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            f"AND l.classid IN ({classes['stream']}, {classes['high']}, {classes['low']})")

    def holders(self, txn: Any) -> list[Holder]:
        txn.execute(self._locks)
        found: dict[str, dict[str, Any]] = {}
        c = self._classes
        for vxid, classid, objid, pid, app, started, state in txn.fetchall():
            h = found.setdefault(vxid, {"pid": pid, "app": app, "start": started,
                                        "state": state, "stream": False,
                                        "high": [], "low": []})
            if classid == c["stream"]:
                h["stream"] = True
            elif classid == c["high"]:
                h["high"].append(int(objid))
            else:
                h["low"].append(int(objid))
        out = []
        for vxid, h in found.items():
            if not h["stream"]:
                continue  # (its stream lock is gone: ending)
            first = None
            if h["high"] and h["low"]:
                # Several (a savepoint's): the least pairing, never above any.
                first = (min(h["high"]) << LOW_BITS) | min(h["low"])
            out.append(Holder(vxid, first, h["pid"], h["app"], h["start"], h["state"]))
        return out

    def _sequence_back(self, txn: Any, s: int, applied: int) -> int:
        """The sequence is behind a watermark already used (a failover to
        a standby that had not received it; the WAL flush before each use
        keeps a crash restart from doing this): moved past it, never back,
        with a warning.  A plain-SQL transaction that took a value below
        meanwhile is one the readers may have passed."""
        seq = self.config.sequence
        txn.execute(f"SELECT setval('{seq}'::regclass, GREATEST(%s, "
                    f"(SELECT last_value FROM {seq})))", (applied,))
        log.warn("stream {stream}: sequence {seq} was at {s}, behind the plain-SQL "
                 "writers' fence ({applied}); moved it past", stream=self.config.name,
                 seq=seq, s=s, applied=applied)
        return schema.sequence_value(txn, seq)

    def poll(self, txn: Any, last: tuple[int, bool] | None, applied: int,
             lower_bound: int, writer: str, upsert: str,
             sleep: Callable[[float], None] = time.sleep, look: bool = False,
             ) -> tuple[int | None, int, list[Holder]]:
        """``(watermark or None, S, holders)``.  ``last`` is the previous
        ``(S, anyone held)``: the same sequence with nobody holding needs
        no look at the locks (a transaction that takes an ID at or below
        ``S`` held the lock when ``S`` was read before), unless ``look``
        (now and then: the stream lock taken by hand holds up every insert
        before it takes an ID, so the sequence stands still).  A watermark
        above ``applied`` (the last one used) is made durable first
        (module docstring): ``upsert`` rewrites the writer's row with
        ``lower_bound``, a position the writer has reached."""
        for attempt in range(RETRIES):
            s = schema.sequence_value(txn, self.config.sequence)
            if s < applied < (1 << 62):
                s = self._sequence_back(txn, s, applied)
            if last is not None and last == (s, False) and not look:
                return s, s, []
            holders = self.holders(txn)
            w = watermark(s, holders)
            if w is not None:
                if w > applied:
                    txn.execute(upsert, (self.config.name, writer, lower_bound))
                return w, s, holders
            sleep(0.001 * (attempt + 1))
        return None, s, holders


class Fence:
    """Polls the fence of one stream and caps its first writer's token
    (reactor thread; the statements in the pool).  ``hung(grace)`` names
    the holders older than ``grace`` seconds."""

    def __init__(self, stream: Any, clock: Any, poll: float = POLL) -> None:
        self.stream = stream
        self.writer = stream.config.writers[0]
        self._clock = clock
        self._interval = poll
        self._poller = Poller(stream.config)
        self._loop: task.LoopingCall | None = None
        self._running = False
        self._last: tuple[int, bool] | None = None
        self._applied = 0
        self._outage = Outage(f"stream {stream.name}: the plain-SQL writers' fence", poll)
        self._resume_at = 0.0  # (after a failed poll: the next one not before)
        #: Holders by virtual transaction ID: (holder, first seen, clock s).
        self.holders: dict[str, tuple[Holder, float]] = {}
        self.polls = 0

    def start(self) -> None:
        cap = self.stream.id_gen.cap(self.writer)
        self._applied = cap if cap is not None else 0  # (found at load)
        self._loop = task.LoopingCall(self.tick)
        self._loop.clock = self._clock
        self._loop.start(self._interval, now=True)

    def stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def tick(self) -> None:
        if self._running or self._clock.seconds() < self._resume_at:
            return
        self._running = True
        gen = self.stream.id_gen
        d = self.stream.db.runInteraction(
            self._poller.poll, self._last, self._applied, gen.get_current_token(self.writer),
            self.writer,
            self.stream.upsert_sql, look=self.polls % LOOK_EVERY == 0)
        d.addCallbacks(self._polled, self._failed)
        d.addBoth(self._done)

    def _done(self, _: Any) -> None:
        self._running = False

    def _polled(self, answer: tuple[int | None, int, list[Holder]]) -> None:
        w, s, holders = answer
        self._outage.succeeded()
        self.polls += 1
        now = self._clock.seconds()
        self.holders = {h.vxid: (h, self.holders[h.vxid][1] if h.vxid in self.holders else now)
                        for h in holders}
        if w is None:
            self._last = None
            return
        self._last = (s, bool(holders))
        if w > self._applied:
            self._applied = w
            self.stream.id_gen.fence(self.writer, w)

    def _failed(self, failure: Any) -> None:
        """The first writer's token waits (one warning per outage)."""
        self._last = None
        self._resume_at = self._clock.seconds() + self._outage.failed(failure.value)

    def hung(self, grace: float) -> list[tuple[Holder, float]]:
        """Holders seen for more than ``grace`` seconds, oldest first:
        ``(holder, since)``."""
        now = self._clock.seconds()
        return sorted(((h, since) for h, since in self.holders.values()
                       if now - since > grace), key=lambda x: x[1])
