"""Idempotency keys: a write's key recorded in the transaction of its fact.

A write given a key (the HTTP API's ``Idempotency-Key``) adds a hook to its
transaction (:meth:`IdempotencyKeys.hook`, run with the fact's ID) that
records ``(table, key) -> (fingerprint, stream_id, created_ms)`` in
``stream_idempotency`` (:data:`replicator.storage.schema.IDEMPOTENCY_DDL`).
So the key commits with the fact or not at all: a crash, a lost
connection, a client that gave up never leave one without the other.

Invariants:

* At most one fact per ``(table, key)`` within the window: the table's
  primary key.  A write whose key is already recorded, and younger than
  the window, raises :class:`KeyTaken` in its transaction, which rolls
  back (its reserved ID completes as a fact with no rows, as any rolled
  back write's).  On PostgreSQL a write whose key another transaction has
  recorded but not yet committed waits for that transaction: it commits
  (:class:`KeyTaken`) or rolls back (this write goes ahead).
* A record older than the window (``window`` seconds, on the clock passed
  in) counts for nothing: it is never answered (:meth:`lookup`), and a
  write with its key replaces it in its own transaction.
* The table holds at most the writes of one window (plus one prune
  interval): :class:`IdempotencyPruner` deletes older records, in
  transactions of at most :data:`PRUNE_BATCH` rows.

Keys are scoped per stream table (:func:`.trimmed.boundary_key`, as
``stream_retention`` is: two deployments sharing a database may both have a
stream ``caches``, never one table); the fingerprint covers the stream's
name and its rows, so a key reused with another body, or on another stream
of the same table, is told apart from a retry.  The HTTP API has one write
credential (``http.secret``): nothing else to scope by.
"""

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from twisted.application.service import Service
from twisted.internet import defer, task
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from ..storage.database import Cursor, Database
from .writes import TxnHook

log = Logger(namespace="replicator.idempotency")

#: ``http.idempotency_window``'s default: a day, as Stripe keeps its keys.
DEFAULT_WINDOW = 86_400.0
#: Records deleted per pruning transaction at most.
PRUNE_BATCH = 10_000
#: How often the pruner runs at most (more often for a shorter window).
PRUNE_INTERVAL = 300.0


class KeyTaken(Exception):
    """The key is recorded already (committed, within the window): this
    write rolled back and wrote nothing."""


class Recorded(NamedTuple):
    """What a key was first used for."""

    fingerprint: str
    stream_id: int


def fingerprint(stream_name: str, lines: Sequence[bytes]) -> str:
    """What a write is, for telling a retry from another write: the stream's
    name and each row's JSON line (:meth:`.stream.Stream.prepare`), so the
    spacing of the request's JSON does not count, its values and their
    order do."""
    digest = hashlib.sha256(stream_name.encode("utf-8") + b"\n")
    digest.update(b"%d\n" % len(lines))
    for line in lines:
        digest.update(line)
    return digest.hexdigest()


class IdempotencyKeys:
    """The statements of ``stream_idempotency`` (in pool threads) and the
    window they keep to."""

    def __init__(self, db: Database, window: float, clock: IReactorTime) -> None:
        self.db = db
        self.window = window
        self._clock = clock
        sql = db.sql
        self._record = sql(
            "INSERT INTO stream_idempotency (table_name, idem_key, fingerprint, stream_id, "
            "created_ms) VALUES (%s, %s, %s, %s, %s) ON CONFLICT (table_name, idem_key) "
            "DO UPDATE SET fingerprint = excluded.fingerprint, "
            "stream_id = excluded.stream_id, created_ms = excluded.created_ms "
            "WHERE stream_idempotency.created_ms < %s")
        self._lookup = sql(
            "SELECT fingerprint, stream_id FROM stream_idempotency "
            "WHERE table_name = %s AND idem_key = %s AND created_ms >= %s")
        self._prune = sql(
            "DELETE FROM stream_idempotency WHERE (table_name, idem_key) IN "
            "(SELECT table_name, idem_key FROM stream_idempotency WHERE created_ms < %s "
            "LIMIT %s)")

    def _now_ms(self) -> int:
        return int(self._clock.seconds() * 1000)

    def _cutoff_ms(self, now_ms: int) -> int:
        """Records created before this are out of the window."""
        return now_ms - int(self.window * 1000)

    def hook(self, table: str, key: str, print_: str) -> TxnHook:
        """The hook that records ``key`` with the fact it is given (one
        fact: the write's only); raises :class:`KeyTaken` in the
        transaction if the key is recorded already."""
        now = self._now_ms()
        cutoff = self._cutoff_ms(now)

        def record(txn: Cursor, stream_id: int) -> None:
            txn.execute(self._record, (table, key, print_, stream_id, now, cutoff))
            if txn.rowcount == 0:
                raise KeyTaken(key)

        return record

    async def lookup(self, table: str, key: str) -> Recorded | None:
        """What ``key`` was first used for, if recorded within the window."""
        cutoff = self._cutoff_ms(self._now_ms())

        def read(txn: Cursor) -> Recorded | None:
            txn.execute(self._lookup, (table, key, cutoff))
            row = txn.fetchone()
            return None if row is None else Recorded(str(row[0]), int(row[1]))

        found: Recorded | None = await self.db.runInteraction(read)
        return found

    async def prune(self) -> int:
        """Delete every record out of the window, a batch per transaction;
        how many went."""
        cutoff = self._cutoff_ms(self._now_ms())

        def batch(txn: Cursor) -> int:
            txn.execute(self._prune, (cutoff, PRUNE_BATCH))
            return int(txn.rowcount)

        total = 0
        while True:
            n: int = await self.db.runInteraction(batch)
            total += n
            if n < PRUNE_BATCH:
                return total


class IdempotencyPruner(Service):
    """Prunes ``stream_idempotency`` every :data:`PRUNE_INTERVAL` seconds
    (or every window, if shorter) on ``clock``.  Every instance that
    writes through the HTTP API runs one: deleting what is out of the
    window twice is harmless.  A failed pass is logged once (until one
    succeeds); stopping waits for a pass under way."""

    def __init__(self, keys: IdempotencyKeys, clock: IReactorTime) -> None:
        self.keys = keys
        self._clock = clock
        self._loop: task.LoopingCall | None = None
        self._running: list[defer.Deferred[Any]] = []
        self._failing = False

    @property
    def interval(self) -> float:
        return min(PRUNE_INTERVAL, self.keys.window)

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._loop = task.LoopingCall(self._pass)
        self._loop.clock = self._clock
        self._loop.start(self.interval, now=False)

    def _pass(self) -> "defer.Deferred[Any]":
        d = defer.ensureDeferred(self.keys.prune())
        self._running.append(d)

        def done(result: Any) -> None:
            self._running.remove(d)
            if isinstance(result, Failure):
                if not self._failing:
                    self._failing = True
                    log.warn("pruning idempotency keys failed ({error}); retrying every "
                             "{interval}s", error=result.getErrorMessage()[:300],
                             interval=self.interval)
                return
            if self._failing:
                self._failing = False
                log.info("pruning idempotency keys works again")

        d.addBoth(done)
        return d

    def stopService(self) -> "defer.Deferred[Any]":
        super().stopService()  # type: ignore[no-untyped-call]
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        return defer.DeferredList(list(self._running))
