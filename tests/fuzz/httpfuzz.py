"""Phase 4: hostile HTTP requests against a running daemon's HTTP listener
(write API, positions, bookkeeping, health, metrics), each on its own raw
socket, beside an honest writer and reader.

Per request: an answer comes (no silent close, within 10 s); it is not a
5xx; a 4xx has a JSON body.  For the phase: the honest clients are not
harmed, no traceback or critical event is logged, no reactor stall.
"""

import json
import os
import random
import shutil
import socket
import tempfile
import threading
import time

from .daemon import SECRET, Daemon, HonestReader, HonestWriter
from .results import PhaseResult, show
from .sockets import _check_daemon, _check_honest, wait_caught_up

FACTS = "/_replicator/v1/streams/caches/facts"
PATHS = ["/health", "/metrics", "/_replicator/v1/positions", "/_replicator/v1/user_syncs",
         "/_replicator/v1/user_ips", "/_replicator/v1/federation_acks", FACTS,
         "/_replicator/v1/streams/events/facts"]


def _request(method=b"POST", path=FACTS.encode(), headers=None, body=b"", auth=True,
             version=b"HTTP/1.1", length=True) -> bytes:
    head = [method + b" " + path + b" " + version, b"Host: 127.0.0.1", b"Connection: close"]
    if auth:
        head.append(b"Authorization: Bearer " + SECRET.encode())
    if length and body is not None:
        head.append(b"Content-Length: %d" % len(body))
    head += headers or []
    return b"\r\n".join(head) + b"\r\n\r\n" + (body or b"")


def _rows(rows) -> bytes:
    return json.dumps({"rows": rows}).encode()


# ------------------------------------------------------------------ families
def bad_json(rng):
    body = rng.choice([
        b"", b"{", b"null", b"[]", b'"rows"', b"{}", b'{"rows": 1}', b'{"rows": [1]}',
        b'{"rows": [[]]}', b'{"rows": [["a", null]]}', b'{"rows": [["a", null, 1, 2]]}',
        b'{"rows": [[1, null, 1]]}', b'{"rows": [["a", null, "1"]]}',
        b'{"rows": [["a", null, true]]}',
        b'{"rows": [["a", null, 1.5]]}', b'{"rows": [["a", null, NaN]]}',
        b'{"rows": [["a", null, Infinity]]}', b'{"rows": [["a\\u0000", null, 1]]}',
        b'{"rows": [["\\ud800", null, 1]]}', b'{"rows": [["a", null, 1]], "rows": 2}',
        b'\xef\xbb\xbf{"rows": [["a", null, 1]]}', b'{"rows": [["\xff", null, 1]]}',
        b'{"rows": [["a", null, 1]], "extra": 1}', b'{"rows": [["a", null, 1]]} trailing',
        b'{"rows": ' + b"[" * 5 + b"]" * 5 + b"}",
    ])
    return _request(body=body)


def huge_number(rng):
    n = rng.choice([20, 30, 400, 4300, 4301, 5000, 20000])
    digits = str(rng.randint(1, 9)) + "".join(rng.choice("0123456789") for _ in range(n - 1))
    where = rng.randrange(3)
    if where == 0:
        body = b'{"rows": [["a", null, ' + digits.encode() + b"]]}"
    elif where == 1:
        body = b'{"rows": [["a", [' + digits.encode() + b"], 1]]}"
    else:
        body = b'{"rows": [["a", null, 1' + b"e" + str(n).encode() + b"]]}"
    return _request(body=body)


def deep_json(rng):
    depth = rng.choice([100, 300, 999, 1000, 5000, 100000])
    inner = b"[" * depth + b"]" * depth if rng.random() < 0.7 else b"[" * depth
    body = b'{"rows": [["a", ' + inner + b", 1]]}" if rng.random() < 0.6 else inner
    return _request(body=body)


def bad_headers(rng):
    body = _rows([["a", None, 1]])
    choice = rng.randrange(12)
    if choice == 0:
        return _request(body=body, length=False, headers=[b"Content-Length: -1"])
    if choice == 1:
        return _request(body=body, length=False, headers=[b"Content-Length: abc"])
    if choice == 2:
        return _request(body=body, length=False,
                        headers=[b"Content-Length: 99999999999999999999999999"])
    if choice == 3:
        return _request(body=body, headers=[b"Content-Length: %d" % (len(body) + 5)])
    if choice == 4:
        return _request(body=body, headers=[b"Transfer-Encoding: chunked"])
    if choice == 5:
        return _request(body=b"zz\r\nxx\r\n0\r\n\r\n", length=False,
                        headers=[b"Transfer-Encoding: chunked"])
    if choice == 6:
        return _request(body=body, headers=[b"X-H%d: v" % i for i in range(500)])
    if choice == 7:
        return _request(body=body, headers=[b"X-Nul: a\x00b"])
    if choice == 8:
        return _request(body=body, headers=[b"X-Big: " + b"a" * 100_000])
    if choice == 9:
        return _request(body=body, headers=[b"NoColonHere"])
    if choice == 10:
        return _request(body=body, headers=[b"X-Fold: a", b" continued"])
    return _request(body=body, length=False, headers=[b"Content-Length: 1e3"])


def bad_auth(rng):
    value = rng.choice([b"", b"Bearer", b"Bearer ", b"Bearer wrong-secret-0123456789",
                        b"Basic Zm9vOmJhcg==", b"bearer " + SECRET.encode(),
                        b"Bearer " + SECRET.encode() + b"x", b"Bearer " + b"\xff" * 20,
                        b"Bearer " + b"a" * 20000])
    return _request(body=_rows([["a", None, 1]]), auth=False,
                    headers=[b"Authorization: " + value])


def bad_path(rng):
    path = rng.choice([
        b"/_replicator/v1/streams/%00/facts", b"/_replicator/v1/streams/%ff/facts",
        b"/_replicator/v1/streams/../facts", b"/_replicator/v1/streams//facts",
        b"/_replicator/v1/streams/nope/facts", b"/_replicator/v1/streams/caches/facts/x",
        b"/_replicator/v1/streams/cach%65s/facts", b"/" + b"a" * 20000, b"*", b"",
        b"http://127.0.0.1/health", b"/health?" + b"x=1&" * 2000, b"/health#x",
        b"/%", b"/\xff", b"/_replicator/v1/positions/..%2f..%2fetc",
    ])
    method = rng.choice([b"GET", b"POST", b"HEAD"])
    return _request(method=method, path=path, body=_rows([["a", None, 1]]))


def bad_method(rng):
    method = rng.choice([b"PUT", b"DELETE", b"OPTIONS", b"TRACE", b"CONNECT", b"PATCH",
                         b"get", b"G\x00ET", b"X" * 5000, b"", b"POST POST"])
    return _request(method=method, path=rng.choice(PATHS).encode(), body=b"")


def bad_request_line(rng):
    return rng.choice([
        b"\r\n\r\n", b"GET\r\n\r\n", b"GET /health\r\n\r\n", b"GET /health HTTP/9.9\r\n\r\n",
        b"GET /health HTTP/1.1 extra\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40,
        b"GET /health HTTP/1.1\n\n", b"GET /health HTTP/1.0\r\n\r\n",
        bytes(rng.randrange(256) for _ in range(200)) + b"\r\n\r\n",
    ])


def too_large(rng):
    size = rng.choice([1 << 20, 5 << 20, 20 << 20])
    return _request(body=b'{"rows": [["' + b"a" * size + b'", null, 1]]}')


def valid(rng):
    path = rng.choice(PATHS)
    if path.endswith("facts"):
        return _request(path=path.encode(), body=_rows(
            [["a", None, 1]] if "caches" in path else [["$e", None, True]]))
    return _request(method=b"GET", path=path.encode(), body=None, auth=rng.random() < 0.5)


FAMILIES = {
    "valid": valid, "bad_json": bad_json, "huge_number": huge_number, "deep_json": deep_json,
    "bad_headers": bad_headers, "bad_auth": bad_auth, "bad_path": bad_path,
    "bad_method": bad_method, "bad_request_line": bad_request_line, "too_large": too_large,
}


def _send(port: int, data: bytes, timeout: float = 15.0) -> tuple[int | None, dict, bytes, str]:
    """(status, headers, body, note); status None if no answer came."""
    received = b""
    note = ""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            try:
                sock.sendall(data)
            except OSError:
                note = "closed while sending"
            sock.settimeout(timeout)
            while True:
                try:
                    chunk = sock.recv(1 << 16)
                except TimeoutError:
                    note = "timeout"
                    break
                except OSError:
                    break
                if not chunk:
                    break
                received += chunk
    except OSError as e:
        return None, {}, b"", f"connect: {e}"
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None, {}, received, note or "no HTTP answer"
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers, body, note


def _judge(result, family, data, status, headers, body, note) -> None:
    if status is None:
        result.found("no_answer", note or "closed silently", family, show(data), show(body))
        return
    if status >= 500:
        result.found("server_error", f"status {status}", family, show(data), show(body))
    if status >= 400 and not data.startswith(b"HEAD "):
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            body = _unchunk(body)
        try:
            answer = json.loads(body)
            assert isinstance(answer, dict)
        except (ValueError, AssertionError):
            result.found("non_json_error", f"status {status}", family, show(data), show(body))


def _unchunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        try:
            n = int(size.split(b";")[0], 16)
        except ValueError:
            return out
        if n == 0:
            break
        out += rest[:n]
        body = rest[n + 2:]
    return out


def slowloris(port: int, result: PhaseResult, connections: int = 40,
              seconds: float = 25.0) -> None:
    """Connections sending one header byte every 0.5 s, never finishing: each
    must be answered (408) and closed by the header deadline (10 s), not
    held (issue 11 item 8)."""
    import select

    socks = []
    for _ in range(connections):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        s.setblocking(False)
        socks.append(s)
    result.tried("slowloris", connections)
    answers = {}
    deadline = time.monotonic() + seconds
    open_socks = set(socks)
    while open_socks and time.monotonic() < deadline:
        for s in list(open_socks):
            try:
                s.send(b"a")
            except OSError:
                open_socks.discard(s)
        ready, _, _ = select.select(list(open_socks), [], [], 0.5)
        for s in ready:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            answers[s] = answers.get(s, b"") + data
            if not data:
                open_socks.discard(s)
    statuses = sorted({a.split(b" ", 2)[1].decode("ascii", "replace") for a in answers.values()
                       if a.startswith(b"HTTP/")})
    result.figure("slowloris_answers", statuses)
    if open_socks:
        result.found("slowloris_held", f"{len(open_socks)} of {connections} connections still "
                     f"open after {seconds:.0f}s", "slowloris",
                     "b'GET /health HTTP/1.1\\r\\nX-Slow: ' + one byte every 0.5 s")
    for s in socks:
        s.close()


def run_phase(seed: int, requests: int, threads: int = 2, families=None,
              slow: bool = False) -> PhaseResult:
    result = PhaseResult("4-http")
    directory = tempfile.mkdtemp(prefix="fuzz-http-")
    daemon = Daemon(directory)
    names = families or list(FAMILIES)
    try:
        daemon.start()
        reader = HonestReader(daemon.rep_port)
        reader.start()
        reader.connected.wait(10)
        writer = HonestWriter(daemon.http_port, ("caches", "events"), seed=seed, pause=0.01)
        writer.start()
        lock = threading.Lock()
        counter = {"n": 0}

        def worker(k):
            while True:
                with lock:
                    i = counter["n"]
                    if i >= requests:
                        return
                    counter["n"] += 1
                family = names[i % len(names)]
                # One generator per input: the same inputs whatever the threads do.
                data = FAMILIES[family](random.Random(seed * 1_000_003 + i))
                status, headers, body, note = _send(daemon.http_port, data)
                with lock:
                    result.tried(family)
                    _judge(result, family, data, status, headers, body, note)

        workers = [threading.Thread(target=worker, args=(k,), daemon=True)
                   for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if slow:
            slowloris(daemon.http_port, result)
        writer.stop()
        wait_caught_up(result, reader, writer, os.path.join(directory, "state.db"), None)
        alive = daemon.alive()
        reader.stop()
        code = daemon.stop()
        if not alive:
            result.found("daemon_died", f"exit {daemon.proc.returncode}", "-", "")
        elif code != 0:
            result.found("unclean_stop", f"exit {code}", "-", "")
        # The fuzzer's valid writes are facts of master too: the reader must
        # have them as well.
        _check_honest(result, reader, writer, os.path.join(directory, "state.db"), None)
        _check_daemon(result, daemon, None)
    finally:
        daemon.kill()
        shutil.rmtree(directory, ignore_errors=True)
    return result.done()
