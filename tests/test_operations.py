"""docs/operations.md, followed step by step on a real PostgreSQL.

:class:`StepOrderTests` reads the page's command blocks in order, as a root
shell on a fresh Debian 12 would meet them: no ``sudo``; the ``replicator``
user and group made (``user`` step) before any ``chown``/``install -o/-g``
to them; ``/opt/replicator`` made before it is run; the packages installed
before ``openssl``/``curl``; the units installed before ``systemctl
enable``; every file the steps take from the repository exists.  It runs
the ``user`` step against a scratch root (``systemd-sysusers --root``).

The other tests run what it says: the SQL block (role and
database), the ``pg_hba.conf`` line (with the test's loopback address), the
secret commands (``/etc/replicator`` moved to a temp dir; ``chown`` dropped
when there is no ``replicator`` user), the openssl commands (certificates
whose CN and SAN are the instance names, signed by the CA; a master and a
worker with the page's TLS keys then replicate over TLS).  It then builds
the three configurations from ``conf/master.yaml`` and ``conf/worker.yaml``
with the edits the page's table lists and nothing else (checked key by key;
the examples' ports are mapped to free loopback ports), starts master,
worker1 and worker2 as ``replicator run`` processes, expects the ``/health``
answers the page describes, and writes on each writer: every write reaches
every other instance (positions API, and the workers' consumer files).
"""

import copy
import grp
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import psycopg2
import yaml
from twisted.trial.unittest import TestCase

from replicator.config import parse_streams
from tests.operations_doc import DOC, ROOT, doc_block
from tests.servers import PostgresServer, free_port, unavailable

DEADLINE = 90.0


#: Where the page's commands take the repository from.
SOURCE = "/usr/local/src/replicator"


def shell_blocks():
    """[(step name or None, text)] of every ``sh`` block of the page, in order."""
    with open(DOC) as f:
        text = f.read()
    return [(m.group(1), m.group(2)) for m in re.finditer(
        r"(?:<!-- step: ([a-z0-9-]+) -->\n)?```sh\n(.*?)```", text, re.S)]


def has_replicator_group() -> bool:
    try:
        grp.getgrnam("replicator")
    except KeyError:
        return False
    return True


def localized(script: str, etc: str) -> str:
    """A step as this test runs it: the repository is this checkout,
    ``/etc/replicator`` is ``etc``; without a ``replicator`` group (no
    ``user`` step on this machine) ownership by it is dropped: ``chown``
    lines and ``-g replicator``."""
    script = script.replace(SOURCE, ROOT).replace("/etc/replicator", etc)
    if not has_replicator_group():
        lines = [l for l in script.splitlines() if not l.startswith("chown ")]
        script = "\n".join(lines).replace(" -g replicator", "") + "\n"
    return script


class StepOrderTests(TestCase):
    """The page's commands in the order a root shell meets them."""

    def test_every_step_works_after_the_ones_above(self):
        blocks = shell_blocks()
        names = [name for name, _ in blocks]
        first = {}
        for i, (name, text) in enumerate(blocks):
            for what, pattern in (
                    ("user", r"systemd-sysusers|useradd|adduser"),
                    ("venv", r"python3 -m venv /opt/replicator|install-venv\.sh .*/opt/replicator"),
                    ("packages", r"apt-get install"),
                    ("units",
                     r"install .*\.service|/etc/systemd/system/\s*$|--units /etc/systemd/system")):
                if re.search(pattern, text, re.M) and what not in first:
                    first[what] = i
        self.assertIn("user", first, "no step makes the replicator user")
        for i, (name, text) in enumerate(blocks):
            where = f"block {i} (step {name})"
            self.assertNotRegex(text, r"\bsudo\b", f"{where}: no sudo on a fresh Debian")
            if re.search(r"chown [^\n]*replicator|-[og] replicator\b", text):
                self.assertGreaterEqual(i, first["user"],
                                        f"{where} gives files to replicator before the "
                                        f"user exists (step {names[first['user']]})")
            if "/opt/replicator/bin/" in text:
                self.assertGreaterEqual(i, first.get("venv", len(blocks)),
                                        f"{where} runs /opt/replicator before it is made")
            if re.search(r"\b(openssl|curl|python3)\b", text):
                self.assertGreater(i, first.get("packages", len(blocks)) - 1,
                                   f"{where} needs a package not installed yet")
            if "systemctl enable" in text:
                self.assertGreater(i, first.get("units", len(blocks)),
                                   f"{where} enables units not installed yet")
        for name, text in blocks:
            for path in re.findall(re.escape(SOURCE) + r"(/[^\s\\']*)", text):
                self.assertTrue(os.path.exists(ROOT + path), f"step {name}: {SOURCE}{path}")

    def test_user_step_makes_the_user_and_group(self):
        sysusers = shutil.which("systemd-sysusers")
        if sysusers is None:
            unavailable("systemd-sysusers not found (install systemd)")
        root = tempfile.mkdtemp(prefix="replicator-ops-root-")
        self.addCleanup(shutil.rmtree, root, True)
        os.makedirs(os.path.join(root, "etc", "sysusers.d"))
        script = doc_block("user").replace(SOURCE, ROOT).replace(
            "/etc/sysusers.d", os.path.join(root, "etc", "sysusers.d"))
        script = script.replace("systemd-sysusers", f"{sysusers} --root={root}")
        script = re.sub(r"(?m)^id replicator$",
                        f"grep -q '^replicator:' {root}/etc/passwd", script)
        subprocess.run(["bash", "-euo", "pipefail", "-c", script], check=True,
                       capture_output=True)
        with open(os.path.join(root, "etc", "group")) as f:
            self.assertRegex(f.read(), r"(?m)^replicator:")


def flatten(doc, prefix="") -> dict:
    """``{"a.b[0].c": value}`` for every leaf of a YAML document."""
    out = {}
    if isinstance(doc, dict):
        for key, value in doc.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out.update(flatten(value, f"{prefix}[{i}]"))
    else:
        out[prefix] = doc
    return out


def changed_keys(before: dict, after: dict) -> set:
    a, b = flatten(before), flatten(after)
    return {k for k in a.keys() | b.keys() if a.get(k, object()) != b.get(k, object())}


def http(url: str, secret: str = None, body: dict = None):
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None)
    if secret:
        request.add_header("Authorization", f"Bearer {secret}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def until(predicate, what: str, timeout: float = DEADLINE):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except OSError as e:
            last = e
        else:
            if last:
                return last
        time.sleep(0.2)
    raise AssertionError(f"{what}: not reached in {timeout}s (last: {last!r})")


class OperationsPathTests(TestCase):
    timeout = 300

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="replicator-ops-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        # A cluster of its own: the page creates a cluster-wide role and
        # edits pg_hba.conf.
        self.pg = PostgresServer()
        self.addCleanup(self.pg.stop)
        self.procs = []
        self.addCleanup(self.stop_all)

    def stop_all(self):
        for proc, log in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()

    # ------------------------------------------------------------ steps
    def create_role_and_database(self) -> str:
        conn = psycopg2.connect(self.pg.dsn("postgres"))
        conn.autocommit = True
        try:
            for statement in filter(None, (s.strip() for s in doc_block("sql").split(";"))):
                conn.cursor().execute(statement)
        finally:
            conn.close()
        password = re.search(r"PASSWORD '([^']+)'", doc_block("sql")).group(1)
        # The page's pg_hba.conf line, for this test's loopback address,
        # first (the test cluster trusts everyone after it).
        lines = [l for l in doc_block("pg_hba").splitlines() if l and not l.startswith("#")]
        self.assertEqual(len(lines), 1, lines)
        line = lines[0].replace("10.0.0.0/24", "127.0.0.1/32")
        hba = os.path.join(self.pg.datadir, "pg_hba.conf")
        with open(hba) as f:
            rest = f.read()
        with open(hba, "w") as f:
            f.write(line + "\n" + rest)
        conn = psycopg2.connect(self.pg.dsn("postgres"))
        conn.autocommit = True
        try:
            conn.cursor().execute("SELECT pg_reload_conf()")
        finally:
            conn.close()
        dsn = f"host=127.0.0.1 port={self.pg.port} user=replicator dbname=replicator"

        def rejects_no_password():
            try:
                psycopg2.connect(dsn).close()
            except psycopg2.OperationalError as e:
                return "password" in str(e)
            return False

        until(rejects_no_password, "pg_hba.conf line in force")
        conn = psycopg2.connect(f"{dsn} password={password}")
        conn.close()
        return f"{dsn} password={password}"

    def make_secret(self) -> str:
        etc = os.path.join(self.tmp, "etc", "replicator")
        script = localized(doc_block("secret"), etc)
        self.assertEqual(has_replicator_group(), "chown " in script)
        os.makedirs(os.path.dirname(etc), exist_ok=True)
        subprocess.run(["bash", "-euo", "pipefail", "-c", script], check=True)
        path = os.path.join(etc, "http-secret")
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
        with open(path) as f:
            secret = f.read().strip()
        self.assertGreaterEqual(len(secret), 16)
        return path

    def install_configs(self, etc: str) -> dict:
        """The page's config-master and config-worker steps, run: the
        installed files, by name (mode 0640)."""
        for step in ("config-master", "config-worker"):
            subprocess.run(["bash", "-euo", "pipefail", "-c", localized(doc_block(step), etc)],
                           check=True)
        installed = {}
        for name in ("master", "worker1", "worker2"):
            path = os.path.join(etc, f"{name}.yaml")
            self.assertEqual(os.stat(path).st_mode & 0o777, 0o640, path)
            with open(path) as f:
                installed[name] = yaml.safe_load(f)
        return installed

    def configs(self, dsn: str, secret_file: str) -> dict:
        installed = self.install_configs(os.path.dirname(secret_file))
        with open(os.path.join(ROOT, "conf", "master.yaml")) as f:
            master_example = yaml.safe_load(f)
        with open(os.path.join(ROOT, "conf", "worker.yaml")) as f:
            worker_example = yaml.safe_load(f)
        # Installed as the examples are.
        self.assertEqual(installed, {"master": master_example, "worker1": worker_example,
                                     "worker2": worker_example})
        ports = {port: free_port() for port in range(9092, 9099)}

        def port(text: str) -> str:
            return re.sub(r"\b(909[2-8])\b", lambda m: str(ports[int(m.group(1))]), text)

        def common(doc):
            doc["database"]["postgres"] = dsn
            doc["http"]["secret_file"] = secret_file
            doc["http"]["listen"] = port(doc["http"]["listen"])
            doc["http"]["metrics_listen"] = port(doc["http"]["metrics_listen"])
            caches = next(s for s in doc["streams"] if s["name"] == "caches")
            caches["writers"] = caches["writers"] + ["worker2"]
            return doc

        master = common(copy.deepcopy(master_example))
        master["replication"]["listen"] = port(master["replication"]["listen"])
        worker1 = common(copy.deepcopy(worker_example))
        worker1["replication"]["upstream"] = port(worker1["replication"]["upstream"])
        worker2 = common(copy.deepcopy(worker_example))
        worker2["replication"]["upstream"] = port(worker2["replication"]["upstream"])
        worker2["instance_name"] = "worker2"
        worker2["http"]["listen"] = f"tcp:{ports[9097]}:interface=127.0.0.1"
        worker2["http"]["metrics_listen"] = f"127.0.0.1:{ports[9098]}"
        worker2["consumers"][0]["path"] = "facts-worker2.jsonl"
        # Only the page's edits (its table), key by key.
        caches_writers = {f"streams[0].writers[{len(master_example['streams'][0]['writers'])}]"}
        shared = {"database.postgres", "http.secret_file", "http.listen",
                  "http.metrics_listen"} | caches_writers
        self.assertEqual(changed_keys(master_example, master),
                         shared | {"replication.listen"})
        self.assertEqual(changed_keys(worker_example, worker1),
                         shared | {"replication.upstream"})
        self.assertEqual(changed_keys(worker_example, worker2),
                         shared | {"replication.upstream", "instance_name",
                                   "consumers[0].path"})
        for doc in (worker1, worker2):
            self.assertEqual(doc["server_name"], master["server_name"])
            # The same declarations (the master's spells out the defaults).
            self.assertEqual(parse_streams(doc["streams"]), parse_streams(master["streams"]))
        return {"master": master, "worker1": worker1, "worker2": worker2}

    def start(self, name: str, doc: dict) -> str:
        state = os.path.join(self.tmp, "var", name)  # its state directory
        os.makedirs(state)
        path = os.path.join(self.tmp, f"{name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(doc, f)
        log = open(os.path.join(state, "out.log"), "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                              if p))
        proc = subprocess.Popen([sys.executable, "-m", "replicator.cli", "run", "-c", path],
                                cwd=state, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
        self.procs.append((proc, log))
        return "http://127.0.0.1:" + doc["http"]["listen"].split(":")[1]

    # ------------------------------------------------------------ the path
    def test_tls_master_and_worker_with_the_documented_certificates(self):
        """The page's openssl commands (the master's host name: ``localhost``,
        the name this test's worker dials), files installed where it says,
        its TLS keys in the shipped examples: the worker connects, and
        writes cross both ways."""
        if shutil.which("openssl") is None:
            unavailable("openssl not found")
        script = doc_block("tls")
        self.assertEqual(script.count("master.example.com"), 1)
        subprocess.run(["bash", "-euo", "pipefail", "-c",
                        script.replace("master.example.com", "localhost")],
                       cwd=self.tmp, check=True, capture_output=True)
        made = os.path.join(self.tmp, "tls")
        for name in ("master", "worker1", "worker2"):
            crt = os.path.join(made, f"{name}.crt")
            verify = subprocess.run(["openssl", "verify", "-CAfile",
                                     os.path.join(made, "ca.crt"), crt],
                                    capture_output=True, text=True)
            self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
            text = subprocess.run(["openssl", "x509", "-in", crt, "-noout", "-subject",
                                   "-ext", "subjectAltName"],
                                  capture_output=True, text=True, check=True).stdout
            self.assertRegex(text, rf"subject=\s*CN\s*=\s*{name}\n")
            self.assertIn(f"DNS:{name}", text)
        # Installed as the page says: the master's files from the directory
        # the commands made, worker1's from a copy of its three files.
        secret_file = self.make_secret()
        etc = os.path.dirname(secret_file)
        tls = os.path.join(etc, "tls")
        subprocess.run(["bash", "-euo", "pipefail", "-c",
                        localized(doc_block("tls-install-master"), etc)], cwd=made, check=True)
        copied = os.path.join(self.tmp, "copied-to-worker1")
        os.makedirs(copied)
        for name in ("worker1.crt", "worker1.key", "ca.crt"):
            shutil.copy(os.path.join(made, name), copied)
        subprocess.run(["bash", "-euo", "pipefail", "-c",
                        localized(doc_block("tls-install-worker"), etc)], cwd=copied, check=True)
        self.assertEqual(sorted(os.listdir(tls)),
                         ["ca", "ca.crt", "master.crt", "master.key", "worker1.crt",
                          "worker1.key"])
        self.assertEqual(os.listdir(os.path.join(tls, "ca")), ["ca.pem"])
        for key in ("master.key", "worker1.key"):
            self.assertEqual(os.stat(os.path.join(tls, key)).st_mode & 0o777, 0o640)
        ports = {port: free_port() for port in range(9092, 9097)}

        def edit(text: str) -> str:
            text = re.sub(r"\b(909[2-6])\b", lambda m: str(ports[int(m.group(1))]), text)
            return text.replace("/etc/replicator", etc).replace("master.example.com",
                                                                "localhost")

        dsn = self.pg.create_database()
        docs = {}
        for name, example, step in (("master", "master.yaml", "tls-master"),
                                    ("worker1", "worker.yaml", "tls-worker")):
            with open(os.path.join(ROOT, "conf", example)) as f:
                doc = yaml.safe_load(f)
            doc["database"]["postgres"] = dsn
            doc["http"]["secret_file"] = secret_file
            doc["http"]["listen"] = edit(doc["http"]["listen"])
            doc["http"]["metrics_listen"] = edit(doc["http"]["metrics_listen"])
            doc["replication"].update(yaml.safe_load(edit(doc_block(step)))["replication"])
            docs[name] = doc
        # Tests listen on loopback only.
        docs["master"]["replication"]["listen"] += ":interface=127.0.0.1"
        with open(secret_file) as f:
            secret = f.read().strip()
        bases = {"master": self.start("master", docs["master"])}
        until(lambda: http(bases["master"] + "/health")[0] == 200, "master healthy")
        bases["worker1"] = self.start("worker1", docs["worker1"])
        until(lambda: http(bases["worker1"] + "/health")[0] == 200, "worker1 healthy")
        code, answer = http(bases["master"] + "/health")
        self.assertEqual((code, answer["connections"]), (200, 1))
        tokens = {}
        for name, base in bases.items():
            code, answer = http(f"{base}/_replicator/v1/streams/caches/facts", secret,
                                {"rows": [[f"tls-{name}", None, 1]]})
            self.assertEqual(code, 200, answer)
            tokens[name] = answer["stream_id"]

        def received():
            for reader, writer in (("master", "worker1"), ("worker1", "master")):
                _, positions = http(f"{bases[reader]}/_replicator/v1/positions", secret)
                entry = positions["streams"]["caches"]["writers"][writer]
                if (entry["reader_position"] or 0) < tokens[writer]:
                    return None
            return True

        until(received, "writes across the TLS link")

    def test_master_and_two_workers_from_the_examples(self):
        dsn = self.create_role_and_database()
        secret_file = self.make_secret()
        with open(secret_file) as f:
            secret = f.read().strip()
        configs = self.configs(dsn, secret_file)
        # Section 3: each file checked before anything started (a new
        # database): the workers' pass too, and name what the master makes.
        for name, doc in configs.items():
            path = os.path.join(self.tmp, f"check-{name}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(doc, f)
            checked = subprocess.run(
                [sys.executable, "-m", "replicator.cli", "check", "-c", path],
                capture_output=True, text=True, timeout=60, cwd=self.tmp,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                    p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)))
            self.assertEqual(checked.returncode, 0, checked.stderr)
            awaiting = ("account_data_stream (stream account_data) is created by its "
                        "writer (master) at its first start; start this instance after it")
            self.assertEqual(awaiting in checked.stdout, name != "master", checked.stdout)
        # The master first (it creates the tables), then the workers.
        bases = {"master": self.start("master", configs["master"])}
        until(lambda: http(bases["master"] + "/health")[0] == 200, "master healthy")
        for name in ("worker1", "worker2"):
            bases[name] = self.start(name, configs[name])

        def all_healthy():
            answers = {n: http(b + "/health") for n, b in bases.items()}
            if all(code == 200 for code, _ in answers.values()) and \
                    answers["master"][1]["connections"] == 2:
                return answers
            return None

        answers = until(all_healthy, "/health 200 everywhere")
        for name, (_, answer) in answers.items():
            self.assertEqual((answer["status"], answer["instance"], answer["role"],
                              answer["replication"]["connected"]),
                             ("ok", name, "master" if name == "master" else "worker", True))
        # The page's expected answers, as /health gives them: the same
        # keys in the same order, the same version string.
        with open(os.path.join(ROOT, "docs", "operations.md")) as f:
            page = f.read()
        for name in ("master", "worker1"):
            line = re.search(rf'`(\{{"status":"ok","instance":"{name}".*?),\.\.\.\}}`',
                             page).group(1)
            documented = json.loads(line + "}")
            answer = answers[name][1]
            self.assertEqual(list(documented), list(answer)[:len(documented)], name)
            self.assertEqual(documented["version"], answer["version"])
        self.assertIn(f"(`replicator {answers['master'][1]['version']}` for a wheel built",
                      page)
        # A write on each writer reaches every other instance.
        tokens = {}
        for name, base in bases.items():
            code, answer = http(f"{base}/_replicator/v1/streams/caches/facts", secret,
                                {"rows": [[f"from-{name}", [f"@{name}:example.com"], 1]]})
            self.assertEqual(code, 200, answer)
            tokens[name] = answer["stream_id"]

        def received():
            for reader, base in bases.items():
                code, positions = http(f"{base}/_replicator/v1/positions", secret)
                writers = positions["streams"]["caches"]["writers"]
                for writer, token in tokens.items():
                    if writer != reader and (writers[writer]["reader_position"] or 0) < token:
                        return None
            return True

        until(received, "every write at every other instance")
        # The consumers append in a thread: their files follow soon after.
        for reader in ("worker1", "worker2"):
            path = os.path.join(self.tmp, "var", reader, f"facts-{reader}.jsonl")

            def consumed():
                with open(path) as f:
                    text = f.read()
                return all(f'"from-{w}"' in text for w in tokens if w != reader) and text

            text = until(consumed, f"{reader}'s consumer file has the others' facts")
            self.assertNotIn(f'"from-{reader}"', text)


class RedisExamplesTests(TestCase):
    """The Redis section's example files pass ``replicator check`` against a
    real PostgreSQL (their DSNs and secret file pointed at the test's; the
    Redis endpoints as written: check builds them, it does not dial); and
    "both at once" does what its table row says, on a real redis-server."""

    timeout = 180

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="replicator-redis-doc-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.procs = []
        self.addCleanup(self.stop_all)

    stop_all = OperationsPathTests.stop_all
    start = OperationsPathTests.start

    def check(self, step: str, tmp: str, dsns: dict) -> dict:
        doc = yaml.safe_load(doc_block(step))
        secret = os.path.join(tmp, "http-secret")
        with open(secret, "w") as f:
            f.write("s" * 32 + "\n")
        os.chmod(secret, 0o600)
        self.assertEqual(doc["http"]["secret_file"], "/etc/replicator/http-secret")
        doc["http"]["secret_file"] = secret
        if "database" in doc:
            doc["database"]["postgres"] = dsns["replicator"]
        if "synapse" in doc:
            doc["synapse"]["database"] = dsns["synapse"]
        path = os.path.join(tmp, f"{step}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(doc, f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        result = subprocess.run([sys.executable, "-m", "replicator.cli", "check", "-c", path],
                                cwd=tmp, env=env, capture_output=True, text=True, timeout=60)
        # Warnings only (a remote writer bound by no secret, our Redis
        # channel unsigned: what these short examples leave out).
        self.assertEqual(result.returncode, 0, (step, result.stderr))
        self.assertEqual([line for line in result.stderr.splitlines()
                          if not line.startswith("replicator: warning: ")], [], step)
        self.assertIn("config ok", result.stdout)
        return doc

    def test_examples_pass_check(self):
        from tests.synapse_side import SYNAPSE_CACHES_DDL

        pg = PostgresServer.shared()
        dsns = {"replicator": pg.create_database("redisdoc"),
                "synapse": pg.create_database("synapsedoc")}
        conn = psycopg2.connect(dsns["synapse"])
        conn.autocommit = True
        try:
            for statement in SYNAPSE_CACHES_DDL:
                conn.cursor().execute(statement)
        finally:
            conn.close()
        tmp = self.tmp
        peer = self.check("redis-peer", tmp, dsns)
        self.assertEqual(set(peer["replication"]), {"redis"})
        both = self.check("redis-and-listen", tmp, dsns)
        self.assertEqual(set(both["replication"]), {"listen", "redis"})
        beside = self.check("redis-synapse", tmp, dsns)
        self.assertNotIn("replication", beside)
        self.assertIn("redis", beside["synapse"])

    def test_both_at_once(self):
        """The "both at once" example as the master, a TCP worker (worker1)
        and a Redis peer (worker2, the "redis-peer" example): the TCP
        worker's facts reach the Redis peer (the master publishes them
        there), and the master's reach both."""
        from tests.servers import RedisServer

        redis = RedisServer.shared()
        dsn = PostgresServer.shared().create_database("redisboth")
        secret = "s" * 32
        listen_port = free_port()

        def from_example(step: str, name: str) -> dict:
            doc = yaml.safe_load(doc_block(step))
            doc["instance_name"] = name
            doc["database"]["postgres"] = dsn
            doc["http"] = {"listen": f"tcp:{free_port()}:interface=127.0.0.1",
                           "secret": secret}
            if "redis" in doc["replication"]:
                doc["replication"]["redis"] = {"endpoint": redis.endpoint}
            doc["consumers"] = [{"type": "jsonl", "path": f"facts-{name}.jsonl"}]
            return doc

        master = from_example("redis-and-listen", "master")
        master["replication"]["listen"] = f"tcp:{listen_port}:interface=127.0.0.1"
        worker1 = from_example("redis-and-listen", "worker1")
        worker1["replication"] = {"upstream": f"tcp:host=127.0.0.1:port={listen_port}"}
        worker2 = from_example("redis-peer", "worker2")
        self.assertEqual(set(worker2["replication"]), {"redis"})
        bases = {"master": self.start("master", master)}
        until(lambda: http(bases["master"] + "/health")[0] == 200, "master healthy")
        # The Redis peer before the TCP worker: a Redis peer hears a TCP
        # worker's position only when that worker speaks (the page says so).
        bases["worker2"] = self.start("worker2", worker2)
        until(lambda: http(bases["worker2"] + "/health")[0] == 200, "worker2 healthy")
        bases["worker1"] = self.start("worker1", worker1)
        # Every reader in place before the writes (a new reader starts at
        # the writers' positions: what was written before is history).
        until(lambda: all(http(b + "/health")[0] == 200 for b in bases.values())
              # the TCP worker and the Redis link
              and http(bases["master"] + "/health")[1]["connections"] == 2, "all healthy")

        def positioned():
            # Every reader has heard every other writer's position (on
            # Redis a newcomer's REPLICATE is answered a moment later).
            for reader, base in bases.items():
                _, positions = http(f"{base}/_replicator/v1/positions", secret)
                writers = positions["streams"]["caches"]["writers"]
                if any(writers[w].get("reader_position") is None for w in bases if w != reader):
                    return False
            return True

        until(positioned, "every reader positioned")
        tokens = {}
        for name in ("master", "worker1"):
            code, answer = http(f"{bases[name]}/_replicator/v1/streams/caches/facts", secret,
                                {"rows": [[f"from-{name}", None, 1]]})
            self.assertEqual(code, 200, answer)
            tokens[name] = answer["stream_id"]
        for reader, writer in (("worker2", "worker1"), ("worker2", "master"),
                               ("worker1", "master"), ("master", "worker1")):
            path = os.path.join(self.tmp, "var", reader, f"facts-{reader}.jsonl")

            def consumed():
                with open(path) as f:
                    return f'"from-{writer}"' in f.read()

            until(consumed, f"{writer}'s fact in {reader}'s consumer file")
