"""All streams of one instance, by name, loaded together at startup."""

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from twisted.logger import Logger

from ..config import StreamConfig
from ..config.model import ROW_INDEX_COLUMN
from ..storage import schema
from ..storage.database import Cursor, Database
from . import fence
from .stream import Stream

log = Logger()


class UnknownStream(KeyError):
    pass


class StreamRegistry:
    """The streams this instance knows, in config order.

    :meth:`start` creates missing tables (for streams with ``create`` that
    are written here: a stream only read here gets no DDL and no writes),
    checks the configured columns exist with types that hold them, and
    loads every stream's positions in one transaction.
    """

    def __init__(self, db: Database, instance_name: str, streams: Sequence[StreamConfig],
                 key_prefix: str = "streams", call_from_thread: Callable[..., Any] | None=None, *,
                 reactor: Any) -> None:
        self.db = db
        self.instance_name = instance_name
        #: The reactor every stream (and the handler over them) runs on.
        self.reactor = reactor
        if call_from_thread is None:
            call_from_thread = reactor.callFromThread
        self._call = call_from_thread
        self._streams: dict[str, Stream] = {
            s.name: Stream(s, db, instance_name, call_from_thread=call_from_thread,
                           clock=reactor)
            for s in streams
        }
        self._keys = {s.name: f"{key_prefix}[{i}]" for i, s in enumerate(streams)}

    async def start(self) -> None:
        added: list[str] = []
        await self.db.runInteraction(self._start_txn, added)
        self._said_added(added)
        for stream in self._streams.values():
            stream.started()

    def _start_txn(self, txn: Cursor, added: list[str]) -> None:
        streams = [s.config for s in self._streams.values()]
        written = {s.name for s in self._streams.values() if s.local_writers}
        has_positions = schema.ensure_schema(txn, streams, self.db.is_postgres, self._keys,
                                             written, added_row_index=added)
        for stream in self._streams.values():
            if stream.fenced:
                fence.install(txn, stream.config, self._keys[stream.name])
            stream.load(txn, has_positions)

    def _said_added(self, added: list[str]) -> None:
        for name in added:
            table = self.get(name).config.table
            log.info("stream {stream}: added column {column} to {table} (the order of a "
                     "fact's rows; rows written before hold 0 and keep their heap order)",
                     stream=name, column=ROW_INDEX_COLUMN, table=table)

    async def add(self, config: StreamConfig, key: str) -> Stream:
        """A stream new at a reload: its table created if it is written
        here (as at :meth:`start`), its positions loaded, then it is known."""
        stream = Stream(config, self.db, self.instance_name, call_from_thread=self._call,
                        clock=self.reactor)

        added: list[str] = []

        def txn(txn: Cursor) -> None:
            written = {config.name} if stream.local_writers else set()
            has_positions = schema.ensure_schema(txn, [config], self.db.is_postgres,
                                                 {config.name: key}, written,
                                                 added_row_index=added)
            if stream.fenced:
                fence.install(txn, config, key)
            stream.load(txn, has_positions)

        await self.db.runInteraction(txn)
        self._streams[config.name] = stream
        self._keys[config.name] = key
        self._said_added(added)
        stream.started()
        return stream

    async def change_writers(self, config: StreamConfig) -> Stream:
        """The running stream ``config.name`` takes ``config`` (other
        instances' writers added or dropped: :meth:`.Stream.change_writers`)."""
        stream = self.get(config.name)
        joining = [w for w in config.writers if w not in stream.config.writers]
        positions = (await self.db.runInteraction(stream.new_writer_positions, joining)
                     if joining else {})
        stream.change_writers(config, positions)
        return stream

    async def stop(self) -> None:
        for stream in self._streams.values():
            await stream.flush_positions()

    def get(self, name: str) -> Stream:
        try:
            return self._streams[name]
        except KeyError:
            raise UnknownStream(name) from None

    def find(self, name: str) -> Stream | None:
        return self._streams.get(name)

    def __iter__(self) -> Iterator[Stream]:
        return iter(self._streams.values())

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, name: str) -> bool:
        return name in self._streams
