"""A ``replicator run`` process under test, and the honest clients beside it.

* :class:`Daemon`: one master instance (SQLite, or PostgreSQL with a DSN)
  on free loopback ports, run through :mod:`.stallmon` so that reactor
  stalls are recorded; its log, RSS, stalls and an orderly stop.
* :class:`HonestReader`: a TCP replication client (NAME, PING every 2 s,
  REPLICATE) that records every fact it receives and whether it was ever
  disconnected or sent ERROR.
* :class:`HonestWriter`: writes random facts through the HTTP API on one
  keep-alive connection and records every acknowledged stream ID.
* :func:`table_facts`: the facts in the daemon's tables, shaped like RDATA
  rows, to compare with what the reader got.

These run in the harness process on plain threads and sockets: nothing
here is the daemon's own code.
"""

import http.client
import json
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import yaml

from tests.servers import free_port, wait_for
from tests.support import without_time

from . import inputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "fuzz-secret-0123456789abcdef"
TABLES = {
    "caches": ("cache_stream", ["cache_func", "keys", "ts"], ["text", "json", "bigint"]),
    "events": ("event_stream", ["event_id", "n", "ok"], ["text", "bigint", "boolean"]),
}


def http_get(port: int, path: str, secret: str | None = None,
             timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Daemon:
    """A master on free loopback ports in its own directory."""

    def __init__(self, directory: str, postgres_dsn: str | None = None, **replication):
        """SQLite allows no remote writer: there every stream has only ``master``."""
        self.dir = directory
        self.rep_port, self.http_port = free_port(), free_port()
        self.config = {
            "server_name": inputs.SERVER_NAME, "instance_name": "master", "log_level": "info",
            "database": {"postgres": postgres_dsn} if postgres_dsn else {"sqlite": "state.db"},
            "replication": {"listen": f"tcp:{self.rep_port}:interface=127.0.0.1",
                            **replication},
            "http": {"listen": f"tcp:{self.http_port}:interface=127.0.0.1", "secret": SECRET},
            "streams": inputs.STREAMS if postgres_dsn else [
                dict(s, writers=["master"]) for s in inputs.STREAMS],
        }
        self.path = os.path.join(directory, "master.yaml")
        self.log_path = os.path.join(directory, "out.log")
        self.stall_path = os.path.join(directory, "stalls.txt")
        self.proc: subprocess.Popen | None = None
        self.ready_at = 0.0

    def start(self) -> "Daemon":
        with open(self.path, "w") as f:
            yaml.safe_dump(self.config, f)
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.fuzz.stallmon", self.stall_path,
                 "run", "-c", self.path], cwd=self.dir, env=env, stdout=log,
                stderr=subprocess.STDOUT)
        wait_for(lambda: self.proc.poll() is None
                 and http_get(self.http_port, "/_replicator/v1/positions", SECRET)[0] == 200,
                 60, f"daemon in {self.dir} answering")
        self.ready_at = time.monotonic()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_kb(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def output(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stalls(self) -> list[tuple[float, float]]:
        """(lateness, reactor-thread CPU seconds in the gap) of every stall
        over 100 ms since the daemon was ready."""
        stalls = []
        try:
            with open(self.stall_path) as f:
                for line in f:
                    fields = line.split()
                    if fields[0] != "max" and float(fields[0]) >= self.ready_at:
                        stalls.append((float(fields[1]), float(fields[2])))
        except OSError:
            pass
        return stalls

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait; the exit status (None if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


_FRAME = re.compile(r'File "[^"]*/replicator/([^"]+)", line \d+, in (\w+)')
_EXC = re.compile(r"(?:builtins\.|\b)([A-Za-z_.]*(?:Error|Exception|Failure|Exit)): ?(.*)")


def _summary(text: str) -> str:
    """``ExcType: message at file:function`` of a traceback's text."""
    frames = _FRAME.findall(text)
    where = f" at {frames[-1][0]}:{frames[-1][1]}" if frames else ""
    tail = text.rsplit(" File ", 1)[-1]
    m = None
    for m in _EXC.finditer(tail):
        pass
    exc = f"{m.group(1)}: {m.group(2)[:100]}" if m else text[:100]
    return exc.strip() + where


def log_problems(text: str) -> list[tuple[str, str]]:
    """(kind, summary) for every critical event and traceback in a daemon log
    (one line per event; a failure's traceback follows on indented lines)."""
    out = []
    lines = [without_time(line) for line in text.splitlines()]
    i = 0
    while i < len(lines):
        line = lines[i]
        j = i + 1
        while j < len(lines) and lines[j].startswith("    "):
            j += 1
        block = " ".join([line] + [l.strip() for l in lines[i + 1:j]])
        if line.startswith("CRITICAL "):
            out.append(("daemon_critical", _summary(block)))
        elif "Traceback (most recent call last)" in block:
            out.append(("daemon_traceback", _summary(block)))
        i = j
    return out


class HonestReader(threading.Thread):
    """A well-behaved worker connection that records every fact."""

    def __init__(self, port: int, name: str = "honest-reader"):
        super().__init__(daemon=True)
        self.port = port
        self.name_ = name
        self.facts: dict[tuple[str, str], dict[int, list[list]]] = {}
        self.positions: dict[tuple[str, str], int] = {}
        self.batches: dict[tuple[str, str], list[list]] = {}
        self.errors: list[str] = []
        self.bad_lines: list[bytes] = []
        self.disconnected: str | None = None
        self.stopping = threading.Event()
        self.connected = threading.Event()
        self.lines = 0

    def run(self) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        except OSError as e:
            self.disconnected = f"connect failed: {e}"
            return
        sock.settimeout(0.2)
        sock.sendall(f"NAME {self.name_}\nPING 1\nREPLICATE\n".encode())
        self.connected.set()
        buffer = b""
        last_ping = time.monotonic()
        try:
            while not self.stopping.is_set():
                if time.monotonic() - last_ping > 2:
                    sock.sendall(b"PING %d\n" % int(time.time() * 1000))
                    last_ping = time.monotonic()
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    self.disconnected = "EOF"
                    return
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._line(line)
        except OSError as e:
            self.disconnected = f"{type(e).__name__}: {e}"
        finally:
            sock.close()

    def _line(self, line: bytes) -> None:
        self.lines += 1
        if len(line) > inputs.MAX_LINE:
            self.bad_lines.append(line[:200])
            return
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            self.bad_lines.append(line[:200])
            return
        name, _, rest = text.partition(" ")
        if name == "ERROR":
            self.errors.append(rest)
        elif name == "RDATA":
            stream, writer, token, row = rest.split(" ", 3)
            key = (stream, writer)
            try:
                value = json.loads(row)
            except ValueError:
                self.bad_lines.append(line[:200])
                return
            self.batches.setdefault(key, []).append(value)
            if token != "batch":
                token = int(token)
                self.facts.setdefault(key, {})[token] = self.batches.pop(key)
                self.positions[key] = max(self.positions.get(key, 0), token)
        elif name == "POSITION":
            stream, writer, _, new = rest.split(" ")
            key = (stream, writer)
            self.positions[key] = max(self.positions.get(key, 0), int(new))

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)


class HonestWriter(threading.Thread):
    """Writes random facts through the HTTP API until stopped (or ``limit``)."""

    def __init__(self, port: int, streams=("caches", "events"), seed: int = 0,
                 limit: int | None = None, pause: float = 0.0):
        super().__init__(daemon=True)
        self.port = port
        self.streams = streams
        self.rng = random.Random(seed)
        self.limit = limit
        self.pause = pause
        self.written: dict[str, dict[int, list[list]]] = {s: {} for s in streams}
        self.failures: list[str] = []
        self.stopping = threading.Event()

    def row(self, stream: str, n: int) -> list:
        rng = self.rng
        if stream == "caches":
            keys = rng.choice([None, [f"@u{n}:hs.test"], {"k": ["é", n, None]}, "✓ \\ \""])
            return [rng.choice(["get_user_by_id", "fn ✓", ""]), keys, rng.randint(-2**63,
                                                                                  2**63 - 1)]
        return [f"$ev{n}:hs.test", rng.choice([None, n]), rng.random() < 0.5]

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        n = 0
        while not self.stopping.is_set() and (self.limit is None or n < self.limit):
            stream = self.rng.choice(self.streams)
            rows = [self.row(stream, n) for _ in range(self.rng.choice([0, 1, 1, 1, 2, 3]))]
            body = json.dumps({"rows": rows}).encode()
            try:
                conn.request("POST", f"/_replicator/v1/streams/{stream}/facts", body=body,
                             headers={"Authorization": f"Bearer {SECRET}",
                                      "Content-Type": "application/json"})
                response = conn.getresponse()
                answer = response.read()
            except (OSError, http.client.HTTPException) as e:
                self.failures.append(f"{type(e).__name__}: {e}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                time.sleep(0.1)
                continue
            if response.status != 200:
                self.failures.append(f"{response.status} {answer[:200]!r}")
                continue
            self.written[stream][json.loads(answer)["stream_id"]] = rows
            n += 1
            if self.pause:
                time.sleep(self.pause)
        conn.close()

    def stop(self) -> None:
        self.stopping.set()
        self.join(60)

    def last_ids(self) -> dict[str, int]:
        return {s: max(ids) for s, ids in self.written.items() if ids}


def table_facts(db_path: str | None = None, dsn: str | None = None
                ) -> dict[tuple[str, str], dict[int, list[list]]]:
    """Facts with rows in the tables (SQLite file or PostgreSQL DSN), rows
    shaped as RDATA sends them."""
    if dsn is not None:
        import psycopg2

        conn = psycopg2.connect(dsn)
        order = "ctid"
    else:
        conn = sqlite3.connect(db_path)
        order = "rowid"
    try:
        out: dict[tuple[str, str], dict[int, list[list]]] = {}
        for stream, (table, cols, types) in TABLES.items():
            query = f"SELECT stream_id, instance_name, {', '.join(cols)} FROM {table} " \
                    f"ORDER BY stream_id, {order}"
            cur = conn.cursor()
            cur.execute(query)
            for stream_id, writer, *values in cur.fetchall():
                row = []
                for t, v in zip(types, values):
                    if v is not None and t == "json" and dsn is None:
                        v = json.loads(v)  # JSONB comes decoded
                    elif v is not None and t == "boolean":
                        v = bool(v)
                    row.append(v)
                out.setdefault((stream, writer), {}).setdefault(stream_id, []).append(row)
        return out
    finally:
        conn.close()


def canonical(facts: dict[int, list[list]]) -> dict[int, list[str]]:
    """Each fact's rows as a sorted list of JSON texts (a fact is a set of rows)."""
    return {token: sorted(json.dumps(r, sort_keys=True) for r in rows)
            for token, rows in facts.items()}
