"""The jsonl consumer's file rotating (by size, by age, by an external
``logrotate``) without ever replaying or skipping history: its positions
are kept beside the file, not derived from the file's last lines alone."""

import os

from twisted.internet import task
from twisted.trial.unittest import SynchronousTestCase

from replicator.consumers import JsonlConsumer, run_inline
from replicator.consumers.jsonl_files import rotated_files

from .test_consumers import read_lines, temp_dir


def fact_tokens(paths):
    """Tokens of every fact line in ``paths``, in order."""
    tokens = []
    for path in paths:
        lines, _ = read_lines(path)
        tokens += [line["token"] for line in lines if "rows" in line]
    return tokens


class RotationTests(SynchronousTestCase):
    def setUp(self):
        self.dir = temp_dir(self)
        self.path = os.path.join(self.dir, "facts.jsonl")
        self.clock = task.Clock()

    def open(self, **kw):
        consumer = JsonlConsumer(self.path, self.clock, run_io=run_inline, **kw)
        self.addCleanup(consumer.close)
        return consumer

    def write(self, consumer, tokens, writer="master"):
        for token in tokens:
            consumer.on_facts("caches", writer, token, [[token, "x" * 20]])
        self.clock.advance(1)

    def test_a_file_moved_away_while_stopped_keeps_the_positions(self):
        """logrotate's default (move, then create) while the daemon is
        stopped: the new file is empty, and the consumer must still resume
        after its last fact, not from nothing (history again, or live)."""
        c = self.open()
        self.write(c, range(1, 11))
        c.close()
        os.rename(self.path, self.path + ".1")
        with open(self.path, "wb"):
            pass
        reopened = self.open()
        self.assertEqual(reopened.positions(), {("caches", "master"): 10})

    def test_a_file_moved_away_while_running_is_reopened(self):
        c = self.open()
        self.write(c, range(1, 6))
        os.rename(self.path, self.path + ".1")  # logrotate: move ...
        with open(self.path, "wb"):  # ... and create
            pass
        self.write(c, range(6, 11))
        c.close()
        self.assertEqual(fact_tokens([self.path + ".1"]), [1, 2, 3, 4, 5])
        self.assertEqual(fact_tokens([self.path]), [6, 7, 8, 9, 10])
        self.assertEqual(self.open().positions(), {("caches", "master"): 10})

    def test_copytruncate_leaves_no_hole(self):
        """logrotate's copytruncate: the file is copied, then cut to zero
        while the consumer holds it; the next batch starts at offset 0 (not
        at the old size, which would leave a run of NUL bytes)."""
        c = self.open()
        self.write(c, range(1, 6))
        with open(self.path, "rb") as f, open(self.path + ".1", "wb") as copy:
            copy.write(f.read())
        os.truncate(self.path, 0)
        self.write(c, range(6, 11))
        with open(self.path, "rb") as f:
            data = f.read()
        self.assertNotIn(b"\x00", data)
        c.close()
        self.assertEqual(fact_tokens([self.path + ".1", self.path]), list(range(1, 11)))
        self.assertEqual(self.open().positions(), {("caches", "master"): 10})

    def test_rotates_by_size_keeping_a_count(self):
        c = self.open(rotate_size=400, rotate_keep=3)
        for token in range(1, 41):
            self.write(c, [token])
        c.close()
        rotated = rotated_files(self.path)
        self.assertEqual([os.path.basename(p) for p in rotated],
                         ["facts.jsonl.3", "facts.jsonl.2", "facts.jsonl.1"])
        for path in rotated:
            self.assertLessEqual(os.path.getsize(path), 400 + 200)
        tokens = fact_tokens(rotated + [self.path])
        self.assertEqual(tokens, list(range(tokens[0], 41)))
        self.assertGreater(tokens[0], 1)  # older files were deleted
        # Every file starts with the positions so far (after the first).
        first, _ = read_lines(rotated[0])
        self.assertIn("position", first[0])
        self.assertEqual(self.open().positions(), {("caches", "master"): 40})

    def test_rotates_by_age(self):
        c = self.open(rotate_age=60)
        self.write(c, [1])
        self.clock.advance(30)
        self.write(c, [2])
        self.assertEqual(rotated_files(self.path), [])
        self.clock.advance(31)
        self.write(c, [3])
        self.assertEqual(rotated_files(self.path), [self.path + ".1"])
        c.close()
        self.assertEqual(fact_tokens([self.path + ".1", self.path]), [1, 2, 3])

    def test_dated_names(self):
        c = self.open(rotate_size=50, rotate_names="date")
        self.write(c, [1])
        self.write(c, [2])
        self.write(c, [3])
        c.close()
        rotated = rotated_files(self.path)
        self.assertEqual(len(rotated), 2)
        for path in rotated:
            self.assertRegex(os.path.basename(path), r"^facts\.jsonl-\d{8}-\d{6}(\.\d+)?$")
        self.assertEqual(fact_tokens(rotated + [self.path]), [1, 2, 3])


class RotationConfigTests(SynchronousTestCase):
    """Each rotation key: the value a consumer gets, or one line naming it."""

    def build(self, **options):
        from twisted.internet import reactor

        from replicator.config import ConsumerConfig
        from replicator.consumers import load_consumers

        path = os.path.join(temp_dir(self), "facts.jsonl")
        [consumer] = load_consumers([ConsumerConfig("jsonl", None, {"path": path, **options})],
                                    ".", reactor)
        self.addCleanup(consumer.close)
        return consumer

    def error(self, **options):
        from replicator.config import ConfigError

        with self.assertRaises(ConfigError) as raised:
            self.build(**options)
        return str(raised.exception)

    def test_values(self):
        c = self.build(rotate_size="100M", rotate_age="12h", rotate_keep=3, rotate_names="date")
        self.assertEqual((c.rotate_size, c.rotate_age, c.rotate_keep, c.rotate_names),
                         (100 << 20, 12 * 3600.0, 3, "date"))
        c = self.build(rotate_size=4096, rotate_age=90)
        self.assertEqual((c.rotate_size, c.rotate_age, c.rotate_keep, c.rotate_names),
                         (4096, 90.0, 7, "number"))
        c = self.build()
        self.assertEqual((c.rotate_size, c.rotate_age), (None, None))

    def test_mistakes(self):
        self.assertEqual(self.error(rotate_size="lots"), "config: consumers[0].rotate_size: "
                         "'lots' is not a size (bytes, or e.g. \"100M\", \"1G\")")
        self.assertEqual(self.error(rotate_size=10), "config: consumers[0].rotate_size: "
                         "must be from 1K to 1P bytes, got 10")
        self.assertEqual(self.error(rotate_age="soon"), "config: consumers[0].rotate_age: "
                         "'soon' is not an age (seconds, or e.g. \"12h\", \"7d\")")
        self.assertEqual(self.error(rotate_age=0), "config: consumers[0].rotate_age: "
                         "must be from 1 second to 10 years, got 0")
        self.assertEqual(self.error(rotate_keep=0), "config: consumers[0].rotate_keep: "
                         "must be an integer from 1 to 100000, got 0")
        self.assertEqual(self.error(rotate_names="weekly"), "config: consumers[0].rotate_names: "
                         "'weekly' is not one of number, date")
        self.assertEqual(self.error(rotate_sise=1), "config: consumers[0].rotate_sise: "
                         "unknown key (did you mean 'rotate_size'?)")


class ReadingSnippetTests(SynchronousTestCase):
    """The reader in docs/jsonl.md, run as printed, on a rotated and rewound
    output."""

    def test_the_documented_reader(self):
        with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "docs", "jsonl.md")) as f:
            text = f.read()
        reader, with_pandas = [block.split("```", 1)[0]
                               for block in text.split("```python\n")[1:]]
        namespace = {}
        exec(compile(reader, "docs/jsonl.md", "exec"), namespace)
        for names in ("number", "date"):
            path = os.path.join(temp_dir(self), "facts.jsonl")
            clock = task.Clock()
            c = JsonlConsumer(path, clock, run_io=run_inline, rotate_size=1024,
                              rotate_names=names, rotate_keep=100)
            for token in range(1, 41):
                c.on_facts("caches", "master", token, [[token, "x" * 20]])
                c.on_position("events", "master", token)
                clock.advance(1)
            c.rewind({("caches", "master"): 30})
            for token in range(31, 46):
                c.on_facts("caches", "master", token, [[token, "x" * 20]])
                clock.advance(1)
            c.close()
            self.assertGreater(len(rotated_files(path)), 2)
            self.assertEqual(namespace["files"](path), rotated_files(path) + [path])
            got = list(namespace["facts"](path))
            self.assertEqual([t for _, _, t, _ in got], list(range(1, 46)))
            self.assertEqual(got[0], ("caches", "master", 1, [[1, "x" * 20]]))
            run = dict(namespace, path=path)
            exec(compile(with_pandas, "docs/jsonl.md", "exec"), run)
            self.assertEqual(list(run["frame"]["token"]), list(range(1, 46)))


class StateAndRewindTests(SynchronousTestCase):
    def setUp(self):
        self.dir = temp_dir(self)
        self.path = os.path.join(self.dir, "facts.jsonl")
        self.clock = task.Clock()

    def open(self, **kw):
        consumer = JsonlConsumer(self.path, self.clock, run_io=run_inline, **kw)
        self.addCleanup(consumer.close)
        return consumer

    def test_reopen_lets_go_of_a_moved_file_at_once(self):
        c = self.open()
        c.on_facts("caches", "master", 1, [])
        self.clock.advance(1)
        os.rename(self.path, self.path + ".1")
        self.assertFalse(os.path.exists(self.path))
        self.successResultOf(c.reopen())
        self.assertEqual(os.fstat(c._fd).st_ino, os.stat(self.path).st_ino)
        self.assertEqual(c.reopens, 1)

    def test_rewind_is_one_transaction(self):
        c = self.open()
        for token in range(1, 11):
            c.on_facts("caches", "master", token, [])
        c.on_position("events", "master", 4)
        self.clock.advance(1)
        self.successResultOf(c.rewind({("caches", "master"): 5}))
        self.assertEqual(c.positions(), {("caches", "master"): 5, ("events", "master"): 4})
        c.close()
        lines, _ = read_lines(self.path)
        self.assertEqual(lines[-1], {"stream": "caches", "writer": "master", "rewind": 5})
        self.assertEqual(self.open().positions(),
                         {("caches", "master"): 5, ("events", "master"): 4})

    def test_a_rewind_cut_short_before_its_commit_is_undone(self):
        c = self.open()
        for token in range(1, 11):
            c.on_facts("caches", "master", token, [])
        self.clock.advance(1)
        c.close()
        size = os.path.getsize(self.path)
        with open(self.path, "ab") as f:  # the lines, and no state written after them
            f.write(b'{"stream":"caches","writer":"master","rewind":5}\n')
        reopened = self.open()
        self.assertEqual(reopened.positions(), {("caches", "master"): 10})
        self.assertEqual(os.path.getsize(self.path), size)

    def test_an_unreadable_state_file_is_one_line(self):
        from replicator.consumers import JsonlError
        from replicator.consumers.jsonl_files import state_path

        self.open().close()
        with open(state_path(self.path), "w") as f:
            f.write("{")
        e = self.assertRaises(JsonlError, JsonlConsumer, self.path, self.clock,
                              run_io=run_inline)
        self.assertTrue(str(e).startswith(f"{state_path(self.path)} is not a state file ("),
                        str(e))
        self.assertTrue(str(e).endswith("; move it away to rebuild the positions from "
                                        "facts.jsonl alone"), str(e))


class CheckConsumerOptionsTests(SynchronousTestCase):
    """``replicator check`` refuses a consumer option ``run`` would refuse,
    without creating the output (a running daemon holds it)."""

    def test_check_names_the_key_and_creates_nothing(self):
        import yaml

        from tests.daemon import CACHES, SECRET, cli

        directory = temp_dir(self)
        path = os.path.join(directory, "c.yaml")
        for consumer, code, said in [
            ({"type": "jsonl", "path": "out/facts.jsonl", "rotate_size": "lots"}, 2,
             "replicator: config: consumers[0].rotate_size: 'lots' is not a size (bytes, or "
             "e.g. \"100M\", \"1G\")\n"),
            ({"type": "log", "level": "loud"}, 2,
             "replicator: config: consumers[0].level: 'loud' is not one of debug, info, warn, "
             "error, critical\n"),
            ({"type": "jsonl", "path": "out/facts.jsonl", "rotate_size": "1M"}, 0, ""),
        ]:
            with open(path, "w") as f:
                yaml.safe_dump({"server_name": "hs.test", "instance_name": "master",
                                "database": {"sqlite": "s.db"}, "streams": [CACHES],
                                "http": {"listen": "tcp:0:interface=127.0.0.1",
                                         "secret": SECRET},
                                "consumers": [consumer]}, f)
            result = cli("check", "-c", path, cwd=directory)
            self.assertEqual((result.returncode, result.stderr), (code, said), result.stdout)
            self.assertFalse(os.path.exists(os.path.join(directory, "out")))
