"""The benchmarks' reader processes count what they were sent, on real servers.

A benchmark whose reader misses or waits for lines hangs ``make bench`` or
reports wrong figures, so the reader of the Redis benchmarks is run here as
``make bench`` runs it, against a real redis-server.
"""

import json
import os
import socket
import subprocess
import sys
import threading

from twisted.trial.unittest import TestCase

from tests.servers import RedisServer, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REDIS_BENCH = os.path.join(ROOT, "scripts", "bench", "redis_bench.py")


def resp(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a.encode() if isinstance(a, str) else a
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def command(port, *args):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(resp(*args))
        return s.recv(4096)


class HoldingRelay:
    """A loopback TCP relay to a real server that passes the client's bytes
    on at once and holds the server's until :meth:`release`, then sends
    them in one write."""

    def __init__(self, port):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream_port = port
        self.held = b""
        self.released = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.upstream_port))
        threading.Thread(target=self._pass_on, args=(client, server), daemon=True).start()
        server.settimeout(0.05)
        while not self.released.is_set():
            try:
                data = server.recv(65536)
            except TimeoutError:
                continue
            if not data:
                break
            self.held += data
        client.sendall(self.held)
        server.settimeout(None)
        self._pass_on(server, client)

    @staticmethod
    def _pass_on(src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass

    def release(self):
        self.released.set()


class RedisReaderTests(TestCase):
    timeout = 60

    def test_messages_arriving_with_the_subscription_confirmation_count(self):
        """The confirmation of SUBSCRIBE and the first messages published
        can reach the reader in one ``recv`` (the bench publishes as soon as
        Redis counts the subscriber).  The reader used to wait for a read
        ending with the confirmation, forever, and hung ``make bench``."""
        redis = RedisServer.shared()
        relay = HoldingRelay(redis.port)
        self.addCleanup(relay.listener.close)
        channel = "bench-readers-test"
        proc = subprocess.Popen(
            [sys.executable, REDIS_BENCH, "--reader", "--port", str(relay.port),
             "--channel", channel, "--mode", "count", "--timeout", "20"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
        wait_for(lambda: command(redis.port, "PUBSUB", "NUMSUB", channel).endswith(b":1\r\n"),
                 timeout=20, what="the reader's subscription")
        for token in range(1, 6):
            command(redis.port, "PUBLISH", channel, f"RDATA s w {token} [\"row\"]")
        # The confirmation and the five messages reach the reader in one write.
        wait_for(lambda: relay.held.count(b"RDATA") == 5, timeout=20, what="the messages")
        relay.release()
        try:
            out, _ = proc.communicate(b"5\n", timeout=20)
        except subprocess.TimeoutExpired:
            self.fail("the reader never took the messages that came with its confirmation")
        result = json.loads(out.decode().strip().splitlines()[-1])
        self.assertEqual(result["counts"], [5])
        self.assertFalse(result["timeout"])


class CatchupReaderTests(TestCase):

    def test_peak_rss_is_the_processs_own(self):
        """The catch-up reader reports its own peak memory.  Its process is
        started by the bench process, which is large by then (the TCP and
        Redis sections' data): ``ru_maxrss`` survives fork and exec, so
        every round reported the parent's peak (688 MB) instead of the
        reader's (67 MB)."""
        ballast = bytearray(300 * 1024 * 1024)  # this process's peak: over 300 MB
        for i in range(0, len(ballast), 4096):
            ballast[i] = 1  # touched, so resident
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import catchup_reader; "
                "print(catchup_reader.peak_rss_kb())")
        out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "scripts", "bench")],
                             stdout=subprocess.PIPE, check=True, timeout=60).stdout
        del ballast
        peak_kb = int(out)
        self.assertGreater(peak_kb, 1024)  # a Python with Twisted imported: some MB
        self.assertLess(peak_kb, 200 * 1024)


class SseReaderTests(TestCase):
    timeout = 60

    def _serve(self, chunks):
        """A one-connection HTTP server on loopback that answers 200 with
        ``chunks`` of an event stream, one write each, then keeps it open."""
        listener = socket.create_server(("127.0.0.1", 0))
        self.addCleanup(listener.close)
        requests = []

        def run():
            conn, _ = listener.accept()
            self.addCleanup(conn.close)
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            requests.append(head)
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
            try:
                for chunk in chunks:
                    conn.sendall(chunk)
                    threading.Event().wait(0.02)  # separate recv()s, most likely
            except OSError:
                pass  # the reader had what it expected and left

        threading.Thread(target=run, daemon=True).start()
        return listener.getsockname()[1], requests

    def _read(self, port, mode, expect):
        reader = os.path.join(ROOT, "scripts", "bench", "sse_reader.py")
        proc = subprocess.Popen(
            [sys.executable, reader, "--port", str(port), "--path", "/s/events?from=now",
             "--secret", "s3cret", "--mode", mode, "--timeout", "20"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
        # stdin stays open: closing it ends the reader with what it has.
        proc.stdin.write(b"%d\n" % expect)
        proc.stdin.flush()
        proc.wait(30)
        lines = proc.stdout.read().decode().strip().splitlines()
        proc.stdin.close()
        self.assertEqual(json.loads(lines[0]), {"ready": 1})
        return json.loads(lines[-1])

    def test_events_split_across_reads_count_once_each(self):
        """Events are counted and timed when their lines straddle reads,
        the first one arriving with the response head included."""
        events = b"retry: 2000\n\n: ping\n\n" + b"".join(
            b'id: t%d\nevent: fact\ndata: {"stream_id":%d,"rows":[]}\n\n' % (i, i)
            for i in range(1, 8))
        chunks = [events[i:i + 7] for i in range(0, len(events), 7)]
        port, requests = self._serve(chunks)
        result = self._read(port, "count", 7)
        self.assertEqual((result["counts"], result["timeout"]), ([7], False))
        self.assertIn(b"Authorization: Bearer s3cret", requests[0])
        self.assertTrue(requests[0].startswith(b"GET /s/events?from=now HTTP/1.0"))
        port, _ = self._serve(chunks)
        result = self._read(port, "latency", 7)
        self.assertEqual(result["tokens"], [list(range(1, 8))])
        self.assertEqual(len(result["at"][0]), 7)


class PagesPhaseTests(TestCase):
    timeout = 120

    def test_the_pages_phase_records_its_figure(self):
        """The read API's paged catch-up runs to its figure, as ``make
        bench`` runs it (a real daemon and PostgreSQL, a few facts).  The
        raw pass it is compared with came to return its CPU time beside
        its seconds, and the phase, the last of ``make bench``, failed on
        the pair after twenty minutes of the others."""
        sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))
        self.addCleanup(sys.path.remove, os.path.join(ROOT, "scripts", "bench"))
        import common
        import sse

        from tests.servers import PostgresServer

        results = os.path.abspath(self.mktemp())
        self.patch(common, "RESULTS", results)
        self.patch(sse, "PAGE_ROUNDS", 1)
        sse.run_pages(PostgresServer.shared().create_database("pagesbench"), 300)
        with open(results) as f:
            entries = [json.loads(line) for line in f]
        self.assertEqual([e["name"] for e in entries],
                         ["sse.pages.facts_per_s", "sse.pages.ndjson.facts_per_s"])
        for entry in entries:
            self.assertGreater(entry["value"], 0)
            self.assertGreater(entry["baseline_value"], 0)
