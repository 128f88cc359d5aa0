"""The key everything about one writer of one stream is kept under.

A stream's table holds the facts of every writer of it, each writer with
its own sequence of IDs; so a position, a reader, its lag, a consumer's
progress, a health finding and a metric series all belong to one
``(stream, writer)`` pair: a :data:`Key`.  It is declared here, on the
ground floor, so that the streams, the consumers, the replication core and
what observes them name it the same way without importing each other.
"""


#: ``(stream, writer)``: the stream's name and the writer's instance name.
Key = tuple[str, str]
