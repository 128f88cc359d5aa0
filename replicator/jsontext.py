"""Compact JSON text: the one JSON encoder of the project, and the
decoder of what clients send (:func:`decode_json_strict`).

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

A client's JSON is decoded by :func:`decode_json_strict`: orjson's values,
but an object with a key given twice is refused (orjson, like the standard
library, would silently keep the last one).  Peer JSON of the line protocol
is decoded by the standard library with :func:`unique_object` as its
``object_pairs_hook`` (:mod:`replicator.replication.wire.parsing`).
"""

import json
from collections.abc import Iterable
from typing import Any

import orjson

_dumps = orjson.dumps
_loads = orjson.loads
_SCALARS = frozenset({str, int, bool, type(None)})


class DuplicateKeyError(ValueError):
    """A JSON object gives the same key twice (``key``, decoded)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key[:60]!r}" + ("..." if len(key) > 60 else ""))
        self.key = key


def unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The dict of a decoded object's ``pairs``; :class:`DuplicateKeyError`
    if a key comes twice (an ``object_pairs_hook`` of the standard
    library's decoder)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return obj


_check_decoder = json.JSONDecoder(object_pairs_hook=unique_object)
#: The escapes of ``:`` in a JSON string (``\u`` is lower case in JSON).
_COLON_ESCAPES = (b"\\u003a", b"\\u003A")


def decode_json_strict(data: bytes) -> Any:
    """The value of the JSON text ``data`` (orjson's), refusing an object
    that gives a key twice, at any depth.

    Raises ``ValueError``: ``orjson.JSONDecodeError`` for what is not JSON,
    :class:`DuplicateKeyError` (naming the first key given twice) for a
    repeated key, a plain ``ValueError`` for text nested too deep to check.

    How duplicates are seen at C speed: outside strings a ``:`` appears
    once per object member, and orjson writes every ``:`` of a string as
    it is.  So unless ``data`` spells a colon as ``\\u003a``, its colons
    are its members plus the colons of its strings, and orjson's encoding
    of the decoded value has as many exactly when no member was dropped;
    a repeated key drops one (with its strings' colons), so there are
    fewer.  Two ``bytes.count`` and one ``orjson.dumps``; only a text with
    such an escape, or nested deeper than orjson encodes (254 levels), or
    a refused one (to name the key) is decoded again by the standard
    library with :func:`unique_object`.
    """
    value = _loads(data)
    colons = data.count(b":")
    if colons < 2:
        return value  # at most one member: nothing can repeat
    if _COLON_ESCAPES[0] not in data and _COLON_ESCAPES[1] not in data:
        try:
            again = _dumps(value)
        except TypeError:  # orjson.JSONEncodeError: nested too deep for it
            pass
        else:
            if again.count(b":") == colons:
                return value
    try:
        _check_decoder.decode(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deep to check for duplicate keys") from None
    return value


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
