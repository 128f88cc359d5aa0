"""Types and lint, failing the suite like any test: mypy (``mypy.ini``:
strict on every package but the observers and the CLI) and ruff
(``ruff.toml``)."""

import os
import subprocess
import sys

from twisted.trial import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


class LintTests(unittest.TestCase):
    def test_mypy(self) -> None:
        """The daemon type-checks (the config in mypy.ini names what is strict)."""
        done = _run("mypy", "--cache-dir", os.path.join(ROOT, ".mypy_cache"))
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

    def test_ruff(self) -> None:
        """The code, tests and scripts pass ruff's rules (ruff.toml)."""
        done = _run("ruff", "check", "--no-cache", "replicator", "tests", "scripts")
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
