"""The master's bookkeeping (:mod:`replicator.replication.core.bookkeeping`)
read over HTTP, paged (secret required: user IDs and IP addresses are
personal): ``GET .../federation_acks``, ``.../user_syncs``, ``.../user_ips``.

A table may hold a hundred thousand entries; answering all of them at once
held the reactor for most of a second.  An answer is therefore a page: at
most ``limit`` entries in key order after the ``from`` cursor, plus the
cursor of the next page (``null`` on the last one).  Following ``next``
from the first page visits every entry that existed throughout, once, in
order.

:func:`build_page` runs in a thread (``deferToThread``), never on the
reactor: it copies the table's keys with one C-level call (atomic under the
GIL, so the reactor thread's updates never break it), then filters and
selects in Python, which yields the GIL to the reactor as it goes; the
handler's tables are only read there, never iterated on the reactor.  An
entry removed meanwhile is skipped.  The page is encoded there too
(peer-given text may hold lone surrogates: they are escaped, never refused).
"""

import base64
import heapq
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from twisted.internet import threads

from ..jsontext import encode_json
from ..replication.interfaces import IReplicationView
from .answers import JSON_TYPE, HttpError, Response, authorize

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


def sort_key(key: Sequence[str | None]) -> tuple[Any, ...]:
    """A total order over keys whose parts may be None (None first)."""
    out: list[Any] = []
    for part in key:
        out.extend((part is not None, part or ""))
    return tuple(out)


def build_page(keys: Callable[[], Iterable[tuple[Any, ...]]],
               lookup: Callable[[tuple[Any, ...]], Any],
               render: Callable[[list[tuple[tuple[Any, ...], Any]]], dict[str, Any]], limit: int,
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


class BookkeepingRoutes:
    """The three paged bookkeeping tables of ``handler``."""

    def __init__(self, handler: IReplicationView, secret: bytes | None) -> None:
        self.handler = handler
        self._secret = secret

    async def _page(self, request: Any, keys: Callable[[], list[tuple[Any, ...]]],
                    lookup: Callable[[tuple[Any, ...]], Any],
                    render: Callable[[list[tuple[Any, Any]]], dict[str, Any]],
                    width: int) -> Response:
        authorize(request, self._secret)
        try:
            limit, cursor = page_args(request.args)
            body = await threads.deferToThread(build_page, keys, lookup, render, limit,
                                               cursor, width)
        except PageError as e:
            raise HttpError(400, str(e)) from None
        return Response(body, JSON_TYPE)

    async def user_syncs(self, request: Any) -> Response:
        handler = self.handler

        def keys() -> list[tuple[Any, ...]]:
            return [(instance, user, device)
                    for instance, users in list(handler.user_syncs.items())
                    for (user, device) in list(users)]

        def lookup(key: tuple[Any, ...]) -> Any:
            return handler.user_syncs.get(key[0], {}).get(key[1:])

        def render(entries: list[tuple[Any, Any]]) -> dict[str, Any]:
            out: dict[str, list[dict[str, Any]]] = {}
            for (instance, user, device), ms in entries:
                out.setdefault(instance, []).append(
                    {"user_id": user, "device_id": device, "last_sync_ms": ms})
            return {"user_syncs": out}

        return await self._page(request, keys, lookup, render, 3)

    async def federation_acks(self, request: Any) -> Response:
        acks = self.handler.federation_acks
        return await self._page(
            request, lambda: [(instance,) for instance in list(acks)],
            lambda key: acks.get(key[0]),
            lambda entries: {"acks": {key[0]: token for key, token in entries}}, 1)

    async def user_ips(self, request: Any) -> Response:
        handler = self.handler

        def render(entries: list[tuple[Any, Any]]) -> dict[str, Any]:
            return {"user_ips": [
                {"user_id": user, "device_id": device, "ip": seen.get("ip"),
                 "user_agent": seen.get("user_agent"), "last_seen": seen.get("last_seen")}
                for (user, device), seen in entries]}

        return await self._page(request, lambda: list(handler.user_ips),
                                lambda key: handler.user_ips.get(key), render, 2)
