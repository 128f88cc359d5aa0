"""A throwaway Redis 7 cluster on loopback: ``masters`` redis-servers in
cluster mode, joined by ``redis-cli --cluster create ... --cluster-yes``
(no replicas), and the operations a test needs on it (who owns a slot, a
slot moved to another master).  Every process is ours, ended by PID."""

import atexit
import os
import shutil
import socket
import subprocess
import tempfile

from tests.servers import unavailable, wait_for, wait_for_port


def _port_pair() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def command(port: int, *args: str) -> str:
    """``redis-cli -p port args...``: its output (raises on failure)."""
    done = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0 or done.stdout.startswith("(error)") or \
            done.stdout.startswith("ERR"):
        raise RuntimeError(f"redis-cli {' '.join(args)}: {done.stdout}{done.stderr}")
    return done.stdout


class RedisCluster:
    def __init__(self, masters: int = 3):
        self.binary = shutil.which("redis-server")
        if self.binary is None or shutil.which("redis-cli") is None:
            unavailable("redis-server/redis-cli not found (make test installs them)")
        self.tmp = tempfile.mkdtemp(prefix="replicator-cluster-")
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen] = []
        atexit.register(self.stop)
        for _ in range(masters):
            port = _port_pair()
            directory = os.path.join(self.tmp, str(port))
            os.mkdir(directory)
            args = [self.binary, "--port", str(port), "--bind", "127.0.0.1",
                    "--dir", directory, "--save", "", "--appendonly", "no",
                    "--daemonize", "no", "--protected-mode", "no",
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "5000"]
            with open(os.path.join(directory, "redis.log"), "ab") as log:
                self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
            self.ports.append(port)
        for port in self.ports:
            wait_for_port(port)
        if masters == 1:
            command(self.ports[0], "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        else:
            done = subprocess.run(
                ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create: {done.stdout}{done.stderr}")
        wait_for(self.ready, 30, "cluster_state:ok on every node")

    def ready(self) -> bool:
        for port in self.ports:
            info = command(port, "CLUSTER", "INFO")
            if "cluster_state:ok" not in info or \
                    f"cluster_known_nodes:{len(self.ports)}\n" not in info:
                return False
        return True

    @property
    def endpoints(self) -> list[str]:
        return [f"tcp:host=127.0.0.1:port={p}" for p in self.ports]

    def node_ids(self) -> dict[int, str]:
        return {p: command(p, "CLUSTER", "MYID").strip() for p in self.ports}

    def owner(self, slot: int) -> int:
        """The port of the master serving ``slot``."""
        for line in command(self.ports[0], "CLUSTER", "NODES").splitlines():
            fields = line.split()
            port = int(fields[1].split(":")[1].split("@")[0])
            for part in fields[8:]:
                low, _, high = part.partition("-")
                if part[0] != "[" and int(low) <= slot <= int(high or low):
                    return port
        raise RuntimeError(f"no owner of slot {slot}")

    def move_slot(self, slot: int, to_port: int) -> None:
        """Migrate ``slot`` (no keys in it) to the master on ``to_port``,
        the way ``redis-cli --cluster reshard`` does: IMPORTING on the
        target, MIGRATING on the source, then NODE on both and the rest."""
        ids = self.node_ids()
        source = self.owner(slot)
        command(to_port, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[source])
        command(source, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[to_port])
        for port in [to_port, source] + [p for p in self.ports if p not in (to_port, source)]:
            command(port, "CLUSTER", "SETSLOT", str(slot), "NODE", ids[to_port])
        wait_for(lambda: all(self._sees(p, slot, to_port) for p in self.ports), 30,
                 f"every node to see slot {slot} on {to_port}")

    def _sees(self, port: int, slot: int, owner: int) -> bool:
        for line in command(port, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            if int(fields[1].split(":")[1].split("@")[0]) != owner:
                continue
            for part in fields[8:]:
                low, _, high = part.partition("-")
                if part[0] != "[" and int(low) <= slot <= int(high or low):
                    return True
        return False

    def cpu_seconds(self) -> float:
        """used_cpu_sys + used_cpu_user of every master (INFO cpu)."""
        total = 0.0
        for port in self.ports:
            for line in command(port, "INFO", "cpu").splitlines():
                if line.startswith(("used_cpu_sys:", "used_cpu_user:")):
                    total += float(line.split(":")[1])
        return total

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs = []
        shutil.rmtree(self.tmp, ignore_errors=True)
