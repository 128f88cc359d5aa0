"""Where a new consumer starts (``start: beginning|now``), over real
processes: a master + worker pair on PostgreSQL, the consumer added at a
reload (SIGHUP) and at a restart.

A new ``jsonl`` file (no state) begins with a position line per (stream,
writer) it starts from; with ``beginning`` (the default) it then holds every
fact still in the table, caught up for it alone; with ``now`` the facts
after the reader's current position.  ``replicator verify`` says EQUAL for
both, naming the range it checked.
"""

import json
import os
import signal

from twisted.trial.unittest import SynchronousTestCase

from replicator.config import ConfigError, ConsumerConfig
from replicator.consumers.loading import check_consumers
from tests import test_reload
from tests.daemon import CACHES, Daemon, base_config, replicator
from tests.servers import PostgresServer, free_port, wait_for


def _lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def _facts(path):
    return [e["token"] for e in _lines(path) if "rows" in e]


class ConsumerStartTests(SynchronousTestCase):
    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        rep_port = free_port()
        self.master = Daemon(self, base_config(
            "master", free_port(), [CACHES], database={"postgres": self.dsn},
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"}), "master")
        self.worker = Daemon(self, base_config(
            "worker1", free_port(), [CACHES], database={"postgres": self.dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            consumers=[{"type": "jsonl", "path": "a.jsonl"}]), "worker1")
        self.master.start()
        self.worker.start()
        self.write = test_reload.ReloadClusterTests.write.__get__(self)
        self.t1 = self.write(self.master, "caches", [["f1", None, 1]])
        self.t2 = self.write(self.master, "caches", [["f2", None, 2]])
        wait_for(lambda: _facts(self.path("a.jsonl")) == [self.t1, self.t2], 60, "a has both")

    def path(self, name):
        return os.path.join(self.worker.dir, name)

    def added(self, name, start=None):
        consumer = {"type": "jsonl", "path": name, "flush_interval": 0.01}
        if start is not None:
            consumer["start"] = start
        return consumer

    def check(self, name, tokens, begins_at):
        """``name`` holds ``tokens`` after one position line ``begins_at``,
        and ``verify`` says so."""
        try:
            wait_for(lambda: _facts(self.path(name))[-1:] == tokens[-1:], 60, f"{name} caught up")
        except AssertionError as e:
            raise AssertionError(f"{e}: {_lines(self.path(name))}; worker: "
                                 f"{self.worker.output()[-3000:]}") from None
        lines = _lines(self.path(name))
        self.assertEqual(lines[0], {"stream": "caches", "writer": "master",
                                    "position": begins_at}, name)
        self.assertEqual(_facts(self.path(name)), tokens, name)
        code, out, err = replicator("verify", "-c", self.worker.path, name, cwd=self.worker.dir)
        self.assertEqual((code, err), (0, ""), out)
        self.assertIn(f"caches/master: {len(tokens)} facts, checked from token {begins_at} of "
                      f"writer master to ", out)
        self.assertIn(f"verify: EQUAL: {len(tokens)} facts", out)

    def test_added_at_a_reload(self):
        test_reload.ReloadClusterTests.rewrite(self.worker, consumers=[
            {"type": "jsonl", "path": "a.jsonl"}, self.added("b.jsonl"),
            self.added("n.jsonl", "now")])
        line, _ = test_reload.ReloadClusterTests.hup_and_wait(self.worker, "reload: applied")
        self.assertIn("needs restart: nothing", line)
        t3 = self.write(self.master, "caches", [["f3", None, 3]])
        self.check("b.jsonl", [self.t1, self.t2, t3], 0)
        self.check("n.jsonl", [t3], self.t2)
        self.assertEqual(_facts(self.path("a.jsonl")), [self.t1, self.t2, t3])

    def test_added_at_a_restart(self):
        self.worker.kill(signal.SIGTERM)
        test_reload.ReloadClusterTests.rewrite(self.worker, consumers=[
            {"type": "jsonl", "path": "a.jsonl"}, self.added("b.jsonl", "beginning"),
            self.added("n.jsonl", "now")])
        self.worker.start()
        t3 = self.write(self.master, "caches", [["f3", None, 3]])
        self.check("b.jsonl", [self.t1, self.t2, t3], 0)
        self.check("n.jsonl", [t3], self.t2)
        self.assertEqual(_facts(self.path("a.jsonl")), [self.t1, self.t2, t3])

    def test_alone_at_a_restart_it_starts_from_the_beginning(self):
        """The red team's case: the only consumer, new, on a worker that
        already read the writer's facts (its position persisted)."""
        self.worker.kill(signal.SIGTERM)
        test_reload.ReloadClusterTests.rewrite(self.worker, consumers=[self.added("b.jsonl")])
        self.worker.start()
        t3 = self.write(self.master, "caches", [["f3", None, 3]])
        self.check("b.jsonl", [self.t1, self.t2, t3], 0)


class StartOptionTests(SynchronousTestCase):
    def test_a_bad_start_is_one_line_naming_the_key(self):
        for type_ in ("jsonl", "log"):
            options = {"path": "a.jsonl"} if type_ == "jsonl" else {}
            config = ConsumerConfig(type=type_, streams=None,
                                    options=dict(options, start="yesterday"))
            with self.assertRaises(ConfigError) as caught:
                check_consumers([config])
            self.assertEqual(str(caught.exception).splitlines(), [
                "config: consumers[0].start: 'yesterday' is not one of beginning, now"])

    def test_defaults(self):
        """A file keeps every fact by default; a log line is live."""
        jsonl = ConsumerConfig(type="jsonl", streams=None, options={"path": "a.jsonl"})
        log = ConsumerConfig(type="log", streams=None, options={})
        with self.subTest("jsonl"):
            from replicator.consumers import jsonl_options
            self.assertEqual(jsonl_options.options_of(jsonl, ".", "c")["start"], "beginning")
        from replicator.consumers import log as log_module
        self.assertEqual(log_module.options_of(log, "c")["start"], "now")
