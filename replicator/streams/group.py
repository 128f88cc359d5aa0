"""Group commit: the writes of one writer that wait go into one transaction.

A write (:meth:`WriteGroups.submit`) is queued for its writer.  When a
database thread starts a write transaction it takes every write queued at
that moment (up to ``max_facts`` facts and about ``max_rows`` rows), so the
writes that arrive while transactions are running go together into the next
one: one ``nextval`` round trip for all their facts, one multi-row INSERT,
one commit.

Invariants:

* Every submitted write is answered exactly once: its IDs, or its own error.
* A write is in at most one transaction at a time, and is taken by a
  transaction only once (or retried alone, below).
* If a group's transaction fails inside its statements (nothing was
  committed), each of its writes is retried alone, so that only a bad one
  gets an error.  A failure of the commit itself (the connection lost while
  committing: the group may have committed after all) is the answer of every
  write of the group: retrying could write a fact twice.
* No write is left queued without a transaction on its way to take it.

Which transaction function runs and how IDs are completed is the stream's
business (:class:`~replicator.streams.stream.Stream`); this module only
decides who goes with whom.
"""

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.python.failure import Failure


class StatementFailed(Exception):
    """A group's transaction failed before its commit; ``failure`` is why."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(str(failure.value))
        self.failure = failure


class Write:
    """One caller's write: its facts (each a list of rows), their wire form
    and hooks, and the Deferred that answers it.  ``ids`` is set by the
    transaction that took it."""

    __slots__ = ("facts", "wire", "lines", "hooks", "deferred", "ids", "rows", "started")

    def __init__(self, facts: list[list[list[Any]]], wire: Any, hooks: list[Any],
                 started: float, lines: Any = None) -> None:
        self.facts = facts
        self.wire = wire
        self.lines = lines  # the rows' JSON lines, per fact (None: not kept)
        self.hooks = hooks
        self.deferred: defer.Deferred[list[int]] = defer.Deferred()
        self.ids: list[int] = []
        self.rows = sum(len(f) for f in facts)
        self.started = started


class Group:
    """The writes one transaction took (``solo``: a retry of one write)."""

    __slots__ = ("writes", "reserved", "taken", "solo")

    def __init__(self, solo: Write | None = None) -> None:
        self.writes: list[Write] = [solo] if solo is not None else []
        self.reserved: list[int] = []  # IDs reserved by the transaction
        self.taken = solo is not None
        self.solo = solo is not None


class WriteGroups:
    """The queue of one writer's waiting writes.

    ``run(group)`` starts a transaction (reactor thread) that calls
    :meth:`take` first thing in its database thread, and returns a Deferred
    of its outcome; ``finish(group, outcome)`` is told every outcome
    (reactor thread), and may call :meth:`retry_alone`.
    """

    def __init__(self, run: Callable[[Group], "defer.Deferred[None]"],
                 finish: Callable[[Group, Any], None], max_facts: int,
                 max_rows: int = 10_000) -> None:
        self._run = run
        self._finish = finish
        self.max_facts = max(1, max_facts)
        self.max_rows = max(1, max_rows)
        self._lock = threading.Lock()
        self._queued: deque[Write] = deque()
        self._queued_facts = 0
        self._waiting = 0  # transactions started that have not taken yet
        self._running = 0  # transactions started whose outcome is not told yet

    def submit(self, write: Write) -> "defer.Deferred[list[int]]":
        """Queue ``write``; start a transaction unless enough are on their way."""
        with self._lock:
            self._queued.append(write)
            self._queued_facts += len(write.facts)
            start = self._waiting * self.max_facts < self._queued_facts
            if start:
                self._waiting += 1
        if start:
            self._start(Group())
        return write.deferred

    def take(self, group: Group) -> list[Write]:
        """In the transaction's thread: the writes it commits (none left: [])."""
        if group.taken:
            return group.writes
        with self._lock:
            group.taken = True
            self._waiting -= 1
            facts = rows = 0
            queued = self._queued
            while queued:
                nxt = queued[0]
                if group.writes and (facts + len(nxt.facts) > self.max_facts
                                     or rows + nxt.rows > self.max_rows):
                    break
                queued.popleft()
                group.writes.append(nxt)
                facts += len(nxt.facts)
                rows += nxt.rows
            self._queued_facts -= facts
        return group.writes

    def retry_alone(self, write: Write) -> None:
        """Run ``write`` in a transaction of its own (after its group failed)."""
        write.ids = []
        self._start(Group(solo=write))

    def _start(self, group: Group) -> None:
        self._running += 1
        d = self._run(group)
        d.addBoth(self._done, group)

    def _done(self, outcome: Any, group: Group) -> None:
        self._running -= 1
        if not group.taken:
            # The transaction never ran (no connection could be had).
            with self._lock:
                group.taken = True
                self._waiting -= 1
                orphans: list[Write] = []
                if self._waiting == 0:
                    orphans = list(self._queued)
                    self._queued.clear()
                    self._queued_facts = 0
            group.writes = orphans
        try:
            self._finish(group, outcome)
        finally:
            self._restart_if_stranded()

    def _restart_if_stranded(self) -> None:
        """A transaction took fewer than were queued (size bounds): make
        sure one more is on its way for the rest."""
        with self._lock:
            start = bool(self._queued) and self._waiting == 0
            if start:
                self._waiting += 1
        if start:
            self._start(Group())

    @property
    def queued(self) -> int:
        return len(self._queued)

    @property
    def busy(self) -> bool:
        """Whether a write is queued or a transaction is on its way (the
        group being told its outcome not counted): more commits are coming."""
        return self._running > 0 or bool(self._queued)
