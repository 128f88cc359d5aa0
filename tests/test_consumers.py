"""Built-in consumers (JSON lines, log) and loading consumers from config."""

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from importlib.metadata import EntryPoint

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import reactor, task
from twisted.logger import Logger, LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from replicator.config import ConfigError, ConsumerConfig
from replicator.consumers import (
    Consumer,
    JsonlConsumer,
    JsonlError,
    LogConsumer,
    MemoryConsumer,
    load_consumers,
    run_inline,
)
from replicator.consumers import loading as consumer_loading
from replicator.consumers.jsonl_lines import fact_lines_at_once
from replicator.jsontext import encode_json_line
from tests.support import temp_dir, until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RecordingConsumer(Consumer):
    """A third-party style consumer: keeps its keyword arguments."""

    def __init__(self, streams=None, **options):
        self.streams = streams
        self.options = options
        self.closed = False

    def close(self):
        self.closed = True


class StrictConsumer(Consumer):
    def __init__(self, streams=None, colour="red"):
        self.streams = streams
        self.colour = colour


class NoStreamsConsumer:
    """Duck-typed, ignores ``streams``."""

    def __init__(self, streams=None):
        pass

    def positions(self):
        return {}

    def on_facts(self, stream, writer, token, rows):
        pass

    def on_position(self, stream, writer, token):
        pass

    def close(self):
        pass


def read_lines(path):
    with open(path, "rb") as f:
        data = f.read()
    return [json.loads(line) for line in data.split(b"\n")[:-1]], data


def crash(consumer):
    """What kill -9 does to a consumer: the kernel closes its file (and its
    lock); the buffer and any timer are gone."""
    os.close(consumer._fd)
    consumer._fd = None
    os.close(consumer._lock_fd)
    consumer._lock_fd = None
    consumer._closed = True
    consumer._cancel_timer()


class LogCapture:
    def __init__(self, case):
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        case.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def texts(self, level=None):
        return [formatEvent(e) for e in self.events
                if e.get("log_namespace") == "replicator.consumers"
                and (level is None or e["log_level"] == level)]


class JsonlTests(SynchronousTestCase):
    def setUp(self):
        self.dir = os.path.join(temp_dir(self), "d")
        self.path = os.path.join(self.dir, "facts.jsonl")
        self.clock = task.Clock()
        self.fsyncs = 0
        real_fsync = os.fsync

        def counting_fsync(fd):
            self.fsyncs += 1
            real_fsync(fd)
        self.patch(os, "fsync", counting_fsync)

    def open(self, **kw):
        consumer = JsonlConsumer(self.path, self.clock, run_io=run_inline, **kw)
        self.addCleanup(consumer.close)
        return consumer

    def test_writes_exactly_the_expected_lines(self):
        c = self.open()
        self.assertIsNone(c.on_facts("caches", "master", 3, [["f", None, 1], ["g", {"k": [1]}, 2]]))
        self.assertIsNone(c.on_facts("caches", "worker1", 1, []))
        self.assertIsNone(c.on_facts("events", "master", 7, [["$é\n☃"]]))
        self.assertIsNone(c.on_position("caches", "master", 5))
        self.clock.advance(0.05)
        with open(self.path, "rb") as f:
            data = f.read()
        self.assertEqual(data.decode("utf-8"), (
            '{"stream":"caches","writer":"master","token":3,'
            '"rows":[["f",null,1],["g",{"k":[1]},2]]}\n'
            '{"stream":"caches","writer":"worker1","token":1,"rows":[]}\n'
            '{"stream":"events","writer":"master","token":7,"rows":[["$é\\n☃"]]}\n'
            '{"stream":"caches","writer":"master","position":5}\n'
        ))
        self.assertEqual(c.positions(), {
            ("caches", "master"): 5, ("caches", "worker1"): 1, ("events", "master"): 7,
        })

    def test_what_orjson_refuses_is_written_as_ascii_json(self):
        c = JsonlConsumer(self.path, self.clock, run_io=run_inline)
        rows = [["\ud800 lone", 2 ** 70, {"1": None}]]
        c.on_facts("caches", "master", 1, rows)
        c.on_facts("caches", "master", 2, [["plain ☃"]])
        c.close()
        with open(self.path, "rb") as f:
            self.assertEqual(f.read().decode("utf-8"), (
                '{"stream":"caches","writer":"master","token":1,'
                '"rows":[["\\ud800 lone",1180591620717411303424,{"1":null}]]}\n'
                '{"stream":"caches","writer":"master","token":2,"rows":[["plain ☃"]]}\n'))
        self.assertEqual(read_lines(self.path)[0][0]["rows"], rows)
        self.assertEqual(self.open().positions(), {("caches", "master"): 2})

    def test_nan_and_infinity_are_refused_not_written_as_null(self):
        c = self.open()
        for bad in (float("nan"), float("inf"), float("-inf")):
            self.assertRaises(ValueError, c.on_facts, "caches", "master", 1, [["a", bad]])
            self.assertRaises(ValueError, c.on_facts_many, "caches", "master",
                              [(1, [[{"x": [bad]}]])])
        c.on_facts("caches", "master", 2, [["a", None, 0.5]])
        c.close()
        self.assertEqual([(line["token"], line["rows"]) for line in read_lines(self.path)[0]],
                         [(2, [["a", None, 0.5]])])

    def test_nothing_is_durable_before_the_timer(self):
        c = self.open()
        c.on_facts("caches", "master", 1, [["a"]])
        self.assertEqual(os.path.getsize(self.path), 0)
        self.assertEqual(c.positions(), {})
        self.clock.advance(0.04)
        self.assertEqual(os.path.getsize(self.path), 0)
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.clock.advance(0.01)
        self.assertEqual(c.positions(), {("caches", "master"): 1})
        self.assertEqual(len(read_lines(self.path)[0]), 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])  # no timer while idle

    def test_two_fsyncs_per_batch_the_file_then_its_state(self):
        c = self.open()
        before = self.fsyncs
        for token in range(1, 101):
            c.on_facts("caches", "master", token, [[token]])
            c.on_position("events", "master", token)
        self.assertEqual(self.fsyncs, before)
        self.clock.advance(0.05)
        self.assertEqual(self.fsyncs, before + 2)
        self.assertEqual(c.flushes, 1)
        for token in range(101, 111):
            c.on_facts("caches", "master", token, [[token]])
        self.clock.advance(0.05)
        self.assertEqual(self.fsyncs, before + 4)
        self.assertEqual(c.flushes, 2)
        self.clock.advance(10)  # idle: nothing more
        self.assertEqual(self.fsyncs, before + 4)
        lines, _ = read_lines(self.path)
        # One position line: where events/master starts (the moves of a
        # writer with no fact since are in the state file, not in lines).
        self.assertEqual(len(lines), 100 + 1 + 10)
        self.assertEqual(lines[1], {"stream": "events", "writer": "master", "position": 1})
        self.assertEqual(c.positions()[("events", "master")], 100)

    def test_without_fsync_writes_but_does_not_sync(self):
        c = self.open(fsync=False)
        c.on_facts("caches", "master", 1, [])
        self.clock.advance(0.05)
        self.assertEqual(self.fsyncs, 0)
        self.assertEqual(c.positions(), {("caches", "master"): 1})

    def test_a_page_of_facts_is_written_like_one_by_one(self):
        """``on_facts_many`` (a catch-up page): the same lines as ``on_facts``
        per fact, what the file has skipped, and back-pressure once full."""
        c = self.open(max_buffer=300)
        c.on_facts("caches", "master", 2, [["b"]])
        self.assertIsNone(c.on_facts_many("caches", "master", [
            (1, [["old"]]), (2, [["again"]]), (3, [["c"], ["d"]]), (4, [])]))
        self.assertEqual(c.skipped, 2)
        self.clock.advance(0.05)
        lines, _ = read_lines(self.path)
        self.assertEqual(lines, [
            {"stream": "caches", "writer": "master", "token": 2, "rows": [["b"]]},
            {"stream": "caches", "writer": "master", "token": 3, "rows": [["c"], ["d"]]},
            {"stream": "caches", "writer": "master", "token": 4, "rows": []},
        ])
        self.assertEqual(c.positions(), {("caches", "master"): 4})
        self.assertIsNone(c.on_facts_many("caches", "master", []))
        big = [(t, [["x" * 50]]) for t in range(5, 15)]
        self.assertIsNone(c.on_facts_many("caches", "master", big))  # written at once
        self.assertEqual(c.positions(), {("caches", "master"): 14})

    def test_full_buffer_flushes_at_once(self):
        c = self.open(max_buffer=300)
        before = self.fsyncs
        line = len(b'{"stream":"caches","writer":"master","token":1,"rows":[["xxxxxxxxxx"]]}\n')
        n = 300 // line + 1
        for token in range(1, n + 1):
            self.assertIsNone(c.on_facts("caches", "master", token, [["x" * 10]]))
        self.assertEqual(self.fsyncs, before + 2)  # the file, then its state
        self.assertEqual(c.positions(), {("caches", "master"): n})
        self.assertEqual(os.path.getsize(self.path), n * line)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_position_lines_once_per_key_per_flush_and_only_after_a_fact(self):
        c = self.open()
        c.on_position("caches", "master", 2)
        c.on_position("caches", "master", 4)  # after its start line: nothing new
        c.on_facts("caches", "worker1", 3, [[1]])
        c.on_position("caches", "worker1", 6)
        c.on_position("events", "master", 1)
        c.on_facts("events", "master", 2, [[2]])  # supersedes the position 1
        c.on_position("caches", "master", 3)  # below 4: ignored
        self.clock.advance(0.05)
        lines, _ = read_lines(self.path)
        self.assertEqual(lines, [
            # A key's first line says where it starts, in order with its facts.
            {"stream": "caches", "writer": "master", "position": 2},
            {"stream": "caches", "writer": "worker1", "token": 3, "rows": [[1]]},
            {"stream": "events", "writer": "master", "position": 1},
            {"stream": "events", "writer": "master", "token": 2, "rows": [[2]]},
            {"stream": "caches", "writer": "worker1", "position": 6},
        ])
        self.assertEqual(c.positions(), {
            ("caches", "master"): 4, ("caches", "worker1"): 6, ("events", "master"): 2,
        })

    def test_an_idle_writer_costs_no_line_per_other_writers_fact(self):
        """Two writers of caches under steady writes, one batch per fact:
        master writes, worker1 is idle and its POSITION follows every one of
        master's facts.  Its position lines are only the ones that say
        something new: its start, one after its own fact, the heading of a
        rotated file; its moves go to the state file.  The file shrinks by
        a line per fact (the old code wrote 2 + N worker1 position lines)."""
        c = self.open(rotate_size=1 << 20)
        n = 300
        c.on_position("caches", "worker1", 0)
        for token in range(1, n + 1):
            c.on_facts("caches", "master", token * 2, [["f", None, token]])
            c.on_position("caches", "worker1", token * 2)
            if token == 100:
                c.on_facts("caches", "worker1", token * 2 + 1, [["w", None, token]])
            self.clock.advance(0.05)
        lines, data = read_lines(self.path)
        facts = [line for line in lines if "rows" in line]
        positions = [line for line in lines if "position" in line]
        self.assertEqual(len(facts), n + 1)
        self.assertEqual(positions, [
            {"stream": "caches", "writer": "worker1", "position": 0},     # where it starts
            {"stream": "caches", "writer": "worker1", "position": 202},   # after its fact
        ])
        self.assertEqual(len(data), sum(len(encode_json_line(line)) for line in lines))
        fact_bytes = sum(len(encode_json_line(line)) for line in facts)
        self.assertEqual(len(data) - fact_bytes, sum(len(encode_json_line(p)) for p in positions))
        # Every move is in the state file: a restart resumes from there.
        self.assertEqual(c.positions(), {("caches", "master"): 2 * n,
                                         ("caches", "worker1"): 2 * n})
        # A new file's heading says where worker1 is.
        c.rotate_size = 1
        c.on_facts("caches", "master", 2 * n + 2, [["g", None, 0]])
        c.on_position("caches", "worker1", 2 * n + 2)
        self.clock.advance(0.05)
        lines, _ = read_lines(self.path)
        self.assertEqual(lines, [
            {"stream": "caches", "writer": "master", "position": 2 * n},
            {"stream": "caches", "writer": "worker1", "position": 2 * n},
            {"stream": "caches", "writer": "master", "token": 2 * n + 2, "rows": [["g", None, 0]]},
        ])
        c.close()
        self.assertEqual(JsonlConsumer(self.path + ".1", self.clock, run_io=run_inline)
                         .positions(), {("caches", "master"): 2 * n,
                                        ("caches", "worker1"): 202})

    def test_a_file_restored_without_its_state_resumes_without_a_duplicate(self):
        """Without the state file the file's last lines give the positions:
        an idle writer's is its last line's (lower than the state said), so
        its reader asks again from there; it has nothing there, nothing is
        written twice."""
        c = self.open()
        c.on_facts("caches", "worker1", 1, [["w"]])
        for token in range(2, 40):
            c.on_facts("caches", "master", token, [["m"]])
            c.on_position("caches", "worker1", token)
            self.clock.advance(0.05)
        c.close()
        os.unlink(os.path.join(self.dir, ".facts.jsonl.state"))
        reopened = self.open()
        self.assertEqual(reopened.positions(), {("caches", "master"): 39,
                                                ("caches", "worker1"): 2})
        before, _ = read_lines(self.path)
        for token in range(2, 40):  # the reader's catch-up: the positions again
            reopened.on_facts("caches", "master", token, [["m"]])
            reopened.on_position("caches", "worker1", token)
        reopened.close()
        self.assertEqual(read_lines(self.path)[0], before)

    def test_positions_survive_reopening(self):
        c = JsonlConsumer(self.path, self.clock, run_io=run_inline)
        c.on_facts("caches", "master", 1, [["a"]])
        c.on_facts("caches", "master", 2, [["b"]])
        c.on_position("caches", "worker1", 9)
        c.close()  # flushes without the timer
        self.assertEqual(self.clock.getDelayedCalls(), [])
        c = self.open()
        self.assertEqual(c.positions(), {("caches", "master"): 2, ("caches", "worker1"): 9})
        c.on_facts("caches", "master", 3, [["c"]])
        c.close()
        lines, _ = read_lines(self.path)
        self.assertEqual([line.get("token", line.get("position")) for line in lines], [1, 2, 9, 3])
        reopened = JsonlConsumer(self.path, self.clock, run_io=run_inline)
        self.assertEqual(reopened.positions(), {("caches", "master"): 3, ("caches", "worker1"): 9})

    def test_close_is_idempotent_and_later_facts_are_dropped(self):
        c = JsonlConsumer(self.path, self.clock, run_io=run_inline)
        c.on_facts("caches", "master", 1, [])
        c.close()
        c.close()
        self.assertIsNone(c.on_facts("caches", "master", 2, []))
        self.assertIsNone(c.on_position("caches", "master", 3))
        self.assertEqual(len(read_lines(self.path)[0]), 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_partial_last_line_is_cut_off(self):
        os.makedirs(self.dir)
        complete = (b'{"stream":"caches","writer":"master","token":1,"rows":[]}\n'
                    b'{"stream":"caches","writer":"master","token":2,"rows":[[1]]}\n')
        partial = b'{"stream":"caches","writer":"master","tok'
        with open(self.path, "wb") as f:
            f.write(complete + partial)
        logs = LogCapture(self)
        c = self.open()
        self.assertEqual(c.positions(), {("caches", "master"): 2})
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), complete)
        warnings = logs.texts(LogLevel.warn)
        self.assertEqual(warnings, [f"{self.path}: cut off a partial last line ({len(partial)} "
                                    f"bytes at offset {len(complete)}; a crash mid-write)"])
        c.on_facts("caches", "master", 3, [])
        c.close()
        lines, _ = read_lines(self.path)
        self.assertEqual([line["token"] for line in lines], [1, 2, 3])

    def test_no_warning_for_a_clean_file(self):
        c = JsonlConsumer(self.path, self.clock, run_io=run_inline)
        c.on_facts("caches", "master", 1, [])
        c.close()
        logs = LogCapture(self)
        self.open()
        self.assertEqual(logs.texts(LogLevel.warn), [])
        self.assertEqual(logs.texts(LogLevel.info),
                         [f"{self.path}: positions of 1 stream writers (0 lines read past "
                          f"its state file)"])

    def test_duplicates_are_skipped(self):
        logs = LogCapture(self)
        c = self.open()
        c.on_facts("caches", "master", 5, [["a"]])
        self.assertIsNone(c.on_facts("caches", "master", 5, [["again"]]))  # buffered
        self.clock.advance(0.05)
        self.assertIsNone(c.on_facts("caches", "master", 3, [["old"]]))  # durable
        c.on_position("caches", "master", 8)
        c.on_facts("caches", "master", 8, [["at the position"]])
        c.on_facts("caches", "worker1", 5, [["other key"]])
        self.assertEqual(c.skipped, 3)
        c.close()
        lines, _ = read_lines(self.path)
        self.assertEqual(lines, [
            {"stream": "caches", "writer": "master", "token": 5, "rows": [["a"]]},
            {"stream": "caches", "writer": "worker1", "token": 5, "rows": [["other key"]]},
            {"stream": "caches", "writer": "master", "position": 8},
        ])
        debug = [t for t in logs.texts(LogLevel.debug) if "skipped" in t]
        self.assertEqual(debug[-1], f"{self.path}: skipped fact 8 of caches/master, at or "
                                    f"below 8 (3 skipped)")
        self.assertEqual(len(debug), 3)
        # After reopening, what is on disk is skipped too.
        c = self.open()
        c.on_facts("caches", "master", 8, [])
        c.on_facts("caches", "master", 9, [])
        self.assertEqual(c.skipped, 1)

    def test_crash_resumes_from_the_last_flush(self):
        c = self.open()
        for token in range(1, 6):
            c.on_facts("caches", "master", token, [[token]])
        c.on_position("caches", "worker1", 4)
        self.clock.advance(0.05)
        flushed, _ = read_lines(self.path)
        for token in range(6, 9):
            c.on_facts("caches", "master", token, [[token]])
        c.on_facts("events", "master", 1, [])
        crash(c)
        with open(self.path, "ab") as f:
            f.write(b'{"stream":"caches","writer":"master","token":6,"ro')
        c = self.open()
        self.assertEqual(c.positions(), {("caches", "master"): 5, ("caches", "worker1"): 4})
        self.assertEqual(read_lines(self.path)[0], flushed)
        # The reader resumes from 5: facts 6.. arrive again, exactly once in the file.
        for token in range(6, 9):
            c.on_facts("caches", "master", token, [[token]])
        c.close()
        tokens = [line["token"] for line in read_lines(self.path)[0] if "rows" in line]
        self.assertEqual(tokens, [1, 2, 3, 4, 5, 6, 7, 8])

    def test_crash_mid_write_keeps_complete_lines(self):
        c = self.open()
        c.on_facts("caches", "master", 1, [])
        self.clock.advance(0.05)
        for token in (2, 3, 4):
            c.on_facts("caches", "master", token, [])
        data = c.pending_bytes()
        cut = data.index(b"\n", data.index(b"\n") + 1) + 10  # two lines and a bit
        with open(self.path, "ab") as f:
            f.write(data[:cut])
        crash(c)
        c = self.open()
        self.assertEqual(c.positions(), {("caches", "master"): 3})

    def test_kill_9(self):
        """A real process killed mid-write: positions are the file's."""
        script = (
            "import os, signal, sys\n"
            "from twisted.internet import task\n"
            "from replicator.consumers import JsonlConsumer, run_inline\n"
            "clock = task.Clock()\n"
            "c = JsonlConsumer(sys.argv[1], clock, run_io=run_inline)\n"
            "for t in range(1, 51): c.on_facts('caches', 'master', t, [[t, 'x' * t]])\n"
            "clock.advance(1)\n"
            "for t in range(51, 61): c.on_facts('caches', 'master', t, [[t]])\n"
            "data = c.pending_bytes()\n"
            "cut = data[:len(data) // 2 + 3]\n"
            "os.pwrite(c._fd, cut, os.fstat(c._fd).st_size)\n"
            "print(cut.count(b'\\n'), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        result = subprocess.run([sys.executable, "-c", script, self.path], cwd=ROOT,
                                capture_output=True, timeout=60)
        self.assertEqual(result.returncode, -signal.SIGKILL, result.stderr.decode())
        complete = int(result.stdout)
        self.assertEqual(complete, 5)
        c = self.open()
        self.assertEqual(c.positions(), {("caches", "master"): 50 + complete})
        lines, data = read_lines(self.path)
        self.assertTrue(data.endswith(b"\n"))
        self.assertEqual([line["token"] for line in lines], list(range(1, 56)))

    def test_a_corrupt_complete_line_is_refused(self):
        os.makedirs(self.dir)
        with open(self.path, "wb") as f:
            f.write(b'{"stream":"caches","writer":"master","token":1,"rows":[]}\n'
                    b'{"stream":"caches","writer":"master","rows":[]}\n')
        e = self.assertRaises(JsonlError, JsonlConsumer, self.path, self.clock,
                               run_io=run_inline)
        self.assertEqual(str(e), f"{self.path}: line 2 (offset 58) is not a fact or position: "
                                 f"no integer token or position")
        with open(self.path, "wb") as f:
            f.write(b"hello\n")
        e = self.assertRaises(JsonlError, JsonlConsumer, self.path, self.clock,
                               run_io=run_inline)
        self.assertTrue(str(e).startswith(
            f"{self.path}: line 1 (offset 0) is not a fact or position: not JSON ("), str(e))
        # Refusing released the file: a good file opens afterwards.
        with open(self.path, "wb") as f:
            f.write(b"\n")
        self.assertEqual(self.open().positions(), {})

    def test_one_consumer_per_file(self):
        self.open()
        e = self.assertRaises(JsonlError, JsonlConsumer, self.path, self.clock,
                               run_io=run_inline)
        self.assertEqual(str(e), f"{self.path} is in use by another consumer")

    def test_creates_the_directory(self):
        self.path = os.path.join(self.dir, "a", "b", "facts.jsonl")
        c = self.open()
        self.assertTrue(os.path.isfile(self.path))
        self.assertEqual(c.positions(), {})

    def test_positions_only_of_its_streams(self):
        c = JsonlConsumer(self.path, self.clock, run_io=run_inline)
        c.on_facts("caches", "master", 1, [])
        c.on_facts("events", "master", 2, [])
        c.close()
        self.assertEqual(self.open(streams=["events"]).positions(), {("events", "master"): 2})

    def test_failed_write_is_rolled_back_and_retried(self):
        c = self.open()
        c.on_facts("caches", "master", 1, [])
        self.clock.advance(0.05)
        size = os.path.getsize(self.path)
        real_pwrite = os.pwrite
        failures = [1]

        def flaky_pwrite(fd, data, offset):
            if failures:
                failures.pop()
                real_pwrite(fd, bytes(data[:7]), offset)  # half a line reaches the file
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwrite(fd, data, offset)
        self.patch(os, "pwrite", flaky_pwrite)
        c.on_facts("caches", "master", 2, [[2]])
        self.clock.advance(0.05)
        self.assertEqual(self.flushLoggedErrors(OSError), [])  # a warning, not a traceback
        self.assertEqual(os.path.getsize(self.path), size)
        self.assertEqual(c.positions(), {("caches", "master"): 1})
        c.on_facts("caches", "master", 3, [[3]])
        self.clock.advance(c.retry_delay)
        self.assertEqual(c.positions(), {("caches", "master"): 3})
        self.assertEqual([line["token"] for line in read_lines(self.path)[0]], [1, 2, 3])

    def test_backpressure_while_writes_fail(self):
        c = self.open(max_buffer=150)  # a line is about 100 bytes
        real_pwrite = os.pwrite
        self.patch(os, "pwrite", lambda fd, data, offset: (_ for _ in ()).throw(
            OSError(errno.EIO, "Input/output error")))
        waits = [c.on_facts("caches", "master", token, [["x" * 40]]) for token in (1, 2, 3)]
        self.assertIsNone(waits[0])
        fired = []
        for d in waits[1:]:
            d.addCallback(fired.append)
        self.assertEqual(fired, [])
        self.clock.advance(c.retry_delay)  # still failing
        self.assertEqual(fired, [])
        self.patch(os, "pwrite", real_pwrite)
        self.clock.advance(2 * c.retry_delay)  # the next retry backs off
        self.assertEqual(fired, [None, None])
        self.assertEqual(c.positions(), {("caches", "master"): 3})


class SlowFsync:
    """A test-only fsync that blocks until released (or 20 s pass), counting
    how often a LoopingCall on the reactor ticked while it was blocked."""

    def __init__(self, case):
        self.release = threading.Event()
        self.ticks = 0
        self.calls = 0
        self.blocked = 0
        self.ticks_while_blocked = []
        real_fsync = os.fsync

        def slow_fsync(fd):
            self.calls += 1
            self.blocked += 1
            before = self.ticks
            self.release.wait(20)
            self.ticks_while_blocked.append(self.ticks - before)
            self.blocked -= 1
            real_fsync(fd)
        case.patch(os, "fsync", slow_fsync)
        case.addCleanup(self.release.set)
        ticker = task.LoopingCall(self.tick)
        ticker.start(0.005)
        case.addCleanup(ticker.stop)

    def tick(self):
        self.ticks += 1


class JsonlThreadTests(TestCase):
    """The file's writes and fsyncs run on a thread of its own: the reactor
    keeps running while they are slow."""

    timeout = 120

    def setUp(self):
        self.path = os.path.join(temp_dir(self), "facts.jsonl")

    def open(self, **kw):
        consumer = JsonlConsumer(self.path, reactor, **kw)
        self.addCleanup(consumer.close)
        return consumer

    async def test_a_slow_fsync_never_stalls_the_reactor(self):
        c = self.open(flush_interval=0.01)  # opening may fsync (a new file)
        slow = SlowFsync(self)
        self.assertIsNone(c.on_facts("caches", "master", 1, [["a"]]))
        await until(lambda: slow.blocked == 1, timeout=30)
        # The reactor keeps running while fsync is stuck in the writer.
        ticks = slow.ticks
        await until(lambda: slow.ticks >= ticks + 5, timeout=30)
        self.assertEqual(c.positions(), {})  # not durable before its fsync returns
        slow.release.set()
        await until(lambda: c.positions() == {("caches", "master"): 1}, timeout=30)
        self.assertGreaterEqual(slow.ticks_while_blocked[0], 5)
        self.assertEqual(read_lines(self.path)[0], [
            {"stream": "caches", "writer": "master", "token": 1, "rows": [["a"]]}])

    async def test_back_pressure_only_when_the_buffer_is_full_while_a_batch_is_written(self):
        c = self.open(max_buffer=300)
        slow = SlowFsync(self)
        answers = []
        token = 0
        while not answers or answers[-1] is None:
            token += 1
            answers.append(c.on_facts("caches", "master", token, [["x" * 40]]))
            if token == 1:
                self.assertEqual(slow.calls, 0)
            self.assertLess(token, 100)
        # A full buffer went to the writer at once, the reader did not
        # wait for it; a second full buffer while it is being written waits.
        await until(lambda: slow.blocked == 1, timeout=30)
        first_batch = 300 // len(_line(1)) + 1
        self.assertEqual(answers[:-1], [None] * (token - 1))
        self.assertEqual(token, 2 * first_batch)
        waiting = answers[-1]
        self.assertFalse(waiting.called)
        self.assertEqual(c.positions(), {})
        slow.release.set()
        await waiting
        await until(lambda: c.positions() == {("caches", "master"): token}, timeout=30)
        self.assertEqual(slow.calls, 4)  # two batches: the file, then its state
        for more in range(token + 1, token + 4):
            self.assertIsNone(c.on_facts("caches", "master", more, [["x" * 40]]))
        await c.close()
        lines, _ = read_lines(self.path)
        self.assertEqual([line["token"] for line in lines], list(range(1, token + 4)))

    async def test_close_waits_for_the_batch_being_written_then_writes_the_rest(self):
        c = self.open(flush_interval=0.01)  # opening may fsync (a new file)
        slow = SlowFsync(self)
        c.on_facts("caches", "master", 1, [["a"]])
        await until(lambda: slow.blocked == 1, timeout=30)
        c.on_facts("caches", "master", 2, [["b"]])
        c.on_position("caches", "worker1", 7)
        closing = c.close()
        self.assertFalse(closing.called)
        slow.release.set()
        await closing
        self.assertIs(c.close(), closing)
        self.assertEqual(c.positions(), {("caches", "master"): 2, ("caches", "worker1"): 7})
        lines, _ = read_lines(self.path)
        self.assertEqual([line.get("token", line.get("position")) for line in lines],
                         [1, 2, 7])
        # The file is released: it opens again.
        reopened = JsonlConsumer(self.path, task.Clock(), run_io=run_inline)
        self.assertEqual(reopened.positions(), c.positions())
        reopened.close()


def _line(token):
    return (json.dumps({"stream": "caches", "writer": "master", "token": token,
                        "rows": [["x" * 40]]}, separators=(",", ":")) + "\n").encode()


class LogConsumerTests(SynchronousTestCase):
    def consumer(self, **kw):
        events = []
        return LogConsumer(logger=Logger(namespace="test", observer=events.append), **kw), events

    def test_one_line_per_fact(self):
        c, events = self.consumer()
        c.on_facts("caches", "master", 7, [["f", None, 1], ["g", {"k": "v"}, 2]])
        c.on_facts("caches", "master", 8, [["h", None, 3]])
        c.on_facts("events", "w1", 9, [])
        c.on_position("caches", "master", 12)
        self.assertEqual([formatEvent(e) for e in events], [
            'caches/master 7: 2 rows [["f",null,1],["g",{"k":"v"},2]]',
            'caches/master 8: 1 row [["h",null,3]]',
            "events/w1 9: 0 rows []",
        ])
        self.assertEqual({e["log_level"] for e in events}, {LogLevel.info})
        self.assertEqual(c.positions(), {})

    def test_preview_is_truncated(self):
        c, events = self.consumer(level="debug")
        c.on_facts("caches", "master", 1, [["x" * 500]])
        text = formatEvent(events[0])
        preview = text[len("caches/master 1: 1 row "):]
        self.assertEqual(len(preview), 200)
        self.assertEqual(preview, '[["' + "x" * 196 + "…")
        self.assertEqual(events[0]["log_level"], LogLevel.debug)

    def test_unknown_level(self):
        e = self.assertRaises(ValueError, LogConsumer, level="loud")
        self.assertEqual(str(e), "level 'loud' is not one of debug, info, warn, error, critical")


class LoadConsumersTests(SynchronousTestCase):
    def setUp(self):
        self.base = temp_dir(self)

    def load(self, *configs):
        built = load_consumers(configs, self.base, reactor)
        for c in built:
            self.addCleanup(c.close)
        return built

    def error(self, *configs):
        return str(self.assertRaises(ConfigError, load_consumers, configs, self.base,
                                       reactor))

    def test_builtins(self):
        jsonl, log, default = self.load(
            ConsumerConfig("jsonl", ("caches",), {"path": "out/facts.jsonl", "fsync": False,
                                                  "flush_interval": 0.2}),
            ConsumerConfig("log", None, {"level": "debug"}),
            ConsumerConfig("jsonl", None, {"path": os.path.join(self.base, "abs.jsonl")}),
        )
        self.assertIsInstance(jsonl, JsonlConsumer)
        self.assertEqual(jsonl.path, os.path.join(os.path.abspath(self.base), "out", "facts.jsonl"))
        self.assertTrue(os.path.isfile(jsonl.path))
        self.assertEqual((jsonl.streams, jsonl.fsync, jsonl.flush_interval),
                         (("caches",), False, 0.2))
        self.assertEqual((default.streams, default.fsync, default.flush_interval),
                         (None, True, 0.05))
        self.assertEqual(default.path, os.path.abspath(os.path.join(self.base, "abs.jsonl")))
        self.assertIsInstance(log, LogConsumer)
        self.assertEqual((log.level, log.streams), (LogLevel.debug, None))

    def test_dotted_paths(self):
        colon, dots = self.load(
            ConsumerConfig("tests.test_consumers:RecordingConsumer", ("events",),
                           {"url": "http://x", "n": 3}),
            ConsumerConfig("tests.test_consumers.RecordingConsumer", None, {}),
        )
        self.assertIsInstance(colon, RecordingConsumer)
        self.assertEqual((colon.streams, colon.options), (("events",), {"url": "http://x", "n": 3}))
        self.assertIsInstance(dots, RecordingConsumer)
        self.assertEqual((dots.streams, dots.options), (None, {}))

    def test_entry_point(self):
        seen = []

        def fake_entry_points(group):
            seen.append(group)
            return [EntryPoint("rec", "tests.test_consumers:RecordingConsumer", group)]
        self.patch(consumer_loading, "entry_points", fake_entry_points)
        (c,) = self.load(ConsumerConfig("rec", ("caches",), {"a": 1}))
        self.assertIsInstance(c, RecordingConsumer)
        self.assertEqual((c.streams, c.options), (("caches",), {"a": 1}))
        self.assertEqual(seen, ["replicator.consumers"])

    def test_broken_entry_point(self):
        self.patch(consumer_loading, "entry_points",
                   lambda group: [EntryPoint("rec", "tests.test_consumers:Nope", group)])
        self.assertEqual(self.error(ConsumerConfig("rec")), (
            "config: consumers[0].type: entry point 'rec' (tests.test_consumers:Nope) cannot be "
            "loaded: AttributeError: module 'tests.test_consumers' has no attribute 'Nope'"))

    def test_streams_set_on_a_consumer_that_ignores_them(self):
        (c,) = self.load(ConsumerConfig("tests.test_consumers:NoStreamsConsumer", ("caches",)))
        self.assertEqual(c.streams, ("caches",))

    def test_builtin_entry_points_declared(self):
        import configparser

        setup_cfg = configparser.ConfigParser()
        with open(os.path.join(ROOT, "setup.cfg"), encoding="utf-8") as f:
            setup_cfg.read_file(f)
        declared = dict(line.split(" = ") for line in setup_cfg["options.entry_points"]
                        ["replicator.consumers"].split("\n") if line)
        self.assertEqual(declared, {
            "jsonl": "replicator.consumers:JsonlConsumer",
            "log": "replicator.consumers:LogConsumer",
        })
        for value in ("replicator.consumers:JsonlConsumer", "replicator.consumers:LogConsumer"):
            self.assertTrue(issubclass(EntryPoint("x", value, "g").load(), Consumer))

    def test_errors(self):
        cases = [
            ([ConsumerConfig("jsonl", None, {})], "config: consumers[0].path: missing"),
            ([ConsumerConfig("log"), ConsumerConfig("x")],
             "config: consumers[1].type: unknown consumer 'x' (not built in, no entry point, "
             "not importable: not a dotted path package.module:Class)"),
            ([ConsumerConfig("nope.mod:Thing")],
             "config: consumers[0].type: unknown consumer 'nope.mod:Thing' (not built in, no "
             "entry point, not importable: No module named 'nope')"),
            ([ConsumerConfig("tests.test_consumers:Missing")],
             "config: consumers[0].type: unknown consumer 'tests.test_consumers:Missing' (not "
             "built in, no entry point, not importable: tests.test_consumers has no attribute "
             "'Missing')"),
            ([ConsumerConfig("jsonl", None, {"path": "f", "fsync": "yes"})],
             "config: consumers[0].fsync: expected true or false, got str"),
            ([ConsumerConfig("jsonl", None, {"path": "f", "flush_interval": "1s"})],
             "config: consumers[0].flush_interval: expected a number, got str"),
            ([ConsumerConfig("jsonl", None, {"path": "f", "flush_interval": -1})],
             "config: consumers[0].flush_interval: must be a number from 0 to 60, got -1"),
            ([ConsumerConfig("jsonl", None, {"path": 3})],
             "config: consumers[0].path: expected a non-empty string, got int"),
            ([ConsumerConfig("jsonl", None, {"path": "f", "bogus": 1})],
             "config: consumers[0].bogus: unknown key"),
            ([ConsumerConfig("log", None, {"levle": "info"})],
             "config: consumers[0].levle: unknown key (did you mean 'level'?)"),
            ([ConsumerConfig("log", None, {"level": "loud"})],
             "config: consumers[0].level: 'loud' is not one of debug, info, warn, error, "
             "critical"),
            ([ConsumerConfig("log"), ConsumerConfig("tests.test_consumers:StrictConsumer", None,
                                                    {"colour": "blue", "size": 3})],
             "config: consumers[1]: cannot create tests.test_consumers:StrictConsumer: "
             "StrictConsumer.__init__() got an unexpected keyword argument 'size'"),
            ([ConsumerConfig("builtins:dict")],
             "config: consumers[0].type: 'builtins:dict' made a dict, which is not a consumer "
             "(no positions, on_facts, on_position, close)"),
            ([ConsumerConfig("tests.test_consumers:ROOT")],
             "config: consumers[0].type: 'tests.test_consumers:ROOT' is not a class"),
        ]
        for configs, expected in cases:
            self.assertEqual(self.error(*configs), expected)

    def test_file_problems_name_the_path(self):
        with open(os.path.join(self.base, "file"), "w"):
            pass
        message = self.error(ConsumerConfig("jsonl", None, {"path": "file/facts.jsonl"}))
        self.assertEqual(message, "config: consumers[0].path: cannot open "
                                  f"{os.path.join(self.base, 'file')}: File exists")
        with open(os.path.join(self.base, "bad.jsonl"), "wb") as f:
            f.write(b"[1]\n")
        path = os.path.join(os.path.abspath(self.base), "bad.jsonl")
        self.assertEqual(self.error(ConsumerConfig("jsonl", None, {"path": "bad.jsonl"})),
                         f"config: consumers[0].path: {path}: line 1 (offset 0) is not a fact or "
                         f"position: not a JSON object")

    def test_consumers_built_before_a_mistake_are_closed(self):
        config = ConsumerConfig("jsonl", None, {"path": "facts.jsonl"})
        self.error(config, ConsumerConfig("x"))
        self.error(config, config)  # the second one finds the file locked
        self.assertEqual(
            self.error(config, config),
            f"config: consumers[1].path: {os.path.join(os.path.abspath(self.base), 'facts.jsonl')}"
            " is in use by another consumer")
        (c,) = self.load(config)  # nothing left holding the file
        self.assertEqual(c.positions(), {})

    def test_memory_consumer_unchanged(self):
        c = MemoryConsumer({("s", "w"): 3}, streams=["s"])
        c.on_facts("s", "w", 4, [[1]])
        self.assertEqual(c.positions(), {("s", "w"): 4})


# ------------------------------------------------------------ property test
KEYS = [("caches", "master"), ("caches", "worker1"), ("events", "master")]

operation = st.one_of(
    st.tuples(st.just("fact"), st.integers(0, 2), st.integers(-2, 3),
              st.lists(st.lists(st.one_of(st.integers(-5, 5), st.text("ab\n", max_size=3)),
                                max_size=2), max_size=2)),
    st.tuples(st.just("position"), st.integers(0, 2), st.integers(-2, 3)),
    st.tuples(st.just("flush")),
)


class CrashProperty(SynchronousTestCase):
    @settings(max_examples=150, deadline=None)
    @given(ops=st.lists(operation, max_size=40), cut=st.floats(0, 1),
           garbage=st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"")))
    def test_reopening_after_a_crash(self, ops, cut, garbage):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "facts.jsonl")
            clock = task.Clock()
            c = JsonlConsumer(path, clock, fsync=False, run_io=run_inline)
            last = {}  # model: per key, the last accepted token (buffered or durable)
            accepted = []  # every accepted event, in order, for the replay
            written = []  # lines flushed, in order
            batch, batch_positions = [], {}
            durable = {}
            after_fact = set()  # keys whose last line is a fact: a position may follow
            token_of = {}  # the offered token per key
            for op in ops:
                if op[0] == "flush":
                    c.flush()
                    written += batch + [{"stream": s, "writer": w, "position": t}
                                        for (s, w), t in batch_positions.items()]
                    after_fact.difference_update(batch_positions)
                    batch, batch_positions = [], {}
                    durable = dict(last)
                    continue
                key = KEYS[op[1]]
                token = token_of.get(key, 0) + op[2]
                token_of[key] = max(token, token_of.get(key, 0))
                if op[0] == "fact":
                    self.assertIsNone(c.on_facts(key[0], key[1], token, op[3]))
                    if token > last.get(key, -10):
                        last[key] = token
                        accepted.append(("fact", key, token, op[3]))
                        batch.append({"stream": key[0], "writer": key[1], "token": token,
                                      "rows": op[3]})
                        batch_positions.pop(key, None)
                        after_fact.add(key)
                else:
                    c.on_position(key[0], key[1], token)
                    if key not in last:  # the key's first line: where it starts, in order
                        last[key] = token
                        accepted.append(("position", key, token))
                        batch.append({"stream": key[0], "writer": key[1], "position": token})
                    elif token > last[key]:
                        last[key] = token
                        accepted.append(("position", key, token))
                        if key in after_fact:
                            batch_positions[key] = token
                self.assertEqual(c.positions(), durable)

            # Crash in the middle of writing the next batch, then garbage.
            pending = c.pending_bytes()
            expected_pending = b"".join(
                json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
                for line in batch + [{"stream": s, "writer": w, "position": t}
                                     for (s, w), t in batch_positions.items()])
            self.assertEqual(pending, expected_pending)
            part = pending[:int(len(pending) * cut)]
            crash(c)
            with open(path, "ab") as f:
                f.write(part + garbage)
            survivors = [json.loads(line) for line in part.split(b"\n")[:-1]]
            for line in survivors:
                durable[(line["stream"], line["writer"])] = line.get("token", line.get("position"))

            c = JsonlConsumer(path, clock, fsync=False, run_io=run_inline)
            self.assertEqual(c.positions(), durable)
            with open(path, "rb") as f:
                data = f.read()
            self.assertTrue(data == b"" or data.endswith(b"\n"))
            self.assertEqual([json.loads(line) for line in data.splitlines()], written + survivors)

            # The reader replays everything from the start: each fact lands once.
            for event in accepted:
                if event[0] == "fact":
                    c.on_facts(event[1][0], event[1][1], event[2], event[3])
                else:
                    c.on_position(event[1][0], event[1][1], event[2])
            c.close()
            c = JsonlConsumer(path, clock, fsync=False, run_io=run_inline)
            self.assertEqual(c.positions(), last)
            c.close()
            with open(path, "rb") as f:
                lines = [json.loads(line) for line in f.read().splitlines()]
            for key in KEYS:
                facts = [(line["token"], line["rows"]) for line in lines
                         if "rows" in line and (line["stream"], line["writer"]) == key]
                self.assertEqual(facts, [(e[2], e[3]) for e in accepted
                                         if e[0] == "fact" and e[1] == key])


# ------------------------------------------------------------ with the reader
class ReaderTests(TestCase):
    """A JsonlConsumer behind a real ReplicationHandler, in memory
    (:mod:`tests.harness`; the file's I/O inline): after a crash the reader
    resumes from the file and each fact lands once."""

    def setUp(self):
        from replicator.config import parse_streams
        from tests.harness import Harness

        self.path = os.path.join(temp_dir(self), "facts.jsonl")
        self.h = Harness(parse_streams([
            {"name": "caches", "table": "cache_stream",
             "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
             "writers": ["master", "worker1"]},
        ]), self.addCleanup)

    def consumer(self):
        # Flushed only when asked (the timer never fires in the test).
        return JsonlConsumer(self.path, self.h.clock, flush_interval=3600, run_io=run_inline)

    def connect(self, node, data):
        proto, _ = self.h.client(node)
        proto.dataReceived(data)
        self.h.settle()
        return proto

    def test_resume_after_a_crash(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "wb") as f:  # "from the beginning"
            f.write(b'{"stream":"caches","writer":"master","position":0}\n')
        master = self.h.instance("master")
        caches = master.stream("caches")
        self.h.run(caches.write_facts([[["a", None, 1], ["b", None, 1]], [], [["c", None, 3]]]))

        jsonl = self.consumer()
        worker = self.h.instance("worker1", [jsonl])
        proto = self.connect(worker, b"POSITION caches master 3 3\n")
        self.assertEqual(worker.handler.reader_positions()[("caches", "master")], 3)
        self.h.run(jsonl.flush())
        self.assertEqual(jsonl.positions(), {("caches", "master"): 3})
        # Two more facts arrive live; the worker dies before they are flushed.
        self.h.run(caches.write_facts([[["d", None, 4]], [["e", None, 5]]]))
        proto.dataReceived(b'RDATA caches master 4 ["d",null,4]\n'
                           b'RDATA caches master 5 ["e",null,5]\n')
        self.h.settle()
        self.assertEqual(worker.handler.reader_positions()[("caches", "master")], 5)
        crash(jsonl)
        proto.connectionLost(None)
        worker.handler.stop()

        jsonl = self.consumer()
        self.assertEqual(jsonl.positions(), {("caches", "master"): 3})
        worker = self.h.instance("worker1", [jsonl])
        proto = self.connect(worker, b"POSITION caches master 5 5\n"
                                     b'RDATA caches master 5 ["e",null,5]\n')
        self.assertEqual(worker.handler.reader_positions()[("caches", "master")], 5)
        proto.connectionLost(None)
        self.h.run(jsonl.close())
        lines, _ = read_lines(self.path)
        self.assertEqual([(line["token"], line["rows"]) for line in lines if "rows" in line], [
            (1, [["a", None, 1], ["b", None, 1]]),
            (3, [["c", None, 3]]),
            (4, [["d", None, 4]]),
            (5, [["e", None, 5]]),
        ])


# ------------------------------------ a catch-up page encoded at once
def lines_one_by_one(stream, writer, facts):
    return b"".join(encode_json_line({"stream": stream, "writer": writer, "token": token,
                                      "rows": rows}) for token, rows in facts)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
              st.text("ab]],[[ \"\\%é", max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text("k]],[[", max_size=3), inner, max_size=2)),
    max_leaves=8)
rows_of = st.lists(st.one_of(st.lists(json_values, max_size=3), json_values), max_size=3)


class FactLinesAtOnceTests(SynchronousTestCase):
    """``fact_lines_at_once``: the same bytes as one ``encode_json_line`` per
    fact, or None (then the consumer encodes fact by fact)."""

    @settings(max_examples=400, deadline=None)
    @given(names=st.tuples(st.text("ab%\"é\\", min_size=1, max_size=3),
                           st.text("ab%\"", min_size=1, max_size=3)),
           facts=st.lists(rows_of, min_size=1, max_size=6))
    def test_same_lines_as_one_by_one(self, names, facts):
        stream, writer = names
        facts = [(token, rows) for token, rows in enumerate(facts, 1)]
        data = fact_lines_at_once(stream, writer, facts)
        try:
            expected = lines_one_by_one(stream, writer, facts)
        except (TypeError, ValueError):
            self.assertIsNone(data)  # the caller's fact-by-fact pass raises
            return
        self.assertIn(data, (None, expected))

    def test_the_common_page_is_encoded_at_once(self):
        facts = [(t, [[f"fact {t}", t, None, True, {"k": [1, "é"]}]] * (1 + t % 3))
                 for t in range(1, 1001)]
        self.assertEqual(fact_lines_at_once("caches", "master", facts),
                         lines_one_by_one("caches", "master", facts))
        self.assertEqual(fact_lines_at_once("c%s", 'w"', facts[:2]),
                         lines_one_by_one("c%s", 'w"', facts[:2]))

    def test_what_the_split_cannot_tell_is_left_to_one_by_one(self):
        for facts in (
            [(1, [["a]],[[b"]]), (2, [["c"]])],  # the separator inside a string
            [(1, [[[1]], [[2]]]), (2, [["c"]])],  # ... between nested arrays
            [(1, []), (2, [["c"]])],  # a fact without rows
            [(1, ["s"]), (2, [[[1]], [[2]]])],  # a row that is not an array
            [(1, [[2**64]])],  # beyond orjson's integers
            [(1, [[float("nan")]])],  # refused by the fallback
            [(True, [[1]])],  # a token that is not an int
        ):
            self.assertIsNone(fact_lines_at_once("s", "w", facts), facts)
