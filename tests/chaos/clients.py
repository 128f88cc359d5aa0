"""HTTP clients that write continuously through the write API and record
the outcome of every request.

Every row carries a tag unique to its request (``<client>.<n>.<j>``, in the
row's first column), so the checker finds each request's rows in the table
whatever ID they got.  A request has 0 to 3 rows (0 rows: a fact without
rows, a position-only advance).

Outcomes: ``acked`` (200 with ``stream_id``), ``failed`` (any other answer,
or the connection refused/reset), ``timeout`` (no answer in time).  Only an
acked write is known to be committed; the others may or may not be.
"""

import asyncio
import json
import random
import time

from .cluster import SECRET

REQUEST_TIMEOUT = 5.0


def make_rows(stream: str, tag: str, n: int, count: int) -> list[list]:
    if stream == "caches":
        return [[f"{tag}.{n}.{j}", [f"@u{n}:chaos.test"] if j % 2 else None, n]
                for j in range(count)]
    return [[f"{tag}.{n}.{j}", None if j % 2 else "!room:chaos.test", "m.chaos"]
            for j in range(count)]


def row_tag(row: list) -> str:
    """The request tag of a row (``client.n``) from its first column."""
    return row[0].rsplit(".", 1)[0]


async def http_request(port: int, method: str, path: str, body: bytes | None = None,
                       secret: str | None = None, timeout: float = REQUEST_TIMEOUT):
    """``(status, body bytes)``; raises OSError / asyncio.TimeoutError."""
    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}",
                    "Connection: close", f"Content-Length: {len(body or b'')}"]
            if body is not None:
                head.append("Content-Type: application/json")
            if secret:
                head.append(f"Authorization: Bearer {secret}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
            await writer.drain()
            data = await reader.read()
        finally:
            writer.transport.abort()
        if not data:
            raise ConnectionError("empty answer")
        header, _, payload = data.partition(b"\r\n\r\n")
        status = int(header.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in header.lower():
            payload = _unchunk(payload)
        return status, payload

    return await asyncio.wait_for(go(), timeout)


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2:]
    return out


class Writer:
    """One client loop: writes facts to ``stream`` on ``instance`` until stopped."""

    def __init__(self, tag: str, instance, stream: str, rng: random.Random, log: list):
        self.tag = tag
        self.instance = instance
        self.stream = stream
        self.rng = rng
        self.log = log  # shared list of outcome records
        self.n = 0
        self.stopping = False

    async def run(self):
        path = f"/_replicator/v1/streams/{self.stream}/facts"
        while not self.stopping:
            self.n += 1
            count = self.rng.choice((0, 1, 1, 1, 2, 3))
            rows = make_rows(self.stream, self.tag, self.n, count)
            record = {"client": self.tag, "n": self.n, "instance": self.instance.name,
                      "stream": self.stream, "rows": rows, "started": time.monotonic()}
            try:
                status, body = await http_request(
                    self.instance.http_port, "POST", path, json.dumps({"rows": rows}).encode(),
                    SECRET)
                if status == 200:
                    record["outcome"] = "acked"
                    record["stream_id"] = json.loads(body)["stream_id"]
                else:
                    record["outcome"] = "failed"
                    record["status"] = status
            except TimeoutError:
                record["outcome"] = "timeout"
            except (OSError, ValueError, IndexError):
                record["outcome"] = "failed"
            record["ended"] = time.monotonic()
            self.log.append(record)
            if record["outcome"] != "acked":
                await asyncio.sleep(0.1)
            else:
                await asyncio.sleep(self.rng.uniform(0, 0.01))
