"""The lines of a ``jsonl`` consumer's file (:mod:`.jsonl`): each encoded,
and parsed back when the file is opened or verified.

The JSON-lines file
-------------------

The operator's reference is ``docs/jsonl.md``.  One compact JSON object per
line, ``\n``-terminated, UTF-8, in the order facts arrived (ascending token
per (stream, writer); keys interleave)::

    {"stream":"caches","writer":"master","token":7,"rows":[["f",null,1]]}
    {"stream":"caches","writer":"master","position":9}
    {"stream":"caches","writer":"master","rewind":4}

A *fact line* has ``token`` and ``rows`` (a list of rows, each a list in the
stream's column order; possibly empty).  A *position line* has ``position``
and no ``rows``: the writer had nothing more up to that token.  It is written
only when it says something new: at most once after each of the key's facts
(the latest position the key reached before the next flush, once the key
advanced past that fact; an idle writer whose position moves with every
other writer's fact gets no line per move), and once per key at the top of
every new file (rotation), with the position it had reached.
A *rewind line* (``replicator rewind``) sets the key back to its token: the
facts after it follow again.  A *skip line* (``replicator rewind --skip-to``)
is a position line with a ``skip`` object (``from``, ``facts``,
``trimmed_through``, ``at``): the facts after ``from`` up to it were
skipped, ``facts`` of them still in the table then; ``"to": "boundary"``
in it (``--skip-to boundary``) says the operator accepted whatever
retention trims before the reader reads: until the key's position moves
again, a retention gap below it is skipped the same way by the daemon,
with another such line (:meth:`.jsonl.JsonlConsumer.accepted_gap`).  A
reader that only wants facts skips lines without ``"rows"``.

A fact's line is encoded ``ENCODE_SLICE`` rows per reactor turn at most
(:func:`sliced_fact_line`), a catch-up page's fact lines by one orjson call
where that gives the same bytes (:func:`fact_lines_at_once`).
"""

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from operator import itemgetter
from typing import Any

import orjson
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater

from ..jsontext import NonFiniteError, any_non_finite, encode_json, encode_json_line
from ..keys import Key
from .base import Row

_dumps = orjson.dumps

#: ``--skip-to boundary``: the stream's trim boundary when the skip is made.
BOUNDARY = "boundary"


def iso_time(ms: int) -> str:
    """``ms`` (since the epoch) as ISO 8601 UTC, as skip lines write it."""
    when = datetime.fromtimestamp(ms / 1000, UTC)
    text = when.strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{ms % 1000:03d}Z" if ms % 1000 else f"{text}Z"


def parse_line(line: bytes) -> tuple[Key | None, int | None, dict[str, Any] | None]:
    """``(key, token, obj)`` of one complete line of a JSON-lines file.

    ``token`` is the fact's token or the position; a blank line gives
    ``(None, None, None)``.  Raises ValueError for anything else.
    """
    if not line.strip():
        return None, None, None
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        try:
            obj = json.loads(line)  # what orjson does not read, like "\ud800"
        except ValueError:
            raise ValueError(f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    stream, writer = obj.get("stream"), obj.get("writer")
    if not isinstance(stream, str) or not isinstance(writer, str):
        raise ValueError("no stream and writer")
    if "rows" in obj:
        token = obj.get("token")
        if not isinstance(obj["rows"], list):
            raise ValueError("rows is not a list")
    elif "rewind" in obj:
        token = obj["rewind"]
    else:
        token = obj.get("position")
    if isinstance(token, bool) or not isinstance(token, int):
        raise ValueError("no integer token or position")
    return (stream, writer), token, obj


#: Rows of one fact encoded per reactor turn at most: a fact with more
#: takes several turns, the reactor running in between.
ENCODE_SLICE = 5000


async def sliced_fact_line(clock: IReactorTime, stream: str, writer: str, token: int,
                            rows: list[Row]) -> bytes:
    """``encode_json_line`` of the fact ``token`` (the same bytes), its
    rows encoded ``ENCODE_SLICE`` per turn of ``clock``.  What orjson
    refuses in a slice makes the whole line go through ``encode_json_line``
    at once (the standard library's ASCII output, for the whole line as
    there); ``NaN`` or an infinity raises as there."""
    fact = {"stream": stream, "writer": writer, "token": token, "rows": rows}
    if len(rows) <= ENCODE_SLICE:
        return encode_json_line(fact)
    parts = []
    for start in range(0, len(rows), ENCODE_SLICE):
        if start:
            await deferLater(clock, 0, lambda: None)
        part = rows[start:start + ENCODE_SLICE]
        try:
            data = _dumps(part)
        except TypeError:
            return encode_json_line(fact)
        if any_non_finite(part, data):
            raise NonFiniteError()
        parts.append(data[1:-1])
    head = encode_json({"stream": stream, "writer": writer, "token": token, "rows": []})
    return head[:-2] + b",".join(parts) + b"]}\n"


_ARRAYS = frozenset({list, tuple})
_first, _last = itemgetter(0), itemgetter(-1)


def fact_lines_at_once(stream: str, writer: str, facts: Sequence[tuple[int, list[Row]]]
                       ) -> bytes | None:
    """The fact lines of ``facts`` (in order, joined) from ONE orjson call, or
    None where that does not apply (then the caller encodes fact by fact, which
    also raises what :func:`.jsontext.encode_json` raises).

    orjson writes the facts' row lists as ``[[[r],...],[[r],...],...]``:
    inside the outer ``[[[`` and ``]]]``, every boundary between two facts
    is ``]],[[``, so the split there gives each fact's rows without their
    outer brackets exactly when it yields one part per fact (one more part:
    a value holds ``]],[[`` itself).  Then one bytes ``%`` formatting writes
    every line.  None too when a token is not an ``int``, a fact has no rows
    or its rows, first row or last row is not a list or tuple (those
    brackets would not be there), orjson refuses a value (an integer beyond
    64 bits...), or a value holds ``NaN``/``Infinity``.
    Measured on a catch-up page of 1,000 facts: 0.5 us a fact, against
    2.4 us for one :func:`.jsontext.encode_json_line` call each."""
    tokens, fact_rows = zip(*facts)
    if not (set(map(type, tokens)) == {int} and set(map(type, fact_rows)) <= _ARRAYS
            and all(fact_rows)
            and set(map(type, map(_first, fact_rows))) <= _ARRAYS
            and set(map(type, map(_last, fact_rows))) <= _ARRAYS):
        return None
    try:
        data = _dumps(fact_rows)
    except TypeError:
        return None
    parts = data[3:-3].split(b"]],[[")
    n = len(facts)
    if len(parts) != n or any_non_finite(fact_rows, data):
        return None
    prefix = encode_json({"stream": stream, "writer": writer})[:-1].replace(b"%", b"%%")
    args: list[object] = [None] * (2 * n)
    args[0::2] = tokens
    args[1::2] = parts
    return (prefix + b',"token":%d,"rows":[[%s]]}\n') * n % tuple(args)
