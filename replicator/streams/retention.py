"""Retention: a stream's oldest facts deleted from its table, in the background.

A stream with ``retention`` (``max_age`` and/or ``max_facts``) is trimmed by
one instance only: the first of its ``writers`` (it writes the table, so it
has the rights, and the choice needs no coordination).  Every ``interval``
seconds (on the clock passed in) a *pass* deletes, in transactions of at most
``batch`` facts each (in the database pool, never on the reactor thread):

* only facts *strictly below the persisted linear position*: the smallest
  ``stream_positions`` row over the stream's configured writers (a writer
  without a row: nothing is trimmed).  Every fact at or below a writer's
  persisted position is committed and final, and every ID still in flight
  or handed out later is above it (docs/streams.md, "Persisted positions"),
  so nothing a writer could still be completing is ever touched;
* only a prefix of the table, in ID order: a fact goes when it is beyond
  the ``max_facts`` newest facts, or older than ``max_age`` (its youngest
  row's ``timestamp_column``, against the clock); the pass stops at the
  first fact that is neither, so the trimmed facts are exactly those at or
  below the boundary.

Each batch, in one transaction: locks the ``stream_retention`` row of the
stream's *table* (:func:`.trimmed.boundary_key`; two deployments sharing a
database may both have a stream ``caches``, never one table; PostgreSQL:
``FOR UPDATE SKIP LOCKED``; an instance that finds it locked,
say a second one configured as the trimmer by mistake, trims nothing this
pass: two never delete at once), reads the persisted linear position,
picks the facts, deletes them and moves ``trimmed_through`` (the trim
boundary, :mod:`.trimmed`) to the last one.  Readers compare the boundary
with where they read from, and stop rather than skip (:mod:`.trimmed`).

A pass that deleted something says so in one log line; the metrics
``replicator_retention_trimmed_facts_total`` and
``replicator_retention_trimmed_through`` count and show it.
"""

from collections.abc import Sequence
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer, task
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from ..config import RetentionConfig, StreamConfig
from ..observe import metrics
from ..storage import schema
from ..storage.database import Cursor, Database
from ..streams.registry import StreamRegistry
from .trimmed import boundary_key

log = Logger(namespace="replicator.retention")


def retention_of(config: StreamConfig) -> RetentionConfig:
    """The retention of a stream that has one (only those get a trimmer)."""
    if config.retention is None:
        raise ValueError(f"stream {config.name} has no retention")
    return config.retention


class Batch:
    """The statements of one stream's trim batches (run in a pool thread)."""

    def __init__(self, config: StreamConfig, db: Database) -> None:
        c = config
        self.config = c
        self.retention = retention_of(c)
        self._postgres = db.is_postgres
        sql = db.sql
        self._sql = sql
        idc, t = c.id_column, c.table
        self.key = boundary_key(c)  # the table's row (not the stream's name)
        self._claim = sql("INSERT INTO stream_retention (table_name, trimmed_through) "
                          "VALUES (%s, 0) ON CONFLICT (table_name) DO NOTHING")
        self._lock = sql("SELECT trimmed_through FROM stream_retention WHERE table_name = %s"
                         + (" FOR UPDATE SKIP LOCKED" if db.is_postgres else ""))
        self._nth_newest = sql(f"SELECT DISTINCT {idc} FROM {t} ORDER BY {idc} DESC "
                               f"LIMIT 1 OFFSET %s")
        if self.retention.max_age is not None:
            self._candidates = sql(
                f"SELECT {idc}, MAX({c.timestamp_column}) FROM {t} WHERE {idc} > %s AND "
                f"{idc} < %s GROUP BY {idc} ORDER BY {idc} LIMIT %s")
        else:
            self._candidates = sql(
                f"SELECT DISTINCT {idc} FROM {t} WHERE {idc} > %s AND {idc} < %s "
                f"ORDER BY {idc} LIMIT %s")
        self._delete = sql(f"DELETE FROM {t} WHERE {idc} > %s AND {idc} <= %s")
        self._move = sql("UPDATE stream_retention SET trimmed_through = %s "
                         "WHERE table_name = %s")

    def count_bound(self, txn: Cursor) -> int | None:
        """The newest ID beyond the ``max_facts`` newest facts (every fact
        at or below it is trimmable by count), or None.  Read once a pass:
        newer facts only move it up, so a pass that uses it late trims less,
        never more."""
        if self.retention.max_facts is None:
            return None
        txn.execute(self._nth_newest, (self.retention.max_facts,))
        row = txn.fetchone()
        return int(row[0]) if row is not None else None

    def linear_position(self, txn: Cursor) -> int:
        """The smallest persisted position over the configured writers (0
        if one has none yet)."""
        persisted = schema.persisted_positions(txn, self.config.positions_key, self._sql)
        return min((persisted.get(w, 0) for w in self.config.writers), default=0)

    def run(self, txn: Cursor, count_bound: int | None,
            age_bound: int | None) -> tuple[int, int, int] | None:
        """One batch: ``(facts deleted, trim boundary, linear position)``,
        or None if another instance holds the stream's row (it is trimming).

        ``age_bound``: milliseconds since the epoch; a fact whose youngest
        row is older is trimmable by age.
        """
        key = self.key
        txn.execute(self._claim, (key,))
        txn.execute(self._lock, (key,))
        row = txn.fetchone()
        if row is None:
            return None
        boundary = int(row[0])
        linear = self.linear_position(txn)
        if linear <= boundary + 1:
            return 0, boundary, linear
        txn.execute(self._candidates, (boundary, linear, self.retention.batch))
        last = None
        taken = 0
        for candidate in txn.fetchall():
            stream_id = int(candidate[0])
            by_count = count_bound is not None and stream_id <= count_bound
            by_age = age_bound is not None and candidate[1] is not None \
                and int(candidate[1]) < age_bound
            if not (by_count or by_age):
                break
            last = stream_id
            taken += 1
        if last is None:
            return 0, boundary, linear
        txn.execute(self._delete, (boundary, last))
        txn.execute(self._move, (last, key))
        return taken, last, linear


class Trimmer:
    """The trim passes of one stream (see the module docstring)."""

    def __init__(self, config: StreamConfig, db: Database, clock: IReactorTime) -> None:
        self.config = config
        self.name = config.name
        self.db = db
        self._clock = clock
        self._batch = Batch(config, db)
        self.retention = retention_of(config)
        self.boundary: int | None = None  # the last one seen
        #: The last pass's batches: (facts deleted, boundary, linear position).
        self.last_pass: list[tuple[int, int, int]] = []
        self._contended = False  # another instance held the row (logged once)
        self._trimmed = metrics.RETENTION_TRIMMED.labels(self.name)
        self._boundary_gauge = metrics.RETENTION_BOUNDARY.labels(self.name)

    def age_bound(self) -> int | None:
        """Facts older than this (milliseconds since the epoch) are trimmable."""
        max_age = self.retention.max_age
        if max_age is None:
            return None
        return int((self._clock.seconds() - max_age) * 1000)

    async def trim(self) -> int:
        """One pass: batches until one deletes less than a batch; the
        number of facts deleted."""
        count_bound = await self.db.runInteraction(self._batch.count_bound)
        age_bound = self.age_bound()
        total, linear = 0, 0
        batch = self.retention.batch
        self.last_pass = []
        while True:
            result = await self.db.runInteraction(self._batch.run, count_bound, age_bound)
            if result is None:
                if not self._contended:
                    self._contended = True
                    log.warn("stream {stream}: retention: another instance is trimming (its "
                             "stream_retention row is locked); this one trims nothing while "
                             "it does. Only the stream's first writer should trim",
                             stream=self.name)
                break
            self._contended = False
            self.last_pass.append(result)
            deleted, self.boundary, linear = result
            self._boundary_gauge.set(self.boundary)
            if deleted:
                total += deleted
                self._trimmed.inc(deleted)
            if deleted < batch:
                break
        if total:
            log.info("stream {stream}: retention trimmed {n} facts; the trim boundary is "
                     "{boundary} (the persisted linear position is {linear})",
                     stream=self.name, n=total, boundary=self.boundary, linear=linear)
        return total


class RetentionService(Service):
    """Runs the trim passes of the streams this instance trims, each every
    ``retention.interval`` seconds on ``clock``; a failed pass is logged
    and the next one runs on time.  Stopping waits for passes under way."""

    def __init__(self, trimmers: Sequence[Trimmer], clock: IReactorTime) -> None:
        self.trimmers = list(trimmers)
        self._clock = clock
        self._loops: list[task.LoopingCall] = []
        self._running: dict[str, defer.Deferred[Any]] = {}
        self._failing: dict[str, bool] = {}

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        for trimmer in self.trimmers:
            loop = task.LoopingCall(self._pass, trimmer)
            loop.clock = self._clock
            self._loops.append(loop)
            loop.start(trimmer.retention.interval, now=False)

    def _pass(self, trimmer: Trimmer) -> defer.Deferred[Any]:
        d = defer.ensureDeferred(trimmer.trim())
        self._running[trimmer.name] = d

        def failed(f: Failure) -> Failure:
            if not self._failing.get(trimmer.name):
                self._failing[trimmer.name] = True
                log.warn("stream {stream}: a retention pass failed ({error}); retrying every "
                         "{interval}s", stream=trimmer.name, error=f.getErrorMessage()[:300],
                         interval=trimmer.retention.interval)
            return f

        def done(result: Any) -> None:
            self._running.pop(trimmer.name, None)
            if not isinstance(result, Failure) and self._failing.get(trimmer.name):
                self._failing[trimmer.name] = False
                log.info("stream {stream}: retention passes work again", stream=trimmer.name)
            return None

        d.addErrback(failed)
        d.addBoth(done)
        return d

    def stopService(self) -> defer.Deferred[Any]:
        super().stopService()  # type: ignore[no-untyped-call]
        for loop in self._loops:
            if loop.running:
                loop.stop()
        self._loops = []
        return defer.DeferredList(list(self._running.values()))


def trimmers_for(instance_name: str, registry: StreamRegistry, db: Database,
                 clock: IReactorTime) -> list[Trimmer]:
    """The streams of ``registry`` this instance trims: those with
    ``retention`` whose first writer it is."""
    return [Trimmer(stream.config, db, clock) for stream in registry
            if stream.config.retention is not None and stream.config.writers[0] == instance_name]
