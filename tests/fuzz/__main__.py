"""``python -m tests.fuzz`` (``make fuzz``): every phase at full size.

Prints the per-phase table (inputs tried per family, figures, findings with
their reproducers), appends the same to ``fuzz-results.jsonl``, and exits 1
if anything was found.  ``--phases 1,5`` runs some phases; ``--scale 0.1``
shrinks every count; ``--seed`` changes the inputs (same seed, same inputs).
PostgreSQL (phase 3, and phase 2 with ``--postgres``) is started in a
temporary directory like the tests do.
"""

import argparse
import os
import tempfile
import time

from twisted.internet import defer, task, threads
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)

from . import configs, httpfuzz, lines, peers, sockets
from .known import stale, unknown
from .results import Results

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Inputs per phase at scale 1.
FULL = {"lines": 20_000, "sockets": 4_000, "http": 2_000, "configs": 300}
CONFIG_THREADS = 3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--phases", default="1,2,3,4,5")
    parser.add_argument("--output", default=os.path.join(ROOT, "fuzz-results.jsonl"))
    args = parser.parse_args(argv)
    phases = set(args.phases.split(","))
    n = {k: max(1, int(v * args.scale)) for k, v in FULL.items()}
    results = Results(args.seed)
    # Not under _trial_temp: trial refuses to reuse a directory it did not make.
    log_path = os.path.join(tempfile.mkdtemp(prefix="fuzz-log-"), "fuzz.log")
    log_file = open(log_path, "a")
    print(f"in-process log events: {log_path}", flush=True)

    def pg():
        from tests.servers import PostgresServer

        return PostgresServer.shared()

    def blocking_phases():
        if "2" in phases:
            # SQLite (every stream written by the master alone), then PostgreSQL
            # (caches also written by worker1: fuzzers may claim that name).
            _print(results.add(sockets.run_phase(args.seed, n["sockets"])))
            _print(results.add(sockets.run_phase(args.seed, n["sockets"] // 4,
                                                 postgres_dsn=pg().create_database())))
        if "3" in phases:
            server = pg()
            _print(results.add(peers.run_phase(args.seed, server.create_database,
                                               peers.ATTACKS + peers.EXTRA)))
        if "4" in phases:
            _print(results.add(httpfuzz.run_phase(args.seed, n["http"], slow=True)))
        if "5" in phases:
            _print(results.add(configs.run_phase(args.seed, n["configs"], threads=CONFIG_THREADS)))

    async def run(reactor):
        # The in-process phase logs through the global publisher: keep it in
        # a file so that the table stays readable.
        predicate = LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)
        globalLogBeginner.beginLoggingTo(
            [FilteringLogObserver(textFileLogObserver(log_file), [predicate])],
            redirectStandardIO=False)
        if "1" in phases:
            _print(results.add(await lines.run_phase(args.seed, n["lines"] // 2)))
        await threads.deferToThread(blocking_phases)
        print()
        print(results.table())
        results.write_jsonl(args.output)
        found = sum(len(p.findings) for p in results.phases)
        new = [f for p in results.phases for f in unknown(p.findings.values())]
        print(f"\nknown open defects (tests/fuzz/known.py): {found - len(new)}; "
              f"new findings: {len(new)}")
        for f in new:
            print(f"  NEW [{f.phase}] {f.kind}: {f.signature}")
        for phase, kind, pattern, why in stale(results.phases):
            print(f"  not seen: [{phase}] {kind} ({why[:70]}): fixed? then remove it from "
                  "tests/fuzz/known.py")
        print(f"\n{sum(p.total_inputs for p in results.phases)} inputs, {found} findings "
              f"in {time.monotonic() - started:.0f}s (seed {args.seed}); "
              f"appended to {os.path.relpath(args.output)}")
        raise SystemExit(1 if found else 0)

    started = time.monotonic()
    task.react(lambda reactor: defer.ensureDeferred(run(reactor)), [])


def _print(result) -> None:
    print(f"phase {result.phase}: {result.total_inputs} inputs, {len(result.findings)} "
          f"findings, {result.seconds:.0f}s", flush=True)


if __name__ == "__main__":
    main()
