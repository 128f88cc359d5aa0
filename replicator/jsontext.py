"""Compact JSON text: the one JSON encoder of the project.

Every JSON the daemon writes (command lines, RDATA rows, HTTP bodies, the
JSON-lines consumer's file, log previews) comes from here, so it is the same
everywhere:

* compact (no spaces) and newline-free; non-ASCII as raw UTF-8;
* orjson for speed; what orjson refuses (integers beyond 64 bits, lone
  surrogates, subclasses of ``tuple``, non-string keys) is encoded by the
  standard library with ASCII escapes (valid UTF-8 too; it writes
  non-string keys as strings);
* ``NaN`` and ``±Infinity`` are refused (``ValueError``), as the decoders of
  peer input refuse them: orjson would silently write ``null``, which is a
  different value.  Checking costs one substring search of the output; the
  value is walked only when the output contains ``null``.
"""

import json
from typing import Any, Iterable

import orjson

_dumps = orjson.dumps
_SCALARS = frozenset({str, int, bool, type(None)})


class NonFiniteError(ValueError):
    """A value holds ``NaN`` or an infinity, which JSON cannot carry."""

    def __init__(self) -> None:
        super().__init__("NaN and Infinity are not valid JSON")


def non_finite(value: Any) -> bool:
    """Whether ``value`` (nested lists, tuples, dicts) holds a float that is
    ``NaN`` or infinite.  Iterative: any depth."""
    stack = [value]
    pop, extend = stack.pop, stack.extend
    while stack:
        v = pop()
        t = type(v)
        if t in _SCALARS:
            continue
        if t is list or t is tuple:
            extend(v)
        elif t is dict:
            extend(v.values())
        elif isinstance(v, float):
            if v - v != 0.0:  # NaN - NaN and inf - inf are NaN
                return True
        elif isinstance(v, (list, tuple)):
            extend(v)
        elif isinstance(v, dict):
            extend(v.values())
    return False


def _fallback(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("ascii")


def encode_json(value: Any) -> bytes:
    """Compact, newline-free JSON bytes for ``value``.

    Raises ``ValueError`` for ``NaN``/``±Infinity`` and ``TypeError`` (or
    ``ValueError``, e.g. a circular reference) for what is not JSON.
    The result is orjson's own output buffer (about 4 KB however short):
    for immediate use or concatenation, not to be kept by the thousand.
    """
    try:
        data = _dumps(value)
    except TypeError:
        return _fallback(value)
    if b"null" in data and non_finite(value):
        raise NonFiniteError()
    return data


def kept(data: bytes) -> bytes:
    """``data`` (orjson's output) as a bytes object of its own size, for
    JSON that is kept: orjson's holds its whole output buffer, 4 KB for a
    short text and up to about 15 times the length of a long one."""
    return b"%b" % data


def encode_json_line(value: Any) -> bytes:
    """:func:`encode_json` followed by ``b"\\n"``.

    Never orjson's ``OPT_APPEND_NEWLINE``: with it orjson returns its whole
    output buffer (about 4 KB, whatever the length), and lines are kept (a
    JSON-lines consumer buffers a catch-up page until its flush); the
    concatenation makes a bytes object of the line's own size."""
    return encode_json(value) + b"\n"


def any_non_finite(values: Iterable[Any], encoded: bytes) -> bool:
    """Whether any of ``values``, whose JSON encodings are all in
    ``encoded`` (orjson's), holds ``NaN`` or an infinity: a substring search
    of ``encoded``, and a walk of the values only if it contains ``null``."""
    return b"null" in encoded and any(map(non_finite, values))


def preview_json(value: Any) -> str:
    """JSON text of ``value`` for a log line: never raises (what is not JSON
    is shown by its ``repr``; ``NaN`` as ``NaN``); non-ASCII kept."""
    try:
        return encode_json(value).decode("utf-8")
    except (TypeError, ValueError):
        pass
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=repr)
    except (TypeError, ValueError, RecursionError):  # a circular or too deep value
        return repr(value)
