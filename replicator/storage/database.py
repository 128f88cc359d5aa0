"""The database handle: an adbapi connection pool over psycopg2 or sqlite3.

Every blocking call runs in the pool's threads, never on the reactor thread.
SQL is written once with ``%s`` placeholders; :meth:`Database.sql` turns it
into sqlite3's ``?`` style.  ``GREATEST`` is spelled by :attr:`Database.greatest`
(``MAX`` on SQLite).
"""

import os
import select
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from twisted.enterprise import adbapi
from twisted.internet import defer
from twisted.internet.interfaces import IReactorFDSet
from twisted.logger import Logger

from .. import files
from ..config import DatabaseConfig
from .reactor_reads import ReactorReads
from .transactions import TransactionQueue

#: A DB-API cursor, as a transaction function receives it (psycopg2 or sqlite3).
Cursor = Any
#: A DB-API connection (psycopg2's or sqlite3's: they share no declared type).
RawConnection = Any

log = Logger()


def _sqlite_open(conn: RawConnection) -> None:
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=5000")


#: A setting every connection of the pool carries (session-wide): its
#: inserts are replicator's own, which give their IDs themselves.  The
#: plain-SQL writers' fence refuses rows whose IDs did not come from it
#: unless the session says this (:mod:`..streams.fence`).
OWN_WRITES_SETTING = "replicator_session.own_writes"


def _postgres_open(conn: RawConnection) -> None:
    # Stream writes are short transactions; READ COMMITTED is what the
    # position bookkeeping assumes.
    conn.set_session(isolation_level="READ COMMITTED")
    cur = conn.cursor()
    cur.execute(f"SET {OWN_WRITES_SETTING} = 'on'")
    cur.close()
    conn.commit()


class _PooledConnection(adbapi.Connection):
    """A pooled PostgreSQL connection that is dropped quietly when it dies.

    adbapi logs a failed rollback (the connection died under the
    transaction: a server restart, a cut link) as an error with its
    traceback, twice per transaction.  Here it is one warning; the
    connection leaves the pool and the next transaction on this wrapper
    (:class:`.TransactionQueue` runs several per wrapper) opens a new one:
    :meth:`cursor` reconnects, :meth:`commit` has nothing left to commit.
    The transaction's own error still reaches its caller.
    """

    def rollback(self) -> None:
        if self._connection is None:  # already dropped
            return
        try:
            self._connection.rollback()
            cursor = self._connection.cursor()
            cursor.execute(self._pool.good_sql)
            cursor.close()
            self._connection.commit()
            return
        except Exception as e:
            log.warn("Database connection lost ({error}); the next transaction opens a new one",
                     error=_first_line(e))
        self._pool.disconnect(self._connection)
        self._connection = None

    def cursor(self) -> Cursor:
        if self._connection is None:
            self._connection = self._pool.connect()
        return self._connection.cursor()

    def commit(self) -> None:
        if self._connection is not None:
            self._connection.commit()


class _PostgresPool(adbapi.ConnectionPool):
    """Hands out a thread's connection only if it is not known to be dead.

    A connection that sat idle in the pool while the server restarted is
    closed at the other end; used as it is, it fails the next transaction
    that never had a chance.  Before a connection is reused, its socket is
    polled (no round trip): an idle connection has nothing to read, so
    anything readable (the server's goodbye, or end of file) is checked
    with one query, and a dead connection is replaced, with one warning.
    A connection that dies without a word (a cut link) still fails the
    transaction that meets it, and :class:`_PooledConnection` drops it.
    """

    connectionFactory = _PooledConnection

    def connect(self) -> RawConnection:
        conn: RawConnection | None = self.connections.get(self.threadID())
        if conn is not None:
            problem = _dead(conn)
            if problem is not None:
                log.warn("Database connection lost ({error}); opening a new one",
                         error=problem)
                self.disconnect(conn)
        return super().connect()


def _dead(conn: RawConnection) -> str | None:
    """Why an idle psycopg2 connection is dead, or None if it seems alive."""
    if conn.closed:
        return "closed"
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    if not poller.poll(0):
        return None
    try:
        cursor = conn.cursor()
        cursor.execute("SELECT 1")
        cursor.close()
        conn.rollback()
    except Exception as e:
        return _first_line(e)
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


@lru_cache(maxsize=1024)
def _qmark(text: str) -> str:
    return text.replace("%s", "?")


class Database:
    """A pool of connections to the configured database.

    ``engine`` is ``postgres`` or ``sqlite``.  SQLite uses exactly one
    connection: the embedded default is a single-process database.
    """

    def __init__(self, config: DatabaseConfig, pool: adbapi.ConnectionPool | None = None):
        """``pool``: a pool to use instead of opening one (the tests' in-memory
        SQLite, run inline); it must speak the configured engine's SQL."""
        self.config = config
        self.engine = config.engine
        if pool is not None:
            self.pool = pool
            self.greatest = "MAX" if self.engine == "sqlite" else "GREATEST"
        elif self.engine == "sqlite":
            assert config.path is not None  # validated: sqlite has a path
            # Data files are 0640 (SQLite gives its -wal and -shm files the
            # database file's mode).
            files.make_directory(os.path.dirname(os.path.abspath(config.path)))
            files.create_data_file(config.path)
            self.pool = adbapi.ConnectionPool(
                "sqlite3", config.path, check_same_thread=False,
                cp_min=1, cp_max=1, cp_openfun=_sqlite_open, cp_noisy=False,
            )
            self.greatest = "MAX"
        else:
            self.pool = _PostgresPool(
                "psycopg2", config.dsn, cp_min=config.pool_min, cp_max=config.pool_max,
                cp_openfun=_postgres_open, cp_reconnect=True, cp_noisy=False,
            )
            self.greatest = "GREATEST"
        # Writes: one transaction each, several per thread hop; one
        # connection stays free for reads when the pool has more than one.
        workers = config.pool_max - 1 if config.pool_max > 1 else 1
        self.transactions = TransactionQueue(self.pool, workers)
        self._reactor_reads: ReactorReads | None = None

    @property
    def is_postgres(self) -> bool:
        return self.engine == "postgres"

    def sql(self, text: str) -> str:
        """``text`` in this engine's placeholder style."""
        return text if self.engine == "postgres" else _qmark(text)

    def runInteraction(self, fn: Callable[..., Any], *args: Any,
                       **kwargs: Any) -> "defer.Deferred[Any]":
        """Run ``fn(txn, ...)`` in one transaction in a pool thread."""
        done: defer.Deferred[Any] = self.pool.runInteraction(fn, *args, **kwargs)
        return done

    def runReads(self, fn: Callable[..., Any], *args: Any) -> "defer.Deferred[Any]":
        """Run ``fn(cursor, ...)`` in a pool thread, each of its statements
        a transaction of its own (PostgreSQL: autocommit, so no BEGIN and
        COMMIT round trips; SQLite: one transaction, as
        :meth:`runInteraction`).  For reads whose every statement is
        consistent by itself (one snapshot per statement)."""
        if not self.is_postgres:
            return self.runInteraction(fn, *args)

        def run(conn: Any) -> Any:
            cursor = conn.cursor()  # (reconnects a dropped connection)
            raw = conn._connection
            raw.autocommit = True  # (between transactions: allowed)
            try:
                return fn(cursor, *args)
            finally:
                try:
                    raw.autocommit = False
                    cursor.close()
                except Exception:  # a dead connection: the failure says why
                    pass

        done: defer.Deferred[Any] = self.pool.runWithConnection(run)
        return done

    def reactor_reads(self, reactor: Any) -> ReactorReads | None:
        """PostgreSQL: the :class:`.reactor_reads.ReactorReads` of this
        database on ``reactor`` (one connection more than the pool, opened
        at the first read), for tiny reads on the path of every fact; None
        on SQLite, on a pool given by a test, or on a reactor that cannot
        watch a socket (a test's clock): then the pool it is."""
        if self._reactor_reads is None:
            if not self.is_postgres or self.config.dsn is None \
                    or not IReactorFDSet.providedBy(reactor) \
                    or not isinstance(self.pool, _PostgresPool):
                return None
            self._reactor_reads = ReactorReads(reactor, self.config.dsn)
        return self._reactor_reads

    def runQuery(self, text: str, *args: Any) -> "defer.Deferred[Any]":
        done: defer.Deferred[Any] = self.pool.runQuery(self.sql(text), *args)
        return done

    def runOperation(self, text: str, *args: Any) -> "defer.Deferred[Any]":
        done: defer.Deferred[Any] = self.pool.runOperation(self.sql(text), *args)
        return done

    def close(self) -> None:
        if self._reactor_reads is not None:
            self._reactor_reads.close()
        self.pool.close()
