"""The ``jsonl`` consumer: facts appended to a JSON-lines file, resumed
exactly from its positions, which a state file beside it keeps.  (One job:
the crash-safe open, buffering, flushing and rotating belong together; the
lines are :mod:`.jsonl_lines`, the options :mod:`.jsonl_options`, the
writing thread :mod:`.file_thread`, the state, lock and rotated files
:mod:`.jsonl_files`.)

The format of its lines is :mod:`.jsonl_lines` (and ``docs/jsonl.md``); its
options, :mod:`.jsonl_options`.

Lines are buffered and written in batches (one ``write`` + ``fsync`` per
flush, then the state file's) by a thread of the file's own, never on the
reactor thread.  The line of a fact of more than ``ENCODE_SLICE`` rows is
encoded a slice per reactor turn (the fact is handed on when it is done).  After a crash the file
holds whole batches plus possibly a
partial last line; on open the partial line is cut off, and the positions
are the state file's plus those of the complete lines written after it
(:mod:`.jsonl_files`), so the reader resumes exactly after the last line on
disk, and a file rotated away (by the consumer or by ``logrotate``) takes no
position with it.
"""

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import orjson
from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from .. import files
from ..jsontext import encode_json_line
from ..keys import Key
from ..net.backoff import Outage
from . import jsonl_files
from .base import STARTS, Consumer, IAcceptsTrimmed, IBatchConsumer, Row
from .file_thread import FileThread, append_at
from .jsonl_lines import (
    BOUNDARY,
    ENCODE_SLICE,
    fact_lines_at_once,
    iso_time,
    parse_line,
    sliced_fact_line,
)

log = Logger(namespace="replicator.consumers")
_dumps = orjson.dumps


class JsonlError(ValueError):
    """The file cannot be used: a complete line that is not a fact or a
    position, or another consumer holds the file."""


@dataclass
class _File:
    """The file being written: touched only by the file's thread (jobs run
    one at a time) once the consumer is open."""

    fd: int
    size: int  # bytes of whole lines
    inode: int
    started: float | None  # when its first line was written (clock seconds)
    heading_size: int = 0  # bytes of the position lines it begins with
    notes: list[str] = field(default_factory=list)  # to log on the reactor thread


def _close_file(handle: _File) -> None:
    """(The file's thread.)  A later job (a reopen) then does nothing."""
    fd, handle.fd = handle.fd, -1
    os.close(fd)


@implementer(IBatchConsumer, IAcceptsTrimmed)
class JsonlConsumer(Consumer):
    """Appends facts to a JSON-lines file (format: see the module docstring).

    Lines are buffered in memory and written with one ``write`` and one
    ``fsync`` per batch: ``flush_interval`` seconds after the first line of
    a batch (a ``callLater`` on ``reactor``), as soon as
    the buffer holds ``max_buffer`` bytes, and in :meth:`close`.  The writes
    and fsyncs run on a thread of this file's own (:class:`FileThread`; or
    whatever ``run_io`` runs a job with), never on the reactor thread, one
    batch at a time and in order; lines that arrive meanwhile form the next
    batch.  ``on_facts`` returns None: the reader does not wait per fact.
    Only when the buffer is full and cannot be handed to the writer (a batch
    is still being written, or the last one failed: disk full, I/O error)
    does it return a Deferred, which fires once a batch has been written, so
    memory stays bounded while the disk is slow or broken.

    :meth:`positions` is what the files held after the last successful flush
    (with ``fsync=False``: written to the OS, which survives a killed process
    but not a power loss).  Opening reads the state file and the lines after
    the offset it records (the whole file if it is another one: rotated
    while stopped); a partial last line (a crash mid-write) is cut off with
    one log line.  A fact at or below the key's last position (durable or
    buffered) is skipped (it happens normally when another consumer makes
    the reader resume from further back).  A lock file is held (``flock``)
    while open: two consumers, in one process or two, or a consumer and
    ``replicator rewind``, cannot share the file.

    Rotation: with ``rotate_size`` (bytes) and/or ``rotate_age`` (seconds
    since the file's first line), before a batch the file is moved to its
    rotated name (``rotate_names``: ``number`` or ``date``, see
    :mod:`.jsonl_files`), ``rotate_keep`` of those kept, and a new file
    begun with one position line per key.  A file moved away or truncated
    by ``logrotate`` is followed before the next batch, or at once by
    :meth:`reopen` (SIGUSR1, or a reload).

    ``reactor`` (required) times the flushes and runs the file's own thread
    (:class:`FileThread`); with ``run_io`` (tests: I/O inline) a ``Clock``
    will do.

    The service must call :meth:`close` (and wait for its Deferred) at
    shutdown, or the last ``flush_interval`` of facts is not written (not
    lost: positions do not include them, so they are fetched again on
    restart).
    """

    #: Delay before retrying a failed flush (seconds; at least flush_interval).
    retry_delay = 1.0

    def __init__(self, path: str, reactor: Any, *, streams: Sequence[str] | None = None,
                 flush_interval: float = 0.05, fsync: bool = True, max_buffer: int = 1 << 20,
                 run_io: Callable[..., "defer.Deferred[Any]"] | None = None,
                 rotate_size: int | None = None, rotate_age: float | None = None,
                 rotate_keep: int = 7, rotate_names: str = "number", start: str = "now") -> None:
        clock = reactor
        if start not in STARTS:
            raise ValueError(f"start {start!r} is not one of {', '.join(STARTS)}")
        self.start = start
        if rotate_names not in jsonl_files.NAMES:
            raise ValueError(f"rotate_names {rotate_names!r} is not one of "
                             f"{', '.join(jsonl_files.NAMES)}")
        self.rotate_size = rotate_size
        self.rotate_age = rotate_age
        self.rotate_keep = rotate_keep
        self.rotate_names = rotate_names
        self.path = os.path.abspath(path)
        self.streams = tuple(streams) if streams is not None else None
        self.flush_interval = flush_interval
        self.fsync = fsync
        self.max_buffer = max_buffer
        self._clock = clock
        self._thread: FileThread | None = None
        if run_io is None:
            self._thread = FileThread(f"jsonl {os.path.basename(self.path)}", reactor)
            run_io = self._thread.run
        self._run_io = run_io
        self._durable: dict[Key, int] = {}  # in the file
        self._last: dict[Key, int] = {}  # in the file, being written, or buffered
        #: Keys a ``--skip-to boundary`` skip line set (with the position it
        #: set); valid while the key's position is still that one.
        self._accepted: dict[Key, int] = {}
        self._buffer: list[bytes] = []
        self._buffered = 0  # bytes of the buffer and of _unwritten
        self._pending_positions: dict[Key, int] = {}
        #: Keys whose last line (written or buffered) is a fact: only these
        #: get a position line (after it, once) until the next rotation.
        self._after_fact: set[Key] = set()
        self._unwritten = b""  # a failed batch: written before anything newer
        self._writing: defer.Deferred[Any] | None = None  # the batch in the writer's hands
        self._again: list[defer.Deferred[bool]] = []  # flush() calls made meanwhile
        self._timer = None
        self._failed = False
        # Writes failing: the retries' backoff and the outage's two log lines.
        self._outage = Outage(f"{path}: writing", self.retry_delay)
        self._waiters: list[defer.Deferred[None]] = []
        self._closed = False
        self._closing: defer.Deferred[None] | None = None
        self._file: _File | None = None  # used by the file's thread only while writing
        self._lock_fd: int | None = None
        #: Rotations made (by size or age) and rotations followed (logrotate).
        self.rotations = 0
        self.reopens = 0
        #: Facts skipped because they were at or below the key's position.
        self.skipped = 0
        #: Successful flushes that wrote something.
        self.flushes = 0
        self._open()

    # ------------------------------------------------------------ opening
    def _open(self) -> None:
        """Lock, open and recover the file (on the calling thread: at
        start, before the reactor runs, or in a command-line tool)."""
        directory = os.path.dirname(self.path)
        files.make_directory(directory)
        try:
            self._lock_fd = jsonl_files.lock(self.path)
        except BlockingIOError:
            raise JsonlError(f"{self.path} is in use by another consumer") from None
        fd = None
        try:
            created = not os.path.exists(self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, files.DATA_MODE)
            try:
                state = jsonl_files.read_state(self.path)
            except jsonl_files.StateError as e:
                raise JsonlError(str(e)) from None
            st = os.fstat(fd)
            start, started, same_file = 0, None, False
            if state is not None:
                self._durable = dict(state.positions)
                self._accepted = dict(state.accepted)
                same_file = state.inode == st.st_ino and state.offset <= st.st_size
                if same_file:
                    start, started = state.offset, state.started
            lines, good, total, unfinished = self._scan(start, same_file)
            if total > good:
                os.ftruncate(fd, good)
                if self.fsync:
                    os.fsync(fd)
                log.warn("{path}: cut off {what} ({n} bytes at offset {offset}; a crash "
                         "mid-write)", path=self.path, n=total - good, offset=good,
                         what="an unfinished rewind" if unfinished else "a partial last line")
            if started is None and good > 0:
                started = self._clock.seconds()
            self._file = _File(fd, good, st.st_ino, started)
            jsonl_files.write_state(self.path, jsonl_files.State(
                dict(self._durable), st.st_ino, good, started,
                self._accepted_at(self._durable)), self.fsync)
            if created and self.fsync:
                jsonl_files.fsync_directory(directory)
        except BaseException:
            self._file = None
            if fd is not None:
                os.close(fd)
            os.close(self._lock_fd)
            self._lock_fd = None
            raise
        self._last = dict(self._durable)
        self._accepted = self._accepted_at(self._durable)
        log.info("{path}: positions of {keys} stream writers ({lines} lines read past its "
                 "state file)", path=self.path, lines=lines, keys=len(self._durable))

    def _scan(self, start: int, committed_only: bool) -> tuple[int, int, int, bool]:
        """Read the file from ``start`` once, updating the positions:
        ``(complete lines, their end offset, file size, unfinished)``.

        A rewind line sets its key's position (the lines come in order).
        With ``committed_only`` (the state file describes this file up to
        ``start``) a rewind line is one whose state was never written (a
        rewind cut short): the scan ends before it (``unfinished``)."""
        good = start
        lines = 0
        unfinished = False
        positions = self._durable
        with open(self.path, "rb") as f:
            f.seek(start)
            for line in f:
                if not line.endswith(b"\n"):
                    break
                try:
                    key, token, obj = parse_line(line)
                except ValueError as e:
                    raise JsonlError(f"{self.path}: line {lines + 1} after offset {start} "
                                     f"(offset {good}) is not a fact or position: {e}"
                                     if start else
                                     f"{self.path}: line {lines + 1} (offset {good}) is not a "
                                     f"fact or position: {e}") from None
                if key is not None:
                    assert token is not None and obj is not None  # a keyed line has both
                    if "rewind" in obj:
                        if committed_only:
                            unfinished = True
                            break
                        positions[key] = token
                    elif token > positions.get(key, token - 1):
                        positions[key] = token
                    skip = obj.get("skip")
                    if isinstance(skip, dict) and skip.get("to") == BOUNDARY:
                        self._accepted[key] = token
                    elif self._accepted.get(key) != token or "rows" in obj:
                        self._accepted.pop(key, None)  # moved on since
                lines += 1
                good += len(line)
            total = f.seek(0, os.SEEK_END)
        return lines, good, total, unfinished

    @property
    def _fd(self) -> int | None:
        """The current file's descriptor (None once closed)."""
        return self._file.fd if self._file is not None else None

    @_fd.setter
    def _fd(self, fd: int | None) -> None:
        if fd is None:
            self._file = None
        else:
            assert self._file is not None
            self._file.fd = fd

    # ------------------------------------------------------------ consumer
    def positions(self) -> dict[Key, int]:
        return {key: token for key, token in self._durable.items()
                if self.streams is None or key[0] in self.streams}

    def _accepted_at(self, positions: dict[Key, int]) -> dict[Key, int]:
        """The accepted keys whose position in ``positions`` is still the
        one their skip set (what a state file of those positions records)."""
        return {key: token for key, token in self._accepted.items()
                if positions.get(key) == token}

    def accepted_gap(self, stream: str, writer: str) -> int | None:
        """The key's position if a ``--skip-to boundary`` skip line (the
        operator's, or one this method's caller wrote after it) set it and
        nothing was handed on since: the operator accepted the loss of
        whatever retention trims before this reader reads; else None.  A
        fact, a position or a rewind of the key spends it."""
        key = (stream, writer)
        token = self._accepted.get(key)
        return token if token is not None and self._last.get(key) == token else None

    def skip_trimmed(self, stream: str, writer: str,
                     boundary: int) -> Optional["defer.Deferred[None]"]:
        """An accepted key (:meth:`accepted_gap`) met a retention gap: buffer
        a skip line to ``boundary`` (every fact up to it trimmed, so none of
        them in the table), the key staying accepted; a Deferred to wait
        on when the buffer is full, as :meth:`on_facts`."""
        key = (stream, writer)
        since = self.accepted_gap(stream, writer)
        assert since is not None and boundary > since, (since, boundary)
        line = encode_json_line({"stream": stream, "writer": writer, "position": boundary,
                                 "skip": {"from": since, "facts": 0,
                                          "trimmed_through": boundary,
                                          "at": iso_time(int(self._clock.seconds() * 1000)),
                                          "to": BOUNDARY}})
        result = self._append(key, [line], boundary, facts=False)
        self._accepted[key] = boundary
        return result

    def on_facts(self, stream: str, writer: str, token: int,
                 rows: list[Row]) -> Optional["defer.Deferred[None]"]:
        if self._closed:
            log.debug("{path} is closed: fact {token} of {stream}/{writer} not written",
                      path=self.path, token=token, stream=stream, writer=writer)
            return None
        key = (stream, writer)
        last = self._last.get(key)
        if last is not None and token <= last:
            self.skipped += 1
            log.debug("{path}: skipped fact {token} of {stream}/{writer}, at or below {last} "
                      "({skipped} skipped)", path=self.path, token=token, stream=stream,
                      writer=writer, last=last, skipped=self.skipped)
            return None
        if len(rows) > ENCODE_SLICE:
            return defer.ensureDeferred(self._append_sliced(key, [(token, rows)]))
        line = encode_json_line({"stream": stream, "writer": writer, "token": token, "rows": rows})
        return self._append(key, [line], token)

    def on_facts_many(self, stream: str, writer: str, facts: Sequence[tuple[int, list[Row]]],
                      ) -> Optional["defer.Deferred[None]"]:
        """``on_facts`` for ``(token, rows)`` facts in token order (a page of a
        catch-up), in one pass.  The buffer may go past ``max_buffer`` by one
        page; a Deferred is returned, as by ``on_facts``, when it is full."""
        if self._closed or not facts:
            return None
        key = (stream, writer)
        last = self._last.get(key)
        if last is not None and facts[0][0] <= last:
            kept = [fact for fact in facts if fact[0] > last]
            self.skipped += len(facts) - len(kept)
            facts = kept
            if not facts:
                return None
        if any(len(rows) > ENCODE_SLICE for _, rows in facts):
            return defer.ensureDeferred(self._append_sliced(key, facts))
        data = fact_lines_at_once(stream, writer, facts)
        if data is None:
            data = b"".join([encode_json_line({"stream": stream, "writer": writer,
                                               "token": token, "rows": rows})
                             for token, rows in facts])
        return self._append(key, [data], facts[-1][0])

    async def _append_sliced(self, key: Key, facts: Sequence[tuple[int, list[Row]]]) -> None:
        """Append the lines of ``facts`` of ``key``, one of which has more
        than ``ENCODE_SLICE`` rows: its rows encoded a slice per reactor
        turn (the same bytes as in one go); waits as :meth:`_append` says."""
        stream, writer = key
        lines = [await sliced_fact_line(self._clock, stream, writer, token, rows)
                 for token, rows in facts]
        if self._closed:
            log.debug("{path} is closed: facts up to {token} of {stream}/{writer} not written",
                      path=self.path, token=facts[-1][0], stream=stream, writer=writer)
            return
        result = self._append(key, lines, facts[-1][0])
        if result is not None:
            await result

    def _append(self, key: Key, lines: list[bytes], last: int,
                facts: bool = True) -> Optional["defer.Deferred[None]"]:
        """Buffer ``lines`` of ``key`` (the last one's token: ``last``; fact
        lines unless ``facts`` is false); a Deferred to wait on when the
        buffer is full, else None."""
        self._buffer.extend(lines)
        self._buffered += sum(map(len, lines))
        self._last[key] = last
        self._accepted.pop(key, None)  # (skip_trimmed sets it again)
        self._pending_positions.pop(key, None)
        if facts:
            self._after_fact.add(key)
        else:
            self._after_fact.discard(key)
        if self._buffered >= self.max_buffer:
            if self._writing is None and not self._failed:
                self.flush()
            if self._buffered >= self.max_buffer:
                # The writer is busy or the disk is failing: wait for it.
                waiter: defer.Deferred[None] = defer.Deferred()
                self._waiters.append(waiter)
                return waiter
        if self._buffer:
            self._schedule(self.flush_interval)
        return None

    def on_position(self, stream: str, writer: str,
                    token: int) -> Optional["defer.Deferred[None]"]:
        if self._closed:
            return None
        key = (stream, writer)
        last = self._last.get(key)
        if last is None:  # the key's first line: where the file begins for it
            line = encode_json_line({"stream": stream, "writer": writer, "position": token})
            return self._append(key, [line], token, facts=False)
        if token <= last:
            return None
        self._last[key] = token  # in the state file with the next batch
        self._accepted.pop(key, None)
        if key in self._after_fact:
            # One line after the key's last fact, of the latest position
            # at the flush; none for the moves after it (nothing new).
            self._pending_positions[key] = token
            self._schedule(self.flush_interval)
        return None

    def close(self) -> "defer.Deferred[None]":
        """Write what is buffered, then release the file; fires when done
        (at once with an inline ``run_io``).  Later calls return the same."""
        if self._closing is not None:
            return self._closing
        self._closed = True
        self._cancel_timer()
        self._closing = defer.ensureDeferred(self._close())
        return self._closing

    async def _close(self) -> None:
        while self._writing is not None:
            await self._wait_written()
        if not await self._write(retry=False):
            log.error("{path}: {n} buffered bytes could not be written at shutdown; they are "
                      "fetched again on restart", path=self.path, n=self._buffered)
        self._release_waiters()
        handle, self._file = self._file, None
        if self._lock_fd is not None:
            # Nothing more is written: another consumer may open the file
            # while this one's descriptor is closed in its thread.
            os.close(self._lock_fd)
            self._lock_fd = None
        if handle is not None:
            await self._run_io(_close_file, handle)
        if self._thread is not None:
            self._thread.stop()

    def _wait_written(self) -> "defer.Deferred[bool]":
        d: defer.Deferred[bool] = defer.Deferred()
        self._again.append(d)
        return d

    # ------------------------------------------------------------ rotation
    def _heading(self) -> bytes:
        """The position lines a new file begins with: every key's position
        in the files before it, so each file says where it starts."""
        return b"".join(encode_json_line({"stream": s, "writer": w, "position": token})
                        for (s, w), token in sorted(self._durable.items()))

    def _write_job(self, handle: _File, data: bytes, heading: bytes, target: dict[Key, int],
                   truncate_first: bool, now: float,
                   accepted: dict[Key, int] | None = None) -> None:
        """(The file's thread.)  Follow a rotation made outside, rotate if
        due, append ``data`` (after ``heading`` in a new file), then record
        ``target`` in the state file.  On an error the file is as before
        (:func:`.append_at`) and the state not written: the batch is retried.
        Without ``data`` only the state is written.  ``accepted``: the
        state's accepted keys (:meth:`accepted_gap`)."""
        self._follow(handle)
        accepted = accepted or {}
        if not data:
            jsonl_files.write_state(self.path, jsonl_files.State(
                target, handle.inode, handle.size, handle.started, accepted), self.fsync)
            return
        if self._rotation_due(handle, now):
            self._rotate(handle, now)
        if handle.size == 0 and heading:
            data = heading + data
            handle.heading_size = len(heading)
        append_at(handle.fd, handle.size, data, truncate_first, self.fsync)
        size = handle.size + len(data)
        if handle.size == 0:
            handle.started = now
        jsonl_files.write_state(self.path, jsonl_files.State(
            target, handle.inode, size, handle.started, accepted), self.fsync)
        handle.size = size

    def _follow(self, handle: _File) -> None:
        """(The file's thread.)  If the file was moved away (``logrotate``'s
        default: move, then create), continue in the file now at the path
        (created if missing); if it was truncated (``copytruncate``),
        continue at its new end."""
        if handle.fd < 0:
            return  # closed
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if st is None or st.st_ino != handle.inode:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, files.DATA_MODE)
            os.close(handle.fd)
            st = os.fstat(fd)
            handle.fd, handle.inode, handle.size = fd, st.st_ino, st.st_size
            handle.started, handle.heading_size = None, 0
            if self.fsync:
                jsonl_files.fsync_directory(os.path.dirname(self.path))
            handle.notes.append("moved away (rotated): continuing in a new file")
            self.reopens += 1
            return
        size = os.fstat(handle.fd).st_size
        if size < handle.size:
            handle.notes.append(f"truncated from {handle.size} to {size} bytes (copytruncate): "
                                f"continuing at its end")
            handle.size, handle.started, handle.heading_size = size, None, 0
            self.reopens += 1

    def _rotation_due(self, handle: _File, now: float) -> bool:
        if handle.size <= handle.heading_size:
            return False
        if self.rotate_size is not None and handle.size >= self.rotate_size:
            return True
        return (self.rotate_age is not None and handle.started is not None
                and now - handle.started >= self.rotate_age)

    def _rotate(self, handle: _File, now: float) -> None:
        """(The file's thread.)  Move the file to its rotated name, keep
        ``rotate_keep`` of those, and continue in a new file."""
        target = jsonl_files.rotate(self.path, self.rotate_names, self.rotate_keep, now)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, files.DATA_MODE)
        os.close(handle.fd)
        handle.fd, handle.inode, handle.size = fd, os.fstat(fd).st_ino, 0
        handle.started, handle.heading_size = None, 0
        if self.fsync:
            jsonl_files.fsync_directory(os.path.dirname(self.path))
        handle.notes.append(f"rotated to {os.path.basename(target)}")
        self.rotations += 1

    def _log_notes(self, handle: _File) -> None:
        while handle.notes:
            log.info("{path}: {note}", path=self.path, note=handle.notes.pop(0))

    def reopen(self) -> "defer.Deferred[None]":
        """Follow a rotation made outside now (SIGUSR1, which ``replicator
        reopen`` sends from ``logrotate``'s ``postrotate``): release a file
        moved away at once rather than at the next batch.  Fires when done."""
        handle = self._file
        if handle is None or self._closed:
            return defer.succeed(None)
        d = self._run_io(self._follow, handle)
        d.addCallback(lambda _: self._log_notes(handle))
        return d

    def rewind(self, positions: dict[Key, int]) -> "defer.Deferred[None]":
        """Set the positions of the keys in ``positions`` (lower them: the
        reader then delivers those facts again), as one transaction: one
        rewind line per key, then the state file (the commit; a rewind cut
        short before it is cut off the file on the next open).  Only on a
        consumer with nothing buffered (``replicator rewind``)."""
        return self._set_positions(positions, "rewind")

    def skip(self, positions: dict[Key, int],
             notes: dict[Key, dict[str, Any]] | None = None) -> "defer.Deferred[None]":
        """Set the positions of the keys in ``positions`` (raise them: the
        facts up to them are never delivered, a retention gap accepted) as
        one transaction: one *skip line* per key (a position line with a
        ``skip`` object: ``notes[key]``, what ``replicator verify`` reports),
        then the state file.  The lines record the skip; one written without
        the state file (a crash between) is a position all the same.  Only
        on a consumer with nothing buffered (``replicator rewind --skip-to``).
        A note with ``"to": "boundary"`` makes its key accepted
        (:meth:`accepted_gap`)."""
        return self._set_positions(positions, "position", notes or {})

    def _set_positions(self, positions: dict[Key, int], kind: str,
                       notes: dict[Key, dict[str, Any]] | None = None,
                       ) -> "defer.Deferred[None]":
        assert not (self._buffer or self._pending_positions or self._unwritten)
        handle = self._file
        if handle is None or not positions:
            return defer.succeed(None)
        notes = notes or {}
        data = b"".join(encode_json_line({"stream": s, "writer": w, kind: token,
                                          **({"skip": notes[(s, w)]} if (s, w) in notes
                                             else {})})
                        for (s, w), token in sorted(positions.items()))
        target = {**self._durable, **positions}
        for key in positions:
            if notes.get(key, {}).get("to") == BOUNDARY:
                self._accepted[key] = positions[key]
            else:
                self._accepted.pop(key, None)
        d = self._run_io(self._write_job, handle, data, self._heading(), target, False,
                         self._clock.seconds(), self._accepted_at(target))

        def done(_: object) -> None:
            self._log_notes(handle)
            self._durable = target
            self._last = dict(target)
            self._after_fact.difference_update(positions)
        return d.addCallback(done)

    # -------------------------------------------------------------- flushing
    def _schedule(self, delay: float) -> None:
        if self._timer is None and not self._closed:
            self._timer = self._clock.callLater(delay, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        self.flush()

    def pending_bytes(self) -> bytes:
        """What the next flush writes: a failed batch, the buffered facts,
        then one position line per key that advanced past its last fact."""
        positions = [
            encode_json_line({"stream": s, "writer": w, "position": token})
            for (s, w), token in self._pending_positions.items()
        ]
        return self._unwritten + b"".join(self._buffer + positions)

    def flush(self, retry: bool = True) -> "defer.Deferred[bool]":
        """Hand what is buffered to the writer now.  Fires with True once it
        is in the file (and fsynced), False if that failed: then the file is
        as before and, with ``retry``, a retry is scheduled.  While a batch
        is being written, the buffer goes once that one is done."""
        self._cancel_timer()
        if self._writing is not None:
            return self._wait_written()
        return defer.ensureDeferred(self._write(retry))

    async def _write(self, retry: bool) -> bool:
        """Write one batch: everything buffered so far (one at a time)."""
        handle = self._file
        if handle is None or not (self._unwritten or self._buffer or self._pending_positions
                                  or self._last != self._durable):
            return True
        # (Positions that moved without a line since, and nothing else: the
        # state file alone takes them, on an explicit flush or close.)
        data = self.pending_bytes()
        target = dict(self._last)  # the positions once this batch is in the file
        truncate_first = self._failed
        self._buffer, self._buffered = [], 0
        self._after_fact.difference_update(self._pending_positions)
        self._pending_positions, self._unwritten = {}, b""
        self._writing = writing = self._run_io(
            self._write_job, handle, data, self._heading(), target, truncate_first,
            self._clock.seconds(), self._accepted_at(target))
        try:
            await writing
        except Exception as e:
            delay = self._outage.failed(e)
            self._failed = True
            self._unwritten = data
            self._buffered += len(data)
            ok = False
            if retry and not self._closed:
                self._schedule(max(delay, self.flush_interval))
        else:
            self._outage.succeeded()
            self._failed = False
            self._durable = target
            if data:
                self.flushes += 1
            ok = True
        finally:
            self._writing = None
            self._log_notes(handle)
        again, self._again = self._again, []
        if ok and not self._closed and (again or self._buffered >= self.max_buffer):
            # Asked for meanwhile, or the buffer filled up: the next batch now.
            result = defer.ensureDeferred(self._write(retry))

            def answer(written: object, waiting: list["defer.Deferred[bool]"] = again) -> None:
                for d in waiting:
                    d.callback(written is True)
            result.addBoth(answer)
        else:
            for d in again:
                d.callback(ok)
        if ok:
            self._release_waiters()
            if self._buffer or self._pending_positions:
                self._schedule(self.flush_interval)
        return ok

    def _release_waiters(self) -> None:
        if self._buffered >= self.max_buffer and not self._closed:
            return  # still full: the batch being written releases them
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(None)
