"""SIGUSR1 (``replicator reopen``) reopens the output files and nothing
else, over real processes (a master + worker pair on PostgreSQL, the
worker's ``jsonl`` output rotated by renaming it); the PID file it finds
the daemon by, in memory."""

import fcntl
import json
import os
import signal

import yaml
from twisted.trial.unittest import SynchronousTestCase

from replicator.daemon.pidfile import PidFileError, hold, running
from tests.daemon import CACHES, SECRET, Daemon, base_config, cli, http
from tests.servers import PostgresServer, free_port, wait_for


def _facts(path):
    """The (stream, writer, first row's first column) of each fact line."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(e["stream"], e["writer"], e["rows"][0][0])
                for e in map(json.loads, f) if "rows" in e]


class ReopenTests(SynchronousTestCase):

    def write(self, daemon, value):
        http(f"{daemon.http_base}/_replicator/v1/streams/caches/facts",
             json.dumps({"rows": [[value, None, 0]]}).encode(), SECRET)

    def said(self, daemon, before, marker):
        """The first output line after offset ``before`` holding ``marker``."""
        found = []

        def there():
            if daemon.proc.poll() is not None:
                raise AssertionError(f"{daemon.path} exited with {daemon.proc.returncode}: "
                                     f"{daemon.output()[-2000:]}")
            found[:] = [line for line in daemon.output()[before:].splitlines()
                        if marker in line]
            return bool(found)

        wait_for(there, 60, f"{marker!r} from {daemon.path}")
        return found[0]

    def test_usr1_reopens_the_rotated_output_and_leaves_a_config_edit_unapplied(self):
        dsn = PostgresServer.shared().create_database()
        rep_port = free_port()
        master = Daemon(self, base_config(
            "master", free_port(), [CACHES], database={"postgres": dsn},
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"}), "master")
        worker = Daemon(self, {}, "worker1")
        worker.config = base_config(
            "worker1", free_port(), [CACHES], database={"postgres": dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            pid_file=os.path.join(worker.dir, "run", "worker1.pid"),
            consumers=[{"type": "jsonl", "path": "facts.jsonl"}])
        with open(worker.path, "w") as f:
            yaml.safe_dump(worker.config, f)
        master.start()
        worker.start()
        with open(worker.config["pid_file"]) as f:
            self.assertEqual(f.read(), f"{worker.proc.pid}\n")
        output = os.path.join(worker.dir, "facts.jsonl")
        rotated = output + ".1"
        other = os.path.join(worker.dir, "other.jsonl")

        self.write(master, "before")
        wait_for(lambda: ("caches", "master", "before") in _facts(output), 60,
                 "the first fact in facts.jsonl")

        # An edit on disk, waiting for a reload: a second consumer.
        worker.config["consumers"] = worker.config["consumers"] + [
            {"type": "jsonl", "path": "other.jsonl"}]
        with open(worker.path, "w") as f:
            yaml.safe_dump(worker.config, f)

        # logrotate's move, then its postrotate.
        os.rename(output, rotated)
        mark = len(worker.output())
        done = cli("reopen", "-c", worker.path)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout, f"replicator: sent SIGUSR1 to PID {worker.proc.pid} "
                                      f"(worker1): it reopens its output files\n")
        line = self.said(worker, mark, "reopen: ")
        self.assertIn("reopen: 1 output file reopened; the config file not read", line)
        self.assertTrue(os.path.exists(output), "reopened at once, not at the next batch")

        self.write(master, "after")
        wait_for(lambda: ("caches", "master", "after") in _facts(output), 60,
                 "the second fact in the new facts.jsonl")
        self.assertEqual(_facts(rotated), [("caches", "master", "before")])
        self.assertEqual(_facts(output), [("caches", "master", "after")])
        # The edit was not applied: no reload, no second consumer.
        self.assertNotIn("reload:", worker.output()[mark:])
        self.assertFalse(os.path.exists(other))

        # SIGHUP is the reload: it applies the same edit.
        mark = len(worker.output())
        os.kill(worker.proc.pid, signal.SIGHUP)
        line = self.said(worker, mark, "reload: applied")
        self.assertIn("consumers[1] (jsonl) started", line)
        wait_for(lambda: ("caches", "master", "before") in _facts(other), 60,
                 "the second consumer caught up")

        for d in (worker, master):
            d.kill(signal.SIGTERM)
            self.assertEqual(d.proc.returncode, 0, d.output()[-2000:])
        self.assertFalse(os.path.exists(worker.config["pid_file"]), "removed at a clean stop")
        done = cli("reopen", "-c", worker.path)
        self.assertEqual(done.returncode, 1)
        self.assertIn("does not exist: is the daemon running?", done.stderr)

    def test_reopen_without_a_pid_file_names_the_key(self):
        daemon = Daemon(self, base_config("master", free_port(), [CACHES],
                                          database={"sqlite": "x.sqlite"}))
        done = cli("reopen", "-c", daemon.path)
        self.assertEqual(done.returncode, 2)
        self.assertTrue(done.stderr.startswith("replicator: config: pid_file: not set"),
                        done.stderr)

    def test_reopen_with_an_unreadable_pid_file_is_one_line(self):
        """A pid_file that is held but cannot be read (here a directory that
        another process holds a lock on) is one line and exit 1, not a
        traceback of the PID never read."""
        held_dir = os.path.abspath(self.mktemp())
        os.makedirs(held_dir)
        fd = os.open(held_dir, os.O_RDONLY)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_EX)
        daemon = Daemon(self, base_config("master", free_port(), [CACHES],
                                          database={"sqlite": "x.sqlite"}, pid_file=held_dir))
        done = cli("reopen", "-c", daemon.path)
        self.assertEqual(done.returncode, 1, done.stderr)
        self.assertEqual(done.stderr.splitlines(),
                         [f"replicator: pid_file: cannot read {held_dir}: Is a directory"])


class PidFileTests(SynchronousTestCase):

    def setUp(self):
        self.path = os.path.join(self.mktemp(), "d.pid")

    def test_held_once_and_removed_at_release(self):
        held = hold(self.path)
        self.assertEqual(running(self.path), os.getpid())
        with self.assertRaises(PidFileError) as e:
            hold(self.path)
        self.assertIn(f"is held by another running daemon (PID {os.getpid()})",
                      str(e.exception))
        held.release()
        self.assertFalse(os.path.exists(self.path))

    def test_a_file_left_by_a_killed_daemon_is_not_signalled(self):
        os.makedirs(os.path.dirname(self.path))
        with open(self.path, "w") as f:
            f.write("1\n")  # a PID nobody holds the file for
        with self.assertRaises(PidFileError) as e:
            running(self.path)
        self.assertIn("is not held by a running daemon", str(e.exception))
        held = hold(self.path)  # and a start takes it over
        self.assertEqual(running(self.path), os.getpid())
        held.release()

    def test_a_held_file_that_cannot_be_read_is_a_pid_file_error(self):
        os.makedirs(self.path)  # a directory: it opens and locks, and does not read
        fd = os.open(self.path, os.O_RDONLY)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_EX)
        with self.assertRaises(PidFileError) as e:
            running(self.path)
        self.assertEqual(str(e.exception),
                         f"pid_file: cannot read {os.path.abspath(self.path)}: Is a directory")
