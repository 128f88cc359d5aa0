"""A Redis master, its replica and Sentinels on loopback, for the failover
tests: every process started here from Debian's ``redis-server`` and
``redis-sentinel`` on free ports, in a directory of its own, and ended by
PID (also at interpreter exit).  Missing binaries skip locally and fail
under CI, as in :mod:`tests.servers`."""

import atexit
import os
import shutil
import subprocess
import tempfile

from tests.servers import RedisServer, free_port, unavailable, wait_for, wait_for_port


def redis_cli(port: int, *args: str, password: str = None) -> list[str]:
    """``redis-cli`` against 127.0.0.1:``port``: its output lines."""
    command = ["redis-cli", "-h", "127.0.0.1", "-p", str(port), "--no-auth-warning"]
    if password:
        command += ["-a", password]
    result = subprocess.run(command + list(args), capture_output=True, text=True, timeout=10)
    return result.stdout.splitlines()


def fields(lines: list[str]) -> dict[str, str]:
    """A flat ``key value key value`` reply as a dict."""
    return dict(zip(lines[::2], lines[1::2]))


class Sentinel:
    """One ``redis-sentinel`` with ``config`` (its sentinel.conf lines, the
    ``port`` line added) in a directory of its own: Sentinel rewrites it."""

    def __init__(self, config: str):
        self.binary = shutil.which("redis-sentinel")
        if self.binary is None:
            unavailable("redis-sentinel not found (make test installs it)")
        self.port = free_port()
        self.tmp = tempfile.mkdtemp(prefix="replicator-sentinel-")
        path = os.path.join(self.tmp, "sentinel.conf")
        with open(path, "w") as f:
            # Ours last: they win over the same lines in ``config``.
            f.write(f"{config}\nport {self.port}\nbind 127.0.0.1\ndir {self.tmp}\n")
        self.log = open(os.path.join(self.tmp, "sentinel.log"), "wb")
        self.proc = subprocess.Popen([self.binary, path], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.stop)
        wait_for_port(self.port)

    def ask(self, *args: str) -> list[str]:
        return redis_cli(self.port, "SENTINEL", *args)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class SentinelSetup:
    """A master and one replica (both with ``password``) and three
    Sentinels watching it as ``master_name`` with quorum 2, ready: each
    Sentinel knows the replica and the two others, so a failover can be
    voted.

    ``sentinel_config(master_port)`` gives the Sentinels' configuration
    (default: :meth:`default_config`, a master down after 500 ms)."""

    def __init__(self, password: str, master_name: str = "mymaster", sentinel_config=None):
        self.password = password
        self.master_name = master_name
        auth = ["--masterauth", password]
        self.master = RedisServer(password=password, args=auth)
        try:
            self.replica = RedisServer(password=password, args=auth + [
                "--replicaof", "127.0.0.1", str(self.master.port)])
            wait_for(lambda: "master_link_status:up" in redis_cli(
                self.replica.port, "INFO", "replication", password=password),
                what="the replica in sync")
            config = (sentinel_config or self.default_config)(self.master.port)
            self.sentinels: list[Sentinel] = []
            for _ in range(3):
                self.sentinels.append(Sentinel(config))
            wait_for(self._ready, timeout=60, what="three Sentinels that know the replica")
        except BaseException:
            self.stop()
            raise

    def default_config(self, master_port: int) -> str:
        name = self.master_name
        return (f"sentinel monitor {name} 127.0.0.1 {master_port} 2\n"
                f"sentinel auth-pass {name} {self.password}\n"
                f"sentinel down-after-milliseconds {name} 500\n"
                f"sentinel failover-timeout {name} 3000\n")

    def _ready(self) -> bool:
        for sentinel in self.sentinels:
            state = fields(sentinel.ask("master", self.master_name))
            if state.get("num-slaves") != "1" or state.get("num-other-sentinels") != "2":
                return False
        return True

    @property
    def addresses(self) -> list[str]:
        """The Sentinels as ``host:port`` (``replication.redis.sentinels``)."""
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def master_port(self) -> int:
        """The master's port as the first Sentinel names it."""
        return int(self.sentinels[0].ask("get-master-addr-by-name", self.master_name)[1])

    def stop(self):
        for sentinel in getattr(self, "sentinels", []):
            sentinel.stop()
        for server in (getattr(self, "replica", None), self.master):
            if server is not None:
                server.stop()
