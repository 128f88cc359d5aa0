"""What the read API reads: a stream, or a view of one with the same
attributes (a Durable Stream created over HTTP,
:class:`.durable_paths.PathView`)."""

from typing import Protocol

from ...config.model import StreamConfig
from ...storage.database import Database
from ...streams.idgen import StreamIdGenerator


class Readable(Protocol):
    """A stream as the read API's pages, long-polls and waits see it."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> StreamConfig: ...

    @property
    def db(self) -> Database: ...

    @property
    def id_gen(self) -> StreamIdGenerator: ...

    async def sequence_value(self) -> int: ...
