"""A ``jsonl`` output's files as they were at one moment, for a reader
beside the daemon (``replicator verify``).

:func:`hold` opens the output and its rotated files (oldest first) and
takes each one's size; :meth:`Held.lines` then reads each file up to that
size only, as often as asked, whatever the daemon does meanwhile: lines it
appends are not read, and a rotation that renames or deletes the files
changes nothing (the open files are read, not the names).  So whatever
the tables say at a later moment covers every line read: the daemon writes
a fact only once it is committed.

Blocking I/O: a pool thread or a command-line tool, never the reactor.
"""

import gzip
import os
import resource
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from .jsonl_files import rotated_files

#: Bytes read at a time.
CHUNK = 1 << 20
#: Times the files are listed and opened again when a rotation moved
#: them in between.
ATTEMPTS = 10


@dataclass
class HeldFile:
    path: str
    file: BinaryIO
    size: int  # what is read of it (gzip: all)


@dataclass
class Held:
    """The files of one output, oldest first, the current one last (if it
    exists); :meth:`close` when done."""

    path: str
    files: list[HeldFile]
    #: Set by :meth:`lines`: a last line cut short at the current file's
    #: size while the file grew since (the batch being written then: not
    #: a problem, not read).
    cut: int = field(default=0)

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def lines(self) -> Iterator[tuple[str, int, bytes]]:
        """``(path, offset, line)`` of every complete line held; a last
        line without its newline is yielded as it is (without ``\\n``)
        unless it is the current file's and that file grew since."""
        for held in self.files:
            current = held.path == self.path
            held.file.seek(0)
            if held.path.endswith(".gz"):
                source: BinaryIO = gzip.GzipFile(fileobj=held.file, mode="rb")  # type: ignore
                left = -1
            else:
                source, left = held.file, held.size
            offset = 0
            rest = b""
            while left:
                chunk = source.read(CHUNK if left < 0 else min(CHUNK, left))
                if not chunk:
                    break  # shrank (copytruncate), or the end of a .gz
                if left > 0:
                    left -= len(chunk)
                parts = (rest + chunk).split(b"\n")
                rest = parts.pop()
                for part in parts:
                    yield held.path, offset, part + b"\n"
                    offset += len(part) + 1
            if rest:
                if current and os.fstat(held.file.fileno()).st_size > held.size:
                    self.cut = len(rest)
                else:
                    yield held.path, offset, rest

    def grown(self) -> int:
        """Bytes the current file holds now beyond what is read."""
        for held in self.files:
            if held.path == self.path:
                return os.fstat(held.file.fileno()).st_size - held.size + self.cut
        return 0

    def close(self) -> None:
        for held in self.files:
            held.file.close()
        self.files = []


def _names(path: str) -> list[str]:
    return rotated_files(path) + ([path] if os.path.exists(path) else [])


def _room_for(n: int) -> None:
    """Let this process hold ``n`` more files open (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(hard, want)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def hold(path: str) -> Held:
    """Open the output ``path`` and its rotated files and take their sizes.
    The names are listed again after: if a rotation moved them meanwhile,
    they are opened again.  OSError as opening raises it (a file deleted
    meanwhile is left out)."""
    for _ in range(ATTEMPTS):
        names = _names(path)
        _room_for(len(names))
        files: list[HeldFile] = []
        try:
            for name in names:
                try:
                    f = open(name, "rb")
                except FileNotFoundError:
                    continue  # the oldest, deleted by a rotation
                files.append(HeldFile(name, f, os.fstat(f.fileno()).st_size))
            if _names(path) == names and all(_same(h) for h in files):
                return Held(path, files)
        except BaseException:
            Held(path, files).close()
            raise
        Held(path, files).close()
    raise OSError(f"{path} is rotated again and again: its files could not be held at one "
                  f"moment")


def _same(held: HeldFile) -> bool:
    try:
        return os.stat(held.path).st_ino == os.fstat(held.file.fileno()).st_ino
    except FileNotFoundError:
        return False
