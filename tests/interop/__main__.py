"""The live interop suite (``make interop``): replicator beside a real Synapse.

Starts a PostgreSQL and a redis-server (temp dirs, free loopback ports),
Synapse's main process from its own virtualenv (``SYNAPSE_PYTHON``, made by
``make interop``), registers users through the admin API and drives real
client traffic (messages, receipts, presence, account data, push rules).
Beside it run two replicator instances with a ``synapse:`` section: both
read Synapse's preset streams, ``app1`` writes a stream of its own that
``app2`` reads.  Checks, printed as they pass:

(a) every fact of Synapse's preset streams still in its tables reached each
    instance's consumer exactly once, in order, rows equal to the table's,
    across a restart of ``app2`` during traffic;
(b) Synapse logged no ERROR and its Redis subscription never reconnected
    (same Redis client id throughout) while we published;
(c) while only we write, Synapse's sync token and its ``stream_positions``
    rows do not move;
(d) our own stream replicated between our instances, exactly once, in order;
(e) over TCP, Synapse's own replication server -> ``app3`` (a reader whose
    upstream is Synapse's main process): 200+ facts of the presets, each
    once, in order, rows equal to Synapse's tables, positions equal to its;
(f) over TCP, our server (``tcphub``, writing streams named and laid out
    like Synapse's caches, receipts and push_rules in a database of its own)
    -> Synapse's generic worker speaking Synapse's TCP client protocol:
    200+ facts, every RDATA counted, parsed and applied by Synapse's handler
    (its tokens for ``tcphub`` reach ours), one connection, no ERROR;
(g) ``replicator-export`` of the presets on Synapse's live database stops
    at Synapse's persisted positions (``stream_positions``);
(h) an instance *without* the ``synapse:`` section (``app4``, writing a
    stream of its own on Synapse's channel) sees Synapse there before it
    announces anything: ``/health`` says to add the section, and Synapse
    logs no ERROR and keeps its Redis subscription while ``app4`` writes.

Synapse 1.163.2 refuses TCP replication in its config, so for (e) and (f)
its processes are started by ``synapse_peer.py`` (run with Synapse's
interpreter), which calls Synapse's entry points and adds only the TCP link.

Exit status 0 when every check passed, 1 otherwise.  Synapse is run as a
peer process; none of its code is imported here.
"""

import hashlib
import hmac
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import psycopg2

from tests.servers import PostgresServer, RedisServer, free_port, wait_for_port

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "synapse_peer.py")
SERVER_NAME = "interop.test"
SECRET = "interop-registration-secret"
HTTP_SECRET = "interop-http-secret-0123456789"
PRESETS = ("caches", "presence", "receipts", "push_rules")
# Synapse's stream positions this suite watches (check c).
TOKEN_STREAMS = ("caches", "account_data", "presence", "receipts", "push_rules", "events")

HOMESERVER = """\
server_name: "{server_name}"
pid_file: {dir}/homeserver.pid
listeners:
  - port: {port}
    bind_addresses: ['127.0.0.1']
    type: http
    tls: false
    x_forwarded: false
    resources:
      - names: [client]
        compress: false
database:
  name: psycopg2
  args:
    user: {pg_user}
    host: 127.0.0.1
    port: {pg_port}
    database: synapse
    cp_min: 1
    cp_max: 5
redis:
  enabled: true
  host: 127.0.0.1
  port: {redis_port}
log_config: {dir}/log.yaml
media_store_path: {dir}/media
registration_shared_secret: "{secret}"
report_stats: false
signing_key_path: {dir}/signing.key
trusted_key_servers: []
suppress_key_server_warning: true
enable_registration: false
presence:
  enabled: true
rc_message: {{per_second: 1000, burst_count: 1000}}
rc_registration: {{per_second: 1000, burst_count: 1000}}
rc_login:
  address: {{per_second: 1000, burst_count: 1000}}
  account: {{per_second: 1000, burst_count: 1000}}
  failed_attempts: {{per_second: 1000, burst_count: 1000}}
rc_presence:
  per_user: {{per_second: 1000, burst_count: 1000}}
"""

LOG_YAML = """\
version: 1
formatters:
  precise:
    format: '%(asctime)s - %(name)s - %(lineno)d - %(levelname)s - %(message)s'
handlers:
  file:
    class: logging.FileHandler
    formatter: precise
    filename: {dir}/homeserver.log
root:
  level: INFO
  handlers: [file]
disable_existing_loggers: false
"""


class Failed(Exception):
    pass


def log(text):
    print(text, flush=True)


def wait(predicate, what, timeout=90.0, step=0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"timed out waiting for {what}")
        time.sleep(step)


def stop_process(proc, grace=30.0):
    """Stop a process this run started: SIGTERM, up to ``grace`` seconds to
    exit, then SIGKILL. Returns its exit status, or None if there was no
    process or it had already ended (nothing was stopped)."""
    if proc is None or proc.poll() is not None:
        return None
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode


# ------------------------------------------------------------------ HTTP
def request(method, url, body=None, token=None, timeout=30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        raise Failed(f"{method} {url}: {e.code} {e.read()[:300]!r}") from None


class Synapse:
    """Synapse's main process, run from its own virtualenv."""

    def __init__(self, python, pg, redis, workdir):
        self.python, self.pg, self.redis = python, pg, redis
        self.dir = os.path.join(workdir, "synapse")
        os.makedirs(os.path.join(self.dir, "media"))
        self.port = free_port()
        self.tcp_port = free_port()  # Synapse's TCP replication server (check e)
        self.base = f"http://127.0.0.1:{self.port}"
        self.config = os.path.join(self.dir, "homeserver.yaml")
        with open(self.config, "w") as f:
            f.write(HOMESERVER.format(server_name=SERVER_NAME, dir=self.dir, port=self.port,
                                      pg_user=pg.user, pg_port=pg.port,
                                      redis_port=redis.port, secret=SECRET))
        with open(os.path.join(self.dir, "log.yaml"), "w") as f:
            f.write(LOG_YAML.format(dir=self.dir))
        self.log_path = os.path.join(self.dir, "homeserver.log")
        self.proc = None

    def start(self):
        subprocess.run([self.python, "-m", "synapse.app.homeserver", "-c", self.config,
                        "--generate-keys"], check=True, cwd=self.dir,
                       stdout=subprocess.DEVNULL)
        self.out = open(os.path.join(self.dir, "stdout.log"), "wb")
        self.proc = subprocess.Popen([self.python, PEER, "master", self.config,
                                      str(self.tcp_port)], cwd=self.dir, stdout=self.out,
                                     stderr=subprocess.STDOUT)

        def up():
            if self.proc.poll() is not None:
                raise Failed(f"Synapse exited with {self.proc.returncode}; see {self.dir}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        wait(up, "Synapse to answer /health", timeout=180, step=0.3)

    def stop(self):
        stop_process(self.proc)

    def register(self, user):
        url = f"{self.base}/_synapse/admin/v1/register"
        nonce = request("GET", url)["nonce"]
        mac = hmac.new(SECRET.encode(), digestmod=hashlib.sha1)
        mac.update(b"\x00".join([nonce.encode(), user.encode(), b"password", b"notadmin"]))
        answer = request("POST", url, {"nonce": nonce, "username": user, "password": "password",
                                       "admin": False, "mac": mac.hexdigest()})
        return answer["access_token"]

    def errors(self, path=None):
        with open(path or self.log_path, errors="replace") as f:
            return [line.rstrip() for line in f if " - ERROR - " in line
                    or " - CRITICAL - " in line]


WORKER = """\
worker_app: synapse.app.generic_worker
worker_name: {name}
worker_log_config: {dir}/worker-log.yaml
worker_pid_file: {dir}/worker.pid
instance_map:
  main: {{host: 127.0.0.1, port: {main_port}}}
redis:
  enabled: false
"""


class SynapseWorker:
    """Synapse's generic worker whose replication is Synapse's TCP client
    protocol, connected to one of our TCP servers (tests/interop/synapse_peer.py)."""

    def __init__(self, synapse, workdir, port, writer, name="synapse_tcp_worker"):
        self.s = synapse
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir)
        with open(synapse.config) as f:
            shared = f.read()
        self.config = os.path.join(self.dir, "worker.yaml")
        with open(self.config, "w") as f:
            f.write(shared.replace("\nredis:\n  enabled: true", "\nold_redis:\n  enabled: true")
                    + WORKER.format(name=name, dir=self.dir, main_port=synapse.port))
        with open(os.path.join(self.dir, "worker-log.yaml"), "w") as f:
            f.write(LOG_YAML.format(dir=self.dir).replace("homeserver.log", "worker.log"))
        self.log_path = os.path.join(self.dir, "worker.log")
        self.status_path = os.path.join(self.dir, "status.json")
        self.port, self.writer = port, writer
        self.proc = None

    def start(self):
        self.out = open(os.path.join(self.dir, "stdout.log"), "wb")
        self.proc = subprocess.Popen([self.s.python, PEER, "worker", self.config, "127.0.0.1",
                                      str(self.port), self.status_path, self.writer],
                                     cwd=self.dir, stdout=self.out, stderr=subprocess.STDOUT)

    def status(self):
        if self.proc.poll() is not None:
            raise Failed(f"Synapse's worker exited with {self.proc.returncode}; see {self.dir}")
        try:
            with open(self.status_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def log_lines(self, text):
        with open(self.log_path, errors="replace") as f:
            return [line.rstrip() for line in f if text in line]

    def stop(self):
        Synapse.stop(self)


class Replicator:
    """One replicator instance, run as ``replicator run``."""

    def __init__(self, name, workdir, dsn, redis, streams, venv_bin, replication=None,
                 synapse=True):
        self.name = name
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.http_port = free_port()
        self.facts_path = os.path.join(self.dir, "facts.jsonl")
        self.config = os.path.join(self.dir, "replicator.yaml")
        doc = {
            "server_name": SERVER_NAME, "instance_name": name,
            "database": {"postgres": dsn, "pool_max": 4},
            "replication": replication or {"redis": {"endpoint": redis.endpoint}},
            "http": {"listen": f"tcp:{self.http_port}:interface=127.0.0.1",
                     "secret": HTTP_SECRET},
            "streams": streams,
            "consumers": [{"type": "jsonl", "path": self.facts_path}],
        }
        if synapse:
            doc["synapse"] = {"server_name": SERVER_NAME}
        with open(self.config, "w") as f:
            json.dump(doc, f, indent=1)  # JSON is YAML
        self.binary = os.path.join(venv_bin, "replicator")
        self.proc = None

    def start(self):
        self.out = open(os.path.join(self.dir, "stdout.log"), "ab")
        self.proc = subprocess.Popen([self.binary, "run", "-c", self.config], cwd=self.dir,
                                     stdout=self.out, stderr=subprocess.STDOUT)
        wait(lambda: self._healthy_or_dead(), f"{self.name} to listen", timeout=60)

    def _healthy_or_dead(self):
        if self.proc.poll() is not None:
            raise Failed(f"{self.name} exited with {self.proc.returncode}; see {self.dir}")
        try:
            wait_for_port(self.http_port, timeout=0.2)
            return True
        except RuntimeError:
            return False

    def stop(self):
        code = stop_process(self.proc)
        if code not in (None, 0):
            raise Failed(f"{self.name} stopped with {code}")

    def health(self):
        """``(status, body)`` of ``GET /health``."""
        url = f"http://127.0.0.1:{self.http_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def write(self, stream, rows):
        url = f"http://127.0.0.1:{self.http_port}/_replicator/v1/streams/{stream}/facts"
        return request("POST", url, {"rows": rows}, token=HTTP_SECRET)["stream_id"]

    def facts(self):
        """{(stream, writer): [(token, rows), ...]} in file order."""
        return self.read()[0]

    def read(self):
        """Facts as :meth:`facts`; per key the position reached (largest
        token or position) and where the consumer started (its first
        line: a position, or the token before its first fact)."""
        facts, reached, first = {}, {}, {}
        if not os.path.exists(self.facts_path):
            return facts, reached, first
        with open(self.facts_path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                obj = json.loads(line)
                key = (obj["stream"], obj["writer"])
                if "rows" in obj:
                    facts.setdefault(key, []).append((obj["token"], obj["rows"]))
                    token = obj["token"]
                    first.setdefault(key, token - 1)
                else:
                    token = obj["position"]
                    first.setdefault(key, token)
                reached[key] = max(reached.get(key, 0), token)
        return facts, reached, first


# ---------------------------------------------------------------- checks
def table_rows(dsn, stream):
    """Synapse's facts of a preset stream, from its table, as wire rows."""
    from replicator.config import parse_streams

    (config,) = parse_streams([{"preset": f"synapse/{stream}"}])
    conn = psycopg2.connect(dsn)
    try:
        cur = conn.cursor()
        cur.execute(f"SELECT {config.id_column}, {', '.join(config.column_names)} "
                    f"FROM {config.table} ORDER BY {config.id_column}, ctid")
        out = {}
        for row in cur.fetchall():
            values = list(row[1:])
            for i, column in enumerate(config.columns):
                if column.json_text and isinstance(values[i], str):
                    values[i] = json.loads(values[i])
            out.setdefault(row[0], []).append(values)
        return out
    finally:
        conn.close()


def synapse_positions(dsn):
    conn = psycopg2.connect(dsn)
    try:
        cur = conn.cursor()
        cur.execute("SELECT stream_name, instance_name, stream_id FROM stream_positions "
                    "WHERE stream_name NOT LIKE 'app%' ORDER BY 1, 2")
        return cur.fetchall()
    finally:
        conn.close()


def redis_clients(port):
    import socket

    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"*2\r\n$6\r\nCLIENT\r\n$4\r\nLIST\r\n")
        data = b""
        while not data.endswith(b"\r\n") or data.count(b"\r\n") < 2:
            data += s.recv(65536)
    lines = data.split(b"\r\n", 1)[1].decode().splitlines()
    return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in lines]


def synapse_subscribers(port):
    """Ids of the Redis clients subscribed to two channels: Synapse's
    (``<server_name>`` and ``<server_name>/USER_IP``; ours hold three)."""
    return sorted(c["id"] for c in redis_clients(port) if c.get("sub") == "2")


def check_exactly_once(name, got, table, since=0):
    """Every fact still in ``table`` above ``since`` arrived once, in order, equal."""
    tokens = [t for t, _ in got]
    if tokens != sorted(set(tokens)):
        raise Failed(f"{name}: tokens out of order or repeated: {tokens[:50]}")
    delivered = dict(got)
    missing = [t for t in table if t > since and t not in delivered]
    if missing:
        raise Failed(f"{name}: {len(missing)} facts in Synapse's table never arrived: "
                     f"{missing[:20]}")
    for token, rows in table.items():
        if token in delivered and delivered[token] != rows:
            raise Failed(f"{name}: fact {token} differs: {delivered[token]!r} != {rows!r}")
    return len([t for t in table if t > since])


# ---------------------------------------------------------------- traffic
class Traffic:
    def __init__(self, synapse, users):
        self.s = synapse
        self.users = users  # name -> token
        self.room = None
        self.n = 0

    def setup(self):
        owner = next(iter(self.users.values()))
        self.room = request("POST", f"{self.s.base}/_matrix/client/v3/createRoom",
                            {"preset": "public_chat"}, owner)["room_id"]
        for token in list(self.users.values())[1:]:
            request("POST", f"{self.s.base}/_matrix/client/v3/join/{self.room}", {}, token)

    def round(self):
        base = self.s.base + "/_matrix/client/v3"
        # A registration and a display name change: cache invalidations.
        newcomer = f"newcomer{self.n}"
        token = self.s.register(newcomer)
        request("PUT", f"{base}/profile/@{newcomer}:{SERVER_NAME}/displayname",
                {"displayname": f"Newcomer {self.n}"}, token)
        for i, (user, token) in enumerate(self.users.items()):
            self.n += 1
            n = self.n
            event = request("PUT", f"{base}/rooms/{self.room}/send/m.room.message/t{n}",
                            {"msgtype": "m.text", "body": f"hello {n}"}, token)["event_id"]
            request("POST", f"{base}/rooms/{self.room}/receipt/m.read/{event}", {}, token)
            uid = f"@{user}:{SERVER_NAME}"
            request("PUT", f"{base}/presence/{uid}/status",
                    {"presence": "online" if n % 2 else "unavailable",
                     "status_msg": f"round {n}"}, token)
            request("PUT", f"{base}/user/{uid}/account_data/org.example.n", {"n": n}, token)
            request("PUT", f"{base}/pushrules/global/override/rule{n % 3}",
                    {"actions": ["dont_notify"],
                     "conditions": [{"kind": "event_match", "key": "content.body",
                                     "pattern": f"x{n}"}]}, token)

    def sync_token(self, user):
        token = self.users[user]
        return request("GET", f"{self.s.base}/_matrix/client/v3/sync?timeout=0",
                       token=token)["next_batch"]


# ------------------------------------------------------------------- TCP
WORKERS = []  # Synapse workers started (stopped by PID at the end)
TCP_FACTS = 70  # facts per stream our server sends Synapse's worker
# Not presence: Synapse catches up a presence writer other than itself over
# HTTP from that writer's instance_map entry, which replicator does not serve.
TCP_STREAMS = ("caches", "receipts", "push_rules")


def tcp_from_synapse(synapse, traffic, app3, dsn):
    """(e) Synapse's TCP replication server -> our reader: every fact of the
    presets in Synapse's tables reached app3 once, in order, equal, and its
    positions reached Synapse's; 200+ facts."""
    def received():
        facts = app3.facts()
        return sum(len(facts.get((p, "master"), [])) for p in PRESETS)
    rounds = 0
    while received() < 200 and rounds < 40:
        traffic.round()
        rounds += 1
        time.sleep(0.5)
    counts = {}
    for p in PRESETS:
        table = table_rows(dsn, p)
        top = max(table) if table else 0
        wait(lambda: app3.read()[1].get((p, "master"), 0) >= top,
             f"app3 to reach {p} {top} over TCP", timeout=60)
        facts, reached, first = app3.read()
        got = facts.get((p, "master"), [])
        check_exactly_once(f"app3 {p}", got, table_rows(dsn, p),
                           since=first.get((p, "master"), 0))
        if reached[(p, "master")] != top:
            raise Failed(f"(e) app3's {p} position {reached[(p, 'master')]} != Synapse's {top}")
        counts[p] = (len(got), top)
    total = sum(n for n, _ in counts.values())
    if total < 200:
        raise Failed(f"(e) only {total} facts reached app3 over TCP")
    errors = synapse.errors()
    if errors:
        raise Failed(f"(e) Synapse logged {len(errors)} ERROR lines, first: {errors[0]}")
    log(f"(e) Synapse's TCP replication server -> app3: {total} facts ("
        + ", ".join(f"{p} {n} up to {top}" for p, (n, top) in counts.items())
        + f"; {rounds} more rounds of traffic), each once, in order, rows equal to Synapse's "
        f"tables, app3's positions = Synapse's; Synapse logged no ERROR")


def tcp_to_synapse(synapse, traffic, pg, workdir, venv_bin, nodes):
    """(f) our TCP server -> Synapse's generic worker (Synapse's TCP client
    protocol): our rows of the preset streams' layouts are parsed and
    applied by Synapse's own handler; its tokens reach ours; no error."""
    conn = psycopg2.connect(pg.dsn("postgres"))
    conn.autocommit = True
    conn.cursor().execute("CREATE DATABASE replicator_tcp")
    conn.close()
    dsn = pg.dsn("replicator_tcp")
    # Tokens above Synapse's own (its worker takes a new writer to start at
    # Synapse's persisted position): our sequences start at 1,000,000.
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    for p in TCP_STREAMS:
        conn.cursor().execute(f"CREATE SEQUENCE tcp_{p}_seq START 1000000")
    conn.close()
    from replicator.synapse import PRESETS as LAYOUTS

    streams = [{"name": p, "table": f"tcp_{p}", "sequence": f"tcp_{p}_seq",
                "columns": [dict(c) for c in LAYOUTS[p]["columns"]], "writers": ["tcphub"]}
               for p in TCP_STREAMS]
    port = free_port()
    hub = Replicator("tcphub", workdir, dsn, None, streams, venv_bin, synapse=False,
                     replication={"listen": f"tcp:{port}:interface=127.0.0.1"})
    nodes.append(hub)
    hub.start()
    worker = SynapseWorker(synapse, workdir, port, "tcphub")
    WORKERS.append(worker)
    worker.start()
    # Synapse's worker is connected once its handler took our POSITIONs.
    tokened = TCP_STREAMS
    first = {p: hub.write(p, [row(p, traffic, 0)]) for p in TCP_STREAMS}

    def tokens():
        status = worker.status() or {}
        return {p: status.get(p, {}).get("token", 0) for p in tokened}
    wait(lambda: all(tokens()[p] >= first[p] for p in tokened),
         "Synapse's worker to connect and take our positions", timeout=180, step=0.5)
    last = {}
    for i in range(1, TCP_FACTS + 1):
        for p in TCP_STREAMS:
            last[p] = hub.write(p, [row(p, traffic, i)])
    wait(lambda: tokens() == {p: last[p] for p in tokened}
         and all(worker.status()[p]["rdata"] >= TCP_FACTS for p in TCP_STREAMS),
         "Synapse's worker to take our RDATA up to our last tokens", timeout=120, step=0.5)
    status = worker.status()
    rdata = {p: status[p]["rdata"] for p in TCP_STREAMS}
    short = {p: n for p, n in rdata.items() if n != TCP_FACTS}
    if short:
        raise Failed(f"(f) Synapse's worker counted too few RDATA lines: {short}")
    errors = synapse.errors(worker.log_path)
    if errors:
        raise Failed(f"(f) Synapse's worker logged {len(errors)} ERROR lines, first: {errors[0]}")
    connects = worker.log_lines("Connection established")
    if len(connects) != 1:
        raise Failed(f"(f) Synapse's worker connected {len(connects)} times (expected once)")
    log(f"(f) our TCP server -> Synapse's worker (its TCP client protocol): "
        f"{TCP_FACTS * len(TCP_STREAMS)} facts ("
        + ", ".join(f"{p} up to {last[p]}, {rdata[p]} RDATA" for p in TCP_STREAMS)
        + "), each parsed and applied by Synapse's handler (its tokens for tcphub = ours), "
        "one connection throughout, no ERROR in its log")


def export_presets(node, dsn, workdir, venv_bin):
    """(g) ``replicator-export`` of the presets on Synapse's live database
    stops at Synapse's persisted positions (its ``stream_positions`` rows,
    named after its ID generators), never at a fact it has not persisted."""
    from replicator.config import parse_streams

    out = os.path.join(workdir, "export")
    before = positions_by_name(dsn)
    started = time.monotonic()
    done = subprocess.run([os.path.join(venv_bin, "replicator-export"), "-c", node.config,
                           "-o", out, "--master", "local[2]", "-q"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise Failed(f"(g) replicator-export exited {done.returncode}: {done.stderr[-500:]}")
    after = positions_by_name(dsn)
    with open(os.path.join(out, "current", "state.json")) as f:
        state = json.load(f)["streams"]
    got = []
    for config in parse_streams([{"preset": f"synapse/{p}"} for p in PRESETS]):
        key = config.positions_key
        token = state.get(config.name, {}).get("token")
        if key not in before:
            # Nothing persisted by Synapse: nothing may be exported.
            if token is not None and token > 0:
                raise Failed(f"(g) {config.name}: exported up to {token} with no persisted "
                             f"position of Synapse's")
            got.append(f"{config.name} nothing (no {key} row)")
            continue
        if not (before[key] <= token <= after[key]):
            raise Failed(f"(g) {config.name}: exported up to {token}, Synapse's persisted "
                         f"{key} position was {before[key]}..{after[key]}")
        top = table_rows(dsn, config.name)
        got.append(f"{config.name} up to {token} ({key}; its table reaches {max(top)})")
    log(f"(g) replicator-export on Synapse's database in {time.monotonic() - started:.0f}s: "
        + "; ".join(got) + ": each bound = Synapse's persisted position")


def synapse_unharmed(check: str, synapse, redis, subscribers_before, errors_before: int = 0):
    """Synapse logged no ERROR line since ``errors_before`` and its Redis
    subscription never reconnected (its clients then are a superset)."""
    errors = synapse.errors()[errors_before:]
    if errors:
        raise Failed(f"{check} Synapse logged {len(errors)} ERROR lines, first: {errors[0]}")
    subscribers_after = synapse_subscribers(redis.port)
    if not set(subscribers_before) <= set(subscribers_after):
        raise Failed(f"{check} Synapse's Redis subscription reconnected: "
                     f"{subscribers_before} -> {subscribers_after}")


def undeclared_synapse(synapse, redis, dsn, workdir, venv_bin, nodes, subscribers_before):
    """(h) An instance that forgot the ``synapse:`` section publishes on
    Synapse's channel: it must see Synapse before harming it."""
    own = {"name": "app_undeclared", "table": "app_undeclared", "columns": [{"body": "text"}],
           "writers": ["app4"]}
    app4 = Replicator("app4", workdir, dsn, redis, [own], venv_bin, synapse=False)
    nodes.append(app4)
    errors_before = len(synapse.errors())
    app4.start()

    def told():
        status, body = app4.health()
        return status == 503 and "`synapse:`" in body.get("reason", "") and body
    body = wait(told, "app4's /health to name the synapse: section", timeout=60)
    for i in range(20):
        app4.write("app_undeclared", [[f"u{i}"]])
    time.sleep(2)  # what app4 would have published has reached Synapse by now
    synapse_unharmed("(h)", synapse, redis, subscribers_before, errors_before)
    with open(os.path.join(app4.dir, "stdout.log"), errors="replace") as f:
        told_lines = [line for line in f if "`synapse:`" in line]
    if len(told_lines) != 1:
        raise Failed(f"(h) app4 logged {len(told_lines)} lines naming `synapse:`")
    app4.stop()
    nodes.remove(app4)
    log(f"(h) app4 without the synapse: section saw Synapse on its channel: /health 503 "
        f"({body['reason'][:70]}...), one log line; 20 facts of app4, Synapse logged no "
        f"ERROR and kept its Redis subscription")


def positions_by_name(dsn):
    return {name: pos for name, writer, pos in synapse_positions(dsn) if writer == "master"}


def row(stream, traffic, i):
    """A row of ``stream`` in Synapse's RDATA layout (the presets')."""
    user = f"@user0:{SERVER_NAME}"
    now = int(time.time() * 1000)
    if stream == "caches":
        return ["get_user_by_id", [f"@tcp{i}:{SERVER_NAME}"], now]
    if stream == "receipts":
        return [traffic.room, "m.read", user, f"$tcp{i}", None, {"ts": now}]
    if stream == "presence":
        return [user, "online", now, now, now, f"tcp {i}", True]
    return [user]


# ------------------------------------------------------------------- main
def main() -> int:
    python = os.path.abspath(os.environ.get("SYNAPSE_PYTHON", ".venv-synapse/bin/python"))
    venv_bin = os.path.dirname(sys.executable)
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="interop-")
    pg = redis = synapse = None
    nodes = []
    ok = False
    try:
        pg = PostgresServer()
        redis = RedisServer()
        conn = psycopg2.connect(pg.dsn("postgres"))
        conn.autocommit = True
        conn.cursor().execute("CREATE DATABASE synapse ENCODING 'UTF8' LC_COLLATE 'C' "
                              "LC_CTYPE 'C' TEMPLATE template0")
        conn.close()
        dsn = pg.dsn("synapse")
        synapse = Synapse(python, pg, redis, workdir)
        synapse.start()
        log(f"synapse {SERVER_NAME} up on :{synapse.port} (redis :{redis.port}, "
            f"postgres :{pg.port})")
        users = {f"user{i}": synapse.register(f"user{i}") for i in range(3)}
        traffic = Traffic(synapse, users)
        traffic.setup()
        subscribers_before = wait(lambda: synapse_subscribers(redis.port),
                                  "Synapse's Redis subscription")

        own = {"name": "app_events", "table": "app_events", "columns": [{"body": "text"}],
               "writers": ["app1"]}
        streams = [{"preset": f"synapse/{p}"} for p in PRESETS] + [own]
        nodes = [Replicator(n, workdir, dsn, redis, streams, venv_bin) for n in ("app1", "app2")]
        for node in nodes:
            node.start()
        app1, app2 = nodes
        log("replicator app1, app2 up (readers of "
            + ", ".join(f"synapse/{p}" for p in PRESETS) + "; app1 writes app_events)")
        # (e) a reader whose upstream is Synapse's own TCP replication server.
        app3 = Replicator("app3", workdir, dsn, redis,
                          [{"preset": f"synapse/{p}"} for p in PRESETS], venv_bin,
                          replication={"upstream": f"tcp:host=127.0.0.1:port={synapse.tcp_port}"})
        nodes.append(app3)
        app3.start()
        log(f"replicator app3 up, reading the presets from Synapse's TCP replication server "
            f":{synapse.tcp_port}")
        # Traffic of both sides, with a restart of app2 in the middle.
        written = []
        for r in range(6):
            traffic.round()
            written += [app1.write("app_events", [[f"a{r}-{i}"]]) for i in range(40)]
            if r == 2:
                app2.stop()
            if r == 3:
                app2.start()
        log(f"traffic: {traffic.n} rounds of message+receipt+presence+account data+push rule "
            f"(and 6 registrations with a display name); "
            f"{len(written)} facts of app_events; app2 restarted mid-way")

        # (a) Synapse's facts, exactly once, in order.
        for p in PRESETS:
            table = table_rows(dsn, p)
            top = max(table) if table else 0
            counts = []
            for node in nodes:
                wait(lambda: node.read()[1].get((p, "master"), 0) >= top,
                     f"{node.name} to reach {p} {top}", timeout=60)
                facts, _, first = node.read()
                got = facts.get((p, "master"), [])
                counts.append(check_exactly_once(f"{node.name} {p}", got, table_rows(dsn, p),
                                                 since=first.get((p, "master"), 0)))
            log(f"(a) {p}: up to {top}, {counts[0]} (app1) and {counts[1]} (app2) facts written "
                f"by Synapse after each started and still in its table, each delivered once, "
                f"in order, rows equal to the table's")

        # (d) our own stream between our instances.
        got = wait(lambda: len(app2.facts().get(("app_events", "app1"), [])) >= len(written)
                   and app2.facts()[("app_events", "app1")], "app2 to read app_events")
        tokens = [t for t, _ in got]
        if tokens != sorted(written):
            raise Failed(f"(d) app_events tokens at app2 differ: {tokens[:20]}...")
        log(f"(d) app_events: {len(written)} facts of app1 reached app2 once each, in order")

        # (c) while only we publish, Synapse's tokens and positions stay.
        time.sleep(2)
        sync_before = traffic.sync_token("user0")
        positions_before = synapse_positions(dsn)
        more = [app1.write("app_events", [[f"quiet-{i}"]]) for i in range(200)]
        wait(lambda: len(app2.facts().get(("app_events", "app1"), [])) >= len(written) + 200,
             "app2 to read 200 more facts")
        sync_after = traffic.sync_token("user0")
        positions_after = synapse_positions(dsn)
        if sync_after != sync_before:
            raise Failed(f"(c) Synapse's sync token moved: {sync_before} -> {sync_after}")
        if positions_after != positions_before:
            raise Failed(f"(c) Synapse's stream_positions changed: {positions_before} -> "
                         f"{positions_after}")
        log(f"(c) {len(more)} facts of ours: Synapse's sync token stayed {sync_after}, its "
            f"{len(positions_after)} stream_positions rows unchanged")

        # (b) Synapse's log and Redis subscription.
        synapse_unharmed("(b)", synapse, redis, subscribers_before)
        log(f"(b) Synapse logged no ERROR; its Redis subscription (client "
            f"{','.join(subscribers_before)}) never reconnected")
        undeclared_synapse(synapse, redis, dsn, workdir, venv_bin, nodes, subscribers_before)
        tcp_from_synapse(synapse, traffic, app3, dsn)
        tcp_to_synapse(synapse, traffic, pg, workdir, venv_bin, nodes)
        export_presets(app1, dsn, workdir, venv_bin)

        for node in nodes:
            node.stop()
        ok = True
        log(f"interop: all checks passed in {time.monotonic() - started:.0f}s")
        return 0
    except Failed as e:
        log(f"interop: FAILED: {e}")
        log(f"interop: kept {workdir} for inspection")
        return 1
    finally:
        for node in nodes:
            try:
                node.stop()
            except Failed:
                pass
        for worker in WORKERS:
            worker.stop()
        if synapse is not None:
            synapse.stop()
        if redis is not None:
            redis.stop()
        if pg is not None:
            pg.stop()
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
