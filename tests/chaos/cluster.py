"""The three instances of a run and what they replicate.

Topology (both transports): ``master``, ``worker1``, ``worker2``, one
PostgreSQL database.  Streams:

* ``caches`` (multi-writer, writer column): written by ``master`` and ``worker1``;
* ``account_data`` (single writer, a table without writer column): written
  by ``worker2``, so over TCP its facts travel worker2 -> master -> worker1
  (the relay path).

The ``foreign`` scenario gives ``caches`` ``foreign_writers: true``: beside
the clients, plain-SQL writers (:mod:`.sqlwriters`) insert facts of its
first writer, the master.

The ``idle`` scenario gives ``caches`` a third writer, worker2, and only the
master's clients write it: worker1 and worker2 are its writers and stay idle
the whole run (:func:`streams_for`, :func:`write_targets_for`).

Every instance has one consumer, a JSON-lines file (``facts.jsonl`` in its
directory), which receives the facts of every writer it does not host.

TCP: the workers' ``upstream`` is a :class:`~tests.chaos.proxy.Proxy` in
front of the master's listener.  Redis: every instance talks to
``redis-server`` through a proxy of its own.  ``ping_interval`` 1 s and
``ping_timeout`` 3 s keep pauses "past the ping timeout" short;
``fetch_limit`` 100 makes catch-ups cross many page boundaries.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile

import yaml

from tests.servers import free_port

SECRET = "chaos-secret-0123456789"
SERVER_NAME = "chaos.test"
PING_INTERVAL = 1
PING_TIMEOUT = 3
INSTANCES = ("master", "worker1", "worker2")
#: Rows per catch-up read: small, so catch-ups cross many page boundaries
#: (a multi-row fact must never be cut at one).
FETCH_LIMIT = 100
#: The audit's second check, soon: a run is short.
AUDIT_RECHECK = 10

STREAMS = [
    {"name": "caches", "table": "cache_invalidation_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}],
     "writers": ["master", "worker1"]},
    {"name": "account_data", "table": "account_data_stream", "writer_column": None,
     "columns": [{"user_id": "text"}, {"room_id": "text?"}, {"data_type": "text"}],
     "writers": ["worker2"]},
]
#: stream -> (table, writer column or None, row columns)
TABLES = {
    "caches": ("cache_invalidation_stream", "instance_name", "cache_func, keys, invalidation_ts"),
    "account_data": ("account_data_stream", None, "user_id, room_id, data_type"),
}
#: (instance, stream) pairs the clients write through
WRITE_TARGETS = [("master", "caches"), ("worker1", "caches"), ("worker2", "account_data")]


def writers_of(stream: str) -> list[str]:
    return next(s["writers"] for s in STREAMS if s["name"] == stream)


def streams_for(scenario: str) -> list[dict]:
    """The streams of a run: ``idle`` makes ``caches`` a three-writer
    stream, ``foreign`` one that takes plain-SQL writers."""
    if scenario == "foreign":
        return [dict(s, foreign_writers=True) if s["name"] == "caches" else s for s in STREAMS]
    if scenario != "idle":
        return STREAMS
    return [dict(s, writers=list(INSTANCES)) if s["name"] == "caches" else s for s in STREAMS]


def write_targets_for(scenario: str):
    """What the clients write: in ``idle`` only the master writes ``caches``."""
    if scenario != "idle":
        return WRITE_TARGETS
    return [(i, s) for i, s in WRITE_TARGETS if s != "caches" or i == "master"]


def read_keys(instance: str, streams: list[dict] = STREAMS):
    """The (stream, writer) keys ``instance`` reads (every writer it does not host)."""
    return [(s["name"], w) for s in streams for w in s["writers"] if w != instance]


class Instance:
    """One ``replicator run`` process: config, start, signals."""

    def __init__(self, name: str, base_dir: str, config: dict):
        self.name = name
        self.dir = os.path.join(base_dir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.config = config
        self.http_port = int(config["http"]["listen"].split(":")[1])
        self.path = os.path.join(self.dir, "config.yaml")
        with open(self.path, "w") as f:
            yaml.safe_dump(config, f)
        self.log_path = os.path.join(self.dir, "out.log")
        # Position 0 for every key it reads: the consumer has history from
        # the start, so it must get every fact (a consumer without history
        # starts live, at the first POSITION it hears, by design).
        with open(self.facts_path, "w") as f:
            for stream, writer in read_keys(name, config["streams"]):
                f.write(json.dumps({"stream": stream, "writer": writer, "position": 0}) + "\n")
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self.expected_down = False  # killed or stopped by us
        self.starts = 0
        self.unexpected_exits: list[int] = []
        self.startup_db_exits = 0
        #: A fault keeps it down (kill9 until its restart): not restarted
        #: by the supervisor meanwhile.
        self.held_down = False

    @property
    def facts_path(self) -> str:
        return os.path.join(self.dir, "facts.jsonl")

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    #: Source tree the daemons import ``replicator`` from before this
    #: checkout's (``--daemon-path``: e.g. an older commit, to see whether
    #: the suite catches a defect that commit has).
    daemon_path: str | None = None

    def start(self, env: dict[str, str] | None = None):
        """Start the process, unless it runs already: the supervisor's
        restart of an instance that exited by itself and a fault's restart
        after its kill can both come (two processes of one instance were
        seen, the second refused by the first's consumer file lock)."""
        if self.running():
            self.held_down = False
            return
        self.note_exit()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        environ = dict(os.environ, PYTHONUNBUFFERED="1")
        paths = [p for p in (self.daemon_path, root, environ.get("PYTHONPATH")) if p]
        environ["PYTHONPATH"] = os.pathsep.join(paths)
        environ.update(env or {})
        with open(self.log_path, "ab") as log:
            log.write(f"==== chaos: start #{self.starts + 1}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "replicator.cli", "run", "-c", self.path],
                cwd=self.dir, stdout=log, stderr=subprocess.STDOUT, env=environ,
                stdin=subprocess.DEVNULL)
        self.starts += 1
        self.paused = False
        self.expected_down = False
        self.held_down = False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def note_exit(self):
        """Record an exit we did not cause.  Exit 1 at startup because the
        database could not be reached (PostgreSQL down or restarting at that
        moment) is documented behaviour, left to the supervisor (systemd
        restarts it; so does the run): counted apart.  Anything else is a
        crash of the daemon itself."""
        if self.proc is not None and self.proc.poll() is not None and not self.expected_down:
            this_start = self.log_text().rsplit("==== chaos: start", 1)[-1]
            if self.proc.returncode == 1 and "replicator: database." in this_start:
                self.startup_db_exits += 1
            else:
                self.unexpected_exits.append(self.proc.returncode)
            self.expected_down = True

    def kill9(self):
        self.note_exit()
        self.held_down = True  # until the fault's own start()
        if self.running():
            self.expected_down = True
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
            self.paused = False

    def pause(self):
        if self.running() and not self.paused:
            self.proc.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self):
        if self.running() and self.paused:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def terminate(self, timeout: float = 30) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout``); the exit status."""
        self.note_exit()
        if not self.running():
            return None
        self.resume()
        self.expected_down = True
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9

    def log_text(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""


def build_configs(transport: str, dsn: str, master_port: int, link_ports: dict[str, int],
                  consumer: dict | None = None,
                  streams: list[dict] = STREAMS) -> dict[str, dict]:
    """Config per instance.  ``link_ports``: the proxy port each instance's
    replication link goes through (TCP: workers only; Redis: all three)."""
    configs = {}
    for name in INSTANCES:
        replication = {"ping_interval": PING_INTERVAL, "ping_timeout": PING_TIMEOUT,
                       "fetch_limit": FETCH_LIMIT, "audit_recheck": AUDIT_RECHECK}
        if transport == "tcp":
            if name == "master":
                replication["listen"] = f"tcp:{master_port}:interface=127.0.0.1"
            else:
                replication["upstream"] = f"tcp:host=127.0.0.1:port={link_ports[name]}"
        else:
            replication["redis"] = {"endpoint": f"tcp:host=127.0.0.1:port={link_ports[name]}"}
        configs[name] = {
            "server_name": SERVER_NAME, "instance_name": name, "log_level": "info",
            "database": {"postgres": dsn, "pool_min": 1, "pool_max": 4},
            "replication": replication,
            "http": {"listen": f"tcp:{free_port()}:interface=127.0.0.1", "secret": SECRET},
            "streams": streams,
            "consumers": [dict(consumer or {"type": "jsonl"}, path="facts.jsonl", fsync=False)],
        }
    return configs


def make_base_dir() -> str:
    return tempfile.mkdtemp(prefix="replicator-chaos-")
