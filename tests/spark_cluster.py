"""A standalone Spark cluster on loopback, started the way docs/operations.md
("Spark cluster") says: its ``spark-master`` and ``spark-worker`` steps run
as written, with ``127.0.0.1`` for every address, free ports, a temporary
work directory per worker and the worker size given here.

Used by ``tests/test_export_cluster.py`` and the export benchmark.  Every
process is a child of this one in a session of its own, stopped by its
process group (the step's shell ``exec``s into the JVM through
``spark-class``) and waited for; the work directories are removed.
"""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from tests.operations_doc import doc_block
from tests.servers import free_port, unavailable, wait_for

#: The addresses, ports and paths of the page's example.
MASTER_HOST, MASTER_PORT, MASTER_UI = "10.0.0.5", "7077", "8080"
WORKER_HOST, WORKER_UI, WORKER_DIR = "10.0.0.11", "8081", "/var/lib/spark/work"
DRIVER_HOST, CONFIG, OUTPUT = "10.0.0.9", "/etc/replicator/master.yaml", "/srv/export"
WORKER_SIZE = "--cores 2 --memory 2g"
VENV = "/opt/replicator"


def replace_all(text: str, pairs) -> str:
    """``text`` with each ``(old, new)`` replaced; every ``old`` must occur."""
    for old, new in pairs:
        assert old in text, f"{old!r} is not in the step any more:\n{text}"
        text = text.replace(old, new)
    return text


def export_command(master_url: str, config: str, output: str) -> str:
    """The page's ``spark-export`` step for this cluster, config and output."""
    host, _, port = master_url[len("spark://"):].partition(":")
    return replace_all(doc_block("spark-export"), [
        (DRIVER_HOST, "127.0.0.1"), (VENV + "/", sys.prefix + "/"), (CONFIG, config),
        (OUTPUT, output), (f"spark://{MASTER_HOST}:{MASTER_PORT}", f"spark://{host}:{port}")])


class SparkCluster:
    """A Spark master and ``workers`` workers (``cores`` and ``memory``
    each) on loopback; :meth:`stop` ends them."""

    def __init__(self, workers: int = 2, cores: int = 1, memory: str = "1g",
                 timeout: float = 120.0):
        if not shutil.which("java"):
            unavailable("java is not installed (apt-get install default-jre-headless)")
        if not os.path.exists(os.path.join(sys.prefix, "bin", "spark-class")):
            unavailable("pyspark is not installed (pip install -e '.[spark]')")
        self.tmp = tempfile.mkdtemp(prefix="spark-cluster-")
        self.port, self.ui_port = free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.work_dirs: list[str] = []
        try:
            self._spawn("master", replace_all(doc_block("spark-master"), [
                (MASTER_HOST, "127.0.0.1"), (MASTER_PORT, str(self.port)),
                (MASTER_UI, str(self.ui_port)), (VENV + "/", sys.prefix + "/")]))
            for i in range(1, workers + 1):
                work = os.path.join(self.tmp, f"worker{i}")
                self.work_dirs.append(work)
                self._spawn(f"worker{i}", replace_all(doc_block("spark-worker"), [
                    (WORKER_HOST, "127.0.0.1"), (WORKER_UI, str(free_port())),
                    (WORKER_DIR, work), (WORKER_SIZE, f"--cores {cores} --memory {memory}"),
                    (f"spark://{MASTER_HOST}:{MASTER_PORT}", self.url),
                    (VENV + "/", sys.prefix + "/")]))
            wait_for(lambda: self._alive_workers() == workers, timeout,
                     f"{workers} Spark workers registered at {self.url}")
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, script: str) -> None:
        # The last command (spark-class) becomes the process: a plain bash
        # script ends with it; signals go to the whole group anyway.
        env = dict(os.environ, SPARK_DAEMON_MEMORY="256m")
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")
        try:
            self.procs.append(subprocess.Popen(
                ["bash", "-e", "-c", script], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=env, cwd=self.tmp))
        finally:
            log.close()

    def status(self) -> dict:
        """The master's ``/json/`` page (workers, applications)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return json.load(r)

    def _alive_workers(self) -> int:
        for name, proc in zip(["master"] + [f"worker{i}" for i in range(1, 99)], self.procs):
            if proc.poll() is not None:
                raise AssertionError(f"Spark {name} exited ({proc.returncode}): "
                                     f"{self.log(name)[-2000:]}")
        try:
            status = self.status()
        except (OSError, ValueError):
            return 0
        return sum(1 for w in status.get("workers", []) if w.get("state") == "ALIVE")

    def log(self, name: str) -> str:
        with open(os.path.join(self.tmp, f"{name}.log"), errors="replace") as f:
            return f.read()

    def executor_logs(self, app_id: str) -> list[list[str]]:
        """The stderr of every executor of application ``app_id``, per
        worker (a worker runs more than one when the master replaces an
        executor it lost, e.g. one late to register on a loaded machine)."""
        out = []
        for work in self.work_dirs:
            logs = []
            for path in sorted(glob.glob(os.path.join(work, app_id, "*", "stderr"))):
                with open(path, errors="replace") as f:
                    logs.append(f.read())
            out.append(logs)
        return out

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []
        shutil.rmtree(self.tmp, ignore_errors=True)
