"""``python -m tests.chaos``: run scenarios, print the result table.

Without ``--seed`` every (scenario, transport) runs ``--seeds`` fresh random
seeds (printed: ``--seed N`` replays a run's schedule).  Exit status 1 if
any run found a violation.
"""

import argparse
import asyncio
import os
import random
import sys

from .nemesis import SCENARIOS
from .run import PLANTS, run_once, summary_table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--scenario", default=",".join(SCENARIOS),
                        help=f"comma-separated, of {', '.join(SCENARIOS)}, none "
                             "(default: all of them)")
    parser.add_argument("--transport", default="tcp,redis", help="tcp, redis or both")
    parser.add_argument("--seed", type=int, action="append",
                        help="replay this seed (repeatable); default: fresh seeds")
    parser.add_argument("--seeds", type=int, default=3, help="fresh seeds per scenario (3)")
    parser.add_argument("--duration", type=float, default=30.0,
                        help="seconds of faults per run (30)")
    parser.add_argument("--plant", choices=sorted(PLANTS),
                        help="plant a defect the checker must catch")
    parser.add_argument("--results", default="chaos-results.jsonl",
                        help="append one JSON line per run here ('' for none)")
    parser.add_argument("--keep", action="store_true", help="keep every run's directory")
    parser.add_argument("--daemon-path", metavar="DIR",
                        help="run the daemons' replicator package from DIR (e.g. an older "
                             "commit from git archive) to check the suite catches its defects")
    parser.add_argument("--summarize", metavar="FILE",
                        help="print the result table of a results file and exit")
    args = parser.parse_args(argv)
    if args.summarize:
        import json

        with open(args.summarize) as f:
            print(summary_table([json.loads(line) for line in f if line.strip()]))
        return 0
    if args.daemon_path:
        from .cluster import Instance

        Instance.daemon_path = os.path.abspath(args.daemon_path)

    scenarios = [s for s in args.scenario.split(",") if s]
    transports = [t for t in args.transport.split(",") if t]
    for s in scenarios:
        if s not in SCENARIOS + ("none",):
            parser.error(f"unknown scenario {s!r}")
    for t in transports:
        if t not in ("tcp", "redis"):
            parser.error(f"unknown transport {t!r}")

    def say(line):
        print(line, flush=True)

    results = []
    for scenario in scenarios:
        for transport in transports:
            seeds = args.seed or [random.SystemRandom().randrange(1, 1_000_000)
                                  for _ in range(args.seeds)]
            for seed in seeds:
                results.append(asyncio.run(run_once(
                    scenario, transport, seed, args.duration, args.plant,
                    os.path.abspath(args.results) if args.results else None, args.keep, say)))
    say("")
    say(summary_table(results))
    bad = [r for r in results if sum(r["violations"].values())]
    for r in bad:
        say(f"violations in {r['scenario']}/{r['transport']} seed={r['seed']}: "
            + ", ".join(f"{k}={n}" for k, n in r["violations"].items() if n)
            + f" (kept {r.get('dir')})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
