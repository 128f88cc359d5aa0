"""The status page in a real browser: headless Chromium loads ``GET /`` from
a running worker (a real ``replicator run`` on PostgreSQL) after writes on
two writers, with a reader held back by a stuck consumer.  The DOM after the
page's script refreshed it is checked against the positions API, and
screenshots (desktop and phone width) are saved under ``_trial_temp``.

With CI=true a missing ``chromium`` is a failure, never a skip.
"""

import json
import os
import signal
import time

from twisted.trial.unittest import SynchronousTestCase

from replicator.config import parse_streams
from tests.cdp import chromium
from tests.daemon import CACHES, SECRET, Daemon, base_config, cli, http
from tests.servers import PostgresServer, free_ports, wait_for
from tests.status_page import Cells, get, run_chromium
from tests.support import create_stream_tables

ACCOUNT_DATA = {
    "name": "account_data", "table": "account_data_stream",
    "columns": [{"user_id": "text"}, {"room_id": "text?"}, {"data_type": "text"}],
    "writers": ["worker1"],
}

#: A consumer that takes the first fact and then never finishes one: its
#: reader falls behind for good (a slow or wedged consumer).
STUCK_CONSUMER = '''
from twisted.internet import defer
from replicator.consumers import Consumer


class Stuck(Consumer):
    def __init__(self, streams=None):
        self.streams = streams
        self.taken = 0

    def on_facts(self, stream, writer, token, rows):
        self.taken += 1
        if self.taken > 1:
            return defer.Deferred()  # never fires
'''


class StatusPageBrowserTests(SynchronousTestCase):
    def test_page_in_chromium_matches_the_positions_api(self):
        chromium()
        dsn = PostgresServer.shared().create_database()
        rep_port, master_http, worker_http = free_ports(3)
        streams = [dict(CACHES, writers=["master"]), ACCOUNT_DATA]
        master = base_config("master", master_http, streams, database={"postgres": dsn},
                             replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        worker = base_config(
            "worker1", worker_http, streams, database={"postgres": dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            health={"lag_grace": 1, "check_interval": 1},
            consumers=[{"type": "stuck:Stuck", "streams": ["caches"]}])
        # worker1 writes account_data; the master, which only reads it,
        # creates nothing: the writer's table exists first.
        create_stream_tables(dsn, parse_streams(streams))
        master_d = Daemon(self, master, "master").start()
        worker_d = Daemon(self, worker, "worker1")
        with open(os.path.join(worker_d.dir, "stuck.py"), "w") as f:
            f.write(STUCK_CONSUMER)
        worker_d.start()
        base = worker_d.http_base

        def positions():
            return json.loads(http(base + "/_replicator/v1/positions", secret=SECRET)[1])

        wait_for(lambda: positions()["streams"]["caches"]["writers"]["master"]
                 ["reader_position"] is not None, 60, "worker1 hearing the master")
        for i in range(6):
            written = cli("write", "-c", master_d.path, "caches",
                          json.dumps(["get_user", [f"@u{i}:hs"], 1000 + i]), cwd=master_d.dir)
            self.assertEqual(written.returncode, 0, written.stderr)
        for i in range(3):
            written = cli("write", "-c", worker_d.path, "account_data",
                          json.dumps([f"@u{i}:hs", None, "m.push_rules"]), cwd=worker_d.dir)
            self.assertEqual(written.returncode, 0, written.stderr)

        def lagging():
            w = positions()["streams"]["caches"]["writers"]["master"]
            return w["position"] is not None and w["lag"] == 5

        wait_for(lagging, 60, "the stuck reader 5 facts behind")

        # The page and its JSON need no secret and show none.
        def sampled():
            code, _, body = get(base + "/status.json")
            snap = json.loads(body)
            history = snap["streams"][0]["writers"][0]["lag_history"]
            return (code == 200 and not snap["healthy"]
                    and sum(1 for _, lag in history if lag == 5) >= 2)

        wait_for(sampled, 60, "two lag samples and an unhealthy verdict")
        code, headers, page = get(base + "/")
        self.assertEqual(code, 200)
        self.assertEqual(headers["Content-Type"], "text/html; charset=utf-8")
        csp = headers["Content-Security-Policy"]
        self.assertIn("default-src 'none'", csp)
        self.assertIn("script-src 'self'", csp)
        self.assertNotIn("unsafe-inline", csp)
        for path in ("/", "/status.json", "/status.js", "/status.css"):
            self.assertNotIn(SECRET.encode(), get(base + path)[2])
        self.assertEqual(get(base + "/_replicator/v1/positions")[0], 401)

        # The DOM once the script refreshed it, against the positions API.
        dumped = run_chromium("--virtual-time-budget=10000", "--dump-dom", base + "/")
        self.assertEqual(dumped.returncode, 0, dumped.stderr[-2000:])
        dom = Cells()
        dom.feed(dumped.stdout)
        self.assertIn("data-refreshed", dom.body, dumped.stdout[:3000])
        self.assertEqual(dom.texts["refresh"], "(refreshed)")
        self.assertEqual(dom.texts["instance"], "worker1")
        self.assertTrue(dom.texts["verdict"].startswith("unhealthy: "), dom.texts)
        api = positions()
        rows = {(r["stream"], r["writer"]): r for r in dom.tables["writers"]}
        expected = set()
        for stream, entry in api["streams"].items():
            for writer, w in entry["writers"].items():
                label = writer + (" (local)" if w["local"] else "")
                expected.add((stream, label))
                row = rows[(stream, label)]
                self.assertEqual(row["position"], str(w["position"]), row)
                self.assertEqual(row["linear"], str(entry["linear"]), row)
                if w["local"]:
                    self.assertEqual(row["in flight"], str(w["in_flight"]), row)
                    self.assertEqual(row["verdict"], "ok")
                else:
                    self.assertEqual(row["reader"], str(w["reader_position"]), row)
                    self.assertEqual(row["lag (15 min)"], str(w["lag"]), row)
                    # The row says what the banner's checks found about it.
                    self.assertRegex(row["verdict"],
                                     r"^5 committed facts not received for \d+s"
                                     r"(; lagging by 5 for \d+s)?$")
        self.assertEqual(set(rows), expected)
        self.assertEqual(api["streams"]["account_data"]["writers"]["worker1"]["position"], 3)
        self.assertIn("<polyline", dumped.stdout)
        [conn] = dom.tables["connections"]
        self.assertEqual((conn["peer"], conn["role"]), ("hs.test", "upstream"))  # its SERVER name
        self.assertEqual(conn["address"], f"127.0.0.1:{rep_port}")
        self.assertIn("stream caches: writer master has 5 committed facts not received",
                      dom.texts["problems"])

        # Screenshots, desktop and phone width: artifacts of this test run.
        for name, size in (("status-page.png", "1280,720"),
                           ("status-page-phone.png", "390,1400")):
            path = os.path.abspath(name)
            shot = run_chromium(f"--window-size={size}", "--virtual-time-budget=10000",
                                "--hide-scrollbars", f"--screenshot={path}", base + "/")
            self.assertEqual(shot.returncode, 0, shot.stderr[-2000:])
            with open(path, "rb") as f:
                head = f.read(24)
            self.assertEqual(head[:8], b"\x89PNG\r\n\x1a\n")
            width = int.from_bytes(head[16:20], "big")
            self.assertEqual(width, int(size.split(",")[0]))


class FrozenMasterTests(SynchronousTestCase):
    def test_a_worker_says_what_its_link_to_a_frozen_master_is(self):
        """The master stopped (SIGSTOP) past the worker's ping_timeout: its
        kernel still accepts the worker's reconnects, which nobody answers.
        The worker's page never shows one as connected, names its upstream
        one way (its SERVER name) in connections and disconnects alike, and
        lists the outage once, from when the master was last heard."""
        dsn = PostgresServer.shared().create_database()
        rep_port, master_http, worker_http = free_ports(3)
        streams = [dict(CACHES, writers=["master"])]
        master = base_config("master", master_http, streams, database={"postgres": dsn},
                             replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"})
        worker = base_config(
            "worker1", worker_http, streams, database={"postgres": dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}",
                         "ping_interval": 0.5, "ping_timeout": 2,
                         "reconnect_initial_delay": 0.1, "reconnect_max_delay": 0.3},
            health={"lag_grace": 1, "check_interval": 1})
        create_stream_tables(dsn, parse_streams(streams))
        master_d = Daemon(self, master, "master").start()
        worker_d = Daemon(self, worker, "worker1").start()
        base = worker_d.http_base

        def status():
            code, _, body = get(base + "/status.json")
            self.assertEqual(code, 200)
            return json.loads(body)

        def linked():
            # One snapshot: the link's handshake done, not only answered
            # (healthy comes a moment before the state says connected).
            snap = status()
            return (snap["healthy"] and len(snap["connections"]) == 1
                    and snap["connections"][0]["state"] == "connected")

        wait_for(linked, 60, "worker1 connected and healthy")
        [before] = status()["connections"]
        self.assertEqual(before["peer"], "hs.test")
        stopped_at = time.time()
        master_d.proc.send_signal(signal.SIGSTOP)
        self.addCleanup(master_d.proc.send_signal, signal.SIGCONT)

        seen = []

        def unanswered_reconnect():
            snap = status()
            seen.append(snap)
            timed_out = [d for d in snap["disconnects"] if d["reason"] == "ping_timeout"]
            return timed_out and not snap["healthy"] and snap["connections"]

        wait_for(unanswered_reconnect, 60, "a reconnect the frozen master does not answer")
        snap = seen[-1]
        self.assertEqual([c.get("state") for c in snap["connections"]], ["handshake"], snap)
        for s in seen:
            if any(d["reason"] == "ping_timeout" for d in s["disconnects"]):
                # Past the ping timeout no link is connected.
                self.assertNotIn("connected", [c["state"] for c in s["connections"]], s)
            else:
                self.assertTrue(all(c["state"] in ("connected", "stalled")
                                    for c in s["connections"]), s)
        stalled = [c for s in seen for c in s["connections"] if c["state"] == "stalled"]
        for c in stalled:  # the first link, silent: since it last heard the master
            self.assertLessEqual(c["state_since"], stopped_at)
        [conn] = snap["connections"]
        self.assertRegex(conn["state_text"],
                         r"^handshake not answered since \d\d:\d\d:\d\d UTC \(\d+s\)$")
        # One name for the upstream, from connect to disconnect.
        names = {c["peer"] for s in seen for c in s["connections"]}
        names |= {d["peer"] for d in snap["disconnects"]}
        self.assertEqual(names, {"hs.test"})
        # The outage is one problem, from when the master was last heard,
        # said once ("not connected" not twice in one line).
        ongoing = [p for p in snap["problems"] if p["until"] is None]
        self.assertEqual(len(ongoing), 1, snap["problems"])
        [problem] = ongoing
        self.assertEqual(problem["reason"], snap["problem"])
        self.assertRegex(problem["reason"],
                         r"^replication not connected: upstream tcp:host=127\.0\.0\.1:port=\d+ "
                         r"not answering since \d\d:\d\d:\d\d UTC \(\d+s\)$")
        self.assertLessEqual(problem["at"], stopped_at)
        self.assertGreaterEqual(problem["at"], before["connected_since"])
        self.assertEqual(len([p for p in snap["problems"] if p["reason"].startswith(
            f"replication not connected: upstream tcp:host=127.0.0.1:port={rep_port} not "
            "answering")]), 1, snap["problems"])
        # The page shows the same.
        page = get(base + "/")[2].decode()
        self.assertIn("handshake not answered since", page)
