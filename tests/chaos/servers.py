"""PostgreSQL for a chaos run: a throwaway cluster under ``pg_ctl``, so that
it can be restarted the way an operator (or a crash) restarts it.

``fsync=off`` keeps it fast on a shared machine and is harmless here: the
operating system never crashes during a run, so what PostgreSQL wrote to it
survives a ``-m immediate`` restart.  ``synchronous_commit`` stays ON: with
it off, an immediate shutdown loses commits that were already acknowledged,
and the suite would blame the daemon for PostgreSQL's configured behaviour.
"""

import os
import pwd
import shutil
import subprocess
import tempfile
import time

from tests.servers import _pg_bindir, free_port, unavailable


class PgCluster:
    """One cluster on a free loopback port; ``restart(mode)`` and
    ``stop``/``start`` keep port and data.

    Why not :class:`tests.servers.PostgresServer` (they share the binary
    lookup and port choice): that one runs ``postgres`` as its own child in a
    session of its own, stops it at interpreter exit and deletes its data on
    ``stop``, and turns ``synchronous_commit`` off with ``fsync``. Here the
    postmaster belongs to ``pg_ctl``, so the nemesis can stop, start and
    restart it in any shutdown mode from a worker thread with the data kept,
    and ``synchronous_commit`` stays on (see the module docstring). One class
    would have to change how a chaos run restarts PostgreSQL, which is the
    fault under test; that needs the full ``make chaos`` matrix to show it
    changes nothing, and has not been done.
    """

    def __init__(self):
        bindir = _pg_bindir()
        if bindir is None:
            unavailable("PostgreSQL server binaries (initdb, pg_ctl) not found")
        self.bindir = bindir
        self.port = free_port()
        self.tmp = tempfile.mkdtemp(prefix="replicator-chaos-pg-")
        self.datadir = os.path.join(self.tmp, "data")
        self.logfile = os.path.join(self.tmp, "postgres.log")
        self._as_user = []
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                unavailable("running as root and there is no 'postgres' user")
            os.chown(self.tmp, pw.pw_uid, pw.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        self._run("initdb", "-D", self.datadir, "-U", self.user, "--auth=trust", "--no-sync",
                  "-E", "UTF8", "--locale=C")
        self.start()

    def _run(self, tool, *args, timeout=120):
        # Output to a file, never a pipe: the postmaster pg_ctl starts would
        # inherit the pipe and keep it open.
        cmd = self._as_user + [os.path.join(self.bindir, tool), *args]
        out_path = os.path.join(self.tmp, f"{tool}.out")
        with open(out_path, "wb") as out:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  stdin=subprocess.DEVNULL).returncode
        if code:
            with open(out_path, "rb") as f:
                detail = f.read().decode(errors="replace").strip()
            raise RuntimeError(f"{tool} {' '.join(args)} failed: {detail}")

    def _options(self) -> str:
        return (f"-p {self.port} -c listen_addresses=127.0.0.1 "
                f"-c unix_socket_directories={self.tmp} -c max_connections=200 "
                "-c fsync=off -c full_page_writes=off")

    def start(self):
        self._run("pg_ctl", "-D", self.datadir, "-l", self.logfile, "-o", self._options(),
                  "-w", "-t", "60", "start")
        self.wait_ready()

    def restart(self, mode: str = "immediate"):
        """``pg_ctl restart -m MODE``: ``immediate`` is a crash (no checkpoint,
        backends killed, recovery on start), ``fast`` an orderly restart."""
        self._run("pg_ctl", "-D", self.datadir, "-l", self.logfile, "-o", self._options(),
                  "-m", mode, "-w", "-t", "60", "restart")
        self.wait_ready()

    def stop(self, mode: str = "fast"):
        if os.path.exists(os.path.join(self.datadir, "postmaster.pid")):
            try:
                self._run("pg_ctl", "-D", self.datadir, "-m", mode, "-w", "-t", "60", "stop")
            except RuntimeError:
                pass

    def wait_ready(self, timeout: float = 60.0):
        import psycopg2

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg2.connect(self.dsn("postgres"), connect_timeout=2).close()
                return
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname={dbname}"

    def create_database(self, name: str) -> str:
        import psycopg2

        conn = psycopg2.connect(self.dsn("postgres"))
        conn.autocommit = True
        try:
            conn.cursor().execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return self.dsn(name)

    def destroy(self):
        self.stop("immediate")
        shutil.rmtree(self.tmp, ignore_errors=True)
