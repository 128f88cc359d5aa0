"""Logging to stdout, one line per event, in the configured ``log_format``
(:mod:`replicator.logs.formats`), without Twisted's lines that repeat ours
(:mod:`replicator.logs.twisted_lines`).  Untrusted text in an event goes
through :func:`replicator.logs.printable.printable`.
"""

import os
import sys
from collections.abc import Callable, Mapping
from typing import IO

from twisted.logger import (
    FilteringLogObserver,
    ILogObserver,
    LogEvent,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
)
from zope.interface import provider

from .printable import printable


def under_journald(stream: IO[str], environ: Mapping[str, str]) -> bool:
    """Whether ``stream`` is journald's: systemd sets ``JOURNAL_STREAM`` to
    the ``device:inode`` of the stream it connected stdout to (a stream
    redirected elsewhere by hand, or a child's, is not journald's)."""
    value = environ.get("JOURNAL_STREAM")
    if not value:
        return False
    try:
        device, inode = (int(part) for part in value.split(":"))
        stat = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return True  # set, but not checkable: trust it
    return (stat.st_dev, stat.st_ino) == (device, inode)


def _observer(stream: IO[str], line: Callable[[LogEvent], str]) -> ILogObserver:
    """Writes each event kept by :func:`.twisted_lines.keep` as ``line(event)``."""
    from .twisted_lines import keep

    @provider(ILogObserver)
    def observe(event: LogEvent) -> None:
        if not keep(event):
            return
        try:
            text = line(event)
        except Exception as e:  # a field that cannot be shown: say so
            text = f"ERROR logs: cannot format an event: {printable(e)}\n"
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):
            pass
    observer: ILogObserver = observe  # (a function that provides it)
    return observer


def start_logging(level: str = "info", log_format: str = "text",
                  stream: IO[str] | None = None,
                  environ: Mapping[str, str] | None = None) -> None:
    """Send every event at ``level`` or above to ``stream`` (stdout) as
    ``log_format`` lines (:mod:`replicator.logs.formats`): ``text`` lines carry
    the time unless journald (which adds its own) reads ``stream``."""
    from .formats import formatter

    stream = stream or sys.stdout
    environ = os.environ if environ is None else environ
    with_time = not under_journald(stream, environ)
    lines = {"line": formatter(log_format, with_time=with_time)}
    predicate = LogLevelFilterPredicate(defaultLogLevel=LogLevel.levelWithName(level))
    observer = FilteringLogObserver(_observer(stream, lambda event: lines["line"](event)),
                                    [predicate])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)

    def change(level: str, log_format: str) -> None:
        predicate.setLogLevelForNamespace("", LogLevel.levelWithName(level))
        lines["line"] = formatter(log_format, with_time=with_time)

    _live["change"] = change


#: How the logging :func:`start_logging` began is changed (a reload).
_live: dict[str, Callable[[str, str], None]] = {}


def change_logging(level: str, log_format: str) -> bool:
    """Log at ``level`` as ``log_format`` lines from now on (a reload);
    False if :func:`start_logging` has not run in this process."""
    change = _live.get("change")
    if change is None:
        return False
    change(level, log_format)
    return True
