"""The fields of a command line: splitting, integers, names, JSON.

What every command class parses its line with.  Everything malformed is a
:class:`CommandParseError` whose text is short and on one line (values
quoted and cut), never Python's own error for an odd input (over-long
integer strings, deep JSON).  JSON of peer input is decoded by the standard
library, so integers of any size round-trip exactly, and ``NaN``,
``Infinity`` and out-of-range floats are refused (the encoder,
:mod:`replicator.jsontext`, refuses them too), and so is an object that
gives a key twice (:func:`replicator.jsontext.unique_object`).
"""

import json
import math
from typing import Any

from ...jsontext import unique_object

_EXCERPT = 80


class CommandParseError(Exception):
    """A line that is not a valid command.

    ``str()`` is a short, single-line description (values quoted and cut to
    a few dozen characters) meant to follow ``ERROR failed to parse line: ``.
    """


def excerpt(text: str) -> str:
    if len(text) > _EXCERPT:
        return repr(text[:_EXCERPT]) + "..."
    return repr(text)


#: The largest stream token or other integer field: a 63-bit integer, as
#: in a PostgreSQL ``bigint`` sequence.
MAX_INTEGER = 2**63 - 1
_MAX_DIGITS = len(str(MAX_INTEGER))


def parse_int(text: str, what: str) -> int:
    """A decimal integer from 0 to :data:`MAX_INTEGER`, ASCII digits only
    (no sign).  The length is checked before conversion, so a number of any
    size is a :class:`CommandParseError`, never Python's ``ValueError`` for
    over-long integer strings."""
    if not (text.isascii() and text.isdigit()):
        raise CommandParseError(f"{what} is not an integer: {excerpt(text)}")
    if len(text) > _MAX_DIGITS or int(text) > MAX_INTEGER:
        raise CommandParseError(f"{what} is out of range (0 to 2**63-1): {excerpt(text)}")
    return int(text)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:_EXCERPT]}")
    return value


_decoder = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_parse_float,
                            object_pairs_hook=unique_object)


def decode_json(text: str, what: str) -> Any:
    """Decode one JSON value of a command, or raise :class:`CommandParseError`."""
    try:
        return _decoder.decode(text)
    except (ValueError, RecursionError) as e:
        # JSONDecodeError is a ValueError; its message is short and one line.
        raise CommandParseError(f"invalid JSON in {what}: {excerpt(str(e))}") from None


#: What one decoded JSON value costs at least, with its reference from its
#: container (an empty list is 56 bytes + 8, a small int 28 + 8, a short
#: string 50 + 8): the unit of :func:`decoded_size`.
DECODED_VALUE = 48
#: What a decoded JSON object costs on top of its values (its hash table).
DECODED_OBJECT = 184
#: The most :func:`decoded_size` can be per byte of text (a ``{``).
MAX_DECODED_PER_BYTE = 1 + DECODED_VALUE + DECODED_OBJECT


def decoded_size(text: bytes) -> int:
    """About how many bytes of memory ``text`` (JSON, or lines holding
    JSON) takes once decoded: its length, plus :data:`DECODED_VALUE` per
    value and :data:`DECODED_OBJECT` per object.  A value is counted at each
    ``,``, ``[``, ``{`` and ``:`` (those in strings too: an over-estimate,
    never an under-estimate of a text's own cost), so ``[[],[],...]``, 3
    bytes a value on the wire and some 60 in memory, counts for what it is.
    Runs at C speed (``bytes.count``): cheap enough for every line."""
    count = text.count
    braces = count(b"{")
    return (len(text) + DECODED_VALUE * (count(b",") + count(b"[") + braces + count(b":") + 1)
            + DECODED_OBJECT * braces)


def split_fields(rest: str, count: int, fields: str) -> list[str]:
    """Split ``rest`` into exactly ``count`` space-separated fields; the last
    one keeps any further spaces."""
    parts = rest.split(" ", count - 1)
    if len(parts) != count:
        raise CommandParseError(f"expected {fields}, got {len(parts)} field(s)")
    return parts


def need(value: str, what: str) -> str:
    if not value:
        raise CommandParseError(f"empty {what}")
    return value


def need_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise CommandParseError(f"{what} is not a string")
    return value
