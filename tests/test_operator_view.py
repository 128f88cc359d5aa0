"""What an operator sees is what is true, over real processes.

One cluster on PostgreSQL over TCP: ``master`` (the hub) and ``worker1`` up,
``worker2`` killed with ``kill -9`` (twice: the first outage ends when it
comes back), ``worker3`` configured and never started.  Then the status
page in headless Chromium (kept open by :class:`tests.cdp.Browser`),
``/status.json``, ``replicator positions`` (text and ``--json``) and
``/metrics`` must say per writer whether it is connected and since when,
when it was last heard, and what holds each stream's linear token; a row's
verdict and the banner come from the same checks; a problem that ended
shows from–to; and once the daemon is stopped the open page says, after
two failed refreshes, that what it shows is stale.  Screenshots go to the
test's temp dir.

The roles each instance names itself with, over TCP and over Redis.
"""

import json
import os
import re
import signal

import psycopg2
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import parse_streams
from tests.cdp import Browser
from tests.daemon import CACHES, SECRET, Daemon, base_config, cli, http
from tests.servers import PostgresServer, RedisServer, free_port, wait_for
from tests.status_page import get
from tests.support import create_stream_tables

ACCOUNT_DATA = {
    "name": "account_data", "table": "account_data_stream",
    "columns": [{"user_id": "text"}, {"room_id": "text?"}, {"data_type": "text"}],
    "writers": ["worker1", "worker3"],
}
HEALTH = {"lag_grace": 1, "check_interval": 1}

#: Every writers-table row as {data-label: text}, and the other parts' texts.
READ_PAGE = """(() => {
  const rows = Array.from(document.querySelectorAll('#writers tbody tr')).map(tr => {
    const row = {};
    tr.querySelectorAll('td').forEach(td => {
      row[td.getAttribute('data-label')] = td.textContent;
    });
    return row;
  });
  const v = document.getElementById('verdict');
  return {rows: rows, verdict: v.textContent, verdictClass: v.className,
          role: document.getElementById('role').textContent,
          problems: Array.from(document.querySelectorAll('#problems li')).map(li => li.textContent),
          refreshed: document.body.getAttribute('data-refreshed')};
})()"""


def status(daemon):
    return json.loads(http(daemon.http_base + "/status.json")[1])


def by_key(page):
    return {(r["stream"], r["writer"]): r for r in page["rows"]}


def write(daemon, stream, rows):
    return json.loads(http(f"{daemon.http_base}/_replicator/v1/streams/{stream}/facts",
                           json.dumps({"rows": rows}).encode(), SECRET)[1])["stream_id"]


def metric(text, prefix):
    for line in text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


class OperatorViewTests(SynchronousTestCase):

    def test_dead_writer_never_started_writer_and_stopped_daemon(self):
        dsn = PostgresServer.shared().create_database()
        rep_port = free_port()
        streams = [dict(CACHES, writers=["master", "worker2"]), ACCOUNT_DATA]
        upstream = {"upstream": f"tcp:host=127.0.0.1:port={rep_port}"}
        master = Daemon(self, base_config(
            "master", free_port(), streams, database={"postgres": dsn}, health=HEALTH,
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"}), "master")
        w1 = Daemon(self, base_config("worker1", free_port(), streams, health=HEALTH,
                                      database={"postgres": dsn}, replication=upstream),
                    "worker1")
        w2 = Daemon(self, base_config("worker2", free_port(), streams, health=HEALTH,
                                      database={"postgres": dsn}, replication=upstream),
                    "worker2")
        create_stream_tables(dsn, parse_streams(streams))
        for d in (master, w1, w2):
            d.start()
        for i in range(3):
            write(master, "caches", [[f"m{i}", None, i]])
            write(w1, "account_data", [[f"@u{i}:hs", None, "m.push_rules"]])
        held = write(w2, "caches", [["w2", None, 1]])

        def heard(d):
            snap = status(d)
            w = {(s["name"], x["writer"]): x for s in snap["streams"] for x in s["writers"]}
            return w[("caches", "worker2")].get("reader_position") == held

        wait_for(lambda: heard(master) and heard(w1), 60, "worker2's fact on master, worker1")

        # worker2 dies; the outage it makes is seen, then ends when it returns.
        w2.kill(signal.SIGKILL)

        def problems(d):
            return status(d)["problems"]

        def outage(d):
            return [p for p in problems(d) if "writer worker2 disconnected" in p["reason"]]

        wait_for(lambda: outage(master), 60, "the master seeing worker2 gone")
        w2.start()
        wait_for(lambda: outage(master) and outage(master)[-1].get("until") is not None, 60,
                 "the outage ended")
        w2.kill(signal.SIGKILL)
        for i in range(3, 6):
            write(master, "caches", [[f"m{i}", None, i]])
        # A fact worker2 committed and never announced (its link died first).
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("INSERT INTO cache_invalidation_stream (stream_id, instance_name, "
                        "cache_func, keys, invalidation_ts) VALUES "
                        "(nextval('cache_invalidation_stream_seq'), 'worker2', 'lost', NULL, 1)")
        conn.close()
        wait_for(lambda: "not received" in (status(master)["problem"] or ""), 60,
                 "the master seeing worker2's unreceived fact")

        # /status.json: per writer, connected or not and since when, last heard.
        snap = status(master)
        writers = {(s["name"], w["writer"]): w for s in snap["streams"] for w in s["writers"]}
        link = writers[("caches", "worker2")]["link"]
        self.assertIs(link["connected"], False, link)
        self.assertIsNotNone(link["since"], link)
        self.assertGreaterEqual(link["heard_age"], 0)
        never = writers[("account_data", "worker3")]["link"]
        self.assertIs(never["connected"], False, never)
        self.assertIsNone(never["heard_age"], never)
        self.assertIn("never connected", never["text"])
        self.assertIs(writers[("account_data", "worker1")]["link"]["connected"], True)
        linear = {s["name"]: s["linear_holder"] for s in snap["streams"]}
        self.assertIn("worker2", linear["caches"]["writers"], linear)
        self.assertIn("by worker2: disconnected since", linear["caches"]["text"])
        self.assertIn("by worker3: never connected", linear["account_data"]["text"])

        # worker1 hears worker2 through the master: it says so once worker2
        # has been silent past its grace (worker2's last lines, relayed
        # just before the kill, may be a second old here).
        def w1_sees_worker2_silent():
            snap = status(w1)
            return any(s["name"] == "caches" and w["writer"] == "worker2"
                       and w.get("verdict") not in (None, "ok")
                       for s in snap["streams"] for w in s["writers"])

        wait_for(w1_sees_worker2_silent, 60, "worker1 seeing worker2 silent")

        # The page, in a real browser, on the master and on worker1.
        browser = Browser(self)
        shots = os.path.abspath("screenshots")
        os.makedirs(shots, exist_ok=True)
        pages = {}
        for name, d in (("worker1", w1), ("master", master)):
            browser.open(d.http_base + "/")
            browser.wait(f"location.href === {json.dumps(d.http_base + '/')} && document.body "
                         "&& document.body.getAttribute('data-refreshed')", 60, f"{name}'s page")
            pages[name] = browser.evaluate(READ_PAGE)
            browser.screenshot(os.path.join(shots, f"status-{name}.png"))
        page = pages["master"]
        rows = by_key(page)
        dead = rows[("caches", "worker2")]
        self.assertIn("disconnected since", dead["verdict"], dead)
        self.assertIn("1 committed fact not received", dead["verdict"], dead)
        self.assertNotRegex(dead["verdict"], r"\bok\b")
        self.assertIn("held by worker2", dead["linear"], dead)
        self.assertIn("never connected", rows[("account_data", "worker3")]["verdict"])
        self.assertIn("held by worker3", rows[("account_data", "worker3")]["linear"])
        self.assertEqual(rows[("caches", "master (local)")]["verdict"], "ok")
        self.assertTrue(page["verdict"].startswith("unhealthy: "), page)
        self.assertEqual(page["role"], "master")
        self.assertTrue(any(re.search(r"\d\d:\d\d:\d\d – \d\d:\d\d:\d\d", p)
                            for p in page["problems"]), page["problems"])
        self.assertTrue(any("ongoing" in p for p in page["problems"]), page["problems"])
        worker_rows = by_key(pages["worker1"])
        seen_from_w1 = worker_rows[("caches", "worker2")]
        self.assertNotEqual(seen_from_w1["verdict"], "ok", seen_from_w1)
        self.assertIn("held by worker2", seen_from_w1["linear"], seen_from_w1)
        self.assertIn("last heard", seen_from_w1["verdict"], seen_from_w1)
        self.assertNotEqual(worker_rows[("account_data", "worker3")]["verdict"], "ok")
        self.assertEqual(pages["worker1"]["role"], "worker")

        # replicator positions, text and JSON.
        out = cli("positions", "-c", master.path)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertRegex(out.stdout, r"caches +worker2 .*disconnected since")
        self.assertRegex(out.stdout, r"account_data +worker3 .*never connected")
        self.assertRegex(out.stdout, r"caches +\(linear\) .*held .*by worker2: disconnected")
        doc = json.loads(cli("positions", "-c", master.path, "--json").stdout)
        self.assertIs(doc["streams"]["caches"]["writers"]["worker2"]["connected"], False)
        self.assertIn("worker2", doc["streams"]["caches"]["linear_holder"]["writers"])

        # Metrics.
        text = http(master.http_base + "/metrics")[1].decode()
        self.assertEqual(metric(text, 'replicator_writer_connected{writer="worker2"}'), 0)
        self.assertEqual(metric(text, 'replicator_writer_connected{writer="worker3"}'), 0)
        self.assertEqual(metric(text, 'replicator_writer_connected{writer="worker1"}'), 1)
        self.assertIsNotNone(metric(
            text, 'replicator_writer_heard_age_seconds{stream="caches",writer="worker2"}'))
        self.assertGreater(metric(text, 'replicator_linear_held_seconds{stream="caches"}'), 0)

        # The daemon stops under its open page: after two failed refreshes
        # the page says that what it shows is stale, and since when.
        master.kill(signal.SIGTERM)
        stale = browser.wait(
            "document.getElementById('verdict').className.includes('stale') && "
            "document.getElementById('verdict').textContent", 60, "the page saying stale")
        self.assertRegex(stale, r"^STALE: no answer from this daemon since "
                                r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC")
        browser.screenshot(os.path.join(shots, "status-master-stopped.png"))
        for d in (w1,):
            d.kill(signal.SIGTERM)


class RoleTests(SynchronousTestCase):
    """``role`` in /health and /status.json over real processes."""

    def roles(self, daemon):
        health = json.loads(get(daemon.http_base + "/health")[2])
        return health["role"], status(daemon)["role"]

    def test_roles_on_redis(self):
        dsn = PostgresServer.shared().create_database()
        redis = RedisServer.shared()
        streams = [dict(CACHES, writers=["master", "worker1"])]
        bus = {"redis": {"endpoint": redis.endpoint}}
        create_stream_tables(dsn, parse_streams(streams))
        master = Daemon(self, base_config("master", free_port(), streams, replication=bus,
                                          database={"postgres": dsn}), "master").start()
        worker = Daemon(self, base_config("worker1", free_port(), streams, replication=bus,
                                          database={"postgres": dsn}), "worker1").start()
        wait_for(lambda: http(master.http_base + "/health")[0] == 200, 60, "master healthy")
        wait_for(lambda: http(worker.http_base + "/health")[0] == 200, 60, "worker healthy")
        self.assertEqual(self.roles(master), ("master", "master"))
        self.assertEqual(self.roles(worker), ("worker", "worker"))
