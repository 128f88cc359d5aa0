"""docs/export.md against a real export: its pyarrow, pandas and Spark
snippets run as written (the page's ``var/export`` pointed at a small
export made here, on SQLite), give the figures the plain-Python reference
gives, and its column table names exactly the columns an export has.

The export is made once for the module, with the SparkSession that
``tests.test_export`` shares (the JVM takes seconds to start).
"""

import os
import re
import shutil
import tempfile

from twisted.trial.unittest import TestCase

from replicator.config import parse_database, parse_streams
from replicator.export.aggregate import OUTPUT_COLUMNS
from replicator.export.reference import Aggregator
from tests.export_fixtures import (
    RUN1_MS,
    STREAMS,
    Generator,
    export,
    run1,
    shared_spark,
    sqlite_with_positions,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "export.md")
#: The linear position the export stops at (the smaller writer's).
POSITION = 350

_made = None


def doc_text() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def snippet(name: str) -> str:
    """The fenced block right after ``<!-- snippet: NAME -->`` in the page."""
    match = re.search(rf"<!-- snippet: {re.escape(name)} -->\n```[a-z]*\n(.*?)```",
                      doc_text(), re.S)
    assert match, f"docs/export.md has no snippet {name!r}"
    return match.group(1)


def made_export():
    """(output directory, reference aggregates) of the module's export."""
    global _made
    if _made is None:
        spark = shared_spark()
        tmp = tempfile.mkdtemp(prefix="export-docs-")
        path = os.path.join(tmp, "db.sqlite")
        conn = sqlite_with_positions(path)
        conn.execute("CREATE TABLE ev (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL, "
                     "body TEXT NOT NULL, ts INTEGER)")
        facts = Generator(5).facts(1, 400, ["w1", "w2"])
        rows = [(i, w, "b", ts) for i, w, stamps in facts for ts in stamps]
        conn.executemany("INSERT INTO ev VALUES (?, ?, ?, ?)", rows)
        conn.executemany("INSERT INTO stream_positions VALUES ('events', ?, ?)",
                         [("w1", POSITION), ("w2", 390)])
        conn.commit()
        conn.close()
        out = os.path.join(tmp, "var", "export")
        export(parse_database({"sqlite": path}), parse_streams(STREAMS[:1]), out, spark=spark,
               now_ms=RUN1_MS)
        agg = Aggregator(2, True, run1)
        agg.feed(sorted(((i, w, ts) for i, w, _b, ts in rows if i <= POSITION),
                        key=lambda r: r[0]))
        _made = (tmp, out, agg.result())
    return _made


def run_snippet(name: str) -> dict:
    """Run the page's snippet ``name`` with its ``var/export`` pointed at
    the module's export; its global names afterwards."""
    _tmp, out, _want = made_export()
    code = snippet(name)
    assert code.count('"var/export') >= 1, f"snippet {name} does not read var/export"
    namespace = {"__name__": f"docs_export_{name}"}
    exec(compile(code.replace('"var/export', f'"{out}'), f"docs/export.md:{name}", "exec"),
         namespace)
    return namespace


class ExportDocsTests(TestCase):
    timeout = 300

    @classmethod
    def tearDownClass(cls):
        global _made
        if _made is not None:
            shutil.rmtree(_made[0], True)
            _made = None

    def test_column_table_names_every_column(self):
        """The page's column table is the export's columns, and only them
        (``stream`` is the directory partition)."""
        documented = set(re.findall(r"^\| `([a-z0-9_]+)` \|", doc_text(), re.M))
        self.assertEqual(documented, set(OUTPUT_COLUMNS) | {"stream"})

    def test_pyarrow(self):
        _tmp, _out, want = made_export()
        table = run_snippet("pyarrow")["table"]
        self.assertEqual(table.num_rows, sum(1 for g, _w, _b in want if g == "minute"))
        self.assertEqual(set(table.schema.names), set(OUTPUT_COLUMNS) | {"stream"})
        self.assertEqual(set(table.column("stream").to_pylist()), {"events"})

    def test_pandas(self):
        _tmp, _out, want = made_export()
        per_minute = run_snippet("pandas")["facts_per_minute"]
        self.assertEqual(int(per_minute.sum()),
                         sum(v["facts"] for (g, _w, _b), v in want.items() if g == "minute"))
        self.assertEqual(len(per_minute),
                         len({b for g, w, b in want if g == "minute" and w}))

    def test_spark(self):
        _tmp, _out, want = made_export()
        got = {(r["stream"], r["writer"]): (r["facts"], r["rows"], r["worst_gap_p99_ms"])
               for r in run_snippet("spark")["per_writer"].collect()}
        expected = {}
        for (g, w, _b), v in want.items():
            if g == "hour" and w:
                facts, rows, worst = expected.get(("events", w), (0, 0, None))
                gap = v["gap_ms_p99"]
                expected[("events", w)] = (facts + v["facts"], rows + v["rows"],
                                           gap if worst is None or (gap or 0) > worst else worst)
        self.assertEqual(got, expected)
