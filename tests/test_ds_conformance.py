"""The Durable Streams server conformance suite
(``@durable-streams/server-conformance-tests``, pinned in the Makefile's
``node-deps``) against a real ``replicator run`` over a real socket, run
by vitest; the result per group is docs/read-api.md's table
("Conformance"), and this test holds the daemon to it: every case of a
group marked as passing passes, and no group passes fewer cases than the
table says.  Without Node.js or the packages the test is skipped, except
with ``CI=true``, where that is a failure."""

import json
import os
import subprocess
from collections import Counter

from twisted.trial.unittest import SynchronousTestCase

from tests.read_api import DS_STREAM, ReadApiDaemon
from tests.servers import unavailable
from tests.web_clients import node_binary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE_DIR = os.path.join(ROOT, ".node", "node_modules")
SUITE = os.path.join(NODE_DIR, "@durable-streams", "server-conformance-tests", "dist",
                     "index.js")
VITEST = os.path.join(NODE_DIR, "vitest", "vitest.mjs")
HERE = os.path.join(ROOT, "tests", "durable")


def require_suite() -> None:
    """Skip (fail with ``CI=true``) without node or the suite."""
    node_binary()
    for path in (SUITE, VITEST):
        if not os.path.exists(path):
            unavailable(f"{os.path.relpath(path, ROOT)} is missing (make node-deps)")


def run_suite(base_url: str, secret: str, report: str,
              long_poll_ms: int = 2000) -> dict[str, tuple[int, int]]:
    """Run the suite against ``base_url``: ``{group: (passed, cases)}``."""
    from pathlib import Path

    env = dict(os.environ, DS_BASE_URL=base_url, DS_SECRET=secret,
               DS_SUITE=Path(SUITE).as_uri(), DS_LONG_POLL_MS=str(long_poll_ms),
               DS_CACHE_DIR=report + ".vite")
    subprocess.run([node_binary(), VITEST, "run", "--root", HERE, "--config",
                    os.path.join(HERE, "vitest.config.mjs"), "--reporter=json",
                    f"--outputFile={report}"], env=env, cwd=HERE, capture_output=True,
                   timeout=900)
    with open(report) as f:
        doc = json.load(f)
    passed: Counter = Counter()
    cases: Counter = Counter()
    for result in doc["testResults"]:
        for case in result["assertionResults"]:
            group = case["ancestorTitles"][0] if case["ancestorTitles"] else case["title"]
            cases[group] += 1
            if case["status"] == "passed":
                passed[group] += 1
    return {g: (passed[g], cases[g]) for g in cases}


def documented_table() -> dict[str, tuple[int, int]]:
    """docs/read-api.md's conformance table: ``{group: (passed, cases)}``."""
    with open(os.path.join(ROOT, "docs", "read-api.md")) as f:
        text = f.read()
    start = text.index("<!-- conformance:")
    out = {}
    for line in text[start:].splitlines()[3:]:
        if not line.startswith("| ") or line.startswith("| **"):
            break
        group, passed, cases = [c.strip() for c in line.strip("|").split("|")]
        out[group] = (int(passed), int(cases))
    return out


class ConformanceTests(SynchronousTestCase):
    def test_suite_groups(self):
        require_suite()
        # Long-polls end after 2 s (the suite waits for two of them to).
        daemon = ReadApiDaemon(self, http={"ds_long_poll": 2}, streams=[DS_STREAM]).start()
        from tests.test_cli import SECRET

        report = os.path.abspath(self.mktemp() + ".json")
        groups = run_suite(daemon.base + "/_replicator/v1/ds/" + DS_STREAM["name"], SECRET,
                           report)
        documented = documented_table()
        self.assertEqual(sorted(groups), sorted(documented), "the suite's groups")
        for group, (ok, n) in sorted(groups.items()):
            want_ok, want_n = documented[group]
            self.assertEqual(n, want_n, group)
            self.assertGreaterEqual(ok, want_ok, f"{group}: fewer cases pass than documented")
