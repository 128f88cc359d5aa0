"""The operators' kit against the real thing: the Prometheus alert rules
(``contrib/prometheus``) and the Grafana dashboard (``contrib/grafana``).

* ``promtool check rules`` and ``promtool test rules`` (the rules' unit tests).
* One real Prometheus (temp dir, free loopback port, 1 s scrape and rule
  evaluation, the rules with every ``for:`` shortened) scraping one real
  ``replicator run`` pair on PostgreSQL: a master and a worker whose link
  goes through a TCP proxy.  Shared by the tests of :class:`LiveTests`:
  every metric the rules and the dashboard name is exported, every panel's
  query returns data, and when the proxy stops relaying (sockets left open)
  while the worker writes, the master's "facts not received" alert fires.

A missing ``promtool``/``prometheus`` skips locally and fails with CI=true.
"""

import asyncio
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import yaml
from twisted.trial.unittest import TestCase

from tests.chaos.proxy import Proxy
from tests.servers import PostgresServer, free_port, unavailable, wait_for_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = os.path.join(ROOT, "contrib", "prometheus", "replicator.rules.yml")
RULE_TESTS = os.path.join(ROOT, "contrib", "prometheus", "replicator.rules.test.yml")
DASHBOARD = os.path.join(ROOT, "contrib", "grafana", "replicator.json")
SECRET = "operator-kit-secret-0123456789"
STREAMS = [
    {"name": "caches", "table": "cache_invalidation_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}],
     "writers": ["master", "worker1"]},
]
#: Deadline for anything the daemons or Prometheus must get to (seconds).
DEADLINE = 90.0


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} not found (make test installs Debian's prometheus package)")
    return path


def until(predicate, what: str, timeout: float = DEADLINE):
    """Poll ``predicate()`` (blocking: no reactor here) until it is truthy;
    returns its value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (OSError, urllib.error.URLError, ValueError) as e:
            last = e
            if isinstance(e, AssertionError):
                raise
        else:
            if last:
                return last
        time.sleep(0.2)
    raise AssertionError(f"{what}: not reached in {timeout}s (last: {last!r})")


def http_json(url: str, data: bytes = None, secret: str = None):
    request = urllib.request.Request(url, data=data)
    if secret:
        request.add_header("Authorization", f"Bearer {secret}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def exported_names(text: str) -> set:
    """Every sample name in a Prometheus text exposition."""
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def declared_names() -> set:
    """Every sample name the daemon's metrics (:mod:`replicator.observe.metrics`) can
    export, whether or not a labelled child exists yet."""
    from prometheus_client.metrics import MetricWrapperBase

    from replicator.observe import metrics

    suffixes = {"counter": ("_total",), "gauge": ("",),
                "histogram": ("_bucket", "_sum", "_count")}
    return {m._name + suffix for m in vars(metrics).values()
            if isinstance(m, MetricWrapperBase) for suffix in suffixes[m._type]} | {
        m.name for m in vars(metrics).values() if isinstance(m, metrics.LiveGauge)}


def metric_names(expr: str) -> set:
    return set(re.findall(r"\breplicator_[a-z_]+", expr))


class ThreadedProxy:
    """The chaos suite's asyncio proxy, on a loop of its own thread (these
    tests block; the proxy must keep relaying meanwhile)."""

    def __init__(self, target_port: int):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = self._call(self._make(target_port))
        self.port = self.proxy.port

    async def _make(self, target_port):
        return await Proxy("worker1", target_port).start()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop_relaying(self):
        """Bytes stop flowing both ways; every socket stays open."""
        self.loop.call_soon_threadsafe(self.proxy._running.clear)

    def heal(self):
        self.loop.call_soon_threadsafe(self.proxy.heal)

    def cut(self):
        self.loop.call_soon_threadsafe(self.proxy.cut)

    def close(self):
        self._call(self.proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Daemon:
    """One ``replicator run`` process from a config written to ``base``."""

    def __init__(self, base: str, name: str, config: dict):
        self.name = name
        self.dir = os.path.join(base, name)
        os.makedirs(self.dir)
        self.http_port = free_port()
        config = dict(config, instance_name=name,
                      http={"listen": f"tcp:{self.http_port}:interface=127.0.0.1",
                            "secret": SECRET})
        self.path = os.path.join(self.dir, "config.yaml")
        with open(self.path, "w") as f:
            yaml.safe_dump(config, f)
        self.log = open(os.path.join(self.dir, "out.log"), "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                              if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "replicator.cli", "run", "-c", self.path], cwd=self.dir,
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def write(self, n: int, tag: str) -> None:
        """``n`` facts of one row each through the write API."""
        for i in range(n):
            http_json(f"{self.base}/_replicator/v1/streams/caches/facts",
                      json.dumps({"rows": [[f"{tag}{i}", None, i]]}).encode(), SECRET)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as response:
            return response.read().decode()

    def log_tail(self, lines: int = 30) -> str:
        """The end of its log, for a failure message."""
        with open(os.path.join(self.dir, "out.log"), "rb") as f:
            text = f.read().decode("utf-8", "replace")
        return f"--- {self.name}:\n" + "\n".join(text.splitlines()[-lines:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def shortened_rules(text: str) -> str:
    """The shipped rules for a test run: every ``for:`` 1 s, and the
    "not received for a minute" threshold 2 s."""
    text, n = re.subn(r"(?m)^(\s+for:) \S+$", r"\1 1s", text)
    assert n >= 8, n
    old = "replicator_unreceived_age_seconds > 60"
    assert text.count(old) == 1, "the not-received rule changed: update this test"
    return text.replace(old, "replicator_unreceived_age_seconds > 2")


class Prometheus:
    """A real Prometheus on a free loopback port, data in a temp dir."""

    def __init__(self, base: str, targets, rules_text: str):
        self.dir = os.path.join(base, "prometheus")
        os.makedirs(self.dir)
        self.port = free_port()
        rules = os.path.join(self.dir, "rules.yml")
        with open(rules, "w") as f:
            f.write(rules_text)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "1s"},
            "rule_files": [rules],
            "scrape_configs": [{"job_name": "replicator",
                                "static_configs": [{"targets": targets}]}],
        }
        path = os.path.join(self.dir, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        self.log = open(os.path.join(self.dir, "out.log"), "wb")
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={path}",
             f"--storage.tsdb.path={os.path.join(self.dir, 'data')}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            cwd=self.dir, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        wait_for_port(self.port, timeout=60)

    def api(self, path: str, **params):
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        answer = http_json(url)
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str):
        return self.api("query", query=expr)["result"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class RulesTests(TestCase):
    """The rules file is valid, and its unit tests pass."""

    def run_promtool(self, *args):
        proc = subprocess.run([tool("promtool"), *args], capture_output=True, text=True,
                              cwd=os.path.dirname(RULES), timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        return proc.stdout + proc.stderr

    def test_promtool_check_rules(self):
        out = self.run_promtool("check", "rules", RULES)
        self.assertIn("SUCCESS: 11 rules found", out)

    def test_promtool_test_rules(self):
        out = self.run_promtool("test", "rules", RULE_TESTS)
        self.assertIn("SUCCESS", out)

    def test_every_alert_has_a_unit_test(self):
        with open(RULES) as f:
            alerts = {r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]}
        with open(RULE_TESTS) as f:
            tested = {t["alertname"] for case in yaml.safe_load(f)["tests"]
                      for t in case["alert_rule_test"] if t["exp_alerts"]}
        self.assertEqual(alerts, tested)


class Live:
    """One Prometheus over one daemon pair, started on first use and shared
    by the tests of :class:`LiveTests` (trial has no setUpClass); stopped at
    process exit."""

    _shared = None
    _failed = None

    @classmethod
    def shared(cls) -> "Live":
        if cls._failed is not None:
            raise AssertionError(f"the shared daemons did not start: {cls._failed}")
        if cls._shared is None:
            live = cls()
            atexit.register(live.stop)
            try:
                live.start()
            except BaseException as e:
                cls._failed = repr(e)
                live.stop()
                raise
            cls._shared = live
        return cls._shared

    def __init__(self):
        self.cleanups = []

    def start(self):
        tool("promtool")
        tool("prometheus")
        self.base = tempfile.mkdtemp(prefix="replicator-opskit-")
        self.cleanups.append(lambda: shutil.rmtree(self.base, ignore_errors=True))
        dsn = PostgresServer.shared().create_database()
        master_port = free_port()
        common = {"server_name": "opskit.test", "log_level": "info",
                  "database": {"postgres": dsn, "pool_min": 1, "pool_max": 3},
                  "streams": STREAMS,
                  "health": {"lag_grace": 1, "check_interval": 0.5}}
        self.master = Daemon(self.base, "master", dict(common, replication={
            "listen": f"tcp:{master_port}:interface=127.0.0.1",
            "ping_interval": 1, "ping_timeout": 3}))
        self.cleanups.append(self.master.stop)
        wait_for_port(master_port, timeout=DEADLINE)
        self.proxy = ThreadedProxy(master_port)
        self.cleanups.append(self.proxy.close)
        self.worker = Daemon(self.base, "worker1", dict(common, replication={
            "upstream": f"tcp:host=127.0.0.1:port={self.proxy.port}",
            "ping_interval": 1, "ping_timeout": 3,
            "reconnect_initial_delay": 0.2, "reconnect_max_delay": 1}))
        self.cleanups.append(self.worker.stop)
        with open(RULES) as f:
            rules = shortened_rules(f.read())
        self.prometheus = Prometheus(self.base, [self.master.target, self.worker.target], rules)
        self.cleanups.append(self.prometheus.stop)
        for daemon in (self.master, self.worker):
            until(lambda: http_json(f"{daemon.base}/health")["status"] == "ok",
                  f"{daemon.name} healthy")
        # Traffic both ways, and one disconnect (the proxy resets the link;
        # the worker reconnects), so that every panel has something to show.
        self.master.write(3, "m")
        self.worker.write(3, "w")
        self.proxy.cut()
        until(lambda: "replicator_disconnects_total" in self.worker.metrics(), "a disconnect")
        until(lambda: http_json(f"{self.worker.base}/health")["status"] == "ok",
              "worker reconnected")
        self.master.write(3, "m2")
        self.worker.write(3, "w2")

    def stop(self):
        while self.cleanups:
            try:
                self.cleanups.pop()()
            except Exception:
                pass


class LiveTests(TestCase):
    """Against the shared :class:`Live` set (tests run in name order: the
    link is stopped last)."""

    timeout = 300

    def setUp(self):
        live = Live.shared()
        self.master, self.worker = live.master, live.worker
        self.proxy, self.prometheus = live.proxy, live.prometheus

    def logs(self) -> str:
        return self.master.log_tail() + "\n" + self.worker.log_tail()

    def exported(self) -> set:
        return exported_names(self.master.metrics()) | exported_names(self.worker.metrics())

    def test_1_rules_name_only_exported_metrics(self):
        """Names the rules use are the daemon's metrics; those already live
        (unlabelled or with a child) are in a real scrape."""
        with open(RULES) as f:
            names = metric_names(f.read())
        self.assertIn("replicator_unreceived_facts", names)
        self.assertEqual(sorted(names - declared_names()), [])
        # The labelled ones get their child at the first lag check after a
        # writer is known (every health.check_interval): wait for that scrape.
        live = {"replicator_healthy", "replicator_unreceived_facts", "replicator_reader_lag",
                "replicator_stream_in_flight_ids", "replicator_reconnect_delay_seconds"}
        until(lambda: live <= self.exported(), f"{sorted(live)} in a scrape")
        self.assertLessEqual(live, self.exported())

    def test_2_every_dashboard_query_returns_data(self):
        with open(DASHBOARD) as f:
            dashboard = json.load(f)
        targets = [(panel["title"], target["expr"])
                   for panel in dashboard["panels"] for target in panel["targets"]]
        self.assertGreaterEqual(len(targets), 10)
        titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
        for topic in ("position", "lag", "facts written", "rdata", "connections",
                      "disconnects", "in flight", "latency", "queue"):
            self.assertIn(topic, titles)
        exported = self.exported() & declared_names()
        for title, expr in targets:
            missing = metric_names(expr) - exported
            self.assertEqual(missing, set(), f"panel {title!r} names unexported metrics\n"
                             + self.logs())
        for title, expr in targets:
            query = expr.replace("$__rate_interval", "1m").replace('"$instance"', '".+"')
            self.assertNotIn("$", query, title)
            until(lambda: self.prometheus.query(query), f"data for panel {title!r}: {query}")

    def test_3_stopped_link_fires_the_not_received_alert(self):
        """The worker's link stops relaying (sockets open) while it writes:
        the master's committed-not-received alert fires, named after the
        master, stream caches, writer worker1; it resolves once healed."""
        self.proxy.stop_relaying()
        try:
            self.worker.write(5, "unseen")

            def firing(name="ReplicatorFactsNotReceived"):
                return [a for a in self.prometheus.api("alerts")["alerts"]
                        if a["labels"]["alertname"] == name and a["state"] == "firing"]

            alerts = until(firing, "ReplicatorFactsNotReceived firing")
            self.assertEqual([(a["labels"]["instance"], a["labels"]["stream"],
                               a["labels"]["writer"]) for a in alerts],
                             [(self.master.target, "caches", "worker1")], self.logs())
            self.assertEqual(alerts[0]["labels"]["severity"], "critical")
            # The master's /health fails for the same reason: replicator_healthy.
            unhealthy = until(lambda: [a for a in firing("ReplicatorUnhealthy")
                                       if a["labels"]["instance"] == self.master.target],
                              "ReplicatorUnhealthy firing for the master")
            self.assertEqual(len(unhealthy), 1)
        finally:
            self.proxy.heal()
        until(lambda: not firing(), "ReplicatorFactsNotReceived resolved")
