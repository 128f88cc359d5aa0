"""Logging to stdout, one line per event (journald adds the time).

Format: ``LEVEL namespace: message``; a failure's traceback follows on
indented lines so journald keeps it with its event.
"""

import sys

from twisted.logger import (
    FilteringLogObserver, LogLevel, LogLevelFilterPredicate, formatEvent,
    globalLogBeginner,
)


def _observer(stream):
    def observe(event):
        level = event.get("log_level", LogLevel.info).name.upper()
        namespace = event.get("log_namespace", "-")
        if namespace.startswith("replicator."):
            namespace = namespace[len("replicator."):]
        text = formatEvent(event).replace("\n", " ")
        failure = event.get("log_failure")
        line = f"{level} {namespace}: {text}\n"
        if failure is not None:
            tb = failure.getTraceback().rstrip("\n").replace("\n", "\n    ")
            line += f"    {tb}\n"
        try:
            stream.write(line)
            stream.flush()
        except (OSError, ValueError):
            pass
    return observe


def start_logging(level: str = "info", stream=None) -> None:
    """Send every event at ``level`` or above to ``stream`` (stdout)."""
    predicate = LogLevelFilterPredicate(defaultLogLevel=LogLevel.levelWithName(level))
    observer = FilteringLogObserver(_observer(stream or sys.stdout), [predicate])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
