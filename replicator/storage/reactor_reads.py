"""Short PostgreSQL reads on the reactor thread, without a pool thread.

A trip to a pool thread and back costs more CPU than the statement it
carries when the statement is tiny: measured on 2 shared cores, reading a
sequence took 78 us of CPU by itself and about 300 us through
``runInteraction`` (the thread pool's hand-over, the thread's wake-up, the
result's way back through ``callFromThread``).  A worker reads its stream's
sequence for every fact it admits (:mod:`..replication.core.admission`), so
that read runs here: on one psycopg2 *asynchronous* connection whose socket
the reactor watches, so that no call ever blocks the reactor thread (the
connection, the statement and its answer are each polled when the socket is
ready).

Invariants:

* One statement at a time, in the order asked; each stands alone (an
  asynchronous connection is in autocommit): only reads that are
  consistent by themselves belong here.
* A connection found dead when a statement is sent on it (it died while
  idle: a server restart) is replaced, and the statement sent again on
  the new one (they are reads).  Any other failure fails that statement;
  the connection is then dropped and the next statement opens a new one.
  Statements waiting behind it are run on the new one.
* :meth:`close` fails what waits and closes the connection.

libpq resolves a host name of the connection string while it connects (the
one step that may wait): give an address (``host=10.0.0.5`` or
``hostaddr=``) where name resolution can be slow.
"""

import os
from collections import deque
from collections.abc import Sequence
from typing import Any

import psycopg2
import psycopg2.extensions
from twisted.internet import defer
from twisted.internet.interfaces import IReadDescriptor, IWriteDescriptor
from twisted.python.failure import Failure
from zope.interface import implementer

#: A statement's rows, as psycopg2 gives them.
Rows = list[tuple[Any, ...]]


class ConnectionClosed(Exception):
    """The reads' connection was closed (:meth:`ReactorReads.close`) or its
    socket lost while a statement was under way."""


@implementer(IReadDescriptor, IWriteDescriptor)
class _Poller:
    """Drives one asynchronous connection's ``poll()`` from the reactor
    until it says ``POLL_OK``, then fires ``waiting``.

    The reactor watches a duplicate of the connection's socket, which only
    this object closes (after taking it out of the reactor): psycopg2
    closes its own descriptor when the connection fails inside ``poll()``,
    and a number the reactor still watched could then be given to another
    socket.  While connecting the socket may change (libpq tries address
    after address): it is duplicated again at each step."""

    def __init__(self, reactor: Any, conn: Any) -> None:
        self._reactor = reactor
        self._conn = conn
        self._fd = -1
        self.connecting = True
        self.waiting: defer.Deferred[None] | None = None

    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return "ReactorReads"

    def wait(self) -> "defer.Deferred[None]":
        """Fires once the connection's current operation is done (it may
        have fired already: ``poll()`` can say done at once)."""
        waiting = self.waiting = defer.Deferred()
        self._poll()
        return waiting

    def doRead(self) -> None:
        self._poll()

    def doWrite(self) -> None:
        self._poll()

    def connectionLost(self, reason: Failure) -> None:
        # (The reactor saw the socket fail: poll() says why, psycopg2's words.)
        self._poll()
        self._finish(Failure(ConnectionClosed(f"socket lost: {reason.getErrorMessage()}")))

    def stop(self) -> None:
        """Out of the reactor (what :meth:`close` and each answer do)."""
        if self._fd >= 0:
            self._reactor.removeReader(self)
            self._reactor.removeWriter(self)

    def close(self) -> None:
        self.stop()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _watch(self, reading: bool) -> None:
        if self.connecting or self._fd < 0:
            self.close()
            self._fd = os.dup(self._conn.fileno())
        if reading:
            self._reactor.removeWriter(self)
            self._reactor.addReader(self)
        else:
            self._reactor.removeReader(self)
            self._reactor.addWriter(self)

    def _poll(self) -> None:
        if self.waiting is None:
            return
        try:
            state = self._conn.poll()
        except Exception:
            self._finish(Failure())
            return
        if state == psycopg2.extensions.POLL_OK:
            self.connecting = False
            self._finish(None)
        elif state == psycopg2.extensions.POLL_READ:
            self._watch(reading=True)
        elif state == psycopg2.extensions.POLL_WRITE:
            self._watch(reading=False)
        else:  # POLL_ERROR: psycopg2 raises instead; never left waiting
            self._finish(Failure(ConnectionClosed(f"poll() answered {state}")))

    def _finish(self, failure: Failure | None) -> None:
        self.stop()
        waiting, self.waiting = self.waiting, None
        if waiting is None:
            return
        if failure is None:
            waiting.callback(None)
        else:
            waiting.errback(failure)


class ReactorReads:
    """Reads of one PostgreSQL database, run one at a time on an
    asynchronous connection the reactor drives (see the module)."""

    def __init__(self, reactor: Any, dsn: str) -> None:
        self._reactor = reactor
        self._dsn = dsn
        self._conn: Any = None
        self._poller: _Poller | None = None
        self._queue: deque[tuple[str, Sequence[Any], defer.Deferred[Rows]]] = deque()
        self._running = False
        self._closed = False

    def fetchall(self, sql: str, args: Sequence[Any] = ()) -> "defer.Deferred[Rows]":
        """Run one statement; fires with its rows (a list of tuples)."""
        d: defer.Deferred[list[tuple[Any, ...]]] = defer.Deferred()
        if self._closed:
            d.errback(ConnectionClosed("closed"))
            return d
        self._queue.append((sql, args, d))
        if not self._running:
            self._running = True
            defer.ensureDeferred(self._drain())
        return d

    async def _drain(self) -> None:
        try:
            while self._queue and not self._closed:
                sql, args, d = self._queue.popleft()
                try:
                    rows = await self._run(sql, args)
                except Exception:
                    self._drop()
                    d.errback(Failure())
                else:
                    d.callback(rows)
        finally:
            self._running = False

    async def _run(self, sql: str, args: Sequence[Any]) -> Any:
        if self._conn is not None and not self._conn.closed:
            try:
                return await self._statement(sql, args)
            except (psycopg2.OperationalError, psycopg2.InterfaceError):
                # The connection died while idle (a server restart, a
                # terminated backend): once more, on a new one (a read).
                self._drop()
        self._conn = psycopg2.connect(self._dsn, async_=True)
        self._poller = _Poller(self._reactor, self._conn)
        await self._poller.wait()  # connected
        return await self._statement(sql, args)

    async def _statement(self, sql: str, args: Sequence[Any]) -> Any:
        assert self._poller is not None
        cursor = self._conn.cursor()
        try:
            cursor.execute(sql, args)
            await self._poller.wait()
            return cursor.fetchall()
        finally:
            cursor.close()

    def _drop(self) -> None:
        if self._poller is not None:
            self._poller.close()
            self._poller = None
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None

    def close(self) -> None:
        """Fail what waits; close the connection."""
        self._closed = True
        queue, self._queue = self._queue, deque()
        for _, _, d in queue:
            d.errback(ConnectionClosed("closed"))
        if self._poller is not None and self._poller.waiting is not None:
            self._poller._finish(Failure(ConnectionClosed("closed")))
        self._drop()
