"""All streams of one instance, by name, loaded together at startup."""

from typing import Dict, Iterator, Optional, Sequence

from ..config import StreamConfig
from ..storage import schema
from ..storage.database import Database
from .stream import Stream


class UnknownStream(KeyError):
    pass


class StreamRegistry:
    """The streams this instance knows, in config order.

    :meth:`start` creates missing tables (for streams with ``create`` that
    are written here: a stream only read here gets no DDL and no writes),
    checks the configured columns exist, and loads every stream's positions
    in one transaction.
    """

    def __init__(self, db: Database, instance_name: str, streams: Sequence[StreamConfig],
                 key_prefix: str = "streams", call_from_thread=None, *, reactor):
        self.db = db
        self.instance_name = instance_name
        #: The reactor every stream (and the handler over them) runs on.
        self.reactor = reactor
        if call_from_thread is None:
            call_from_thread = reactor.callFromThread
        self._streams: Dict[str, Stream] = {
            s.name: Stream(s, db, instance_name, call_from_thread=call_from_thread,
                           clock=reactor)
            for s in streams
        }
        self._keys = {s.name: f"{key_prefix}[{i}]" for i, s in enumerate(streams)}

    async def start(self) -> None:
        await self.db.runInteraction(self._start_txn)
        for stream in self._streams.values():
            stream.started()

    def _start_txn(self, txn) -> None:
        streams = [s.config for s in self._streams.values()]
        written = {s.name for s in self._streams.values() if s.local_writers}
        has_positions = schema.ensure_schema(txn, streams, self.db.is_postgres, self._keys,
                                             written)
        for stream in self._streams.values():
            stream.load(txn, has_positions)

    async def stop(self) -> None:
        for stream in self._streams.values():
            await stream.flush_positions()

    def get(self, name: str) -> Stream:
        try:
            return self._streams[name]
        except KeyError:
            raise UnknownStream(name) from None

    def find(self, name: str) -> Optional[Stream]:
        return self._streams.get(name)

    def __iter__(self) -> Iterator[Stream]:
        return iter(self._streams.values())

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, name: str) -> bool:
        return name in self._streams
