"""Durable Streams reads (docs/read-api.md, "Durable Streams") from a real
master and worker on one PostgreSQL, a multi-writer stream written on
both: a reader that switches instance mid-stream, from the master to the
worker and back, gets every fact of the table once, in order; the two
instances answer an offset with the same bytes.  A Durable Stream created
over HTTP on the master (its writer) is served by the worker with the
master's bytes and offsets; the worker refuses to write it."""

import json
import urllib.error
import urllib.request

from twisted.trial.unittest import SynchronousTestCase

from tests.daemon import CACHES, SECRET, Daemon, base_config, http
from tests.servers import PostgresServer, free_port, wait_for
from tests.support import table_facts

STREAM = dict(CACHES, writers=["master", "worker1"], create=True)
COLUMNS = ("cache_func", "keys", "invalidation_ts")
LINK = {"ping_interval": 1, "ping_timeout": 5}
DS = "/_replicator/v1/ds/caches"
#: Durable Streams created over HTTP, written by the master.
DS_STREAM = {"name": "ds", "table": "ds_operations", "durable_streams": True,
             "writers": ["master"]}


def ds_get(base: str, query: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(base + DS + query,
                                     headers={"Authorization": f"Bearer {SECRET}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, {k.lower(): v for k, v in response.headers.items()}, \
            response.read()


class MasterAndWorker:
    """A master and a worker1 on one PostgreSQL, both writing ``caches``
    (a mixin of a SynchronousTestCase)."""

    def start(self, streams=(STREAM,)):
        self.dsn = PostgresServer.shared().create_database()
        rep_port = free_port()
        http_extra = {"max_page_bytes": 1024}  # a page of about a dozen facts
        master = base_config("master", free_port(), list(streams), database={"postgres": self.dsn},
                             replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1",
                                          **LINK})
        master["http"].update(http_extra)
        worker = base_config("worker1", free_port(), list(streams), database={"postgres": self.dsn},
                             replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}",
                                          **LINK})
        worker["http"].update(http_extra)
        self.master = Daemon(self, master, "master").start()
        self.worker = Daemon(self, worker, "worker1").start()
        wait_for(lambda: http(self.worker.http_base + "/health")[0] == 200, 60, "worker linked")
        self.n = 0

    def write(self, count: int) -> None:
        for _ in range(count):
            daemon = (self.master, self.worker)[self.n % 2]
            rows = [[f"f{self.n}", [f"@u{self.n}:hs"], self.n]]
            status, _ = http(f"{daemon.http_base}/_replicator/v1/streams/caches/facts",
                             json.dumps({"rows": rows}).encode(), SECRET)
            self.assertEqual(status, 200)
            self.n += 1

    def table(self) -> list[tuple[int, str, list]]:
        facts = table_facts(self.dsn, [("caches", "cache_invalidation_stream",
                                        ", ".join(COLUMNS))])
        out = []
        for (_, writer), items in facts.items():
            for stream_id, rows in items:
                out.append((stream_id, writer, [[json.loads(v) if isinstance(v, str) and c == "keys"
                                                  else v for c, v in zip(COLUMNS, row)]
                                                for row in rows]))
        return sorted(out)

    def tail(self, daemon) -> int:
        request = urllib.request.Request(daemon.http_base + DS, method="HEAD",
                                         headers={"Authorization": f"Bearer {SECRET}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.headers["Stream-Next-Offset"])


class SwitchingReaderTests(MasterAndWorker, SynchronousTestCase):
    def test_a_reader_switching_instance_gets_every_fact_once_in_order(self):
        self.start()
        self.write(40)
        top = self.table()[-1][0]
        for daemon in (self.master, self.worker):
            wait_for(lambda d=daemon: self.tail(d) >= top, 60, "linear token past the writes")
        got: list[dict] = []
        offset = "-1"
        served: list[tuple[str, bytes]] = []
        # Two pages from the master, the rest from the worker.
        for _ in range(2):
            status, headers, body = ds_get(self.master.http_base, f"?offset={offset}")
            self.assertEqual(status, 200)
            self.assertNotIn("stream-up-to-date", headers)  # (more follows)
            served.append((offset, body))
            got += json.loads(body)
            self.assertGreater(headers["stream-next-offset"], offset)
            offset = headers["stream-next-offset"]
        while True:
            status, headers, body = ds_get(self.worker.http_base, f"?offset={offset}")
            got += json.loads(body)
            offset = headers["stream-next-offset"]
            if headers.get("stream-up-to-date") == "true":
                break
        # The worker gives the same bytes for the master's offsets.
        for start, body in served:
            self.assertEqual(ds_get(self.worker.http_base, f"?offset={start}")[2], body)
        # Back to the master, live: what is written meanwhile.
        self.write(6)
        top = self.table()[-1][0]
        while not got or got[-1]["stream_id"] < top:
            status, headers, body = ds_get(self.master.http_base,
                                           f"?offset={offset}&live=long-poll&timeout=10")
            if status == 200:
                got += json.loads(body)
            offset = headers["stream-next-offset"]
        self.assertEqual([(f["stream_id"], f["writer"],
                           [[r[c] for c in COLUMNS] for r in f["rows"]]) for f in got],
                         self.table())
        self.assertEqual(len(got), 46)


def ds_call(base: str, method: str, path: str, body: bytes = None,
            content_type: str = "application/octet-stream") -> tuple[int, dict[str, str], bytes]:
    """A request to the Durable Stream ``path`` of stream ``ds``: ``(status,
    headers, body)``, an error status too."""
    request = urllib.request.Request(f"{base}/_replicator/v1/ds/ds/{path}", data=body,
                                     method=method,
                                     headers={"Authorization": f"Bearer {SECRET}",
                                              "Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, \
                response.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


class CreatedOverHttpTests(MasterAndWorker, SynchronousTestCase):
    def test_a_worker_serves_the_masters_bytes(self):
        self.start(streams=(STREAM, DS_STREAM))
        pieces = [b"\x00first\n", b"\xffsecond", b"third\r\n"]
        status, headers, _ = ds_call(self.master.http_base, "PUT", "v1/s", pieces[0])
        self.assertEqual(status, 201)
        offsets = [headers["stream-next-offset"]]
        for piece in pieces[1:]:
            status, headers, _ = ds_call(self.master.http_base, "POST", "v1/s", piece)
            self.assertEqual(status, 204)
            offsets.append(headers["stream-next-offset"])
        # The worker does not write it: the master does.
        status, _, body = ds_call(self.worker.http_base, "POST", "v1/s", b"x")
        self.assertEqual(status, 409, body)
        self.assertIn(b"not a writer of stream ds", body)
        wait_for(lambda: ds_call(self.worker.http_base, "GET", "v1/s")[0] == 200
                 and ds_call(self.worker.http_base, "GET", "v1/s")[1]["stream-next-offset"]
                 >= offsets[-1], 60, "the worker's linear token past the appends")
        for start in ("-1", *offsets):
            on_master = ds_call(self.master.http_base, "GET", f"v1/s?offset={start}")
            on_worker = ds_call(self.worker.http_base, "GET", f"v1/s?offset={start}")
            self.assertEqual(on_worker[0], 200)
            self.assertEqual(on_worker[2], on_master[2], start)
            self.assertEqual(on_worker[1]["stream-next-offset"],
                             on_master[1]["stream-next-offset"])
        self.assertEqual(ds_call(self.worker.http_base, "GET", "v1/s")[2], b"".join(pieces))
        self.assertEqual(ds_call(self.worker.http_base, "GET", f"v1/s?offset={offsets[0]}")[2],
                         b"".join(pieces[1:]))
        # Deleted on the master: gone on the worker too.
        self.assertEqual(ds_call(self.master.http_base, "DELETE", "v1/s")[0], 204)
        wait_for(lambda: ds_call(self.worker.http_base, "HEAD", "v1/s")[0] == 404, 60,
                 "the delete replicated")
