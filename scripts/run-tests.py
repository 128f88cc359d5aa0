#!/usr/bin/env python3
"""Run the whole suite with twisted.trial and end with one plain summary line:
``N passed, N failed`` (plus ``, N skipped``).  Exit status is trial's.

Arguments, if any, name test modules/packages (default: ``tests``);
``--fast`` runs the in-memory tests that ``tests/fast.txt`` lists, one
trial worker per core (they share no server, port or file).
"""
import os
import re
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
targets = sys.argv[1:] or ["tests"]
jobs: list[str] = []
if targets == ["--fast"]:
    jobs = ["-j", str(os.cpu_count() or 1)]
    with open(os.path.join(root, "tests", "fast.txt")) as listed:
        targets = [line.strip() for line in listed
                   if line.strip() and not line.startswith("#")]
env = dict(os.environ, PYTHONUNBUFFERED="1", SPARK_LOCAL_IP="127.0.0.1")
proc = subprocess.Popen(
    [sys.executable, "-m", "twisted.trial", "--temp-directory", "_trial_temp", *jobs, *targets],
    cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
)
last = ""
for line in proc.stdout:
    sys.stdout.write(line)
    sys.stdout.flush()
    if re.match(r"^(PASSED|FAILED) \(", line):
        last = line
rc = proc.wait()
counts = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", last))
passed = counts.get("successes", 0)
failed = (counts.get("failures", 0) + counts.get("errors", 0)
          + counts.get("unexpectedSuccesses", 0))
skipped = counts.get("skips", 0)
if not last:
    failed = max(failed, 1)
summary = f"{passed} passed, {failed} failed"
if skipped:
    summary += f", {skipped} skipped"
print(summary)
sys.exit(rc if rc else (1 if failed or not last else 0))
