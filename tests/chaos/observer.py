"""What the run observes while it runs: position *claims* and the order in
which facts became visible in the tables.

A claim is "every fact of (stream, writer) at or below P is committed":
each instance's positions API says it (a writer's ``position`` and
``announced``, a reader's ``position`` and ``reader_position``, the
stream's ``linear`` token for every writer) and so does each row of
``stream_positions``.

Each poll round reads the claims first and then, in later statements
(autocommit: every statement sees what was committed when it started), the
set of fact IDs in every table: a *snapshot*.  A claim read before snapshot
``k`` is attributed to ``k``.  A fact first seen in snapshot ``f`` was not
committed when snapshot ``f - 1`` was taken, so a claim attributed to any
``k < f`` with ``P >= id`` was made before that fact committed: a violation,
with no false positives whatever the timing.
"""

import asyncio
import json
import time

from .clients import http_request
from .cluster import SECRET, STREAMS, TABLES

Key = tuple[str, str]


class Observer:
    def __init__(self, dsn: str, instances: dict, interval: float = 0.25):
        self.dsn = dsn
        self.instances = instances
        self.interval = interval
        self.t0 = time.monotonic()
        self.snapshots: list[float] = []  # time of snapshot k
        #: (stream, writer) -> {id: first snapshot index that held it}
        self.first_seen: dict[Key, dict[int, int]] = {}
        #: (stream, writer) -> [(snapshot index, max claimed position, evidence)]
        self.claims: dict[Key, list[tuple[int, int, str]]] = {}
        self._pending: dict[Key, tuple[int, str]] = {}
        self.polls = 0
        self.api_answers = 0
        self.stopping = False
        self._conn = None
        self.last_positions: dict[str, dict] = {}

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def _claim(self, key: Key, position, evidence: str):
        if not isinstance(position, int) or position <= 0:
            return
        current = self._pending.get(key)
        if current is None or position > current[0]:
            self._pending[key] = (position, evidence)

    async def poll_api(self):
        async def one(instance):
            if not instance.running() or instance.paused:
                return
            try:
                status, body = await http_request(instance.http_port, "GET",
                                                  "/_replicator/v1/positions", secret=SECRET,
                                                  timeout=1.0)
            except (TimeoutError, OSError, ValueError, IndexError):
                return
            if status != 200:
                return
            t = self.now()
            doc = json.loads(body)
            self.api_answers += 1
            self.last_positions[instance.name] = doc
            for stream, entry in doc.get("streams", {}).items():
                writers = entry.get("writers", {})
                for writer, w in writers.items():
                    for field in ("position", "announced", "reader_position"):
                        self._claim((stream, writer), w.get(field),
                                    f"{instance.name} positions API {stream}/{writer} "
                                    f"{field}={w.get(field)} at t={t}")
                    self._claim((stream, writer), entry.get("linear"),
                                f"{instance.name} positions API {stream} linear="
                                f"{entry.get('linear')} at t={t}")

        await asyncio.gather(*(one(i) for i in self.instances.values()))

    def _snapshot(self):
        """In a thread: stream_positions claims, then every table's IDs."""
        import psycopg2

        if self._conn is None or self._conn.closed:
            self._conn = psycopg2.connect(self.dsn, connect_timeout=2)
            self._conn.autocommit = True
        cur = self._conn.cursor()
        cur.execute("SELECT stream_name, instance_name, stream_id FROM stream_positions")
        positions = cur.fetchall()
        t = self.now()
        ids: dict[Key, list[int]] = {}
        for stream in STREAMS:
            table, writer_column, _ = TABLES[stream["name"]]
            if writer_column:
                cur.execute(f"SELECT {writer_column}, stream_id FROM {table} GROUP BY 1, 2")
                for writer, stream_id in cur.fetchall():
                    ids.setdefault((stream["name"], writer), []).append(stream_id)
            else:
                cur.execute(f"SELECT DISTINCT stream_id FROM {table}")
                ids[(stream["name"], stream["writers"][0])] = [r[0] for r in cur.fetchall()]
        return positions, t, ids

    async def snapshot(self) -> bool:
        try:
            positions, t, ids = await asyncio.to_thread(self._snapshot)
        except Exception:
            if self._conn is not None:
                try:
                    self._conn.close()
                except Exception:
                    pass
                self._conn = None
            return False
        for stream, writer, position in positions:
            self._claim((stream, writer), position,
                        f"stream_positions {stream}/{writer}={position} at t={t}")
        k = len(self.snapshots)
        self.snapshots.append(self.now())
        for key, (position, evidence) in self._pending.items():
            self.claims.setdefault(key, []).append((k, position, evidence))
        self._pending = {}
        for key, values in ids.items():
            seen = self.first_seen.setdefault(key, {})
            for stream_id in values:
                if stream_id not in seen:
                    seen[stream_id] = k
        return True

    async def run(self):
        while not self.stopping:
            self.polls += 1
            await self.poll_api()
            await self.snapshot()
            await asyncio.sleep(self.interval)

    async def final(self):
        """One last round (claims and a snapshot) after quiescence."""
        await self.poll_api()
        for _ in range(20):
            if await self.snapshot():
                return
            await asyncio.sleep(0.5)

    def close(self):
        if self._conn is not None:
            self._conn.close()
            self._conn = None
