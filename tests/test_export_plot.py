"""The exporter's plot, drawn from series (no Spark needed): event time only,
no running minute, minute ticks, a legend beside the data; and the
exporter's one-line error when PySpark is missing."""

import os
import re
import subprocess
import sys
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from replicator.export import plot

T0 = 1_795_000_020_000 - (1_795_000_020_000 % 60_000)  # a minute boundary


class PlotTests(SynchronousTestCase):
    def setUp(self):
        import matplotlib.pyplot as plt

        self.plt = plt
        self.figs = []

    def tearDown(self):
        for fig in self.figs:
            self.plt.close(fig)

    def draw(self, series, left_out=()):
        fig = plot.figure(series, 24.0, left_out)
        self.figs.append(fig)
        fig.canvas.draw()
        return fig, fig.axes[0]

    def test_the_running_minute_is_not_drawn(self):
        series = {"caches": [(T0 + i * 60_000, 50) for i in range(5)]}
        # At T0 + 4.5 min the fifth minute is running: its count is partial.
        kept = plot.complete_minutes(series, T0 + 4 * 60_000 + 30_000)
        self.assertEqual(kept, {"caches": [(T0 + i * 60_000, 50) for i in range(4)]})
        self.assertEqual(plot.complete_minutes(series, T0 + 5 * 60_000), series)
        self.assertEqual(plot.complete_minutes({"caches": series["caches"][:1]}, T0 + 1), {})

    def test_a_few_minutes_are_labelled_in_minutes_not_seconds(self):
        fig, ax = self.draw({"caches": [(T0 + i * 60_000, i) for i in range(3)]})
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        self.assertTrue(labels)
        for label in labels:
            self.assertRegex(label, r"^(\d\d:\d\d|[A-Z][a-z]{2}[- ]\d\d|\d{4}.*)$")
            self.assertFalse(re.fullmatch(r"\d\d(\.\d+)?", label), labels)
        self.assertNotIn("minute (UTC)", ax.get_xlabel())
        self.assertIn("event time (UTC)", ax.get_xlabel())

    def test_the_legend_does_not_cover_the_data(self):
        series = {name: [(T0 + i * 60_000, 100) for i in range(30)]
                  for name in ("account_data", "caches", "presence")}
        fig, ax = self.draw(series)
        renderer = fig.canvas.get_renderer()
        legend = ax.get_legend().get_window_extent(renderer)
        axes = ax.get_window_extent(renderer)
        self.assertGreaterEqual(legend.x0, axes.x1)
        # And the saved file is a PNG with the legend inside the image.
        self.assertLessEqual(legend.x1, fig.bbox.x1)

    def test_streams_without_event_time_are_left_out_and_named(self):
        fig, _ = self.draw({"caches": [(T0, 1), (T0 + 60_000, 2)]},
                           left_out=["account_data"])
        texts = [t.get_text() for t in fig.texts]
        self.assertEqual(texts, ["not plotted (no timestamp_column, so no event time): "
                                 "account_data"])


class MissingSparkTests(SynchronousTestCase):
    def test_one_line_saying_how_to_install_and_exit_1(self):
        shadow = tempfile.mkdtemp()
        os.mkdir(os.path.join(shadow, "pyspark"))
        with open(os.path.join(shadow, "pyspark", "__init__.py"), "w") as f:
            f.write("raise ModuleNotFoundError(\"No module named 'pyspark'\", name='pyspark')\n")
        conf = os.path.join(shadow, "c.yaml")
        with open(conf, "w") as f:
            f.write("server_name: hs\ninstance_name: master\ndatabase: {sqlite: x.db}\n"
                    "streams:\n  - name: caches\n    table: t\n    columns: [{a: text}]\n"
                    "    writers: [master]\n")
        env = dict(os.environ, PYTHONPATH=shadow)
        result = subprocess.run([sys.executable, "-m", "replicator.export.cli", "-c", conf,
                                 "-o", os.path.join(shadow, "out")],
                                capture_output=True, text=True, env=env, timeout=60,
                                cwd=shadow)
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertEqual(result.stderr.count("\n"), 1, result.stderr)
        self.assertIn("PySpark is not installed", result.stderr)
        self.assertIn("pip install -e '.[spark]'", result.stderr)
        self.assertNotIn("Traceback", result.stderr)


class KeepOptionTests(SynchronousTestCase):
    def test_keep_is_parsed_and_checked(self):
        from replicator.export.cli import build_parser

        parser = build_parser()
        self.assertEqual(parser.parse_args(["-c", "x.yaml"]).keep, 1)
        self.assertEqual(parser.parse_args(["-c", "x.yaml", "--keep", "0"]).keep, 0)
        self.assertEqual(parser.parse_args(["-c", "x.yaml", "--keep", "5"]).keep, 5)
        with self.assertRaises(SystemExit):
            parser.parse_args(["-c", "x.yaml", "--keep", "-1"])

    def test_the_store_keeps_current_and_keep_previous_generations(self):
        from replicator.export.state import ExportState, OutputStore

        out = os.path.join(tempfile.mkdtemp(), "export")

        def runs(count, keep):
            store = OutputStore(out, keep_previous=keep)
            store.lock()
            try:
                for _ in range(count):
                    store.commit(store.begin(), store.load_state() or ExportState())
            finally:
                store.unlock()
            return (sorted(e for e in os.listdir(out) if e.startswith("gen-")),
                    os.path.basename(store.current_path()))

        self.assertEqual(runs(5, keep=2), (
            ["gen-00000003", "gen-00000004", "gen-00000005"], "gen-00000005"))
        self.assertEqual(runs(1, keep=0), (["gen-00000006"], "gen-00000006"))
