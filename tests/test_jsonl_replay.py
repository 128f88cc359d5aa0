"""``replicator verify`` and ``replicator rewind`` as an operator runs them
(the real command, on PostgreSQL), and a jsonl consumer's output rotating
under live writes in a real master + worker pair: by size, by the real
``logrotate`` (copytruncate, and move + create with a SIGHUP), then rewound
to a token and to a time, verified after each step."""

import json
import os
import shutil
import signal
import subprocess

import psycopg2
import yaml
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import parse_instance
from replicator.consumers.jsonl_files import rotated_files
from replicator.storage.schema import RETENTION_DDL, table_ddl
from tests.daemon import CACHES, SECRET, Daemon, base_config, http, replicator
from tests.servers import PostgresServer, free_port, wait_for
from tests.support import temp_dir

TIMED = dict(CACHES, timestamp_column="invalidation_ts")


def fact_line(token, rows):
    return json.dumps({"stream": "caches", "writer": "master", "token": token, "rows": rows},
                      separators=(",", ":")) + "\n"


def lines_of(paths):
    out = []
    for path in paths:
        with open(path) as f:
            out += [json.loads(line) for line in f]
    return out


class VerifyTests(SynchronousTestCase):
    """A table of 20 facts (every fifth has two rows) and an output written
    by hand with one mistake of each kind injected."""

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        self.dir = temp_dir(self)
        config = base_config("worker1", free_port(), [TIMED], database={"postgres": self.dsn},
                             consumers=[{"type": "jsonl", "path": "out/facts.jsonl"}])
        with open(os.path.join(self.dir, "worker1.yaml"), "w") as f:
            yaml.safe_dump(config, f)
        stream = parse_instance(config).streams[0]
        self.rows = {}
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            for statement in table_ddl(stream, True):
                cur.execute(statement)
            for token in range(1, 21):
                self.rows[token] = [[f"f{token}", ["k", r], 1000 * token]
                                    for r in range(2 if token % 5 == 0 else 1)]
                for row in self.rows[token]:
                    cur.execute("INSERT INTO cache_invalidation_stream VALUES (%s, %s, %s, %s, "
                                "%s)", (token, "master", row[0], json.dumps(row[1]), row[2]))
        os.makedirs(os.path.join(self.dir, "out"))
        self.path = os.path.join(self.dir, "out", "facts.jsonl")

    def output(self, tokens, tail=b""):
        with open(self.path, "wb") as f:
            for token, rows in tokens:
                f.write(fact_line(token, rows).encode())
            f.write(tail)

    def verify(self, consumer="0"):
        return replicator("verify", "-c", "worker1.yaml", consumer, cwd=self.dir)

    def test_equal(self):
        self.output([(t, self.rows[t]) for t in range(1, 21)])
        code, out, err = self.verify()
        self.assertEqual((code, err), (0, ""), out)
        self.assertIn("verify: EQUAL: 20 facts, each exactly once, in order, whole", out)
        self.assertEqual(self.verify("out/facts.jsonl")[0], 0)

    def trim(self, upto):
        """Retention ran up to ``upto``: the facts and the table's boundary."""
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(RETENTION_DDL)
            cur.execute("DELETE FROM cache_invalidation_stream WHERE stream_id <= %s", (upto,))
            cur.execute("INSERT INTO stream_retention VALUES ('cache_invalidation_stream', %s) "
                        "ON CONFLICT (table_name) DO UPDATE SET trimmed_through = %s",
                        (upto, upto))

    def test_facts_trimmed_from_the_table_are_counted_not_compared(self):
        """The output's oldest facts predate the trim boundary: those are
        counted apart, the rest compared (a difference there still is one)."""
        self.output([(t, self.rows[t]) for t in range(1, 21)])
        self.trim(8)
        code, out, err = self.verify()
        self.assertEqual((code, err), (0, ""), out)
        self.assertIn("  caches/master: 20 facts, checked from token 0 of writer master to 20: "
                      "12 matched; no "
                      "differences; 8 trimmed from the table (not compared)\n", out)
        self.assertIn("verify: EQUAL: 12 facts, each exactly once, in order, whole (8 "
                      "trimmed from the table, not compared)", out)
        self.output([(t, self.rows[t]) for t in range(3, 21) if t != 12])
        code, out, err = self.verify()
        self.assertEqual((code, err), (1, ""), out)
        self.assertIn("11 matched; 1 missing; 6 trimmed from the table (not compared)", out)
        self.assertIn("verify: DIFFERENT: 1 missing\n", out)

    def test_rewind_refuses_a_point_retention_trimmed(self):
        """A time or a token before what the table keeps is refused (one
        line naming the boundary, exit 2), the file left alone: the next
        start would stop at the gap again."""
        self.output([(t, self.rows[t]) for t in range(1, 21)])
        self.trim(8)
        with open(self.path, "rb") as f:
            before = f.read()
        for args, message in [
            (("--to", "1970-01-01T00:00:01Z"),
             "rewind: --to 1970-01-01T00:00:01Z is before what stream caches keeps: facts "
             "up to 8 were trimmed by retention (the oldest fact left, 9, is of "
             "1970-01-01T00:00:09Z); rewind to that time or later"),
            (("--to", "8", "--stream", "caches"),
             "rewind: --to 8: stream caches keeps facts after 8 only (facts up to 8 were "
             "trimmed by retention); rewind to 9 or above"),
        ]:
            code, out, err = replicator("rewind", "-c", "worker1.yaml", "0", *args, cwd=self.dir)
            self.assertEqual((code, out, err), (2, "", f"replicator: {message}\n"))
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), before)
        code, out, err = replicator("rewind", "-c", "worker1.yaml", "0", "--to",
                                    "1970-01-01T00:00:09Z", cwd=self.dir)
        self.assertEqual((code, err), (0, ""), out)
        self.assertIn("position 20 -> 8 (the next start delivers from 9 again)", out)

    def test_skip_to_accepts_the_loss(self):
        """``--skip-to TOKEN`` moves a consumer behind the trim boundary past
        it: a skip line in the file, the skip counted, and verify says how
        many facts it skipped; a token below its position, below the
        boundary or beyond the stream is refused."""
        self.output([(t, self.rows[t]) for t in range(1, 5)])  # stopped at 4
        self.trim(8)

        def skip(*args):
            return replicator("rewind", "-c", "worker1.yaml", "0", "--skip-to", *args,
                              cwd=self.dir)

        for args, message in [
            (("3",), "rewind: --skip-to 3 is not past consumers[0]'s position in stream "
                     "caches (4): nothing would be skipped (--to delivers facts again)"),
            (("5",), "rewind: --skip-to 5 is below stream caches's trim boundary 8: the next "
                     "start would stop at the gap again; skip to 8 or above, or give "
                     "--skip-to boundary (the boundary when the skip is made, however far "
                     "retention has trimmed by then)"),
            (("99",), "rewind: --skip-to 99 is beyond stream caches (its last token is 20)"),
            (("bound",), "rewind: --skip-to 'bound' is not a token (an integer) nor "
                         "'boundary' (the stream's trim boundary)"),
            (("8", "--to", "3"), None),
        ]:
            code, out, err = skip(*args)
            self.assertEqual((code, out), (2, ""), err)
            if message is not None:
                self.assertEqual(err, f"replicator: {message}\n")
        code, out, err = skip("10")
        self.assertEqual((code, err), (0, ""), out)
        self.assertEqual(out, "rewind: caches/master: position 4 -> 10: skipped facts 5 to 10 "
                              "(2 of them in the table; facts up to 8 were trimmed by "
                              "retention)\n")
        last = lines_of([self.path])[-1]
        self.assertEqual(set(last), {"stream", "writer", "position", "skip"})
        self.assertEqual((last["position"], {k: v for k, v in last["skip"].items() if k != "at"}),
                         (10, {"from": 4, "facts": 2, "trimmed_through": 8}))
        at = last["skip"]["at"]
        code, out, _ = self.verify()
        self.assertEqual(code, 0, out)  # 9 and 10 were in the table: skipped, not missing
        self.assertIn("4 fact lines, 1 position lines, 0 rewind lines, 1 skip lines\n", out)
        self.assertIn(f"    skipped by rewind --skip-to at {at}: facts 5 to 10, 2 of them in "
                      f"the table then (facts up to 8 were trimmed by retention)\n", out)
        self.assertIn(f"verify: EQUAL: 0 facts, each exactly once, in order, whole (4 trimmed "
                      f"from the table, not compared; 2 facts skipped by rewind --skip-to at "
                      f"{at})\n", out)

        # --skip-to boundary: the boundary as it is when the skip is made.
        self.trim(14)
        code, out, err = skip("boundary", "--stream", "caches")
        self.assertEqual((code, err), (0, ""), out)
        self.assertEqual(out, "rewind: caches/master: position 10 -> 14: skipped facts 11 to "
                              "14 (0 of them in the table; facts up to 14 were trimmed by "
                              "retention)\n")
        self.assertEqual(lines_of([self.path])[-1]["skip"]["from"], 10)
        # Pasted again: nothing to skip, and that is not a mistake.
        code, out, err = skip("boundary")
        self.assertEqual((code, err), (0, ""), out)
        self.assertEqual(out, "rewind: nothing to skip: consumers[0]'s position in stream "
                              "caches (14) is not below its trim boundary 14\n")
        code, out, _ = self.verify()
        self.assertEqual(code, 0, out)
        self.assertIn(", 2 skip lines\n", out)
        self.assertIn("(4 trimmed from the table, not compared; 2 facts skipped by rewind "
                      "--skip-to at ", out)

    def test_a_file_that_begins_after_facts_in_the_table_says_where_or_is_different(self):
        """A file whose first line for a key is fact 3 while facts 1 and 2
        are in the table is not EQUAL; one that begins with a position line
        at 2 is, from there, and says so."""
        self.output([(t, self.rows[t]) for t in range(3, 21)])
        code, out, err = self.verify()
        self.assertEqual(code, 1, out + err)
        self.assertIn("    no start line: 3 (the key's first line; fact 1 and maybe more "
                      "before it are in the table)\n", out)
        self.assertIn("verify: DIFFERENT: 1 no start line", out)
        with open(self.path, "wb") as f:
            f.write(b'{"stream":"caches","writer":"master","position":2}\n')
            for t in range(3, 21):
                f.write(fact_line(t, self.rows[t]).encode())
        code, out, err = self.verify()
        self.assertEqual((code, err), (0, ""), out)
        self.assertIn("caches/master: 18 facts, checked from token 2 of writer master to 20: "
                      "18 matched; no differences", out)
        self.assertIn("verify: EQUAL: 18 facts", out)

    def test_every_kind_of_difference_is_named_and_counted(self):
        facts = [(t, self.rows[t]) for t in range(1, 21) if t != 7]  # 7 missing
        facts.insert(12, (12, self.rows[12]))  # 12 twice
        facts[8] = (10, self.rows[10][:1])  # 10 partial: 1 of 2 rows
        facts[15], facts[16] = facts[16], facts[15]  # out of order
        facts.append((25, [["x", None, 1]]))  # not in the table
        self.output(facts, tail=b'{"stream":"caches","writer":"master","token":26,"ro')
        code, out, err = self.verify()
        self.assertEqual(code, 1, out + err)
        self.assertIn("    missing: 7\n", out)
        self.assertIn("    duplicate: 12\n", out)
        self.assertIn("    partial: 10 (1 of 2 rows)\n", out)
        self.assertIn("    out of order: ", out)
        self.assertIn("    extra: 25 (not in the table)\n", out)
        self.assertIn("a truncated last line (", out)
        self.assertIn("verify: DIFFERENT: 1 missing, 1 duplicate, 1 out of order, 1 partial, "
                      "1 extra, 1 file problems", out)

    def test_a_truncated_last_line_alone(self):
        self.output([(t, self.rows[t]) for t in range(1, 21)], tail=b'{"stream":"cach')
        code, out, _ = self.verify()
        self.assertEqual(code, 1)
        self.assertIn(f"{self.path} offset ", out)
        self.assertIn("a truncated last line (15 bytes)", out)

    def test_rotated_files_are_read_oldest_first(self):
        self.output([(t, self.rows[t]) for t in range(11, 21)])
        with open(self.path + ".2", "w") as f:
            f.writelines(fact_line(t, self.rows[t]) for t in range(1, 6))
        with open(self.path + ".1", "w") as f:
            f.writelines(fact_line(t, self.rows[t]) for t in range(6, 11))
        code, out, _ = self.verify()
        self.assertEqual(code, 0, out)
        self.assertIn("and 2 rotated files: 20 fact lines", out)

    def test_usage_mistakes_are_one_line_and_exit_2(self):
        self.output([])
        for args, message in [
            (("verify", "-c", "worker1.yaml", "3"),
             "replicator: no consumers[3] (the config has 1 consumers)\n"),
            (("verify", "-c", "worker1.yaml", "other.jsonl"),
             "replicator: no jsonl consumer with path 'other.jsonl' (give its path as in the "
             "config, or its index: 0, 1, ...)\n"),
            (("rewind", "-c", "worker1.yaml", "0", "--to", "yesterday"),
             "replicator: rewind: --to 'yesterday' is neither a token (an integer) nor a time "
             "(ISO 8601, e.g. 2026-11-25T10:00:00Z)\n"),
            (("rewind", "-c", "worker1.yaml", "0", "--to", "0"),
             "replicator: rewind: --to 0: a token is from 1 to 2^63-1\n"),
            (("rewind", "-c", "worker1.yaml", "0", "--to", "21"),
             "replicator: rewind: --to 21 is beyond stream caches (its last token is 20)\n"),
            (("rewind", "-c", "worker1.yaml", "0", "--to", "5", "--stream", "nope"),
             "replicator: rewind: consumers[0] does not read stream 'nope' (it reads caches)\n"),
        ]:
            code, out, err = replicator(*args, cwd=self.dir)
            self.assertEqual((code, out, err), (2, "", message), args)


class RotationClusterTests(SynchronousTestCase):
    """A master writing and worker1's jsonl consumer reading, on PostgreSQL."""

    def setUp(self):
        self.dsn = PostgresServer.shared().create_database()
        self.written = []

    def write(self, daemon, n):
        for _ in range(n):
            i = len(self.written)
            status, body = http(f"{daemon.http_base}/_replicator/v1/streams/caches/facts",
                                json.dumps({"rows": [[f"f{i}", ["k"], 1000 * (i + 1)]]}).encode(),
                                SECRET)
            self.written.append(json.loads(body)["stream_id"])

    def files(self):
        return rotated_files(self.path) + [self.path]

    def facts(self):
        return [line["token"] for line in lines_of(self.files()) if "rows" in line]

    def caught_up(self):
        def done():
            if self.worker.proc.poll() is not None:
                raise AssertionError(self.worker.output()[-3000:])
            return set(self.written) <= set(self.facts())
        try:
            wait_for(done, 60, "worker1's output has every fact")
        except AssertionError as e:
            missing = sorted(set(self.written) - set(self.facts()))
            raise AssertionError(f"{e}: {len(missing)} missing ({missing[:10]}); worker1: "
                                 f"{self.worker.output()[-3000:]}") from None

    def verify(self):
        code, out, err = replicator("verify", "-c", self.worker.path, "0", cwd=self.worker.dir)
        self.assertEqual(code, 0, out + err)
        return out

    def test_rotation_logrotate_rewind_and_verify(self):
        # Steps: (1) rotation by size; (2) a restart; (3) logrotate; (4) rewind.
        rep_port = free_port()
        master = Daemon(self, base_config(
            "master", free_port(), [TIMED], database={"postgres": self.dsn},
            replication={"listen": f"tcp:{rep_port}:interface=127.0.0.1"}), "master").start()
        consumer = {"type": "jsonl", "path": "facts-worker1.jsonl", "rotate_size": "2K",
                    "rotate_keep": 1000, "flush_interval": 0.01}
        self.worker = Daemon(self, base_config(
            "worker1", free_port(), [TIMED], database={"postgres": self.dsn},
            replication={"upstream": f"tcp:host=127.0.0.1:port={rep_port}"},
            consumers=[consumer]), "worker1").start()
        self.path = os.path.join(self.worker.dir, "facts-worker1.jsonl")

        # (1) By size, under live writes: several files, each fact once.
        self.write(master, 150)
        self.caught_up()
        self.assertGreater(len(rotated_files(self.path)), 3)
        self.assertEqual(self.facts(), self.written)
        self.verify()

        # (2) Stopped, its own rotation turned off, started again: no fact
        # again (the positions are not in the file, which is nearly empty).
        self.worker.kill(signal.SIGTERM)
        del consumer["rotate_size"]
        with open(self.worker.path, "w") as f:
            yaml.safe_dump(self.worker.config, f)
        self.worker.start()
        self.write(master, 5)
        self.caught_up()
        self.assertEqual(self.facts(), self.written)

        # (3) The real logrotate (numbered names, as the consumer's own):
        # copytruncate, then move + create with a SIGHUP from postrotate.
        logrotate = shutil.which("logrotate") or "/usr/sbin/logrotate"
        if not os.path.exists(logrotate):
            raise AssertionError("logrotate is not installed (make system-deps installs it)")
        for name, options in (("copytruncate", "copytruncate"),
                              ("create", f"create\n  postrotate\n    kill -HUP "
                                         f"{self.worker.proc.pid}\n  endscript")):
            conf = os.path.join(self.worker.dir, f"logrotate-{name}.conf")
            with open(conf, "w") as f:
                f.write(f"{self.path} {{\n  rotate 1000\n  missingok\n  {options}\n}}\n")
            rotated = len(rotated_files(self.path))
            self.write(master, 20)
            if name == "copytruncate":
                # What is written between its copy and its truncation is in
                # neither file (copytruncate's own window, docs/jsonl.md):
                # quiet first.  Move + create runs under live writes.
                self.caught_up()
            result = subprocess.run([logrotate, "-f", "-s", conf + ".state", conf],
                                    capture_output=True, text=True, timeout=60)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertEqual(len(rotated_files(self.path)), rotated + 1)
            self.write(master, 20)
            self.caught_up()
            if name == "create":
                wait_for(lambda: "moved away (rotated)" in self.worker.output(), 30,
                         "the worker follows the moved file")
        self.assertIn("(copytruncate): continuing at its end", self.worker.output())
        self.assertEqual(self.facts(), self.written)
        self.verify()
        code, out, err = replicator("rewind", "-c", self.worker.path, "0", "--to",
                                    str(self.written[-1] + 1), cwd=self.worker.dir)
        self.assertEqual(code, 2, out + err)

        # (4) rewind while running is refused; stopped, to a token, then to a time.
        code, out, err = replicator("rewind", "-c", self.worker.path, "0", "--to", "50",
                                    cwd=self.worker.dir)
        self.assertEqual(code, 1, out + err)
        self.assertIn("stop the daemon first", err)
        # Fact i (from 0) has invalidation_ts 1000 * (i + 1): 200 s is fact 199.
        for point, index in (("50", self.written.index(50)), ("1970-01-01T00:03:20Z", 199)):
            first = self.written[index]
            self.worker.kill(signal.SIGTERM)
            code, out, err = replicator("rewind", "-c", self.worker.path, "0", "--to", point,
                                        cwd=self.worker.dir)
            self.assertEqual(code, 0, out + err)
            self.assertIn(f"(the next start delivers from {first} again)", out)
            self.worker.start()
            wait_for(lambda: self.facts().count(self.written[-1]) == 2, 60,
                     f"worker1 delivered again from {point}")
            self.assertEqual(self.facts()[-(len(self.written) - index):],
                             self.written[index:])
            self.verify()
            self.write(master, 3)
            self.caught_up()
            self.assertIn("verify: EQUAL", self.verify())
