"""Catch-up pages read ahead: a run of pages read one after the other in
one pool thread, so the thread never waits for the reactor between pages.

A reader's catch-up asks for one page at a time (``Stream.facts_since``),
and asks for the next one as soon as it has a page.  Read one interaction
per page, the pool thread waited between pages for two thread hops (the
page to the reactor, the next read back to the pool), and for the reactor
to let go of the GIL (it encodes the page it has meanwhile): measured at
1,000,000 facts, 2.4 to 3.3 s of a 6 to 8 s catch-up.  Here, once asked for
a page, the pool thread goes on with the next ones (up to ``run_pages`` in
one run), and each page goes to the reactor as soon as it is read.

Invariants:

* The pages are exactly those of one read per page (the same
  :meth:`.PageQuery.read_facts` from where the previous page ended; one
  transaction per run, READ COMMITTED, so each SELECT sees what was
  committed when it started, as in a transaction of its own).
* Memory stays bounded: the run stops reading while ``ahead`` pages are
  waiting for the reader; after ``wait`` seconds without the reader taking
  one, the run ends (giving back its pool thread and connection: a reader
  that failed and retries later must not hold them).
* A page is handed only for the request it answers: a request that is not
  the one the run expects (another ``since``, ``until`` or ``limit``)
  stops the run and starts a new one from there.  A read that fails ends
  the run; the request that was waiting for it gets the failure.
"""

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.python.failure import Failure

from ..storage.database import Database

#: ``read(cursor, writer, since, until, limit)`` -> ``(facts, upto, limited)``
ReadPage = Callable[..., tuple[Any, ...]]


class _Run:
    """One run of pages of one writer (shared by the pool thread and the reactor)."""

    def __init__(self, writer: str, since: int, until: int, limit: int, ahead: int) -> None:
        self.writer = writer
        self.next_since = since  # the request the next page answers (reactor side)
        self.until = until
        self.limit = limit
        self.slots = threading.Semaphore(ahead)
        self.stopped = False  # set by the reactor: the run reads nothing more
        self.pages: deque[object] = deque()  # pages (or a Failure) read, not yet asked for
        self.waiting: defer.Deferred[Any] | None = None  # a request ahead of the pages
        self.ended = False  # the pool thread is done with this run
        self.failed = False  # a read failed (set by the pool thread)

    def expects(self, since: int, until: int, limit: int) -> bool:
        return (not self.stopped and self.waiting is None and since == self.next_since
                and until == self.until and limit == self.limit
                and bool(self.pages or not self.ended))


class ReadAhead:
    """Pages of a writer's facts, read ahead in runs (see the module docstring).

    ``read`` runs in a pool thread with a cursor; ``call_from_thread`` hands
    its pages to the reactor thread.  One run at a time per writer.
    """

    def __init__(self, db: Database, read: ReadPage, call_from_thread: Callable[..., Any],
                 run_pages: int = 16, ahead: int = 2, wait: float = 0.2) -> None:
        self._db = db
        self._read = read
        self._call_from_thread = call_from_thread
        self.run_pages = run_pages
        self.ahead = ahead
        self.wait = wait
        self._runs: dict[str, _Run] = {}

    def page(self, writer: str, since: int, until: int, limit: int) -> defer.Deferred[Any]:
        """The page ``(facts, upto, limited)`` of ``writer`` after ``since``."""
        run = self._runs.get(writer)
        if run is None or not run.expects(since, until, limit):
            if run is not None:
                self._stop(run)
            run = self._runs[writer] = _Run(writer, since, until, limit, self.ahead)
            d = self._db.pool.runWithConnection(self._produce, run, since)
            d.addErrback(self._run_failed, run)
            d.addBoth(self._ended, run)
        if run.pages:
            return self._take(run, run.pages.popleft())
        run.waiting = defer.Deferred()
        return run.waiting

    # ------------------------------------------------------------- reactor
    def _take(self, run: _Run, item: Any) -> defer.Deferred[Any]:
        """``item`` as the answer to the request it was read for."""
        if isinstance(item, Failure):
            self._stop(run)
            return defer.fail(item)
        run.slots.release()  # the pool thread may read one more
        run.next_since = item[1]
        return defer.succeed(item)

    def _arrived(self, item: Any, run: _Run) -> None:
        if run.stopped:
            return
        if run.waiting is not None:
            waiting, run.waiting = run.waiting, None
            self._take(run, item).chainDeferred(waiting)
        else:
            run.pages.append(item)

    def _run_failed(self, failure: Failure, run: _Run) -> None:
        """The run failed: a failed read was handed on already; anything
        else (no connection) goes to the request, as a failed read would."""
        if not run.failed:
            self._arrived(failure, run)

    def _ended(self, _: Any, run: _Run) -> None:
        run.ended = True
        if run.waiting is not None and not run.pages and not run.stopped:
            # The run ended before the page asked for (it waited too long
            # for the reader): that page comes from a new run.
            waiting, run.waiting = run.waiting, None
            if self._runs.get(run.writer) is run:
                del self._runs[run.writer]
            self.page(run.writer, run.next_since, run.until, run.limit).chainDeferred(waiting)

    def _stop(self, run: _Run) -> None:
        run.stopped = True
        run.pages.clear()
        run.slots.release()  # a pool thread waiting for a slot sees the stop
        if run.waiting is not None:
            waiting, run.waiting = run.waiting, None
            waiting.errback(Failure(RuntimeError("read-ahead stopped")))

    # ---------------------------------------------------------- pool thread
    def _produce(self, conn: Any, run: _Run, since: int) -> None:
        """Read up to ``run_pages`` pages from ``since`` in one
        transaction (READ COMMITTED: each page sees what was committed when
        it was read, as with one transaction each, without a COMMIT round
        trip each: 1.15 s of a 1,000,000-fact catch-up), handing each page
        to the reactor as soon as it is read; a failed read ends the run
        (its failure handed on instead)."""
        cursor = conn.cursor()
        try:
            for _ in range(self.run_pages):
                if since >= run.until or run.stopped:
                    return
                if not run.slots.acquire(timeout=self.wait) or run.stopped:
                    return
                try:
                    page = self._read(cursor, run.writer, since, run.until, run.limit)
                except Exception:
                    run.failed = True
                    self._call_from_thread(self._arrived, Failure(), run)
                    raise  # the pool rolls back (or drops a dead connection)
                self._call_from_thread(self._arrived, page, run)
                since = page[1]
        finally:
            try:
                cursor.close()
            except Exception:
                pass  # a broken connection: what failed was handed on
