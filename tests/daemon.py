"""A real ``replicator`` process for the tests that run the CLI or the
daemon end to end: :class:`Daemon` (``replicator run`` with its own config
in a temp dir), :func:`cli` (one command), :func:`http` (one request to
its API), :func:`base_config`, the ``caches`` stream most of them write
(:data:`CACHES`), the API's secret (:data:`SECRET`) and
:func:`tail_of_a_server`, :func:`replicator` (a command run from a
directory, its exit code and output) and :func:`metric` (one sample of
a ``/metrics`` page).  Test modules take them from here, never from
one another."""

import os
import signal
import subprocess
import sys
import tempfile
import urllib.request

import yaml

from tests.servers import wait_for

PY = sys.executable
#: The repository: what a command run from elsewhere imports.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "test-secret-0123456789"
CACHES = {
    "name": "caches", "table": "cache_invalidation_stream",
    "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}],
    "writers": ["master"],
}


def cli(*args, timeout=60, cwd=None):
    return subprocess.run([PY, "-m", "replicator.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def http(url, data=None, secret=None):
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    if secret:
        request.add_header("Authorization", f"Bearer {secret}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.read()


class Daemon:
    """A `replicator run` process with its own config in a temp dir."""

    def __init__(self, test, config: dict, name="daemon", command=(PY, "-m", "replicator.cli"),
                 env=None):
        self.test = test
        self.command, self.env = list(command), env
        self.dir = tempfile.mkdtemp(prefix=f"replicator-{name}-")
        self.path = os.path.join(self.dir, f"{name}.yaml")
        self.config = config
        with open(self.path, "w") as f:
            yaml.safe_dump(config, f)
        self.proc = None
        self.log_path = os.path.join(self.dir, "out.log")

    def start(self):
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([*self.command, "run", "-c", self.path], cwd=self.dir,
                                     env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.test.addCleanup(self.kill)
        base = self.http_base

        def answering():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.path} exited with {self.proc.returncode}")
            return http(base + "/_replicator/v1/positions", secret=SECRET)[0] == 200

        try:
            # Generous: a loaded 2-core machine can take tens of seconds.
            wait_for(answering, timeout=90.0, what=f"{self.path} answering")
        except AssertionError as e:
            raise AssertionError(f"{e}; its output: {self.output()[-2000:]}") from None
        return self

    @property
    def http_base(self):
        return "http://127.0.0.1:{}".format(self.config["http"]["listen"].split(":")[1])

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def kill(self, sig=signal.SIGKILL):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)


def base_config(name, http_port, streams, **extra):
    config = {
        "server_name": "hs.test", "instance_name": name, "log_level": "info",
        "http": {"listen": f"tcp:{http_port}:interface=127.0.0.1", "secret": SECRET},
        "streams": streams,
    }
    config.update(extra)
    return config


def tail_of_a_server(test, text=True):
    """``replicator tail`` connected to a server socket of the test's own:
    (the tail process, the accepted connection to write lines to)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    test.addCleanup(listener.close)
    port = listener.getsockname()[1]
    tail = subprocess.Popen(
        [PY, "-m", "replicator.cli", "tail", f"tcp:host=127.0.0.1:port={port}",
         "--server-name", "hs.test"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=text)
    test.addCleanup(lambda: tail.poll() is None and tail.kill())
    listener.settimeout(30)
    conn, _ = listener.accept()
    test.addCleanup(conn.close)
    return tail, conn


def replicator(*args, cwd):
    """The real command: ``(exit code, stdout, stderr)``."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", "replicator.cli", *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout, result.stderr


def metric(text, prefix):
    """The value of the first sample of ``text`` (a ``/metrics`` page) whose
    line starts with ``prefix``; 0.0 if none."""
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
