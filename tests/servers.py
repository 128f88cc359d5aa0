"""Real servers for integration tests: PostgreSQL and Redis.

Each server runs from a temporary directory on a free loopback port and is
torn down at process exit.  One server of each kind is shared by the whole
test run (started on first use); every test gets a database of its own from
:meth:`PostgresServer.create_database`.

A server that cannot be found or started makes the test *skip* on a
developer's machine and *fail* under CI (``CI=true``): in CI a missing server
is a broken install, never a reason to pass.
"""

import atexit
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid

from twisted.trial.unittest import SkipTest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def wait_for(predicate, timeout=30.0, what="condition"):
    """Poll ``predicate`` (OSError counts as not yet) until true or
    ``timeout`` seconds have passed (then AssertionError naming ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout}s")
        time.sleep(0.05)


def unavailable(what: str):
    """Skip locally, fail in CI."""
    if in_ci():
        raise RuntimeError(f"{what} (CI=true: a missing server is a failure)")
    raise SkipTest(what)


#: Every port :func:`free_port` handed out in this process: never handed out
#: twice (two calls in a row may otherwise get the same one, the first
#: not bound yet: a worker's HTTP port was once its master's replication port).
_handed: set = set()


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed:
            _handed.add(port)
            return port


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports."""
    return [free_port() for _ in range(n)]


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nothing listens on 127.0.0.1:{port} after {timeout}s") from None
            time.sleep(0.05)


def _pg_bindir():
    for name in ("initdb", "pg_ctl", "postgres"):
        path = shutil.which(name)
        if path:
            return os.path.dirname(os.path.realpath(path))
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    return dirs[-1] if dirs else None


class PostgresServer:
    """A throwaway PostgreSQL cluster (``initdb`` + ``postgres``) on loopback.

    Runs as the ``postgres`` user when started as root (PostgreSQL refuses
    root).  Durability is off (``fsync=off``): these clusters hold test data.
    ``synchronous_commit`` follows ``fsync`` unless given: the fault suite
    keeps it on, because with it off an immediate shutdown loses commits that
    were already acknowledged (PostgreSQL's configured behaviour, not ours).

    ``postgres`` is this process's child in a session of its own; ``halt``
    (``pg_ctl stop -m MODE``), ``start`` and ``restart`` keep port and data,
    ``stop`` ends it and deletes them (also at interpreter exit).
    """

    _shared = None

    def __init__(self, fsync: bool = False, synchronous_commit=None, settings=()):
        """``settings``: more ``name=value`` server settings."""
        bindir = _pg_bindir()
        if bindir is None:
            unavailable("PostgreSQL server binaries (initdb) not found")
        self.bindir = bindir
        self.port = free_port()
        self.tmp = tempfile.mkdtemp(prefix="replicator-pg-")
        self.datadir = os.path.join(self.tmp, "data")
        self._user_cmd = []
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                unavailable("running as root and there is no 'postgres' user")
            os.chown(self.tmp, pw.pw_uid, pw.pw_gid)
            self._user_cmd = ["runuser", "-u", "postgres", "--"]
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        self._run([
            os.path.join(bindir, "initdb"), "-D", self.datadir, "-U", self.user,
            "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C",
        ])
        args = [
            os.path.join(bindir, "postgres"), "-D", self.datadir,
            "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
            "-c", f"unix_socket_directories={self.tmp}",
            "-c", "max_connections=200", "-c", "shared_buffers=128MB",
        ]
        if not fsync:
            args += ["-c", "fsync=off", "-c", "full_page_writes=off"]
        if not (fsync if synchronous_commit is None else synchronous_commit):
            args += ["-c", "synchronous_commit=off"]
        for setting in settings:
            args += ["-c", setting]
        self._args = args
        self._log = open(os.path.join(self.tmp, "postgres.log"), "wb")
        self._spawn()
        atexit.register(self.stop)

    def _spawn(self):
        self.proc = subprocess.Popen(
            self._user_cmd + self._args, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except Exception:
            self.stop()
            raise

    def halt(self, mode: str = "fast"):
        """``pg_ctl stop -m MODE``; port and data are kept for :meth:`start`.
        ``immediate`` is a crash (no checkpoint: recovery at the next start),
        ``fast`` an orderly shutdown.  Blocking; nothing if not running."""
        if self.proc.poll() is None:
            self._run([os.path.join(self.bindir, "pg_ctl"), "stop", "-D", self.datadir,
                       "-m", mode, "-w", "-t", "60"])
            self.proc.wait(60)

    def start(self):
        """The same server again, on the same port, after :meth:`halt`."""
        self._spawn()

    def restart(self, mode: str = "immediate"):
        """``pg_ctl restart -m MODE``, keeping the server our child."""
        self.halt(mode)
        self._spawn()

    def crash_restart(self):
        """An immediate stop (as after a crash), then the same server again."""
        self.restart("immediate")

    def _run(self, cmd):
        try:
            subprocess.run(self._user_cmd + cmd, check=True, capture_output=True)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(
                f"{cmd[0]} failed: {e.stderr.decode(errors='replace').strip()}"
            ) from None

    def _wait_ready(self, timeout: float = 60.0):
        import psycopg2

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited; see {self._log.name}")
            try:
                psycopg2.connect(self.dsn("postgres")).close()
                return
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname={dbname}"

    def create_database(self, prefix: str = "t") -> str:
        """A fresh empty database; returns its DSN."""
        import psycopg2

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        conn = psycopg2.connect(self.dsn("postgres"))
        conn.autocommit = True
        try:
            conn.cursor().execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return self.dsn(name)

    def stop(self):
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            # Fast shutdown; signal the whole group (runuser does not pass
            # signals on to postgres).
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @classmethod
    def shared(cls) -> "PostgresServer":
        """The one server of this test run, started on first use."""
        if cls._shared is None or cls._shared.proc.poll() is not None:
            cls._shared = cls()
        return cls._shared


class RedisServer:
    """A throwaway redis-server on loopback, restartable on the same port.

    ``args`` are more command line options (later ones win: ``--port 0
    --tls-port PORT`` makes ``port`` a TLS port), ``port`` the port waited
    for (default: a free one)."""

    _shared = None

    def __init__(self, password: str = None, args=(), port: int = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            unavailable("redis-server not found (make test installs it)")
        self.port = port or free_port()
        self.password = password
        self.args = list(args)
        self.tmp = tempfile.mkdtemp(prefix="replicator-redis-")
        self.proc = None
        self._procs = []  # every process started, so that stop() ends them all
        self._lock = threading.Lock()
        self._stopped = False
        self.start()
        atexit.register(self.stop)

    def start(self):
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", self.tmp, "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--protected-mode", "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.args
        with self._lock:
            if self._stopped:
                # E.g. a fault injector's restart racing the end of its run.
                raise RuntimeError("redis-server: start() after stop()")
            with open(os.path.join(self.tmp, "redis.log"), "ab") as log:
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            self._procs.append(self.proc)
        wait_for_port(self.port)

    def kill(self):
        """Stop abruptly (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        """End every process this server started (by PID), then its files;
        no start() after this."""
        with self._lock:
            self._stopped = True
            procs = list(self._procs)
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def endpoint(self) -> str:
        return f"tcp:host=127.0.0.1:port={self.port}"

    @classmethod
    def shared(cls) -> "RedisServer":
        if cls._shared is None or cls._shared.proc.poll() is not None:
            cls._shared = cls()
        return cls._shared
