"""Phase 5: mutated configs given to ``replicator run``.

Each mutation starts from a shipped example (``conf/dev.yaml``, with its
ports moved to free loopback ports and its secret file in the run's
directory) and changes one thing: a key removed, renamed or added, a value
of another type or out of range, a name with a newline, a listener left to
Twisted's defaults or open beyond loopback, or the file's bytes
(another encoding, invalid UTF-8, YAML tags, anchors, deep nesting,
truncation).  The daemon is given a few seconds: it must either exit 2 with
exactly one stderr line ``replicator: config: <key>: ...``, or keep running
(then SIGTERM must stop it with exit 0) — never a traceback, never another
exit status.  A mutation that can never be right (a non-finite or absurd
number, a name with a control character, a file that is not UTF-8) must not
start.
"""

import copy
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import yaml

from tests.servers import free_port

from .daemon import ROOT
from .results import PhaseResult, show

ONE_LINE = re.compile(r"replicator: config: [^\s:][^:\n]*: [^\n]+\n")
#: A runtime failure at startup (exit 1, README): one line naming the key.
ONE_LINE_RUNTIME = re.compile(r"replicator: (config: )?[a-z_]+[\w.\[\]]*: [^\n]+\n")
#: What the daemon logs once it is up (then it gets SIGTERM).
#: The readiness line, after the time that text lines start with.
READY = re.compile(rb"^(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ )?INFO service: instance .* ready$",
                   re.M)
#: Seconds a mutated config gets to exit or become ready.
STARTUP_LIMIT = 60.0

_VALUES: list[tuple[Any, bool]] = [  # (value, must be refused wherever a number goes)
    (None, False), (True, False), (False, False), (0, False), (-1, False), (1, False),
    (2 ** 31, False), (2 ** 63, True), (10 ** 30, True), (1e30, True),
    (float("nan"), True), (float("inf"), True), (-float("inf"), True), (-0.0, False),
    (1.5, False), ("", False), (" ", False), ("x", False), ("a" * 5000, False),
    ("1.5", False), ("é✓", False), ([], False), ({}, False), ([1, "a"], False),
    ({"a": 1}, False), ("tcp:0", False), ("tcp:notaport", False), ("ssl:0", False),
    ("unix:/nonexistent/dir/sock", False), ("/nonexistent/file", False), ("select", False),
]
#: Listeners that must never start: Twisted's defaults (port 443 for tls:,
#: server.pem for ssl:), no port, and (replication only) a listener beyond
#: loopback without client_ca or allowed_networks.
_INSECURE_LISTENS = ["tls:", "tls:0", "tcp:", "tcp:interface=127.0.0.1",
                     "ssl:0:interface=127.0.0.1", "ssl:interface=127.0.0.1:privateKey=k.pem"]
_PUBLIC_LISTENS = ["tcp:0", "tcp:0:interface=0.0.0.0", r"tcp6:0:interface=\:\:", "tcp6:0"]
_BAD_NAMES = ["localhost\n", "caches\n", "a b", "a\x00b", "\x1b[31m", "a\rb", "\t", "x\u2028y"]
_SQL_WORDS = ["select", "order", "table", "user", "group", "from"]
_NAME_KEYS = {"server_name", "instance_name", "name", "table", "id_column", "writer_column",
              "sequence", "timestamp_column"}


def base_config(directory: str) -> dict:
    with open(os.path.join(ROOT, "conf", "dev.yaml")) as f:
        config = yaml.safe_load(f)
    config["database"] = {"sqlite": "state.db"}
    config["replication"]["listen"] = f"tcp:{free_port()}:interface=127.0.0.1"
    config["http"]["listen"] = f"tcp:{free_port()}:interface=127.0.0.1"
    config["http"]["metrics_listen"] = f"127.0.0.1:{free_port()}"
    config["http"]["secret_file"] = "secret"
    with open(os.path.join(directory, "secret"), "w") as f:
        f.write("fuzz-secret-0123456789abcdef\n")
    os.chmod(os.path.join(directory, "secret"), 0o600)
    return config


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _get(config, path):
    for p in path:
        config = config[p]
    return config


def mutate_tree(rng: random.Random, config: dict) -> tuple[dict, str, bool]:
    """One structural mutation: (config, description, must_refuse)."""
    config = copy.deepcopy(config)
    paths = [p for p in _paths(config) if p]
    path = rng.choice(paths)
    parent, key = _get(config, path[:-1]), path[-1]
    old = parent[key]
    where = ".".join(str(p) for p in path)
    op = rng.randrange(9)
    if op == 8:
        section = rng.choice(["replication", "http"])
        if isinstance(config.get(section), dict):
            choices = _INSECURE_LISTENS + (_PUBLIC_LISTENS if section == "replication" else [])
            config[section]["listen"] = rng.choice(choices)
            return config, f"{section}.listen = {config[section]['listen']!r}", True
    if op == 0:
        del parent[key]
        return config, f"delete {where}", False
    if op == 1 and isinstance(parent, dict):
        parent[str(key) + rng.choice(["_", "s", "X"])] = parent.pop(key)
        return config, f"rename {where}", False
    if op == 2 and isinstance(parent, dict):
        parent[rng.choice(["bogus", "Server_Name", "", "streams ", "1"])] = old
        return config, f"add a key beside {where}", False
    if op == 3 and (key in _NAME_KEYS or isinstance(old, str)):
        bad = rng.choice(_BAD_NAMES)
        parent[key] = (old if isinstance(old, str) else "x") + bad if bad.endswith("\n") else bad
        return config, f"{where} = {parent[key]!r}", key in _NAME_KEYS
    if op == 4 and key in ("table", "sequence", "id_column", "writer_column", "name"):
        parent[key] = rng.choice(_SQL_WORDS)
        return config, f"{where} = {parent[key]!r} (SQL keyword)", False
    if op == 5 and isinstance(parent, list):
        parent.append(copy.deepcopy(old))
        return config, f"duplicate {where}", False
    if op == 6 and "streams" in config and isinstance(config["streams"], list) \
            and config["streams"] and isinstance(config["streams"][0], dict):
        config["streams"][0]["writer_column"] = config["streams"][0].get("id_column", "stream_id")
        return config, "streams.0.writer_column = id_column", False
    value, absurd = rng.choice(_VALUES)
    parent[key] = value
    numeric = isinstance(old, (int, float)) and not isinstance(old, bool)
    return config, f"{where} = {value!r}"[:120], absurd and numeric


def mutate_text(rng: random.Random, text: str) -> tuple[bytes, str, bool]:
    """One mutation of the file's bytes: (data, description, must_refuse)."""
    op = rng.randrange(11)
    data = text.encode()
    if op == 0:
        return text.replace("localhost", "lócalhost").encode("latin-1"), "latin-1 file", True
    if op == 1:
        pos = rng.randrange(len(data))
        return data[:pos] + b"\xff\xfe" + data[pos:], "invalid UTF-8 bytes", True
    if op == 2:
        return b"\xef\xbb\xbf" + data, "UTF-8 BOM", False
    if op == 3:
        return text.encode("utf-16"), "UTF-16 file", True
    if op == 4:
        return data + b"\nserver_name: other\n", "duplicate key", False
    if op == 5:
        laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
            f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
            for i in range(8))
        return data + b"\n" + laughs.encode() + b"bogus: *i\n", "billion laughs", False
    if op == 6:
        return data + b"\nx: " + b"[" * 5000 + b"]" * 5000 + b"\n", "deep nesting", False
    if op == 7:
        return data[:rng.randrange(len(data))], "truncated", False
    if op == 8:
        return b"!!python/object/apply:os.system [\"echo pwned\"]\n", "python tag", False
    if op == 9:
        return bytes(rng.randrange(256) for _ in range(200)), "random bytes", True
    return data.replace(b"  ", b"\t", 1), "tab indentation", False


def _run(directory: str, data: bytes) -> tuple[int | None, str, str, bool]:
    """(exit status, stdout, stderr, was running at the deadline)."""
    path = os.path.join(directory, "mutated.yaml")
    with open(path, "wb") as f:
        f.write(data)
    env = dict(os.environ, PYTHONPATH=ROOT)
    out_path, err_path = os.path.join(directory, "out"), os.path.join(directory, "err")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "replicator.cli", "run", "-c", path],
                                cwd=directory, env=env, stdout=out, stderr=err)
        running = False
        deadline = time.monotonic() + STARTUP_LIMIT
        code = None
        while True:
            code = proc.poll()
            if code is not None:
                break
            with open(out_path, "rb") as f:
                if READY.search(f.read()):
                    running = True
                    break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if code is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                code = None
    with open(out_path, "rb") as f:
        stdout = f.read().decode("utf-8", "replace")
    with open(err_path, "rb") as f:
        stderr = f.read().decode("utf-8", "replace")
    return code, stdout, stderr, running


def _judge(result, family, description, data, must_refuse, code, stdout, stderr, running):
    repro = f"{description}: {show(data, 120)}"
    if "Traceback" in stdout or "Traceback" in stderr:
        text = stderr if "Traceback" in stderr else stdout
        last = [l.strip() for l in text.splitlines()
                if re.match(r"\s*[\w.]+(Error|Exception|Exit|Failure)\b", l)][-1:]
        if last:
            signature = _generic(last[0])
        else:  # cut off at the deadline: name the innermost frame
            frames = re.findall(r'File "[^"]*/(?:site-packages|replicator)/([^"]+)", line \d+, '
                                r"in (\w+)", text)
            signature = "unfinished traceback" + (f" in {frames[-1][0]}:{frames[-1][1]}"
                                                  if frames else "")
        result.found("traceback", signature, family, repro, text[-400:])
        return
    if not running and code is not None and code < 0:
        result.found("neither_ready_nor_exited", f"{description[:40]}: not in "
                     f"{STARTUP_LIMIT:.0f}s", family, repro, (stdout + stderr)[-300:])
        return
    if running:
        if code != 0:
            result.found("unclean_stop", f"exit {code} after SIGTERM", family, repro,
                         stderr[-300:])
        if must_refuse:
            result.found("accepted_bad_config", description[:80], family, repro, "")
        return
    if code == 2:
        if not ONE_LINE.fullmatch(stderr):
            result.found("exit2_not_one_line", _generic(stderr.splitlines()[0]) if stderr else
                         "(empty stderr)", family, repro, stderr[-400:])
        return
    if code == 0:
        result.found("exit0_without_running", "exit 0", family, repro, stderr[-300:])
        return
    if code == 1 and ONE_LINE_RUNTIME.fullmatch(stderr):
        result.figure("exit_1_one_line", result.figures.get("exit_1_one_line", 0) + 1)
        return
    first = stderr.strip().splitlines()[-1] if stderr.strip() else "(empty stderr)"
    result.found(f"exit_{code}", _generic(first), family, repro, stderr[-400:])


def _generic(text: str) -> str:
    """One signature per kind of message: paths, numbers and quoted values folded."""
    text = re.sub(r"/tmp/\S+", "<dir>", text)
    text = re.sub(r"0x[0-9a-f]+|\d+", "N", text)
    return re.sub(r"'[^']*'", "'...'", text)[:120]


def run_phase(seed: int, count: int, threads: int = 2) -> PhaseResult:
    result = PhaseResult("5-configs")
    lock = threading.Lock()
    counter = {"n": 0}

    def worker(k):
        while True:
            with lock:
                i = counter["n"]
                if i >= count:
                    return
                counter["n"] += 1
            # One generator per config: the same inputs whatever the threads do.
            rng = random.Random(seed * 1_000_003 + i)
            directory = tempfile.mkdtemp(prefix="fuzz-config-")
            try:
                config = base_config(directory)
                if rng.random() < 0.75:
                    family = "tree"
                    config, description, refuse = mutate_tree(rng, config)
                    try:
                        data = yaml.safe_dump(config, allow_unicode=True).encode()
                    except yaml.YAMLError:
                        continue
                else:
                    family = "text"
                    text = yaml.safe_dump(config, allow_unicode=True)
                    data, description, refuse = mutate_text(rng, text)
                outcome = _run(directory, data)
                with lock:
                    result.tried(family)
                    result.figure("running", result.figures.get("running", 0) + outcome[3])
                    _judge(result, family, description, data, refuse, *outcome)
            finally:
                shutil.rmtree(directory, ignore_errors=True)

    workers = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return result.done()
