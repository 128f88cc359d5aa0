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
        # table -> the snapshot (xmin, xmax, in progress) its last read saw
        self._seen_by: dict[str, tuple[int, int, frozenset[int]]] = {}
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
        """In a thread: stream_positions claims, then the IDs of every row
        committed since the last snapshot, and the snapshot itself.

        Each table is read in one statement, so the rows and
        ``pg_current_snapshot()`` it returns belong to one snapshot.  A row
        is new when the previous snapshot of that table did not see its
        inserting transaction: that transaction ID is at or past the
        snapshot's ``xmax`` or in its in-progress list.  Only transactions
        from the previous ``xmin`` on can be such, so the statement sends
        back those rows alone (``age`` compares transaction IDs without a
        cast per row), and the exact test runs here.  Reading the whole
        ID set at every poll grew with the table: at a million facts the
        observer alone kept both cores busy.  (Transaction IDs of a test's
        fresh cluster stay in their first epoch: the 64-bit IDs of the
        snapshot are compared by their low 32 bits.  No writer of a run uses
        savepoints, whose IDs a snapshot's list leaves out.)"""
        import psycopg2

        if self._conn is None or self._conn.closed:
            self._conn = psycopg2.connect(self.dsn, connect_timeout=2)
            self._conn.autocommit = True
            self._seen_by = {}
        cur = self._conn.cursor()
        cur.execute("SELECT stream_name, instance_name, stream_id FROM stream_positions")
        positions = cur.fetchall()
        t = self.now()
        ids: dict[Key, list[int]] = {}
        seen_by = {}
        for stream in STREAMS:
            table, writer_column, _ = TABLES[stream["name"]]
            writer = writer_column or f"'{stream['writers'][0]}'"
            before = self._seen_by.get(table)
            if before is None:
                cur.execute(f"SELECT pg_current_snapshot()::text, "
                            f"array(SELECT ARRAY[{writer}, stream_id::text, xmin::text] "
                            f"FROM {table})")
            else:
                cur.execute(f"SELECT pg_current_snapshot()::text, "
                            f"array(SELECT ARRAY[{writer}, stream_id::text, xmin::text] "
                            f"FROM {table} WHERE age(xmin) <= age(%s::text::xid))",
                            (str(before[0]),))
            snapshot_text, rows = cur.fetchone()
            seen_by[table] = parse_snapshot(snapshot_text)
            for row_writer, stream_id, xid in rows or ():
                if before is None or not visible(int(xid), before):
                    ids.setdefault((stream["name"], row_writer), []).append(int(stream_id))
        self._seen_by = seen_by
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


def parse_snapshot(text: str) -> tuple[int, int, frozenset[int]]:
    """``pg_current_snapshot()``'s ``xmin:xmax:xip,...``, as 32-bit IDs."""
    xmin, xmax, xip = text.split(":")
    low = 0xFFFFFFFF
    return (int(xmin) & low, int(xmax) & low,
            frozenset(int(x) & low for x in xip.split(",") if x))


def visible(xid: int, snapshot: tuple[int, int, frozenset[int]]) -> bool:
    """Whether ``snapshot`` saw the (committed) transaction ``xid``."""
    xmin, xmax, in_progress = snapshot
    return xid < xmin or (xid < xmax and xid not in in_progress)
