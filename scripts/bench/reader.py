#!/usr/bin/env python3
"""A replication client for the TCP benchmarks, as cheap as it can be.

One process holds ``--sockets`` connections to ``--port`` (plain blocking
sockets multiplexed with ``selectors``; no Twisted, no parsing beyond what
the mode needs).  Each connection sends ``NAME <name>-<i>`` and
``REPLICATE`` and then only reads.

Modes:

``count``
    Count RDATA lines per connection (occurrences of ``b"\\nRDATA "`` in
    what was received, straddling ``recv`` boundaries included) and note the
    wall-clock time (``time.time()``) of the last ``recv`` that brought any.
``latency``
    Split lines and, for every RDATA line, record its token (the fourth
    field) with the wall-clock time of the ``recv`` that completed it.
``sleep``
    Connect with a tiny receive buffer, send the handshake and never read:
    the congested client.  Exits when stdin closes.

The expected number of RDATA lines per connection comes from ``--expect`` or
from a line ``<n>`` on stdin (so it can be given once the writers stop).
When every connection has seen it (or a connection closed, or the deadline
passed) the process prints one JSON line and exits::

    {"counts": [...], "last_at": [...], "closed": [...], "timeout": false,
     "tokens": [[...], ...], "at": [[...], ...]}   # the last two in latency mode

Closing stdin early ends the run at once with what has been seen.
"""

import argparse
import json
import os
import resource
import selectors
import socket
import sys
import time

BUFFER = 1 << 20


def connect(args, i, rcvbuf):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # else leave the kernel's autotuning alone
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((args.host, args.port))
    sock.sendall(b"NAME %s-%d\nREPLICATE\n" % (args.name.encode(), i))
    return sock


def sleep_mode(args):
    socks = [connect(args, i, 4096) for i in range(args.sockets)]
    print(json.dumps({"ready": True}), flush=True)
    try:
        sys.stdin.buffer.read()  # until the benchmark closes our stdin
    finally:
        for s in socks:
            s.close()


def run(args):
    socks = [connect(args, i, None) for i in range(args.sockets)]
    result = read_loop(socks, args.mode == "latency", args.expect, args.timeout)
    for s in socks:
        s.close()
    emit(result)


def read_loop(socks, latency, expect, timeout, separator=b"\n", initial=None):
    """Read ``socks`` (connected, handshake sent) until each saw ``expect``
    RDATA lines or closed, stdin closed, or ``timeout`` s passed; the result
    dict of the module docstring (plus ``cpu``: this process's CPU seconds).

    RDATA lines are found after ``separator`` (``b"\r\n"`` inside a Redis
    RESP stream, where every payload is one line).  In latency mode a
    ``batch`` line counts but has no token to time.  ``initial[i]``: bytes
    of ``socks[i]`` already received (what came with a subscription's
    confirmation), taken as the first ``recv``."""
    pattern = separator + b"RDATA "
    tail_len = len(pattern) - 1
    n = len(socks)
    counts = [0] * n
    last_at = [0.0] * n
    closed = [False] * n
    tails = [b""] * n
    leftovers = [b""] * n
    tokens = [[] for _ in range(n)]
    arrivals = [[] for _ in range(n)]
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    sel.register(stdin, selectors.EVENT_READ, -1)
    stdin_text = b""
    buf = bytearray(BUFFER)
    view = memoryview(buf)
    deadline = time.monotonic() + timeout
    timed_out = False
    stop = False

    def done():
        if expect is None:
            return False
        return all(closed[i] or counts[i] >= expect for i in range(n))

    for i, data in enumerate(initial or ()):
        if not data:
            continue
        now = time.time()
        if latency:
            leftovers[i] = data  # whole lines in it are read with the next recv
            continue
        seen = data.count(pattern)
        tails[i] = data[-tail_len:]
        if seen:
            counts[i] += seen
            last_at[i] = now

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
            sock = key.fileobj
            try:
                got = sock.recv_into(buf)
            except BlockingIOError:
                continue
            except ConnectionError:
                got = 0
            if not got:
                closed[i] = True
                sel.unregister(sock)
                continue
            now = time.time()
            if latency:
                data = leftovers[i] + view[:got].tobytes()
                lines = data.split(separator)
                leftovers[i] = lines.pop()
                tok, arr = tokens[i], arrivals[i]
                seen = 0
                for line in lines:
                    if line.startswith(b"RDATA "):
                        field = line.split(b" ", 4)[3]
                        if field != b"batch":
                            tok.append(int(field))
                            arr.append(now)
                        seen += 1
                if seen:
                    counts[i] += seen
                    last_at[i] = now
                continue
            seen = buf.count(pattern, 0, got)
            head = view[: min(tail_len, got)].tobytes()
            tail = tails[i]
            if tail:
                seen += (tail + head).count(pattern)
            if got >= tail_len:
                tails[i] = view[got - tail_len : got].tobytes()
            else:
                tails[i] = (tail + head)[-tail_len:]
            if seen:
                counts[i] += seen
                last_at[i] = now

    ru = resource.getrusage(resource.RUSAGE_SELF)
    result = {"counts": counts, "last_at": last_at, "closed": closed, "timeout": timed_out,
              "expect": expect, "cpu": ru.ru_utime + ru.ru_stime}
    if latency:
        result["tokens"] = tokens
        result["at"] = arrivals
    return result


def emit(result):
    """Print the result as one JSON line for the benchmark."""
    try:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # the benchmark is gone
        pass


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--sockets", type=int, default=1)
    p.add_argument("--name", default="bench")
    p.add_argument("--mode", choices=("count", "latency", "sleep"), default="count")
    p.add_argument("--expect", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    if args.mode == "sleep":
        sleep_mode(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
