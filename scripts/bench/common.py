"""Shared plumbing of the benchmarks: recording figures beside baselines."""

import json
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench-results.jsonl")


def record(name, value, unit, baseline, baseline_value, higher_is_better=True):
    """Print one figure with its ratio to the baseline; append it as JSON."""
    if baseline_value:
        ratio = value / baseline_value if higher_is_better else baseline_value / value
    else:
        ratio = None
    entry = {
        "name": name, "value": round(value, 3), "unit": unit,
        "baseline": baseline, "baseline_value": round(baseline_value, 3)
        if baseline_value is not None else None,
        "ratio": round(ratio, 3) if ratio is not None else None,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(line_of(entry), flush=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def line_of(entry: dict) -> str:
    """One figure as ``make bench`` prints it: value, baseline, ratio."""
    shown = f"{entry['ratio']:.2f}x" if entry["ratio"] is not None else "-"
    if entry["baseline"] is None:
        against = "(no baseline)"
    else:
        against = f"baseline {entry['baseline']} {entry['baseline_value']:,.1f}"
    return (f"{entry['name']:<40} {entry['value']:>14,.1f} {entry['unit']:<10} "
            f"{against}  ratio {shown}")


def rate(count, seconds):
    return count / seconds if seconds > 0 else float("inf")


def stamp_commits(gen) -> dict:
    """``{stream_id: time.time()}`` of each ID's completion (right after its
    commit), filled in as the generator completes IDs."""
    stamps = {}
    original = gen.complete_many

    def stamped(writer, ids):
        now = time.time()
        for i in ids:
            stamps[i] = now
        return original(writer, ids)

    gen.complete_many = stamped
    return stamps


def stamp_sends(handler) -> dict:
    """``{token: time.time()}`` of each fact's lines being handed to every
    transport by the handler's fan-out."""
    stamps = {}
    send_updates = handler.send_updates

    def stamped(stream_name, writer, prev, updates, upto):
        send_updates(stream_name, writer, prev, updates, upto)
        now = time.time()
        for t, _ in updates:
            stamps[t] = now

    handler.send_updates = stamped
    return stamps


async def standalone_main(module, dbname: str, argv) -> None:
    """``python scripts/bench/X.py [--only A,B] [--profile]`` for a bench
    module with ``PHASES``, ``PROFILE`` and ``async run(dsn, only)``: its
    own durable PostgreSQL, and a cProfile of the measured parts if asked."""
    import argparse
    import cProfile
    import pstats

    from tests.servers import PostgresServer

    p = argparse.ArgumentParser()
    p.add_argument("--only", default=",".join(module.PHASES))
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    if args.profile:
        module.PROFILE = cProfile.Profile()
    pg = PostgresServer(fsync=True)
    try:
        await module.run(pg.create_database(dbname), args.only.split(","))
    finally:
        pg.stop()
    if module.PROFILE is not None:
        pstats.Stats(module.PROFILE).sort_stats("tottime").print_stats(30)
