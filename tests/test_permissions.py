"""What the daemon and `make run` create is private: secrets 0600, data
0640 or tighter, and a secret file everyone can read is warned about."""

import os
import shutil
import stat
import subprocess
import sys
import tempfile

from twisted.internet import reactor
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator import files
from replicator.config import parse_database
from replicator.consumers import JsonlConsumer
from replicator.storage.database import Database
from tests.daemon import CACHES, SECRET, Daemon, base_config, http
from tests.servers import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


class UmaskMixin:
    def loose_umask(self):
        """Run with the common default umask 022, whatever the test runner has."""
        old = os.umask(0o022)
        self.addCleanup(os.umask, old)

    def tmpdir(self):
        path = tempfile.mkdtemp(prefix="replicator-perm-")
        self.addCleanup(shutil.rmtree, path, True)
        return path


class MakeSecretTests(UmaskMixin, SynchronousTestCase):
    def make_secret(self, cwd):
        return subprocess.run(
            ["make", "--no-print-directory", "-f", os.path.join(REPO, "Makefile"), "-C", cwd,
             "var/http-secret", f"PY={sys.executable}"],
            capture_output=True, text=True, timeout=60)

    def test_make_creates_the_http_secret_0600(self):
        self.loose_umask()
        cwd = self.tmpdir()
        done = self.make_secret(cwd)
        self.assertEqual(done.returncode, 0, done.stderr)
        path = os.path.join(cwd, "var", "http-secret")
        self.assertEqual(mode(path), 0o600)
        with open(path) as f:
            secret = f.read().strip()
        self.assertGreaterEqual(len(secret), 32)
        # Made again: the same secret, still private.
        self.assertEqual(self.make_secret(cwd).returncode, 0)
        with open(path) as f:
            self.assertEqual(f.read().strip(), secret)
        self.assertEqual(mode(path), 0o600)

    def test_make_fixes_a_world_readable_secret_of_an_earlier_version(self):
        cwd = self.tmpdir()
        os.mkdir(os.path.join(cwd, "var"))
        path = os.path.join(cwd, "var", "http-secret")
        with open(path, "w") as f:
            f.write("an-old-secret-made-world-readable\n")
        os.chmod(path, 0o644)
        done = self.make_secret(cwd)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(mode(path), 0o600)
        with open(path) as f:
            self.assertEqual(f.read(), "an-old-secret-made-world-readable\n")


class CreatedFileModeTests(UmaskMixin, SynchronousTestCase):
    """The explicit modes hold even without the daemon's umask."""

    def test_jsonl_output_is_0640(self):
        self.loose_umask()
        path = os.path.join(self.tmpdir(), "out", "facts.jsonl")
        consumer = JsonlConsumer(path, fsync=False, reactor=reactor)
        consumer.close()
        self.assertEqual(mode(path), 0o640)
        self.assertEqual(mode(os.path.dirname(path)), 0o750)

    def test_umask_is_only_ever_tightened(self):
        old = os.umask(0o077)
        try:
            self.assertEqual(files.restrict_umask(), 0o077)
            self.assertEqual(os.umask(0o022), 0o077)
            self.assertEqual(files.restrict_umask(), 0o022)
            self.assertEqual(os.umask(0o022), 0o027)
        finally:
            os.umask(old)


class SqliteFileModeTests(UmaskMixin, TestCase):
    async def test_sqlite_database_and_its_wal_are_0640(self):
        self.loose_umask()
        path = os.path.join(self.tmpdir(), "state", "replicator.db")
        db = Database(parse_database({"sqlite": path}))
        self.addCleanup(db.close)

        await db.runOperation("CREATE TABLE t (x INTEGER)")
        await db.runOperation("INSERT INTO t VALUES (1)")
        self.assertEqual(mode(path), 0o640)
        self.assertEqual(mode(path + "-wal"), 0o640)
        self.assertEqual(mode(os.path.dirname(path)), 0o750)


class SecretFileWarningTests(UmaskMixin, SynchronousTestCase):
    def setUp(self):
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def warnings(self):
        return [formatEvent(e) for e in self.events if "secret file" in formatEvent(e)]

    def test_warned_only_when_others_can_read(self):
        path = os.path.join(self.tmpdir(), "secret")
        with open(path, "w") as f:
            f.write(SECRET)
        for bits, warned in ((0o600, False), (0o640, False), (0o400, False),
                             (0o644, True), (0o604, True)):
            os.chmod(path, bits)
            self.events.clear()
            self.assertEqual(files.warn_if_exposed(path, "http.secret_file"), warned, oct(bits))
            self.assertEqual(len(self.warnings()), int(warned))
        self.assertEqual(self.warnings(), [
            f"http.secret_file: secret file {path} is readable by every user (mode 0604); "
            f"make it private: chmod 600 {path}"])


class DaemonFileModeTests(SynchronousTestCase):
    """`replicator run` started from a shell with umask 022."""

    def test_daemon_files_are_private_and_an_exposed_secret_is_warned_about(self):
        http_port = free_port()
        config = base_config("master", http_port, [CACHES], database={"sqlite": "db/state.db"},
                             consumers=[{"type": "jsonl", "path": "out/facts.jsonl"}])
        config["http"] = {"listen": f"tcp:{http_port}:interface=127.0.0.1",
                          "secret_file": "secret"}
        daemon = Daemon(self, config)
        secret = os.path.join(daemon.dir, "secret")
        with open(secret, "w") as f:
            f.write(SECRET + "\n")
        os.chmod(secret, 0o644)
        old = os.umask(0o022)
        try:
            daemon.start()
        finally:
            os.umask(old)
        status, _ = http(daemon.http_base + "/_replicator/v1/streams/caches/facts",
                         b'{"rows": [["f", null, 1]]}', SECRET)
        self.assertEqual(status, 200)
        created = {name: mode(os.path.join(daemon.dir, name))
                   for name in ("db", "db/state.db", "db/state.db-wal", "out", "out/facts.jsonl")}
        self.assertEqual(created, {"db": 0o750, "db/state.db": 0o640, "db/state.db-wal": 0o640,
                                   "out": 0o750, "out/facts.jsonl": 0o640})
        daemon.kill()
        self.assertIn("http.secret_file: secret file ./secret is readable by every user "
                      "(mode 0644); make it private: chmod 600 ./secret", daemon.output())
