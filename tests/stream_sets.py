"""Stream sets that several test modules run on, each named for the
tests it was made for: :data:`HANDLER_STREAMS` (the handler's: ``caches``
by master and worker1, ``events`` by master), :data:`WRITTEN_STREAMS`
(one ``caches`` of master's), :data:`HEALTH_STREAM_DEFS` (health's, as
configured).  Test modules take them from here, never from one another."""

from replicator.config import parse_streams

#: The handler tests' streams.
HANDLER_STREAMS = parse_streams([
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": ["master", "worker1"]},
    {"name": "events", "table": "event_stream",
     "columns": [{"event_id": "text"}], "writers": ["master"]},
])
#: The write path's tests' stream.
WRITTEN_STREAMS = parse_streams([{
    "name": "caches", "table": "cache_invalidations", "writers": ["master"],
    "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}],
}])
#: The health tests' streams, as configured (``STREAMS`` parsed there).
HEALTH_STREAM_DEFS = [
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"ts": "bigint"}], "writers": ["master"]},
    {"name": "events", "table": "event_stream",
     "columns": [{"event_id": "text"}], "writers": ["master", "worker2"]},
]
