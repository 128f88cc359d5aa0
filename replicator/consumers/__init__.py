"""What a reader does with facts: the consumer interface and the built-ins.

A consumer receives every committed fact of the streams it reads exactly
once, in ascending token order per (stream, writer), each multi-row fact
whole.  It reports what it has *durably* handled through
:meth:`Consumer.positions`; after a restart the reader resumes from there, so
a consumer that persists its positions sees no fact twice and misses none.

Methods may return a Deferred or a coroutine: the reader waits for it
before handing over the next fact of the same (stream, writer).

Built-ins (also registered as entry points of the ``replicator.consumers``
group, see :func:`load_consumers`), one module each:

* :class:`JsonlConsumer` (``jsonl``) appends facts to a JSON-lines file
  (rotated by size or age, or by ``logrotate``) and resumes exactly from the
  positions a state file beside it keeps.
* :class:`LogConsumer` (``log``) logs one line per fact; always live.
* :class:`MemoryConsumer` keeps facts in a list (tests, debugging).

:mod:`.base` holds the interface (:class:`IConsumer`; a consumer that
also takes a catch-up page at once, ``on_facts_many``, declares
:class:`IBatchConsumer`), :mod:`.loading` builds consumers from the
configuration (built-ins, entry points, dotted paths).

The JSON-lines format is described in :mod:`.jsonl` and ``docs/jsonl.md``;
``replicator rewind`` and ``replicator verify`` are :mod:`.jsonl_commands`
(the comparison: :mod:`.jsonl_verify`, over the files as
:mod:`.jsonl_held` holds them at one moment).
"""

from .base import Consumer, IBatchConsumer, IConsumer, MemoryConsumer
from .file_thread import FileThread, run_inline
from .jsonl import JsonlConsumer, JsonlError
from .jsonl_lines import parse_line
from .loading import ENTRY_POINT_GROUP, load_consumers
from .log import LogConsumer, preview

__all__ = ["Consumer", "IBatchConsumer", "IConsumer", "MemoryConsumer", "FileThread",
           "JsonlConsumer", "JsonlError", "parse_line", "run_inline", "ENTRY_POINT_GROUP",
           "load_consumers", "LogConsumer", "preview"]
