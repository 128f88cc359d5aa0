"""Short PostgreSQL transactions on the reactor thread: no thread hop.

psycopg2's asynchronous connections (``async_=True``) send a statement and
return at once; :class:`_Poller` lets the reactor watch the connection's
socket and calls ``poll()`` when it is ready, so a transaction's round
trips are the reactor's I/O like any other, and its answer is a callback
on the reactor thread: none of the two thread hops (to a pool thread and
back through ``callFromThread``) that a pooled transaction pays.

A transaction is a *statements generator* (the form
:class:`~replicator.streams.writes.WriteTransaction` writes it in, which a
pool thread can run as well, :func:`run_statements`): it yields ``(sql,
params)``, is sent the cursor once the statement ran, and returns the
transaction's result.  :class:`ReactorTransactions` runs each on one of
``workers`` connections of its own, between ``BEGIN`` (sent with the first
statement) and ``COMMIT``.

Invariants:

* A transaction's statements run in order on one connection, one
  transaction per connection at a time; nothing blocks the reactor but the
  driver's formatting of a statement (so big statements belong in the
  pool, :mod:`replicator.streams.stream` sends them there).
* A failure before the commit (the generator's, a statement's) rolls back
  and is the transaction's error; a failure of the ``COMMIT`` round trip
  itself is the error as it is (the transaction may have committed).
* A connection that fails (closed, or a round trip lost) is dropped; the
  next transaction opens a new one.  A connection that cannot be opened
  fails the job that waited for it before anything of it ran
  (:class:`ConnectionUnavailable`).
"""

import os
from collections import deque
from typing import Any, Callable, Deque, Generator, List, Optional, Tuple

import psycopg2
import psycopg2.extensions
from twisted.internet import defer
from twisted.internet.interfaces import IReactorFDSet, IReadDescriptor, IWriteDescriptor
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

log = Logger()

Statement = Tuple[str, Any]
#: yields statements, is sent each one's cursor, returns the result.
Statements = Generator[Statement, Any, Any]

BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED; "


class ConnectionUnavailable(Exception):
    """No connection to the database could be opened; nothing ran."""


def run_statements(cursor: Any, statements: Statements) -> Any:
    """Run ``statements`` on a blocking DB-API ``cursor`` (a pool thread)."""
    try:
        statement = next(statements)
        while True:
            try:
                cursor.execute(*statement)
            except BaseException as e:
                statement = statements.throw(e)
            else:
                statement = statements.send(cursor)
    except StopIteration as done:
        return done.value


@implementer(IReadDescriptor, IWriteDescriptor)
class _Poller:
    """Drives one asynchronous psycopg2 connection's ``poll()`` from the
    reactor until it says ``POLL_OK``: :meth:`wait` fires then (or fails
    with what ``poll()`` raised)."""

    def __init__(self, reactor: IReactorFDSet, conn: Any) -> None:
        self._reactor = reactor
        self.conn = conn
        # The reactor watches a copy of the socket's descriptor: the driver
        # closes its own when the connection fails, which must not pull a
        # descriptor from under the reactor's epoll set (closed in close()).
        self._fd = os.dup(conn.fileno())
        self._waiting: "Optional[defer.Deferred[None]]" = None
        self._reading = self._writing = False

    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return "postgres"

    def wait(self) -> "defer.Deferred[None]":
        self._waiting = defer.Deferred()
        d = self._waiting
        self._poll()
        return d

    def doRead(self) -> None:
        self._poll()

    doWrite = doRead

    def connectionLost(self, reason: Any) -> None:
        self._watch(False, False)
        self._fire(reason)

    def close(self) -> None:
        """Stop watching; the descriptor's copy is closed."""
        self._watch(False, False)
        self._fire(ConnectionUnavailable("connection closed"))
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _poll(self) -> None:
        if self._waiting is None:
            self._watch(False, False)
            return
        try:
            state = self.conn.poll()
        except BaseException as e:
            self._watch(False, False)
            self._fire(e)
            return
        if state == psycopg2.extensions.POLL_OK:
            self._watch(False, False)
            self._fire(None)
        elif state == psycopg2.extensions.POLL_READ:
            self._watch(True, False)
        elif state == psycopg2.extensions.POLL_WRITE:
            self._watch(False, True)
        else:  # pragma: no cover (the driver's states are the three above)
            self._watch(False, False)
            self._fire(RuntimeError(f"psycopg2 poll() state {state}"))

    def _watch(self, read: bool, write: bool) -> None:
        if read != self._reading:
            (self._reactor.addReader if read else self._reactor.removeReader)(self)
            self._reading = read
        if write != self._writing:
            (self._reactor.addWriter if write else self._reactor.removeWriter)(self)
            self._writing = write

    def _fire(self, error: Any) -> None:
        d, self._waiting = self._waiting, None
        if d is None:
            return
        if error is None:
            d.callback(None)
        else:
            d.errback(error)


class _Connection:
    """One asynchronous connection and its poller."""

    def __init__(self, reactor: IReactorFDSet, dsn: str) -> None:
        self.raw = psycopg2.connect(dsn, async_=True)
        self.poller = _Poller(reactor, self.raw)

    async def execute(self, cursor: Any, sql: str, params: Any = None) -> None:
        cursor.execute(sql, params)
        await self.poller.wait()

    @property
    def broken(self) -> bool:
        raw = self.raw
        return bool(raw.closed) or raw.get_transaction_status() == \
            psycopg2.extensions.TRANSACTION_STATUS_UNKNOWN

    def close(self) -> None:
        self.poller.close()
        try:
            self.raw.close()
        except Exception:
            pass


class ReactorTransactions:
    """Runs transactions on at most ``workers`` asynchronous connections.

    ``run(fn, *args)`` calls ``fn(connection, *args)`` on the reactor
    thread once a connection is ready for it (``connection``: the psycopg2
    connection, to tell one from a new one after a reconnect, never to
    run blocking calls on); ``fn`` returns a statements generator (run
    as one transaction there) or a Deferred (work it handed elsewhere, e.g.
    the pool: its result is the result, and until it comes the connection
    waits, so that at most ``workers`` transactions run at a time).
    """

    def __init__(self, reactor: IReactorFDSet, dsn: str, workers: int = 1) -> None:
        self._reactor = reactor
        self._dsn = dsn
        self._workers = max(1, workers)
        self._idle: List[_Connection] = []
        self._open = 0  # connections in use or idle (and being opened)
        self._jobs: Deque[Tuple[Callable[..., Any], tuple, "defer.Deferred[Any]"]] = deque()
        self._closed = False

    def run(self, fn: Callable[..., Any], *args: Any) -> "defer.Deferred[Any]":
        d: "defer.Deferred[Any]" = defer.Deferred()
        if self._closed:
            d.errback(ConnectionUnavailable("the database handle is closed"))
            return d
        self._jobs.append((fn, args, d))
        self._kick()
        return d

    def _kick(self) -> None:
        while self._jobs and (self._idle or self._open < self._workers):
            job = self._jobs.popleft()
            if self._idle:
                conn: Optional[_Connection] = self._idle.pop()
            else:
                conn = None
                self._open += 1
            defer.ensureDeferred(self._work(conn, *job))

    async def _connect(self) -> _Connection:
        try:
            conn = _Connection(self._reactor, self._dsn)
        except psycopg2.Error as e:
            raise ConnectionUnavailable(first_line(e)) from None
        try:
            await conn.poller.wait()
        except BaseException as e:
            conn.close()
            raise ConnectionUnavailable(first_line(e)) from None
        return conn

    async def _work(self, conn: Optional[_Connection], fn: Callable[..., Any], args: tuple,
                    d: "defer.Deferred[Any]") -> None:
        if conn is None:
            try:
                conn = await self._connect()
            except ConnectionUnavailable:
                self._open -= 1
                d.errback(Failure())
                self._kick()
                return
        try:
            work = fn(conn.raw, *args)
            if isinstance(work, defer.Deferred):
                # Handed elsewhere: it still counts as one of ``workers``
                # transactions at a time, as if it ran here.
                result = await work
            else:
                result = await self._transaction(conn, work)
        except BaseException:
            failure = Failure()
            self._release(conn)
            d.errback(failure)
        else:
            self._release(conn)
            d.callback(result)
        self._kick()

    async def _transaction(self, conn: _Connection, work: Statements) -> Any:
        """``work`` between BEGIN (sent with its first statement) and COMMIT."""
        cursor = conn.raw.cursor()
        began = False
        try:
            try:
                statement = next(work)
                while True:
                    sql, params = statement
                    if not began:
                        sql, began = BEGIN + sql, True
                    try:
                        await conn.execute(cursor, sql, params)
                    except BaseException as e:
                        statement = work.throw(e)
                    else:
                        statement = work.send(cursor)
            except StopIteration as done:
                result = done.value
            except BaseException:
                if began:
                    await self._rollback(conn, cursor)
                raise
            if began:
                await conn.execute(cursor, "COMMIT")
            return result
        finally:
            cursor.close()

    async def _rollback(self, conn: _Connection, cursor: Any) -> None:
        if conn.broken:
            return
        try:
            await conn.execute(cursor, "ROLLBACK")
        except Exception as e:
            log.warn("Database connection lost ({error}); the next transaction opens a new one",
                     error=first_line(e))
            conn.close()

    def _release(self, conn: _Connection) -> None:
        """``conn`` is free: idle again, or closed if it is of no more use."""
        if conn.broken or self._closed or conn.raw.get_transaction_status() != \
                psycopg2.extensions.TRANSACTION_STATUS_IDLE:
            conn.close()
            self._open -= 1
        else:
            self._idle.append(conn)

    def close(self) -> None:
        """Close idle connections; those in use close when their job ends."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
            self._open -= 1


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
