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
import select
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
    reactor until it says ``POLL_OK``: :meth:`wait`'s callback is called
    then with None (or with what ``poll()`` raised).  While a connection
    is in use the reactor keeps watching it for reading (one ``epoll``
    change per transaction, not two per statement); :meth:`rest` stops."""

    def __init__(self, reactor: IReactorFDSet, conn: Any) -> None:
        self._reactor = reactor
        self.conn = conn
        # The reactor watches a copy of the socket's descriptor: the driver
        # closes its own when the connection fails, which must not pull a
        # descriptor from under the reactor's epoll set (closed in close()).
        self._fd = os.dup(conn.fileno())
        self._then: Optional[Callable[[Any], None]] = None
        self._reading = self._writing = False

    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return "postgres"

    def wait(self, then: Callable[[Any], None]) -> None:
        self._then = then
        self._poll()

    def doRead(self) -> None:
        self._poll()

    doWrite = doRead

    def connectionLost(self, reason: Any) -> None:
        self.rest()
        self._fire(reason.value if hasattr(reason, "value") else reason)

    def rest(self) -> None:
        """Stop watching (an idle connection)."""
        self._watch(False, False)

    def close(self) -> None:
        """Stop watching; the descriptor's copy is closed."""
        self.rest()
        self._fire(ConnectionUnavailable("connection closed"))
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _poll(self) -> None:
        if self._then is None:
            self.rest()
            return
        try:
            state = self.conn.poll()
        except BaseException as e:
            self.rest()
            self._fire(e)
            return
        if state == psycopg2.extensions.POLL_OK:
            self._watch(True, False)
            self._fire(None)
        elif state == psycopg2.extensions.POLL_READ:
            self._watch(True, False)
        elif state == psycopg2.extensions.POLL_WRITE:
            self._watch(True, True)
        else:  # pragma: no cover (the driver's states are the three above)
            self.rest()
            self._fire(RuntimeError(f"psycopg2 poll() state {state}"))

    def _watch(self, read: bool, write: bool) -> None:
        if read != self._reading:
            (self._reactor.addReader if read else self._reactor.removeReader)(self)
            self._reading = read
        if write != self._writing:
            (self._reactor.addWriter if write else self._reactor.removeWriter)(self)
            self._writing = write

    def _fire(self, error: Any) -> None:
        then, self._then = self._then, None
        if then is not None:
            then(error)


class _Connection:
    """One asynchronous connection and its poller."""

    def __init__(self, reactor: IReactorFDSet, dsn: str) -> None:
        self.raw = psycopg2.connect(dsn, async_=True)
        self.poller = _Poller(reactor, self.raw)

    def alive(self) -> bool:
        """Whether an idle connection still seems alive, without a round
        trip: an idle connection has nothing to read, so anything readable
        (the server's goodbye after a restart, end of file) is read now,
        and a connection that fails on it is dead."""
        if self.raw.closed:
            return False
        poller = select.poll()
        poller.register(self.poller.fileno(), select.POLLIN)
        if not poller.poll(0):
            return True
        try:
            self.raw.poll()
        except psycopg2.Error:
            return False
        return not self.broken

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


class _Transaction:
    """One statements generator run on one connection, between BEGIN
    (sent with its first statement) and COMMIT, by callbacks from the
    connection's poller (no Deferred per statement); ``done(error,
    result)`` is called once, ``error`` a Failure or None."""

    def __init__(self, conn: _Connection, work: Statements,
                 done: Callable[[Optional[Failure], Any], None]) -> None:
        self._conn = conn
        self._work = work
        self._done = done
        self._cursor = conn.raw.cursor()
        self._began = False
        self._failure: Optional[Failure] = None

    def start(self) -> None:
        self._step(lambda: next(self._work))

    def _step(self, advance: Callable[[], Statement]) -> None:
        try:
            sql, params = advance()
        except StopIteration as stop:
            if not self._began:
                self._finish(None, stop.value)
                return
            self._result = stop.value
            self._send("COMMIT", None, self._committed)
            return
        except BaseException:
            self._failure = Failure()
            if self._began and not self._conn.broken:
                self._send("ROLLBACK", None, self._rolled_back)
            else:
                self._finish(self._failure, None)
            return
        if not self._began:
            sql, self._began = BEGIN + sql, True
        self._send(sql, params, self._answered)

    def _send(self, sql: str, params: Any, then: Callable[[Any], None]) -> None:
        try:
            self._cursor.execute(sql, params)
        except BaseException as e:
            then(e)
            return
        self._conn.poller.wait(then)

    def _answered(self, error: Any) -> None:
        if error is None:
            self._step(lambda: self._work.send(self._cursor))
        else:
            self._step(lambda: self._work.throw(error))

    def _committed(self, error: Any) -> None:
        if error is None:
            self._finish(None, self._result)
        else:
            self._finish(Failure(error), None)

    def _rolled_back(self, error: Any) -> None:
        if error is not None:
            log.warn("Database connection lost ({error}); the next transaction opens a new one",
                     error=first_line(error))
            self._conn.close()
        self._finish(self._failure, None)

    def _finish(self, failure: Optional[Failure], result: Any) -> None:
        try:
            self._cursor.close()
        except Exception:
            pass
        self._done(failure, result)


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

    def __init__(self, reactor: Any, dsn: str, workers: int = 1) -> None:
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
            conn: Optional[_Connection] = None
            if self._idle:
                idle = self._idle.pop()
                if idle.alive():
                    conn = idle
                else:  # (replaced: its count is kept)
                    log.warn("Database connection lost; opening a new one")
                    idle.close()
            else:
                self._open += 1
            if conn is None:
                defer.ensureDeferred(self._connect_for(job))
            else:
                # The reactor's next turn: the writes that the callbacks of
                # this turn submit (writers a commit just answered) go too.
                self._reactor.callLater(0, self._start, conn, job)

    async def _connect_for(self, job: Tuple[Callable[..., Any], tuple, "defer.Deferred[Any]"]
                           ) -> None:
        try:
            conn = _Connection(self._reactor, self._dsn)
        except psycopg2.Error as e:
            self._unavailable(job, e)
            return
        try:
            await _wait(conn.poller)
        except BaseException as e:
            conn.close()
            self._unavailable(job, e)
            return
        self._start(conn, job)

    def _unavailable(self, job: Any, error: BaseException) -> None:
        self._open -= 1
        job[2].errback(Failure(ConnectionUnavailable(first_line(error))))
        self._kick()

    def _start(self, conn: _Connection, job: Tuple[Callable[..., Any], tuple,
                                                  "defer.Deferred[Any]"]) -> None:
        fn, args, d = job

        def done(failure: Optional[Failure], result: Any) -> None:
            self._release(conn)
            if failure is not None:
                d.errback(failure)
            else:
                d.callback(result)
            self._kick()

        try:
            work = fn(conn.raw, *args)
        except BaseException:
            done(Failure(), None)
            return
        if isinstance(work, defer.Deferred):
            # Handed elsewhere: it still counts as one of ``workers``
            # transactions at a time, as if it ran here.
            work.addCallbacks(lambda result: done(None, result),
                              lambda failure: done(failure, None))
            return
        _Transaction(conn, work, done).start()

    def _release(self, conn: _Connection) -> None:
        """``conn`` is free: idle again, or closed if it is of no more use."""
        if conn.broken or self._closed or conn.raw.get_transaction_status() != \
                psycopg2.extensions.TRANSACTION_STATUS_IDLE:
            conn.close()
            self._open -= 1
        else:
            conn.poller.rest()
            self._idle.append(conn)

    def close(self) -> None:
        """Close idle connections; those in use close when their job ends."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
            self._open -= 1


def _wait(poller: _Poller) -> "defer.Deferred[None]":
    """A Deferred of :meth:`_Poller.wait` (opening a connection)."""
    d: "defer.Deferred[None]" = defer.Deferred()
    poller.wait(lambda error: d.callback(None) if error is None else d.errback(Failure(error)))
    return d


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
