"""File modes of what the daemon creates, and the check of secret files.

Secrets are ``0600`` and data (SQLite files, JSON-lines output) ``0640``,
directories ``0750``: :func:`restrict_umask` makes that the floor for
everything the process creates, and the creators pass these modes explicitly
as well, so a library or test that runs without the daemon's umask gets the
same files.  A secret file others can read is reported with a warning
(:func:`warn_if_exposed`), never refused: the operator decides.
"""

import os
import stat

from twisted.logger import Logger

log = Logger()

#: Bits the process never grants: nothing for others, no write for the group.
UMASK = 0o027
DATA_MODE = 0o640
DIRECTORY_MODE = 0o750


def restrict_umask() -> int:
    """Add :data:`UMASK` to the process umask (never loosening it); returns
    the previous umask."""
    old = os.umask(UMASK)
    os.umask(old | UMASK)
    return old


def make_directory(path: str) -> None:
    """``path`` and its parents, created ``0750`` (existing ones untouched)."""
    os.makedirs(path, mode=DIRECTORY_MODE, exist_ok=True)


def create_data_file(path: str) -> bool:
    """Create ``path`` empty with :data:`DATA_MODE` if it does not exist;
    True if it was created.  An existing file keeps its mode."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, DATA_MODE)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def readable_by_others(path: str) -> int | None:
    """The permission bits of ``path`` if users other than its owner and
    group may read it, else None (also when it cannot be examined)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
    return mode if mode & stat.S_IROTH else None


def warn_if_exposed(path: str | None, key: str) -> bool:
    """Log a warning if the secret file ``path`` (configured under ``key``)
    is readable by every user; True if it was."""
    if not path:
        return False
    mode = readable_by_others(path)
    if mode is None:
        return False
    log.warn("{key}: secret file {path} is readable by every user (mode {mode}); "
             "make it private: chmod 600 {path}", key=key, path=path, mode=f"{mode:04o}")
    return True
