"""The files around a JSON-lines file (:mod:`.jsonl`): its state file, its
lock file and its rotated files.  Everything here does blocking I/O: it runs
in the file's own thread (or in a command-line tool), never on the reactor.

The state file
--------------

``.<name>.state`` beside ``<name>`` (hidden, so a ``logrotate`` pattern
``<name>*`` or ``*.jsonl`` does not take it) holds the consumer's positions
independently of the file, which may be moved away or truncated at any time
by a rotation::

    {"version":1,"inode":1234,"offset":5678,"started":1764111111.5,
     "positions":[["caches","master",42],...],"accepted":[["caches","master",42]]}

It says: "these were the positions once byte ``offset`` of the file with
inode ``inode`` was written".  On open the positions are the state's, plus
what the current file holds after ``offset`` (the batch a crash caught
between the file's write and the state's), or, if the file is another one
(rotated away while stopped), plus the whole new file.  The state is
replaced atomically (write a temporary file, fsync, rename) after every
batch, so it is never older than the last batch written but one.
``started`` is when the current file got its first line (for ``rotate_age``).
``accepted`` (optional) lists the keys whose position a ``replicator rewind
--skip-to boundary`` set with nothing handed on since: the loss of what
retention trims before the reader reads is accepted for them
(:meth:`.JsonlConsumer.accepted_gap`).

The lock file
-------------

``.<name>.lock``, held (``flock``) by whatever has the file open: the
consumer in the daemon, or ``replicator rewind``.  It is a separate file
because the JSON-lines file itself is moved away by a rotation.

Rotated files
-------------

Named as ``logrotate`` names them: ``<name>.1`` (newest) ... ``<name>.N``,
or dated ``<name>-YYYYMMDD-HHMMSS`` (UTC; ``.1``, ``.2`` added within one
second; :func:`rotated_files` takes any date of digits, ``-`` and ``_``
after the ``-``, as ``logrotate``'s ``dateext`` makes them, and sorts those
by name); either may end in ``.gz`` (``logrotate``'s ``compress``).
:func:`rotated_files` lists them oldest first.
"""

import dataclasses
import fcntl
import json
import os
import re
import time
from typing import Any

from .. import files
from ..keys import Key

STATE_VERSION = 1


class StateError(ValueError):
    """The state file cannot be read (the text says why and what to do)."""


@dataclasses.dataclass
class State:
    """What the state file holds (see the module docstring)."""

    positions: dict[Key, int]
    inode: int
    offset: int
    started: float | None = None
    #: Keys whose position a ``--skip-to boundary`` set, nothing handed on
    #: since: the position each had then (:meth:`.JsonlConsumer.accepted_gap`).
    accepted: dict[Key, int] = dataclasses.field(default_factory=dict)


def _sibling(path: str, suffix: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{suffix}")


def state_path(path: str) -> str:
    return _sibling(path, "state")


def lock_path(path: str) -> str:
    return _sibling(path, "lock")


def read_state(path: str) -> State | None:
    """The state of the JSON-lines file ``path``, or None if it has none."""
    where = state_path(path)
    try:
        with open(where, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(data)
        if obj.get("version") != STATE_VERSION:
            raise ValueError(f"version {obj.get('version')!r}, expected {STATE_VERSION}")
        positions = {}
        for stream, writer, token in obj["positions"]:
            if not (isinstance(stream, str) and isinstance(writer, str)
                    and type(token) is int):
                raise ValueError(f"bad position {[stream, writer, token]!r}")
            positions[(stream, writer)] = token
        started = obj.get("started")
        accepted = {}
        for stream, writer, token in obj.get("accepted", ()):
            if not (isinstance(stream, str) and isinstance(writer, str)
                    and type(token) is int):
                raise ValueError(f"bad accepted skip {[stream, writer, token]!r}")
            accepted[(stream, writer)] = token
        return State(positions, int(obj["inode"]), int(obj["offset"]),
                     float(started) if started is not None else None, accepted)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StateError(f"{where} is not a state file ({e}); move it away to rebuild the "
                         f"positions from {os.path.basename(path)} alone") from None


def write_state(path: str, state: State, fsync: bool) -> None:
    """Replace the state of ``path`` atomically (temporary file, fsync when
    ``fsync``, rename)."""
    where = state_path(path)
    data = json.dumps({
        "version": STATE_VERSION, "inode": state.inode, "offset": state.offset,
        "started": state.started,
        "positions": [[s, w, t] for (s, w), t in sorted(state.positions.items())],
        **({"accepted": [[s, w, t] for (s, w), t in sorted(state.accepted.items())]}
           if state.accepted else {}),
    }, separators=(",", ":")).encode()
    temporary = where + ".tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                 files.DATA_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, where)


def lock(path: str) -> int:
    """Take the lock of the JSON-lines file ``path``: its fd (closing it
    releases the lock).  BlockingIOError if another holds it."""
    fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, files.DATA_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------- rotation
NAMES = ("number", "date")


def _rotated(path: str) -> list[tuple[tuple[int, Any, Any], str]]:
    directory, name = os.path.split(path)
    pattern = re.compile(re.escape(name) + r"(?:\.(\d+)|-(\d[\d_-]*?)(?:\.(\d+))?)(?:\.gz)?")
    found = []
    try:
        entries = os.listdir(directory or ".")
    except FileNotFoundError:
        return []
    for entry in entries:
        m = pattern.fullmatch(entry)
        if m is None:
            continue
        order: tuple[int, Any, Any]
        if m.group(1) is not None:
            order = (1, -int(m.group(1)), "")  # numbered: .N oldest ... .1 newest
        else:
            order = (0, m.group(2), int(m.group(3) or 0))
        found.append((order, os.path.join(directory, entry)))
    return sorted(found)


def rotated_files(path: str) -> list[str]:
    """The rotated files of ``path`` (numbered or dated, maybe ``.gz``),
    oldest first (dated ones before numbered ones when both exist)."""
    return [p for _, p in _rotated(path)]


def rotate(path: str, names: str, keep: int, now: float) -> str:
    """Move ``path`` to its newest rotated name and delete the oldest beyond
    ``keep``; returns the name it was moved to.  (The caller holds the file
    open, creates the next one, and fsyncs the directory.)"""
    if names == "date":
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
        target = f"{path}-{stamp}"
        n = 0
        while os.path.lexists(target) or os.path.lexists(target + ".gz"):
            n += 1
            target = f"{path}-{stamp}.{n}"
        os.rename(path, target)
    else:
        numbered = sorted((-order[1], p) for order, p in _rotated(path) if order[0] == 1)
        for n, p in reversed(numbered):
            suffix = ".gz" if p.endswith(".gz") else ""
            os.rename(p, f"{path}.{n + 1}{suffix}")
        target = f"{path}.1"
        os.rename(path, target)
    for old in rotated_files(path)[:-keep] if keep > 0 else rotated_files(path):
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass
    return target
