"""The read API: any program reads a stream over HTTP (docs/read-api.md).

* :mod:`.tokens`: resume tokens (every writer's position, versioned).
* :mod:`.auth`: read credentials scoped to streams.
* :mod:`.params`: the query parameters, checked.
* :mod:`.pages`: one page of facts, never past what is safe; final pages.
* :mod:`.persisted`: the persisted linear position (what is final for good).
* :mod:`.watch`: waking readers when a stream's positions move.
* :mod:`.source`: what the read API reads (a stream, or a view of one).
* :mod:`.live`: new facts read and encoded once for every event stream.
* :mod:`.sse`: one event stream (Server-Sent Events), live or catching up.
* :mod:`.book`: readers' positions and lag; the cap on open reads.
* :mod:`.routes`: the routes.
* :mod:`.direct`: event-stream bytes written straight to a client's socket.
* :mod:`.builds`: page builds bounded per address.
* :mod:`.durable`: every stream read as a Durable Stream (the open protocol).
"""
