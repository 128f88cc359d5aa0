"""Planted faults from outside the daemons: what the delivery audit and
the checked POSITIONs must catch.

* :class:`PositionForger` (``--plant forge-position``, Redis): a client
  that only SUBSCRIBEs and PUBLISHes on the cluster's channel and answers
  every ``RDATA <stream> <writer> T`` of a whole fact with ``POSITION
  <stream> <writer> T T+2``, as if the writer had nothing up to ``T+2``.
* :class:`LateCommitter` (``--plant late-sql``): a plain-SQL insert of a
  fact into a single-writer stream's table, its transaction held open for
  a few seconds while the readers move past its ID, then committed.

Each counts what it did (``forged``, ``committed``); the run records when
the daemons first said so (:func:`tripped`).
"""

import asyncio
import re
import time

import psycopg2

from .clients import http_request

RDATA = re.compile(rb"^RDATA (\S+) (\S+) (\d+) ")


def _command(*parts: bytes) -> bytes:
    out = b"*%d\r\n" % len(parts)
    for p in parts:
        out += b"$%d\r\n%s\r\n" % (len(p), p)
    return out


async def _read_reply(reader: asyncio.StreamReader) -> list:
    """One RESP reply (arrays of bulk strings and integers: what pub/sub sends)."""
    line = await reader.readline()
    kind, rest = line[:1], line[1:-2]
    if kind == b"*":
        return [await _read_reply(reader) for _ in range(int(rest))]
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = await reader.readexactly(n + 2)
        return data[:-2]
    if kind in (b":",):
        return int(rest)
    return rest


class PositionForger:
    def __init__(self, port: int, channel: str, streams: list[str]):
        self.port = port
        self.channel = channel.encode()
        self.streams = {s.encode() for s in streams}
        self.forged = 0
        self.first_at: float | None = None
        self.stopping = False

    async def run(self) -> None:
        sub_r, sub_w = await asyncio.open_connection("127.0.0.1", self.port)
        _, pub_w = pub = await asyncio.open_connection("127.0.0.1", self.port)
        pub_r = pub[0]
        sub_w.write(_command(b"SUBSCRIBE", self.channel))
        await sub_w.drain()
        drainer = asyncio.ensure_future(self._drain(pub_r))
        try:
            while not self.stopping:
                try:
                    reply = await asyncio.wait_for(_read_reply(sub_r), 0.5)
                except TimeoutError:
                    continue
                if not isinstance(reply, list) or len(reply) != 3 or reply[0] != b"message":
                    continue
                m = RDATA.match(reply[2])
                if m is None or m.group(1) not in self.streams:
                    continue
                stream, writer, token = m.group(1), m.group(2), int(m.group(3))
                line = b"POSITION %s %s %d %d" % (stream, writer, token, token + 2)
                pub_w.write(_command(b"PUBLISH", self.channel, line))
                self.forged += 1
                if self.first_at is None:
                    self.first_at = time.monotonic()
        finally:
            drainer.cancel()
            for w in (sub_w, pub_w):
                w.close()

    async def _drain(self, reader: asyncio.StreamReader) -> None:
        while True:
            if not await reader.read(65536):
                return


class LateCommitter:
    """Every ``every`` seconds, one fact by plain SQL whose commit waits ``hold`` s."""

    def __init__(self, dsn: str, table: str, sequence: str, columns: list[str],
                 every: float = 6.0, hold: float = 4.0, rounds: int = 3):
        self.dsn, self.table, self.sequence, self.columns = dsn, table, sequence, columns
        self.every, self.hold, self.rounds = every, hold, rounds
        self.committed: list[int] = []
        self.first_at: float | None = None
        self.stopping = False

    def _begin(self):
        conn = psycopg2.connect(self.dsn)
        cur = conn.cursor()
        cur.execute(f"SELECT nextval('{self.sequence}')")
        stream_id = cur.fetchone()[0]
        values = ["late-sql", None, "late"][:len(self.columns)]
        cur.execute(f"INSERT INTO {self.table} (stream_id, {', '.join(self.columns)}) "
                    f"VALUES (%s, {', '.join(['%s'] * len(self.columns))})",
                    (stream_id, *values))
        return conn, stream_id

    async def run(self) -> None:
        for _ in range(self.rounds):
            if self.stopping:
                return
            conn, stream_id = await asyncio.to_thread(self._begin)
            await asyncio.sleep(self.hold)  # the readers move past stream_id meanwhile
            await asyncio.to_thread(conn.commit)
            await asyncio.to_thread(conn.close)
            self.committed.append(stream_id)
            if self.first_at is None:
                self.first_at = time.monotonic()
            await asyncio.sleep(self.every)


TRIP = re.compile(r'^(replicator_audit_mismatch|replicator_positions_contradicted_total)'
                  r'\{([^}]*)\} ([0-9.e+]+)$', re.M)


async def tripped(http_ports: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per instance: the audit's mismatches (``mismatch``) and the POSITIONs
    the table contradicted (``contradicted``), from its ``/metrics``."""
    out: dict[str, dict[str, float]] = {}
    for name, port in http_ports.items():
        counts = {"mismatch": 0.0, "contradicted": 0.0}
        try:
            status, body = await http_request(port, "GET", "/metrics", timeout=2)
        except (TimeoutError, OSError):
            out[name] = counts
            continue
        for metric, _, value in TRIP.findall(body.decode("utf-8", "replace")):
            kind = "mismatch" if metric.endswith("mismatch") else "contradicted"
            counts[kind] += float(value)
        out[name] = counts
    return out
