"""Plain-SQL writers of the ``foreign`` scenario: programs that are not
replicator inserting into a stream with ``foreign_writers: true``.

Each writer loops: one transaction inserting 1 to 3 rows into ``caches``'
table with a plain ``INSERT`` (the ID and the writer column from their
defaults: the fence's function and the first writer's name), holds it open
0 to 400 ms, then commits, or one time in eight rolls back
(``CHAOS_SQL_FACTS``: that many facts in each transaction, each with its
own ID, for a long run that must reach many facts).  Every fact is
recorded like an HTTP client's request (:mod:`.clients`),
so the checker holds them to the same rules: ``acked`` (committed, with
its ID), ``failed`` (rolled back, or refused before the commit: wholly
absent), ``timeout`` (the connection died during the commit: wholly there
or wholly absent).  Rows carry a tag unique to the transaction
(``sql-<i>.<n>.<j>``).
"""

import asyncio
import concurrent.futures
import os
import random
import time

import psycopg2

#: The longest a transaction is held open before its commit or rollback.
MAX_HOLD = 0.4
ROLLBACK_ONE_IN = 8
#: Whose facts they are: ``caches``' first writer (the writer column's default).
WRITER = "master"
#: Plain-SQL writers of a run (``CHAOS_SQL_WRITERS``: more for a long run).
WRITERS = int(os.environ.get("CHAOS_SQL_WRITERS", "4"))
#: Facts in each plain-SQL transaction (``CHAOS_SQL_FACTS``).
FACTS = max(1, int(os.environ.get("CHAOS_SQL_FACTS", "1")))


class SqlWriter:
    def __init__(self, tag: str, dsn: str, table: str, rng: random.Random, log: list):
        self.tag, self.dsn, self.table, self.rng, self.log = tag, dsn, table, rng, log
        self.n = 0
        self.stopping = False
        self._conn: object | None = None
        # A thread of its own: with the loop's shared executor, writers
        # waiting on a lock could take every thread from the ones whose
        # commit would release it.
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _connect(self):
        if self._conn is None or self._conn.closed:
            self._conn = psycopg2.connect(self.dsn, connect_timeout=3,
                                          application_name=self.tag)
        return self._conn


    def _end(self, commit: bool) -> None:
        (self._conn.commit if commit else self._conn.rollback)()

    def _drop(self) -> None:
        try:
            if self._conn is not None:
                self._conn.close()
        except Exception:
            pass
        self._conn = None

    async def run(self) -> None:
        while not self.stopping:
            records = []
            for _ in range(FACTS):
                self.n += 1
                count = self.rng.choice((1, 1, 2, 3))
                # One ID for the fact's rows: a fact of several rows.
                rows = [[f"{self.tag}.{self.n}.{j}", None, self.n] for j in range(count)]
                records.append({"client": self.tag, "n": self.n, "instance": WRITER,
                                "stream": "caches", "rows": rows,
                                "started": time.monotonic()})
            commit = self.rng.randrange(ROLLBACK_ONE_IN) != 0
            try:
                ids = await self._call(self._insert_facts, [r["rows"] for r in records])
            except Exception:
                self._drop()
                self._record(records, "failed")
                await asyncio.sleep(0.1)
                continue
            await asyncio.sleep(self.rng.uniform(0, MAX_HOLD))
            try:
                await self._call(self._end, commit)
                self._record(records, "acked" if commit else "failed", ids if commit else None)
            except Exception:
                self._drop()
                self._record(records, "timeout" if commit else "failed")
        self._thread.shutdown(wait=False)

    def _record(self, records: list[dict], outcome: str,
                ids: list[int] | None = None) -> None:
        """The transaction's facts, each with the transaction's outcome."""
        ended = time.monotonic()
        for i, record in enumerate(records):
            record["outcome"] = outcome
            if ids is not None:
                record["stream_id"] = ids[i]
            record["ended"] = ended
            self.log.append(record)

    def _insert_facts(self, facts: list[list[list]]) -> list[int]:
        """Each fact's rows inserted in this one transaction: the IDs."""
        return [self._insert_fact(rows) for rows in facts]

    def _insert_fact(self, rows: list[list]) -> int:
        """The fact's rows under one ID: the first row takes the default,
        the others repeat it (a multi-row fact by plain SQL)."""
        conn = self._connect()
        cur = conn.cursor()
        cur.execute(f"INSERT INTO {self.table} (cache_func, keys, invalidation_ts) "
                    "VALUES (%s, NULL, %s) RETURNING stream_id", (rows[0][0], rows[0][2]))
        stream_id = cur.fetchone()[0]
        for row in rows[1:]:
            cur.execute(f"INSERT INTO {self.table} (stream_id, cache_func, keys, "
                        "invalidation_ts) VALUES (%s, %s, NULL, %s)",
                        (stream_id, row[0], row[2]))
        return stream_id

