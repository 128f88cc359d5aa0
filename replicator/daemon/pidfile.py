"""The running daemon's PID file (``pid_file``): how ``replicator reopen``
finds the process to signal.

:func:`hold` writes the PID and keeps the file open with an exclusive
``flock`` for the life of the process; :meth:`PidFile.release` removes it
at a clean stop.  The lock, not the file's presence, is what says a daemon
runs: a file left by a killed process is not locked, so :func:`running`
refuses it instead of signalling whatever process has that PID now (the
default action of SIGUSR1 is to end a process), and a second daemon with the
same ``pid_file`` is refused at its start.

Both run before the reactor does or in a command-line tool: the blocking
calls are on no reactor thread.
"""

import fcntl
import os

from .. import files


class PidFileError(Exception):
    """The PID file cannot be held, or names no running daemon (the
    message says which, naming the file)."""


class PidFile:
    """The held PID file of this process."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = fd

    def release(self) -> None:
        """Remove the file (still locked, so no reader takes it as running)."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1


def hold(path: str) -> PidFile:
    """Create or take over ``path``, lock it and write this process's PID."""
    path = os.path.abspath(path)
    try:
        files.make_directory(os.path.dirname(path))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, files.DATA_MODE)
    except OSError as e:
        raise PidFileError(f"pid_file: cannot create {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = _read(fd)
        os.close(fd)
        raise PidFileError(f"pid_file: {path} is held by another running daemon"
                           f"{f' (PID {other})' if other else ''}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return PidFile(path, fd)


def running(path: str) -> int:
    """The PID of the daemon holding ``path``; :class:`PidFileError` if no
    daemon holds it (missing, or left by a process that is gone)."""
    path = os.path.abspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PidFileError(f"pid_file: {path} does not exist: is the daemon running?") from None
    except OSError as e:
        raise PidFileError(f"pid_file: cannot read {path}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read(fd)
            if pid is None:
                raise PidFileError(f"pid_file: {path} holds no PID") from None
            return pid
        raise PidFileError(f"pid_file: {path} is not held by a running daemon (left by one "
                           f"that stopped without removing it)")
    finally:
        os.close(fd)


def _read(fd: int) -> int | None:
    text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() and 0 < int(text) < 1 << 31 else None
