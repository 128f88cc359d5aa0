#!/usr/bin/env python3
"""A Server-Sent Events client for the read API benchmark, as cheap as
``reader.py`` is for TCP: one process holds ``--sockets`` connections
(plain sockets multiplexed with ``selectors``), each a
``GET <path>`` (HTTP/1.0, so the body is the event stream itself, not
chunked) with ``Authorization: Bearer <secret>``.

Once every connection has its ``200`` header it prints ``{"ready": n}``.
Then, per connection:

``count``
    Count events (``event: fact`` lines, straddling ``recv`` boundaries
    included) and note the wall-clock time of the last ``recv`` that
    brought any.
``latency``
    Split lines and, for every ``data:`` line, record the fact's
    ``stream_id`` with the wall-clock time (``time.time()``) of the
    ``recv`` that completed it.
``idle``
    Read and count like ``count`` (the connection stays open and idle).

With ``--format ds`` the stream is a Durable Streams SSE answer
(``GET .../ds/{stream}?offset=now&live=sse``): an ``event: data`` holds a
JSON array of facts, so facts are counted (each ``"stream_id":``), not
events, and in latency mode every ``stream_id`` of a ``data:`` line is
recorded.

The expected number of events comes from a line ``<n>`` on stdin; when
every connection has seen it (or closed, or ``--timeout`` passed, or stdin
closed) it prints one JSON line in ``reader.py``'s format: ``counts``,
``last_at``, ``closed``, ``timeout``, ``cpu``, and ``tokens``/``at`` in
latency mode.
"""

import argparse
import json
import os
import re
import resource
import selectors
import socket
import sys
import time

BUFFER = 1 << 20
EVENT = b"\nevent: fact"
FACT = b'"stream_id":'
STREAM_ID = re.compile(rb'"stream_id":\s*(\d+)')


def connect(args):
    sock = socket.create_connection((args.host, args.port))
    sock.sendall(b"GET %s HTTP/1.0\r\nHost: %s:%d\r\nAccept: text/event-stream\r\n"
                 b"Authorization: Bearer %s\r\n\r\n"
                 % (args.path.encode(), args.host.encode(), args.port, args.secret.encode()))
    return sock


def read_head(sock) -> bytes:
    """The response's head (blocking); the body bytes that came with it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise SystemExit(f"closed before the response head: {data[:200]!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    if b" 200 " not in status + b" ":
        raise SystemExit(f"answer {status!r}: {rest[:300]!r}")
    return b"\n" + rest  # a leading newline: the first event counts too


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--secret", required=True)
    p.add_argument("--sockets", type=int, default=1)
    p.add_argument("--mode", choices=("count", "latency", "idle"), default="count")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--format", choices=("events", "ds"), default="events")
    args = p.parse_args()
    ds = args.format == "ds"
    marker = FACT if ds else EVENT
    socks = [connect(args) for _ in range(args.sockets)]
    initial = [read_head(s) for s in socks]
    print(json.dumps({"ready": len(socks)}), flush=True)

    latency = args.mode == "latency"
    n = len(socks)
    counts = [0] * n
    last_at = [0.0] * n
    closed = [False] * n
    tails = [b""] * n
    tokens = [[] for _ in range(n)]
    arrivals = [[] for _ in range(n)]
    expect = None
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    sel.register(stdin, selectors.EVENT_READ, -1)
    stdin_text = b""
    deadline = time.monotonic() + args.timeout
    timed_out = stop = False

    def take(i, data, now):
        if latency:
            data = tails[i] + data
            *lines, tails[i] = data.split(b"\n")
            seen = 0
            for line in lines:
                if line.startswith(b"data:"):
                    found = STREAM_ID.findall(line) if ds else STREAM_ID.findall(line)[:1]
                    for m in found:
                        tokens[i].append(int(m))
                        arrivals[i].append(now)
                        seen += 1
        else:
            joined = tails[i] + data
            seen = joined.count(marker)
            tails[i] = joined[-(len(marker) - 1):]
        if seen:
            counts[i] += seen
            last_at[i] = now

    for i, data in enumerate(initial):
        take(i, data, time.time())

    def done():
        return expect is not None and all(closed[i] or counts[i] >= expect for i in range(n))

    while not stop and not done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        for key, _ in sel.select(min(remaining, 1.0)):
            i = key.data
            if i < 0:
                data = os.read(stdin.fileno(), 4096)
                if not data:
                    sel.unregister(stdin)
                    stop = True
                    break
                stdin_text += data
                *lines, stdin_text = stdin_text.split(b"\n")
                for line in lines:
                    if line.strip():
                        expect = int(line)
                continue
            try:
                data = key.fileobj.recv(BUFFER)
            except BlockingIOError:
                continue
            except ConnectionError:
                data = b""
            if not data:
                closed[i] = True
                sel.unregister(key.fileobj)
                continue
            take(i, data, time.time())

    for s in socks:
        s.close()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    result = {"counts": counts, "last_at": last_at, "closed": closed, "timeout": timed_out,
              "expect": expect, "cpu": ru.ru_utime + ru.ru_stime}
    if latency:
        result["tokens"] = tokens
        result["at"] = arrivals
    try:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        pass


if __name__ == "__main__":
    main()
