"""SIGHUP reloads the config: over real processes (a master + worker pair on
PostgreSQL, one cluster for every check), and the plan of what applies live
and what needs a restart, in memory."""

import dataclasses
import json
import os
import signal

import yaml
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import parse_instance
from replicator.daemon.reload import plan
from tests.daemon import CACHES, SECRET, Daemon, base_config, http, metric
from tests.servers import PostgresServer, free_port, wait_for


class ReloadClusterTests(SynchronousTestCase):
    """A running master + worker1 pair: a writer added by SIGHUP, a database
    change refused, an invalid file kept out, a log level applied."""

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()

    def write(self, daemon, stream, rows):
        status, body = http(f"{daemon.http_base}/_replicator/v1/streams/{stream}/facts",
                            json.dumps({"rows": rows}).encode(), SECRET)
        return json.loads(body)["stream_id"]

    @staticmethod
    def jsonl_writers(daemon, name):
        path = os.path.join(daemon.dir, f"facts-{name}.jsonl")
        if not os.path.exists(path):
            return set()
        with open(path) as f:
            return {(e["stream"], e["writer"]) for e in map(json.loads, f) if "rows" in e}

    @staticmethod
    def rewrite(daemon, **changes):
        daemon.config = dict(daemon.config, **changes)
        with open(daemon.path, "w") as f:
            yaml.safe_dump(daemon.config, f)

    @staticmethod
    def hup_and_wait(daemon, marker):
        """SIGHUP to the daemon's PID; the first new output line containing
        ``marker`` (after what was there before)."""
        before = len(daemon.output())
        os.kill(daemon.proc.pid, signal.SIGHUP)
        found = []

        def said():
            if daemon.proc.poll() is not None:
                raise AssertionError(f"{daemon.path} exited with {daemon.proc.returncode}: "
                                     f"{daemon.output()[-2000:]}")
            found[:] = [line for line in daemon.output()[before:].splitlines()
                        if marker in line]
            return bool(found)

        wait_for(said, 60, f"{marker!r} from {daemon.path}")
        return found[0], daemon.output()[before:]

    def test_reload_adds_a_writer_refuses_a_database_change_and_keeps_a_bad_file_out(self):
        rep_port = free_port()
        streams = [dict(CACHES, writers=["master", "worker1"])]
        master_cfg = base_config(
            "master", free_port(), streams, database={"postgres": self.dsn},
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        master_cfg["http"]["metrics_listen"] = f"127.0.0.1:{free_port()}"
        master = Daemon(self, master_cfg, "master")
        worker_cfg = lambda name, s: base_config(  # noqa: E731
            name, free_port(), s, database={"postgres": self.dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            consumers=[{"type": "jsonl", "path": f"facts-{name}.jsonl"}])
        worker1 = Daemon(self, worker_cfg("worker1", streams), "worker1")
        master.start()
        worker1.start()
        pids = (master.proc.pid, worker1.proc.pid)
        metrics_url = f"http://{master.config['http']['metrics_listen']}/metrics"

        # The link is up: the master's fact reaches worker1.
        self.write(master, "caches", [["m0", None, 0]])
        wait_for(lambda: ("caches", "master") in self.jsonl_writers(worker1, "worker1"), 60,
                 "worker1 has the master's fact")
        disconnects = metric(http(metrics_url)[1].decode(), "replicator_disconnects_total")
        made = master.output().count("Replication connection")

        # (1) A new writer, worker2, of caches, and a new stream the master
        # writes: both files edited, SIGHUP to both.
        with_worker2 = [dict(CACHES, writers=["master", "worker1", "worker2"]),
                        {"name": "more", "table": "more_stream", "columns": [{"x": "text"}],
                         "writers": ["master"]}]
        self.rewrite(master, streams=with_worker2, log_level="debug")
        self.rewrite(worker1, streams=with_worker2)
        line, _ = self.hup_and_wait(master, "reload: applied")
        self.assertIn("streams[0].writers", line)
        self.assertIn("streams[1] (stream more)", line)
        self.assertIn("log_level", line)
        self.assertIn("needs restart: nothing", line)
        line, _ = self.hup_and_wait(worker1, "reload: applied")
        self.assertIn("streams[0].writers", line)

        self.write(master, "more", [["new"]])  # its table was created at the reload
        try:
            wait_for(lambda: ("more", "master") in self.jsonl_writers(worker1, "worker1"), 60,
                     "worker1 has the new stream's fact")
        except AssertionError as e:
            raise AssertionError(f"{e}; master: {master.output()[-3000:]}; "
                                 f"worker1: {worker1.output()[-3000:]}") from None
        worker2 = Daemon(self, worker_cfg("worker2", with_worker2), "worker2").start()
        self.write(worker2, "caches", [["w2", ["k"], 2]])
        wait_for(lambda: ("caches", "worker2") in self.jsonl_writers(worker1, "worker1"), 60,
                 "worker1 has worker2's fact")
        # No restart, and the master-worker1 link never dropped.
        self.assertEqual((master.proc.pid, worker1.proc.pid), pids)
        self.assertIsNone(master.proc.poll())
        self.assertEqual(metric(http(metrics_url)[1].decode(), "replicator_disconnects_total"),
                         disconnects)

        # (4) The log level applied: a successful request is logged at debug now.
        mark = len(master.output())
        http(master.http_base + "/health")
        wait_for(lambda: "/health" in master.output()[mark:], 30, "a debug access line")

        # (2) A database change is refused in one line; the rest keeps serving.
        self.rewrite(worker1, database={"postgres": self.dsn + "_other"})
        line, out = self.hup_and_wait(worker1, "reload: applied")
        self.assertIn("needs restart: database.postgres", line)
        refusals = [entry for entry in out.splitlines() if "changed in the file" in entry]
        self.assertEqual(len(refusals), 1, out)
        self.assertIn("reload: database.postgres: changed in the file; needs a restart; "
                      "keeping the running value", refusals[0])
        self.write(worker1, "caches", [["still", None, 3]])
        self.assertEqual(http(worker1.http_base + "/health")[0], 200)

        # (3) An invalid file: one line naming the key; the old config runs on.
        self.rewrite(worker1, replication={"upstream": "tcp:host=127.0.0.1:port=notaport"})
        line, out = self.hup_and_wait(worker1, "keeping the running config")
        self.assertIn("replication.upstream", line)
        self.assertNotIn("reload: applied", out)
        self.write(worker1, "caches", [["after", None, 4]])
        wait_for(lambda: master.output().count("Replication connection") == made + 2, 30,
                 "worker2's connection only")  # made + named: worker2, nobody else
        self.assertEqual((master.proc.pid, worker1.proc.pid), pids)

        for d in (master, worker1, worker2):
            d.kill(signal.SIGTERM)
            self.assertEqual(d.proc.returncode, 0, d.output()[-2000:])


def _config(**changes):
    base = {
        "server_name": "hs.test", "instance_name": "worker1",
        "database": {"postgres": "dbname=a"},
        "replication": {"upstream": "tcp:host=127.0.0.1:port=9092"},
        "streams": [dict(CACHES, writers=["master", "worker1"])],
    }
    base.update(changes)
    return parse_instance(base)


class PlanTests(SynchronousTestCase):
    """What a reload applies, and what it keeps until a restart."""

    def test_nothing_changed(self):
        p = plan(_config(), _config())
        self.assertEqual((p.applied, p.restart), ([], []))

    def test_live_keys(self):
        read = _config(log_level="debug", log_format="json",
                       health={"lag_grace": 30}, streams=[
                           dict(CACHES, writers=["master", "worker1", "worker2"]),
                           {"name": "more", "table": "more_stream",
                            "columns": [{"x": "text"}], "writers": ["worker2"]}])
        p = plan(_config(), read)
        self.assertEqual(p.restart, [])
        self.assertEqual(p.applied, ["log_level", "log_format", "health", "streams[0].writers",
                                     "streams[1] (stream more)"])
        self.assertEqual(p.config, dataclasses.replace(read, path=None))

    def test_restart_keys_keep_their_running_values(self):
        running = _config()
        read = _config(instance_name="worker9", database={"postgres": "dbname=b"},
                       replication={"upstream": "tcp:host=127.0.0.1:port=9093",
                                    "ping_interval": 2})
        p = plan(running, read)
        self.assertEqual(p.restart, ["instance_name", "database.postgres",
                                     "replication.upstream", "replication.ping_interval"])
        self.assertEqual(p.config, running)

    def test_a_stream_removed_or_its_columns_changed_needs_a_restart(self):
        p = plan(_config(), _config(streams=[dict(CACHES, writers=["master", "worker1"],
                                                  columns=[{"cache_func": "text"}])]))
        self.assertEqual(p.restart, ["streams[0]"])
        self.assertEqual(p.config, _config())

    def test_a_stream_written_here_alone_gains_a_writer_at_a_restart(self):
        alone = [dict(CACHES, writers=["worker1"])]
        p = plan(_config(streams=alone),
                 _config(streams=[dict(CACHES, writers=["worker1", "worker2"])]))
        self.assertEqual(p.restart, ["streams[0].writers (written here alone)"])

    def test_peer_policy_is_live(self):
        running = parse_instance({
            "server_name": "hs.test", "instance_name": "master",
            "database": {"postgres": "dbname=a"},
            "replication": {"listen": "tcp:9092:interface=127.0.0.1",
                            "allowed_peers": ["worker1"]},
            "streams": [dict(CACHES, writers=["master"])]})
        read = dataclasses.replace(running, replication=dataclasses.replace(
            running.replication, allowed_peers=("worker1", "worker2")))
        p = plan(running, read)
        self.assertTrue(p.peers)
        self.assertEqual(p.applied, ["replication.allowed_peers"])
        self.assertEqual(p.config.replication.allowed_peers, ("worker1", "worker2"))
