"""The three ways one log event becomes one line (the ``log_format`` key).

* ``text``: ``LEVEL system: message``, after the local time
  (``2026-11-25 20:39:27.123 INFO replication.protocol: ...``) unless
  journald, which adds its own, takes the lines.
* ``logfmt``: ``time=... level=info system=... msg="..."`` and the event's
  fields as ``key=value``.
* ``json``: one object per line: ``time`` (RFC 3339, milliseconds),
  ``level``, ``system``, ``message`` and the event's fields.

Whatever the format, an event is one line (a traceback is indented lines
after a text line; a ``traceback`` field in logfmt and JSON), its text is
printable (:func:`replicator.logs.printable.printable`), and no Python object repr
reaches it: Twisted's addresses read ``host:port``, ``<X object at 0x...>``
reads ``X``.
"""

import json
import math
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

from twisted.logger import LogEvent, LogLevel, formatEvent
from twisted.python.failure import Failure

from .printable import printable

FORMATS = ("text", "logfmt", "json")
#: The local time a ``text`` line starts with outside journald.
TEXT_TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} ")

#: Keys of an event that are not its fields: Twisted's own (``log_*``) and
#: those of a legacy ``twisted.python.log`` event.
_NOT_FIELDS = frozenset({"message", "format", "system", "time", "isError", "why", "failure",
                         "printed"})
#: Names the line itself uses: a field by one of these names is left out.
_RESERVED = frozenset({"time", "level", "system", "message", "msg", "traceback"})

_ADDRESS = re.compile(r"IPv([46])Address\(type='\w+', host='([^']*)', port=(\d+)(?:, [^)]*)?\)")
_UNIX = re.compile(r"UNIXAddress\((?:b?'([^']*)'|None)\)")
_OBJECT = re.compile(r"<(?:[\w.]+\.)?(\w+) object at 0x[0-9a-fA-F]+>")
_LOGFMT_PLAIN = re.compile(r"^[^\s=\"\\]+$")
_KEY_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


def _address(match: "re.Match[str]") -> str:
    host, port = match.group(2), match.group(3)
    return f"[{host}]:{port}" if match.group(1) == "6" else f"{host}:{port}"


def clean(text: str) -> str:
    """``text`` without object reprs (see the module), one printable line."""
    text = _ADDRESS.sub(_address, text)
    text = _UNIX.sub(lambda m: m.group(1) or "unix socket", text)
    text = _OBJECT.sub(r"\1", text)
    return printable(text.replace("\n", " "), limit=None)


#: Packages that group modules for maintainers, left out of a log line's
#: system so that operators' greps outlive a change of layout
#: (``replicator.replication.transport.protocol`` is ``replication.protocol``).
_LAYERS = re.compile(r"^(?:(replication)\.(?:transport|core|wire)\.|(?:observe|daemon|net)\.)")


def system(event: LogEvent) -> str:
    """Where an event comes from: its namespace without ``replicator.``, the
    grouping packages (:data:`_LAYERS`) and a class name at the end
    (``replication.protocol``); Twisted's own events are ``twisted``."""
    namespace = event.get("log_namespace") or "-"
    if namespace == "log_legacy" or namespace.startswith("twisted."):
        return "twisted"
    if namespace in ("__main__", "replicator.cli"):
        return "cli"
    if namespace.startswith("replicator."):
        namespace = _LAYERS.sub(lambda m: f"{m.group(1)}." if m.group(1) else "",
                                namespace[len("replicator."):])
    head, _, last = namespace.rpartition(".")
    if head and last[:1].isupper():
        namespace = head
    return namespace


def level(event: LogEvent) -> str:
    name: str = event.get("log_level", LogLevel.info).name
    return name


def message(event: LogEvent) -> str:
    return clean(formatEvent(event))


def _value(value: Any) -> Any:
    """A field's value as JSON takes it: numbers, booleans, None and text
    kept; anything else as its (cleaned) text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return printable(value, 1000)
    return clean(str(value))


def fields(event: LogEvent) -> dict[str, Any]:
    """The event's own fields (what its message was formatted from)."""
    out: dict[str, Any] = {}
    for key, value in event.items():
        if (key.startswith("log_") or key in _NOT_FIELDS or key in _RESERVED
                or isinstance(value, Failure) or not isinstance(key, str)):
            continue
        out[_KEY_CHARS.sub("_", key)] = _value(value)
    return out


def _traceback(event: LogEvent) -> str | None:
    failure: Failure | None = event.get("log_failure")
    return failure.getTraceback().rstrip("\n") if failure is not None else None


def _time(event: LogEvent, sep: str = "T", zone: bool = True) -> str:
    when = datetime.fromtimestamp(event.get("log_time") or 0).astimezone()
    text = when.isoformat(sep=sep, timespec="milliseconds")
    return text if zone else text[:23]


def text_line(event: LogEvent, with_time: bool) -> str:
    line = f"{level(event).upper()} {system(event)}: {message(event)}\n"
    if with_time:
        line = f"{_time(event, ' ', zone=False)} {line}"
    tb = _traceback(event)
    if tb is not None:
        line += "    " + tb.replace("\n", "\n    ") + "\n"
    return line


def _logfmt_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = value if isinstance(value, str) else str(value)
    if _LOGFMT_PLAIN.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def logfmt_line(event: LogEvent) -> str:
    pairs = [("time", _time(event)), ("level", level(event)), ("system", system(event)),
             ("msg", message(event))]
    pairs += list(fields(event).items())
    tb = _traceback(event)
    if tb is not None:
        pairs.append(("traceback", printable(tb, limit=None)))
    return " ".join(f"{k}={_logfmt_value(v)}" for k, v in pairs) + "\n"


def json_line(event: LogEvent) -> str:
    record = {"time": _time(event), "level": level(event), "system": system(event),
              "message": message(event)}
    record.update(fields(event))
    tb = _traceback(event)
    if tb is not None:
        record["traceback"] = tb
    return json.dumps(record, ensure_ascii=True, allow_nan=False, default=str) + "\n"


def formatter(name: str, with_time: bool = True) -> Callable[[LogEvent], str]:
    """The line maker of format ``name`` (one of :data:`FORMATS`); the
    time is left out of ``text`` lines when ``with_time`` is false."""
    if name == "text":
        return lambda event: text_line(event, with_time)
    if name == "logfmt":
        return logfmt_line
    if name == "json":
        return json_line
    raise ValueError(f"unknown log format {name!r}")
