"""Paged listings of the master's bookkeeping tables for the HTTP API.

A table (USER_IP, USER_SYNC, FEDERATION_ACK) may hold a hundred thousand
entries; answering all of them at once held the reactor for most of a
second.  A listing is therefore a page: at most ``limit`` entries in key
order after the ``from`` cursor, plus the cursor of the next page (``null``
on the last one).  Following ``next`` from the first page visits every entry
that existed throughout, once, in order.

:func:`build_page` runs in a thread (``deferToThread``), never on the
reactor: it copies the table's keys with one C-level call (atomic under the
GIL, so the reactor thread's updates never break it), then filters and
selects in Python, which yields the GIL to the reactor as it goes.  An entry
removed meanwhile is skipped.  The page is encoded there too (peer-given
text may hold lone surrogates: they are escaped, never refused).
"""

import base64
import heapq
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..jsontext import encode_json

#: Entries per page unless ``limit`` says otherwise, and the most it may say.
#: The bound keeps each C-level step (the final sort of a page, its
#: encoding), which holds the GIL and so the reactor, to a few milliseconds
#: (measured: a 10,000-entry page held it up to 200 ms on a loaded machine).
DEFAULT_LIMIT = 1000
MAX_LIMIT = 1000
#: A cursor longer than this is not one of ours.
MAX_CURSOR = 4096


class PageError(ValueError):
    """A bad ``limit`` or ``from``; the text says which (a 400)."""


def page_args(args: dict[bytes, list[bytes]]) -> tuple[int, bytes | None]:
    """``(limit, from)`` of a request's query arguments."""
    limit = DEFAULT_LIMIT
    values = args.get(b"limit")
    if values:
        text = values[0]
        if not (text.isdigit() and len(text) <= 6 and 1 <= int(text) <= MAX_LIMIT):
            raise PageError(f"limit must be an integer from 1 to {MAX_LIMIT}")
        limit = int(text)
    cursor = None
    values = args.get(b"from")
    if values and values[0]:
        cursor = values[0]
        if len(cursor) > MAX_CURSOR:
            raise PageError("from is not a cursor from a previous page's next")
    return limit, cursor


def encode_cursor(key: Sequence[str | None]) -> str:
    return base64.urlsafe_b64encode(encode_json(list(key))).decode("ascii").rstrip("=")


def decode_cursor(cursor: bytes, width: int) -> tuple[str | None, ...]:
    """The key a cursor stands for: ``width`` strings (None allowed after
    the first); anything else is a :class:`PageError`."""
    bad = PageError("from is not a cursor from a previous page's next")
    try:
        # The standard library's parser: peer-given names may hold lone
        # surrogates, which encode_json escapes and orjson would refuse.
        key = json.loads(base64.urlsafe_b64decode(cursor + b"=" * (-len(cursor) % 4)))
    except (ValueError, TypeError, RecursionError):
        raise bad from None
    if not (isinstance(key, list) and len(key) == width and isinstance(key[0], str)
            and all(part is None or isinstance(part, str) for part in key)):
        raise bad
    return tuple(key)


def sort_key(key: Sequence[str | None]) -> tuple:
    """A total order over keys whose parts may be None (None first)."""
    out: list[Any] = []
    for part in key:
        out.extend((part is not None, part or ""))
    return tuple(out)


def build_page(keys: Callable[[], Iterable[tuple]], lookup: Callable[[tuple], Any],
               render: Callable[[list[tuple[tuple, Any]]], dict], limit: int,
               cursor: bytes | None, width: int) -> bytes:
    """One page as the encoded JSON answer (a line ending in ``\\n``).

    ``keys()`` lists the table's keys (a C-level copy), ``lookup(key)`` gives
    an entry or None if it is gone, ``render(entries)`` the answer's object
    without ``next``.  Raises :class:`PageError` for a bad cursor.
    """
    after = sort_key(decode_cursor(cursor, width)) if cursor is not None else None
    candidates = (k for k in keys() if after is None or sort_key(k) > after)
    # One more than the page, to know whether there is a next one.
    chosen = heapq.nsmallest(limit + 1, candidates, key=sort_key)
    more = len(chosen) > limit
    entries = []
    for key in chosen[:limit]:
        value = lookup(key)
        if value is not None:
            entries.append((key, value))
    answer = render(entries)
    answer["next"] = encode_cursor(chosen[limit - 1]) if more else None
    return encode_json(answer) + b"\n"
