"""The thread a file consumer writes through: its I/O jobs run one at a
time, in order, off the reactor; and the append that never leaves part of a
batch in the file."""

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.python.failure import Failure

#: An I/O job: the function, its arguments, the Deferred of its result.
_Job = tuple[Callable[..., Any], tuple[Any, ...], "defer.Deferred[Any]"]


class FileThread:
    """One thread that runs the I/O jobs of one file, one at a time, in the
    order given; each job's result (or failure) comes back on the reactor
    thread through the Deferred :meth:`run` returned.

    The thread starts with the first job and is a daemon: a process that
    exits without :meth:`stop` does not wait for it (what it had not written
    is not in the file's positions, so it is fetched again).
    """

    def __init__(self, name: str, reactor: Any) -> None:
        self.name = name
        self._reactor = reactor
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: stop
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[..., Any], *args: Any) -> "defer.Deferred[Any]":
        d: defer.Deferred[Any] = defer.Deferred()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self._thread.start()
        self._jobs.put((fn, args, d))
        return d

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, d = job
            try:
                result = fn(*args)
            except BaseException:
                self._reactor.callFromThread(d.errback, Failure())
            else:
                self._reactor.callFromThread(d.callback, result)

    def stop(self) -> None:
        """Let the thread end once the jobs given so far are done."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


def run_inline(fn: Callable[..., Any], *args: Any) -> "defer.Deferred[Any]":
    """Run an I/O job on the calling thread (tests on a Clock, scripts)."""
    return defer.maybeDeferred(fn, *args)


def append_at(fd: int, size: int, data: bytes, truncate_first: bool, fsync: bool) -> None:
    """Write ``data`` at offset ``size`` and fsync (the writer thread).  On
    any error the file is cut back to ``size`` (if it can be) and the error
    raised: the file never keeps part of a batch."""
    try:
        if truncate_first:
            os.ftruncate(fd, size)
        view = memoryview(data)
        offset = size
        while view:
            n = os.pwrite(fd, view, offset)
            view = view[n:]
            offset += n
        if fsync:
            os.fsync(fd)
    except OSError:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass  # truncated before the next attempt
        raise
