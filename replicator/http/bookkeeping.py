"""The master's bookkeeping, read over HTTP (secret required: user IDs and
IP addresses are personal): ``GET .../federation_acks``, ``.../user_syncs``,
``.../user_ips``.

Each is paged (:mod:`replicator.http.listing`) and each page is built and encoded in
a thread: the handler's tables are only read there, by C-level copies,
never iterated on the reactor.
"""

from collections.abc import Callable
from typing import Any

from twisted.internet import threads

from ..replication.interfaces import IReplicationView
from . import listing as pages
from .answers import JSON_TYPE, HttpError, Response, authorize


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
            limit, cursor = pages.page_args(request.args)
            body = await threads.deferToThread(pages.build_page, keys, lookup, render, limit,
                                               cursor, width)
        except pages.PageError as e:
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
