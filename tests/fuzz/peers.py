"""Phase 3: forged peers against a running master on PostgreSQL (stream
``caches`` written by ``master`` and ``worker1``, ``events`` by ``master``),
the attacks of issue 11 items 1-4, each beside an honest reader:

* ``poison_master``: ``NAME worker1`` + ``POSITION caches worker1 777 2^62``;
  the master's next ``caches`` fact must still reach the reader and the
  master's own token must not move to 2^62.
* ``poison_worker``: a forged upstream tells a worker ``POSITION events
  master 0 2^62``; the real fact 1 in the table must still reach the
  worker's consumer (after the claim is refused and a truthful upstream
  answers).
* ``impersonate_master``: ``NAME master`` + RDATA for ``master``: refused,
  never relayed.
* ``impersonate_writer``: a peer that merely says ``NAME worker1`` gets its
  RDATA relayed (no identity check without TLS/allow-list: reported as a
  figure, not a finding, since the fix is a setting).
* ``bookkeeping``: another connection's ``CLEAR_USER_SYNC worker1``,
  ``USER_SYNC worker1 ...`` and ``FEDERATION_ACK worker1`` must not change
  worker1's state; which bookkeeping endpoints answer without the secret is
  reported.
* ``batch_amplification``: ``batch`` lines cheap on the wire, dear in
  memory, from one and then three connections named ``worker1``: RSS may
  grow by at most 3 times what was sent (issue 20 item 4).
* ``borrowed_name``: while the real ``worker1`` is connected and its next
  ``caches`` fact is still uncommitted, a second connection says ``NAME
  worker1`` and ``POSITION caches worker1 <p> <t>`` past that fact
  (issue 20 item 3): it must be refused, no reader and not the master may
  be moved past the fact, and the fact must reach the reader once worker1
  sends it.
* ``redis_forged_positions``: over Redis, a client that only SUBSCRIBEs
  and PUBLISHes answers every ``RDATA caches master T`` with ``POSITION
  caches master T T+2`` while the master writes; with
  ``replication.redis.keys`` on both instances the reader must get every
  fact of the table, none lost (without keys, how many were lost is a
  figure: the trust the setting adds).
* ``away_writer``: while worker1 is away (no link) and its next ``caches``
  fact is in flight, an impostor says ``NAME worker1`` and ``POSITION caches
  worker1 0 <t>`` past that fact, on a master that gives worker1 a secret
  (``writer_secrets``): the impostor cannot prove the NAME and is refused,
  and once worker1 commits the fact and comes back (a worker daemon that
  proves its NAME) the master's consumer gets it.  No fact lost.
* ``relay_long_line``: a 12 KB ``LOCK_RELEASED`` with non-ASCII text and a
  lone surrogate: the honest reader stays connected and gets no line over
  the limit.
"""

import json
import os
import shutil
import socket
import tempfile
import time

import yaml

from tests.servers import free_port

from . import inputs
from .daemon import (
    ROOT,
    SECRET,
    Daemon,
    HonestReader,
    http_get,
    log_problems,
    wait_for,
)
from .results import PhaseResult, show
from .sockets import _check_daemon

BIG = 2 ** 62


class Peer:
    """A raw replication connection: send lines, collect what comes back."""

    def __init__(self, port: int, lines: str = ""):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.received = b""
        self.closed = False  # nothing more comes from the server
        self.send_failed = False
        if lines:
            self.send(lines)

    def send(self, text) -> None:
        data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
        self.sock.settimeout(60)
        try:
            self.sock.sendall(data)
        except OSError:
            self.send_failed = True

    def drain(self, seconds: float = 0.5) -> bytes:
        deadline = time.monotonic() + seconds
        while not self.closed and time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            except OSError:
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            self.received += data
        return self.received

    def errors(self) -> list[bytes]:
        return [l for l in self.received.split(b"\n") if l.startswith(b"ERROR")]

    def close(self) -> None:
        self.sock.close()


def _positions(daemon: Daemon) -> dict:
    status, body = http_get(daemon.http_port, "/_replicator/v1/positions", SECRET)
    return json.loads(body)["streams"]


def _write(daemon: Daemon, stream: str, rows) -> int:
    """One fact through the HTTP API; its stream ID."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", daemon.http_port, timeout=30)
    try:
        conn.request("POST", f"/_replicator/v1/streams/{stream}/facts",
                     body=json.dumps({"rows": rows}).encode(),
                     headers={"Authorization": f"Bearer {SECRET}"})
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise AssertionError(f"write failed: {response.status} {body!r}")
    return json.loads(body)["stream_id"]


def poison_master(daemon, result) -> None:
    reader = HonestReader(daemon.rep_port)
    reader.start()
    reader.connected.wait(10)
    attack = f"NAME worker1\nPOSITION caches worker1 777 {BIG}\n"
    peer = Peer(daemon.rep_port, attack)
    peer.drain(1.0)
    result.tried("poison_master")
    token = _write(daemon, "caches", [["poison-probe", None, 1]])
    try:
        wait_for(lambda: token in reader.facts.get(("caches", "master"), {})
                 or reader.disconnected, 10, "fact after poisoning")
        if reader.disconnected:
            raise AssertionError(reader.disconnected)
    except AssertionError:
        result.found("position_poisoning", "master fact never reached the reader", "poison_master",
                     repr(attack), f"fact {token}; reader positions "
                     f"{ {f'{s}/{w}': p for (s, w), p in reader.positions.items()} }")
    master = _positions(daemon)["caches"]["writers"]["master"]["position"]
    if master is not None and master >= BIG:
        result.found("position_poisoning", "master's own token moved by a peer's claim",
                     "poison_master", repr(attack), f"caches/master position {master}")
    result.figure("poison_master.peer_refused", bool(peer.errors()) and peer.closed)
    peer.close()
    reader.stop()


def impersonate_master(daemon, result) -> None:
    reader = HonestReader(daemon.rep_port)
    reader.start()
    reader.connected.wait(10)
    attack = 'NAME master\nRDATA caches master 999999 ["forged",null,1]\n'
    peer = Peer(daemon.rep_port, attack)
    peer.drain(1.0)
    result.tried("impersonate_master")
    if 999999 in reader.facts.get(("caches", "master"), {}):
        result.found("impersonation", "RDATA as master relayed", "impersonate_master",
                     repr(attack))
    if not (peer.errors() and peer.closed):
        result.found("impersonation", "RDATA as master not refused with ERROR + close",
                     "impersonate_master", repr(attack), show(peer.received[-200:]))
    peer.close()
    reader.stop()


def impersonate_writer(daemon, result) -> None:
    reader = HonestReader(daemon.rep_port)
    reader.start()
    reader.connected.wait(10)
    attack = 'NAME worker1\nRDATA caches worker1 3 ["forged",null,1]\n'
    peer = Peer(daemon.rep_port, attack)
    peer.drain(1.0)
    result.tried("impersonate_writer")
    relayed = 3 in reader.facts.get(("caches", "worker1"), {})
    result.figure("impersonate_writer.relayed_without_identity_check", relayed)
    peer.close()
    reader.stop()


def _refused(peer: Peer) -> bool:
    return bool(peer.errors()) and peer.closed


def rename(daemon, result) -> None:
    """A connection names itself once; the server's own name is never a peer's."""
    for variant, lines in (("second_name", "NAME worker1\nNAME worker2\n"),
                           ("own_name", "NAME master\nREPLICATE\n")):
        peer = Peer(daemon.rep_port, lines)
        peer.drain(1.0)
        result.tried(f"rename.{variant}")
        if not _refused(peer):
            result.found("identity", f"{variant} not refused with ERROR + close", "rename",
                         repr(lines), show(peer.received[-200:]))
        peer.close()


def allow_lists(directory, result) -> None:
    """``allowed_peers`` and ``allowed_networks`` in a daemon of their own."""
    d = Daemon(os.path.join(directory, "allow"), allowed_peers=["worker1"])
    os.makedirs(d.dir)
    try:
        d.start()
        for variant, lines, refused in (
                ("anonymous_reader", "REPLICATE\n", True),
                ("unlisted_name", "NAME evil\nREPLICATE\n", True),
                ("listed_name", "NAME worker1\nREPLICATE\n", False)):
            peer = Peer(d.rep_port, lines)
            peer.drain(1.0)
            result.tried(f"allow_lists.{variant}")
            if _refused(peer) != refused:
                result.found("identity", f"allowed_peers: {variant} "
                             f"{'accepted' if refused else 'refused'}", "allow_lists",
                             repr(lines), show(peer.received[-200:]))
            peer.close()
        d.stop()
        _check_daemon(result, d, None)
    finally:
        d.kill()
    d = Daemon(os.path.join(directory, "networks"), allowed_networks=["10.0.0.0/8"])
    os.makedirs(d.dir)
    try:
        d.start()
        peer = Peer(d.rep_port, "NAME worker1\nREPLICATE\n")
        peer.drain(1.0)
        result.tried("allow_lists.network")
        if not _refused(peer) or b"SERVER" in peer.received:
            result.found("identity", "allowed_networks: a peer from elsewhere got in",
                         "allow_lists", "127.0.0.1 not in 10.0.0.0/8",
                         show(peer.received[-200:]))
        peer.close()
        d.stop()
        _check_daemon(result, d, None)
    finally:
        d.kill()


def tls_identity(directory, dsn, result) -> None:
    """With ``client_ca``, NAME is the certificate's: a worker1 certificate
    saying NAME master, another certificate of the CA saying NAME worker1,
    and a certificate of another CA are all refused."""
    import ssl

    from tests.pki import make_pki

    pki_dir = os.path.join(directory, "pki")
    os.makedirs(pki_dir)
    pki = make_pki(pki_dir)
    port = free_port()
    listen = (f"ssl:{port}:interface=127.0.0.1:privateKey={pki['server.key']}"
              f":certKey={pki['server.crt']}")
    d = Daemon(os.path.join(directory, "tls"), dsn, client_ca=pki["ca.crt"])
    os.makedirs(d.dir)
    d.rep_port = port
    d.config["replication"]["listen"] = listen

    def exchange(who, lines):
        context = ssl.create_default_context(cafile=pki["ca.crt"])
        context.load_cert_chain(pki[f"{who}.crt"], pki[f"{who}.key"])
        data = b""
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                with context.wrap_socket(raw, server_hostname="localhost") as s:
                    s.sendall(lines.encode())
                    s.settimeout(2)
                    while True:
                        chunk = s.recv(4096)
                        if not chunk:
                            break
                        data += chunk
        except (ssl.SSLError, OSError) as e:
            return data, e
        return data, None

    try:
        d.start()
        attack = ('POSITION caches worker1 0 1\nRDATA caches worker1 1 ["forged",null,1]\n'
                  "POSITION caches worker1 1 1\n")
        for who, name, accepted in (("client", "master", False), ("client", "worker2", False),
                                    ("intruder", "worker1", False),
                                    ("stranger", "worker1", False),
                                    ("client", "worker1", True)):
            lines = f"NAME {name}\n" + ("REPLICATE\n" if accepted else attack)
            data, error = exchange(who, lines)
            result.tried(f"tls_identity.{who}_as_{name}")
            got_in = b"POSITION caches master" in data or (
                not accepted and error is None and not data.rstrip(b"\n").rsplit(b"\n", 1)[-1]
                .startswith(b"ERROR"))
            if got_in != accepted:
                result.found("identity", f"client_ca: {who} certificate as NAME {name} "
                             f"{'accepted' if got_in else 'refused'}", "tls_identity",
                             repr(lines), f"{show(data[-200:])} {error!r}")
        d.stop()
        _check_daemon(result, d, None)
    finally:
        d.kill()


def bookkeeping(daemon, result) -> None:
    owner = Peer(daemon.rep_port, "NAME worker1\nUSER_SYNC worker1 @real:hs.test D start 1\n"
                                  "FEDERATION_ACK worker1 5\n")
    owner.drain(0.5)
    attacks = [
        ("clear_other", "CLEAR_USER_SYNC worker1\n",
         lambda s, a: any(u["user_id"] == "@real:hs.test" for u in s.get("worker1", []))),
        ("sync_as_other", "USER_SYNC worker1 @forged:hs.test D start 1\n",
         lambda s, a: not any(u["user_id"] == "@forged:hs.test" for u in s.get("worker1", []))),
        ("ack_as_other", "FEDERATION_ACK worker1 999\n", lambda s, a: a.get("worker1") != 999),
    ]
    for name, line, ok in attacks:
        evil = Peer(daemon.rep_port, "NAME evil\n" + line)
        evil.drain(0.5)
        result.tried(f"bookkeeping.{name}")
        syncs = json.loads(http_get(daemon.http_port, "/_replicator/v1/user_syncs",
                                    SECRET)[1])["user_syncs"]
        acks = json.loads(http_get(daemon.http_port, "/_replicator/v1/federation_acks",
                                   SECRET)[1])["acks"]
        if not ok(syncs, acks):
            result.found("bookkeeping_overwritten", name, "bookkeeping", repr(line),
                         f"user_syncs {syncs}; acks {acks}")
        evil.close()
    owner.close()
    open_paths = []
    for path in ("/_replicator/v1/positions", "/_replicator/v1/user_syncs",
                 "/_replicator/v1/user_ips", "/_replicator/v1/federation_acks"):
        if http_get(daemon.http_port, path)[0] == 200:
            open_paths.append(path.rsplit("/", 1)[1])
    result.figure("bookkeeping.answer_without_secret", open_paths)


def relay_long_line(daemon, result) -> None:
    reader = HonestReader(daemon.rep_port)
    reader.start()
    reader.connected.wait(10)
    for variant, key in (("cjk", "中" * 4000 + "\\ud800"), ("latin", "é" * 6000 + "\\udc80"),
                         ("ascii", "a" * 12000 + "\\ud800")):
        line = f'LOCK_RELEASED ["worker1","purge","{key}"]\n'
        peer = Peer(daemon.rep_port, "NAME worker1\n" + line)
        peer.drain(1.0)
        result.tried(f"relay_long_line.{variant}")
        if reader.disconnected:
            result.found("relay_disconnects_others", variant, "relay_long_line",
                         show(line.encode()), f"reader: {reader.disconnected}, "
                         f"errors {reader.errors[:2]}")
            break
        for bad in reader.bad_lines:
            result.found("relay_sent_bad_line", variant, "relay_long_line",
                         show(line.encode()), show(bad))
        reader.bad_lines.clear()
        peer.close()
    reader.stop()


def batch_flood(daemon, result, lines: int = 20_000) -> None:
    """A writer peer sends 20,000 ``batch`` lines of 1 KB and never ends the
    fact: the partial batch must be capped (ERROR + close) and the memory
    it took given back (issue 11 item 5)."""
    rss0 = daemon.rss_kb()
    peer = Peer(daemon.rep_port, "NAME worker1\n")
    row = '["' + "x" * 1000 + '",null,1]'
    chunk = "".join(f"RDATA caches worker1 batch {row}\n" for _ in range(500)).encode()
    sent = 0
    peak = rss0
    while sent < lines and not peer.closed and not peer.send_failed:
        peer.send(chunk)
        sent += 500
        if sent % 5000 == 0:
            peak = max(peak, daemon.rss_kb())
            peer.drain(0.01)
    peer.drain(2.0)
    peak = max(peak, daemon.rss_kb())
    result.tried("batch_flood", sent)
    result.figure("batch_flood.rss_kb_before_peak", f"{rss0} -> {peak}")
    result.figure("batch_flood.answer", show(peer.received[-120:]))
    if not peer.errors():
        result.found("batch_uncapped", f"{sent} batch lines of 1 KB accepted without ERROR",
                     "batch_flood", f"NAME worker1 + {lines} x RDATA caches worker1 batch "
                     "<1 KB row>", f"RSS {rss0} -> {peak} KB")
    peer.close()


def batch_amplification(daemon, result, lines: int = 9_900, peers=(1, 3)) -> None:
    """A peer named as a configured writer sends ``batch`` lines cheap on the
    wire and dear in memory (a ``json`` column of 530 empty lists: 1.6 KB of
    line, some 40 KB once parsed), under both batch bounds (rows, bytes),
    and never ends the fact; then the same from three connections at once.
    What we hold must be about what was sent, not 25 times it (issue 20
    item 4): RSS may grow by at most 3 times the wire size."""
    row = '["amp",[' + ",".join(["[]"] * 530) + '],1]'
    line = f"RDATA caches worker1 batch {row}\n".encode()
    for count in peers:
        rss0 = daemon.rss_kb()
        conns = [Peer(daemon.rep_port, "NAME worker1\n") for _ in range(count)]
        chunk = line * 100
        sent = 0
        peak = rss0
        while sent < lines:
            for peer in conns:
                if not peer.closed and not peer.send_failed:
                    peer.send(chunk)
            sent += 100
            if sent % 1000 == 0:
                peak = max(peak, daemon.rss_kb())
                for peer in conns:
                    peer.drain(0.01)
        for peer in conns:
            peer.drain(1.0)
        peak = max(peak, daemon.rss_kb())
        wire_kb = count * sent * len(line) // 1024
        variant = f"batch_amplification.{count}conn"
        result.tried(variant, count * sent)
        result.figure(f"{variant}.rss_kb_before_peak", f"{rss0} -> {peak} ({wire_kb} KB sent)")
        result.figure(f"{variant}.refused", sum(1 for p in conns if p.errors()))
        if peak - rss0 > 3 * wire_kb:
            result.found("batch_amplified", f"RSS grew {(peak - rss0) // 1024} MB for "
                         f"{wire_kb // 1024} MB of batch lines on {count} connection(s)",
                         "batch_amplification", f"{count} x (NAME worker1 + {lines} x RDATA "
                         "caches worker1 batch <530 empty lists>)",
                         f"RSS {rss0} -> {peak} KB")
        for peer in conns:
            peer.close()
        time.sleep(0.5)


def slow_readers(daemon, result, facts: int = 240, rows: int = 40, row_kb: int = 15) -> None:
    """Three connections that REPLICATE and never read while facts of 40
    rows of 15 KB are written: 9,600 lines (under ``max_queued_lines``) of
    144 MB wait for them.  The bound must hold in bytes too (dropped with
    ``Failed to keep up``), not only in lines (issue 11 item 7)."""
    import http.client

    rss0 = daemon.rss_kb()
    slow = []
    for i in range(3):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", daemon.rep_port))
        s.sendall(f"NAME slow{i}\nREPLICATE\n".encode())
        slow.append(s)
    body = json.dumps({"rows": [["s" * (row_kb * 1024), None, k] for k in range(rows)]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", daemon.http_port, timeout=60)
    peak = rss0
    for n in range(facts):
        conn.request("POST", "/_replicator/v1/streams/caches/facts", body=body,
                     headers={"Authorization": f"Bearer {SECRET}"})
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            result.found("slow_readers_write_failed", f"status {response.status}",
                         "slow_readers", "")
            break
        if n % 20 == 0:
            peak = max(peak, daemon.rss_kb())
    conn.close()
    time.sleep(1.0)
    peak = max(peak, daemon.rss_kb())
    result.tried("slow_readers", facts * rows)
    result.figure("slow_readers.rss_kb_before_peak", f"{rss0} -> {peak}")
    queued_mb = facts * rows * row_kb / 1024
    if peak - rss0 > 100 * 1024:
        result.found("queue_unbounded_in_bytes", f"RSS grew {(peak - rss0) // 1024} MB with "
                     "readers that never read", "slow_readers",
                     f"3 x (NAME slowN, REPLICATE, never read) + {facts} facts of {rows} rows "
                     f"of {row_kb} KB", f"{queued_mb:.0f} MB of lines queued, "
                     f"{facts * rows} lines < max_queued_lines")
    for s in slow:
        s.close()


def poison_worker(directory, dsn, result) -> None:
    """A forged upstream claims ``events/master`` is at 2^62 (2^70 is a parse
    error since integers are bounded).  The worker's consumer is new: the
    first POSITION places it (at 0), the lie comes after."""
    import psycopg2

    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(5)
    port = upstream.getsockname()[1]
    http_port = free_port()
    config = {
        "server_name": inputs.SERVER_NAME, "instance_name": "worker1", "log_level": "info",
        "database": {"postgres": dsn},
        "replication": {"upstream": f"tcp:host=127.0.0.1:port={port}"},
        "http": {"listen": f"tcp:{http_port}:interface=127.0.0.1", "secret": SECRET},
        "streams": inputs.STREAMS,
        "consumers": [{"type": "jsonl", "path": "facts.jsonl"}],
    }
    path = os.path.join(directory, "worker1.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    # The master (not started here) would have created the tables worker1
    # only reads: a reader refuses to start without them.
    from replicator.config.streams import parse_streams
    from tests.support import create_stream_tables

    create_stream_tables(dsn, parse_streams(inputs.STREAMS))
    import subprocess
    import sys

    log_path = os.path.join(directory, "worker.log")
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "replicator.cli", "run", "-c", path],
                                cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        upstream.settimeout(60)
        conn, _ = upstream.accept()
        # The real fact 1 of events/master, committed in the shared database.
        db = psycopg2.connect(dsn)
        with db, db.cursor() as cur:
            cur.execute("SELECT nextval('event_stream_seq')")
            token = cur.fetchone()[0]
            cur.execute("INSERT INTO event_stream (stream_id, instance_name, event_id, n, ok) "
                        "VALUES (%s, 'master', '$real', NULL, true)", (token,))
        db.close()
        attack = (f"SERVER {inputs.SERVER_NAME}\nPOSITION events master 0 0\n"
                  f"POSITION events master 0 {2 ** 62}\n")
        conn.sendall(attack.encode())
        result.tried("poison_worker")
        time.sleep(1.0)
        conn.close()
        # A truthful upstream from now on.
        upstream.settimeout(30)
        try:
            conn2, _ = upstream.accept()
            # As a REPLICATE answer: (prev, new] = (token, token], nothing
            # unsent; the reader's gap from 0 to token is caught up.
            conn2.sendall(f"SERVER {inputs.SERVER_NAME}\n"
                          f"POSITION events master {token} {token}\n".encode())
        except TimeoutError:
            conn2 = None
        facts_path = os.path.join(directory, "facts.jsonl")

        def delivered():
            if not os.path.exists(facts_path):
                return False
            with open(facts_path, "rb") as f:
                return b"$real" in f.read()

        try:
            wait_for(delivered, 15, "fact 1 delivered to the worker's consumer")
        except AssertionError:
            result.found("position_poisoning", "worker: real fact never delivered after an "
                         "upstream claimed 2^62", "poison_worker", repr(attack),
                         f"fact {token} of events/master in the table")
        if conn2 is not None:
            conn2.close()
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except Exception:
            proc.kill()
        upstream.close()
    with open(log_path, "rb") as f:
        for kind, line in log_problems(f.read().decode("utf-8", "replace")):
            result.found(kind, line, "poison_worker", "")


def borrowed_name(daemon, result) -> None:
    """A second connection borrows the live worker1's NAME to hide its
    uncommitted fact (see the module docstring)."""
    import psycopg2

    key = ("caches", "worker1")
    reader = HonestReader(daemon.rep_port)
    reader.start()
    reader.connected.wait(10)
    prev = reader.positions.get(key, 0)
    # As a real writer does on connect: its name, then its position (RDATA
    # on a connection that has not announced it is not taken, nor relayed).
    real = Peer(daemon.rep_port, f"NAME worker1\nPING 1\nREPLICATE\n"
                                 f"POSITION caches worker1 {prev} {prev}\n")
    real.drain(0.5)
    db = psycopg2.connect(daemon.config["database"]["postgres"])
    db.autocommit = True
    try:
        with db.cursor() as cur:  # worker1's next fact: its ID taken, not yet committed
            cur.execute("SELECT nextval('cache_stream_seq')")
            token = cur.fetchone()[0]
        attack = f"NAME worker1\nPING 1\nPOSITION caches worker1 {prev} {token}\n"
        borrower = Peer(daemon.rep_port, attack)
        borrower.drain(1.0)
        result.tried("borrowed_name")

        def master_at():
            writer = _positions(daemon)["caches"]["writers"].get("worker1") or {}
            return writer.get("position") or 0

        try:
            wait_for(lambda: reader.positions.get(key, 0) >= token or master_at() >= token, 3,
                     "worker1 moved past its uncommitted fact")
            result.found("borrowed_name", "a second connection as worker1 moved worker1 past "
                         "its uncommitted fact", "borrowed_name", repr(attack),
                         f"fact {token} uncommitted; reader at {reader.positions.get(key)}, "
                         f"master at {master_at()}")
        except AssertionError:
            pass
        result.figure("borrowed_name.borrower_refused", _refused(borrower))
        borrower.close()
        # worker1 commits its fact and sends it.
        row = ["borrowed-probe", None, 1]
        with db.cursor() as cur:
            cur.execute("INSERT INTO cache_stream (stream_id, instance_name, cache_func, keys, "
                        "ts) VALUES (%s, 'worker1', %s, NULL, 1)", (token, row[0]))
        real.send(f"PING 2\nRDATA caches worker1 {token} {json.dumps(row)}\n")
        real.drain(0.5)
        if real.closed or real.errors():
            result.found("borrowed_name", "the real worker1 was refused", "borrowed_name",
                         repr(attack), show(real.received[-200:]))
        try:
            wait_for(lambda: token in reader.facts.get(key, {}), 10, "worker1's fact")
        except AssertionError:
            result.found("borrowed_name", "worker1's fact never reached the reader",
                         "borrowed_name", repr(attack), f"fact {token}")
    finally:
        db.close()
        real.close()
        reader.stop()


class RedisForger:
    """A Redis client that only SUBSCRIBEs and PUBLISHes: every ``RDATA
    caches master T`` it hears on ``channel`` (bare or signed) is answered
    at once with ``POSITION caches master T T+2``."""

    def __init__(self, port: int, channel: str):
        import threading

        self.port, self.channel = port, channel
        self.forged = 0
        self.stopping = False
        self.sub = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.pub = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sub.sendall(_resp("SUBSCRIBE", channel))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import re

        buffer = b""
        pattern = re.compile(rb"RDATA caches master (\d+) ")
        self.sub.settimeout(0.2)
        while not self.stopping:
            try:
                data = self.sub.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            buffer = buffer[-200:] + data
            for match in pattern.finditer(data):
                token = int(match.group(1))
                self.pub.sendall(_resp("PUBLISH", self.channel,
                                       f"POSITION caches master {token} {token + 2}"))
                self.forged += 1

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(5)
        self.sub.close()
        self.pub.close()


def _resp(*words: str) -> bytes:
    out = b"*%d\r\n" % len(words)
    for word in words:
        b = word.encode()
        out += b"$%d\r\n%s\r\n" % (len(b), b)
    return out


def redis_forged_positions(directory, dsn_factory, result, facts: int = 120) -> None:
    """See the module docstring: with keys, then (a figure) without."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tests.servers import RedisServer

    from .daemon import table_facts

    keys = {}
    for name in ("master", "worker1", "reader"):
        key = Ed25519PrivateKey.generate()
        private, public = (os.path.join(directory, f"{name}.{ext}") for ext in ("key", "pub"))
        with open(private, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        with open(public, "wb") as f:
            f.write(key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        keys[name] = (private, public)
    redis = RedisServer()
    try:
        for signed in (True, False):
            variant = "signed" if signed else "unsigned"
            dsn = dsn_factory()
            daemons = []
            for name in ("master", "reader"):
                d = Daemon(os.path.join(directory, f"{variant}-{name}"), dsn)
                os.makedirs(d.dir)
                rep = {"endpoint": redis.endpoint, "channels": "per_stream"}
                if signed:
                    rep["keys"] = {"private_key": keys[name][0],
                                   "public_keys": {n: p[1] for n, p in keys.items()}}
                d.config["instance_name"] = name
                d.config["replication"] = {"redis": rep}
                if name == "reader":
                    d.config["consumers"] = [{"type": "jsonl", "path": "facts.jsonl"}]
                daemons.append(d.start())
            master, reader = daemons
            forger = RedisForger(redis.port, f"{inputs.SERVER_NAME}/replicator/stream/caches")
            try:
                time.sleep(1.5)  # both registered, the master's position announced
                from concurrent.futures import ThreadPoolExecutor

                # Four writers at once: the sequence runs ahead of what was
                # published, so a forged T+2 is within it (as under load).
                with ThreadPoolExecutor(4) as pool:
                    written = sorted(pool.map(
                        lambda i: _write(master, "caches", [[f"forge-{i}", None, i]]),
                        range(facts)))
                facts_path = os.path.join(reader.dir, "facts.jsonl")

                def got():
                    out = set()
                    if os.path.exists(facts_path):
                        with open(facts_path) as f:
                            for line in f:
                                entry = json.loads(line)
                                if entry.get("writer") == "master" and "rows" in entry:
                                    out.add(entry["token"])
                    return out

                def caught_up():
                    writers = _positions(reader)["caches"]["writers"]
                    return (writers.get("master") or {}).get("position") or 0

                try:
                    wait_for(lambda: caught_up() >= written[-1], 15, "reader at the last fact")
                except AssertionError:
                    pass
                time.sleep(0.5)  # the consumer's file written
                table = set(table_facts(dsn=dsn).get(("caches", "master"), {}))
                lost = sorted(table - got())
                result.tried(f"redis_forged_positions.{variant}", forger.forged)
                result.figure(f"redis_forged_positions.{variant}.lost", len(lost))
                if signed and lost:
                    result.found("position_poisoning", "redis: a forged POSITION lost facts "
                                 "with keys configured", "redis_forged_positions",
                                 "POSITION caches master T T+2 after every RDATA T",
                                 f"{len(lost)} of {len(table)} facts lost, e.g. {lost[:5]}")
            finally:
                forger.stop()
                for d in daemons:
                    d.stop()
                    _check_daemon(result, d, None)
                    d.kill()
    finally:
        redis.stop()


def away_writer(directory, dsn, result) -> None:
    """An impostor while the writer is away (see the module docstring)."""
    import secrets

    import psycopg2

    secret_path = os.path.join(directory, "worker1.secret")
    with open(secret_path, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.chmod(secret_path, 0o600)
    master = Daemon(os.path.join(directory, "master"), dsn,
                    writer_secrets={"worker1": secret_path})
    master.config["consumers"] = [{"type": "jsonl", "path": "facts.jsonl"}]
    os.makedirs(master.dir)
    worker = Daemon(os.path.join(directory, "worker1"), dsn)
    worker.config["instance_name"] = "worker1"
    worker.config["replication"] = {
        "upstream": f"tcp:host=127.0.0.1:port={master.rep_port}", "secret_file": secret_path,
        "reconnect_initial_delay": 0.1, "reconnect_max_delay": 0.5}
    os.makedirs(worker.dir)
    facts = os.path.join(master.dir, "facts.jsonl")
    db = None
    try:
        master.start()
        db = psycopg2.connect(dsn)
        db.autocommit = True
        with db.cursor() as cur:  # worker1's next fact: its ID taken, not yet committed
            cur.execute("SELECT nextval('cache_stream_seq')")
            token = cur.fetchone()[0]
        attack = f"NAME worker1\nPING 1\nPOSITION caches worker1 0 {token}\n"
        impostor = Peer(master.rep_port, attack)
        impostor.drain(1.0)
        result.tried("away_writer")
        refused = _refused(impostor) and b"AUTH_CHALLENGE " in impostor.received
        result.figure("away_writer.impostor_refused", refused)
        if not refused:
            result.found("away_writer", "an impostor's POSITION for a writer with a secret was "
                         "not refused", "away_writer", repr(attack), show(impostor.received[-200:]))
        impostor.close()
        # worker1 commits its fact, then comes back (and proves its NAME).
        with db.cursor() as cur:
            cur.execute("INSERT INTO cache_stream (stream_id, instance_name, cache_func, keys, "
                        "ts) VALUES (%s, 'worker1', 'away-probe', NULL, 1)", (token,))
        worker.start()

        def delivered():
            if not os.path.exists(facts):
                return False
            with open(facts, "rb") as f:
                return b"away-probe" in f.read()

        try:
            wait_for(delivered, 15, "worker1's fact at the master's consumer")
            result.figure("away_writer.fact_delivered", True)
        except AssertionError:
            result.figure("away_writer.fact_delivered", False)
            result.found("away_writer", "worker1's fact never reached the master's consumer "
                         "after an impostor's POSITION", "away_writer", repr(attack),
                         f"fact {token} of caches/worker1 committed")
        metrics_text = http_get(master.http_port, "/metrics")[1].decode("utf-8", "replace")
        result.figure("away_writer.unproven_refusals", sum(
            float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
            if line.startswith('replicator_connections_refused_total{reason="unproven"}')))
        worker.stop()
        master.stop()
        _check_daemon(result, master, None)
        _check_daemon(result, worker, None)
    finally:
        if db is not None:
            db.close()
        worker.kill()
        master.kill()


ATTACKS = [impersonate_master, impersonate_writer, rename, bookkeeping, relay_long_line,
           poison_master, borrowed_name]
#: Attacks that start daemons of their own (make fuzz only).
EXTRA = [allow_lists, tls_identity, poison_worker, batch_flood, slow_readers,
         batch_amplification, redis_forged_positions, away_writer]


def run_phase(seed: int, dsn_factory, attacks=None) -> PhaseResult:
    """``dsn_factory()`` gives a fresh PostgreSQL database's DSN."""
    result = PhaseResult("3-peers")
    directory = tempfile.mkdtemp(prefix="fuzz-peers-")
    daemon = Daemon(directory, dsn_factory())
    try:
        daemon.start()
        for attack in attacks or ATTACKS:
            if attack not in EXTRA:
                attack(daemon, result)
        for attack in (batch_flood, slow_readers, batch_amplification):  # own daemons
            if attack in (attacks or ATTACKS):
                own = Daemon(os.path.join(directory, attack.__name__), dsn_factory())
                os.makedirs(own.dir)
                try:
                    own.start()
                    attack(own, result)
                    own.stop()
                    _check_daemon(result, own, None)
                finally:
                    own.kill()
        if not daemon.alive():
            result.found("daemon_died", f"exit {daemon.proc.returncode}", "-", "")
        code = daemon.stop()
        if code not in (0, None) or code is None:
            result.found("unclean_stop", f"exit {code}", "-", "")
        _check_daemon(result, daemon, None)
        attacks = attacks or ATTACKS
        if allow_lists in attacks:
            allow_lists(directory, result)
        if tls_identity in attacks:
            tls_identity(directory, dsn_factory(), result)
        if redis_forged_positions in attacks:
            redis_dir = os.path.join(directory, "redis")
            os.makedirs(redis_dir)
            redis_forged_positions(redis_dir, dsn_factory, result)
        if away_writer in attacks:
            away_dir = os.path.join(directory, "away")
            os.makedirs(away_dir)
            away_writer(away_dir, dsn_factory(), result)
        if poison_worker in attacks:
            worker_dir = os.path.join(directory, "worker")
            os.makedirs(worker_dir)
            poison_worker(worker_dir, dsn_factory(), result)
    finally:
        daemon.kill()
        shutil.rmtree(directory, ignore_errors=True)
    return result.done()
