"""A real ``replicator run`` serving the read API, for the tests of its
clients: one writer (``master``) of ``caches`` on PostgreSQL, two reader
credentials (``app`` reads ``caches``, ``other`` only ``account_data``),
the access log on (``log_level: debug``), an event stream's heartbeat
every 0.5 s.

Also what those tests share: writing facts through the write API, the
table's facts in the API's shape, and a parser of ``text/event-stream``.
"""

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterable

from tests.daemon import CACHES, SECRET, Daemon, base_config
from tests.servers import PostgresServer, free_port
from tests.support import table_facts

#: The reader credentials' secrets (files written next to the config).
READER_SECRET = "reader-app-secret-0123456789abcdef"
OTHER_SECRET = "reader-other-secret-0123456789abcdef"
ACCOUNT_DATA = {
    "name": "account_data", "table": "account_data_stream",
    "columns": [{"user_id": "text"}, {"room_id": "text?"}, {"data_type": "text"}],
    "writers": ["master"],
}
#: A stream of Durable Streams created over HTTP, written by ``master``.
DS_STREAM = {"name": "ds", "table": "ds_operations", "durable_streams": True,
             "writers": ["master"]}
COLUMNS = ("cache_func", "keys", "invalidation_ts")
STREAMS_PATH = "/_replicator/v1/streams"


class ReadApiDaemon:
    """The daemon; :meth:`start` again after :meth:`kill` is a restart on
    the same ports and database."""

    def __init__(self, test, http_port: int | None = None, http: dict | None = None,
                 streams: Iterable[dict] = ()):
        """``http``: more of the ``http`` section; ``streams``: more
        streams (e.g. :data:`DS_STREAM`)."""
        self.dsn = PostgresServer.shared().create_database()
        self.port = http_port or free_port()
        self.daemon = Daemon(test, {}, "reader-api")
        secrets = {}
        for name, secret in (("app", READER_SECRET), ("other", OTHER_SECRET)):
            path = os.path.join(self.daemon.dir, f"{name}.secret")
            with open(path, "w") as f:
                f.write(secret + "\n")
            os.chmod(path, 0o600)
            secrets[name] = path
        config = base_config(
            "master", self.port, [dict(CACHES), ACCOUNT_DATA, *streams],
            database={"postgres": self.dsn}, log_level="debug")
        config["http"]["heartbeat_interval"] = 0.5  # pings seen within a test
        config["http"].update(http or {})
        config["http"]["readers"] = [
            {"name": "app", "secret_file": secrets["app"], "streams": ["caches"]},
            {"name": "other", "secret_file": secrets["other"], "streams": ["account_data"]},
        ]
        self.daemon.config = config
        import yaml

        with open(self.daemon.path, "w") as f:
            yaml.safe_dump(config, f)
        self.written = 0

    def start(self) -> "ReadApiDaemon":
        self.daemon.start()
        return self

    def kill(self) -> None:
        """SIGKILL, by PID: a crash."""
        self.daemon.kill()

    @property
    def base(self) -> str:
        return self.daemon.http_base

    def url(self, stream: str = "caches", kind: str = "facts", base: str | None = None) -> str:
        return f"{base or self.base}{STREAMS_PATH}/{stream}/{kind}"

    def write(self, n: int, base: str | None = None) -> None:
        """``n`` facts through the write API; every fifth has two rows."""
        for _ in range(n):
            i = self.written
            self.written += 1
            rows = [[f"func{i}", [f"@u{i}:hs"], i]]
            if i % 5 == 4:
                rows.append([f"func{i}b", None, -i])
            request = urllib.request.Request(
                self.url(base=base), data=json.dumps({"rows": rows}).encode(), method="POST",
                headers={"Authorization": f"Bearer {SECRET}",
                         "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200, response.status

    def table(self) -> list[tuple[int, list[list]]]:
        """``caches``' facts in the table: ``[(stream_id, [row, ...])]`` in
        order, rows as lists of the columns' values."""
        facts = table_facts(self.dsn, [("caches", "cache_invalidation_stream",
                                        ", ".join(COLUMNS))])
        return [(token, [[_json(c, v) for c, v in zip(COLUMNS, row)] for row in rows])
                for token, rows in facts.get(("caches", "master"), [])]

    def log(self) -> str:
        return self.daemon.output()


def _json(column: str, value):
    """A table value as the API shows it (a json column holds JSON text)."""
    if column == "keys" and isinstance(value, str):
        return json.loads(value)
    return value


def as_table(facts: Iterable[dict]) -> list[tuple[int, list[list]]]:
    """The API's facts (``{"stream_id", "writer", "rows": [{col: value}]}``)
    in :meth:`ReadApiDaemon.table`'s shape."""
    return [(f["stream_id"], [[row[c] for c in COLUMNS] for row in f["rows"]])
            for f in facts]


def get(url: str, secret: str | None = READER_SECRET,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One GET: status, headers (lower-case names), body; 4xx/5xx too."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    if secret:
        request.add_header("Authorization", f"Bearer {secret}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, \
                response.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def parse_events(text: str) -> list[dict[str, str]]:
    """The events of a ``text/event-stream`` body (complete ones only):
    ``{"id", "event", "data", "retry"}`` as present; comments are
    ``{"comment": ...}``."""
    events = []
    blocks = text.replace("\r\n", "\n").split("\n\n")
    for block in blocks[:-1]:
        event: dict[str, str] = {}
        for line in block.split("\n"):
            if not line:
                continue
            if line.startswith(":"):
                event.setdefault("comment", line[1:].strip())
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data" and "data" in event:
                event["data"] += "\n" + value
            else:
                event[field] = value
        if event:
            events.append(event)
    return events
