"""Shared plumbing of the benchmarks: recording figures beside baselines,
latency percentiles and their report lines, CPU time, profiling."""

import json
import os
import resource
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench-results.jsonl")


#: The cProfile.Profile of a standalone run with ``--profile``, else None.
PROFILE = None


class profiled:
    """Profile this process while the block runs, when profiling."""

    def __enter__(self):
        if PROFILE is not None:
            PROFILE.enable()

    def __exit__(self, *exc):
        if PROFILE is not None:
            PROFILE.disable()


def cpu_seconds():
    """User + system CPU time of this process, in seconds."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def percentile(sorted_values, p):
    """The ``p``-th percentile (nearest rank) of sorted values; NaN if none."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, int(round(p / 100.0 * (len(sorted_values) - 1)))))
    return sorted_values[k]


def delays_ms(results, commit_at, since):
    """Arrival - commit in ms for every (client, fact) committed after
    ``since``, sorted; and how many arrivals were missing.  ``results`` are
    the readers' JSON results (``tokens`` and ``at`` per connection)."""
    out = []
    expected = [t for t, at in commit_at.items() if at >= since]
    missing = 0
    for r in results:
        for toks, ats in zip(r["tokens"], r["at"]):
            got = 0
            for t, at in zip(toks, ats):
                c = commit_at.get(t)
                if c is not None and c >= since:
                    out.append((at - c) * 1000.0)
                    got += 1
            missing += len(expected) - got
    out.sort()
    return out, missing


def spread(delays):
    """``p50 .. ms, p99 .. ms, max .. ms`` of sorted delays in ms."""
    return (f"p50 {percentile(delays, 50):.2f} ms, p99 {percentile(delays, 99):.2f} ms, "
            f"max {delays[-1]:.1f} ms")


def write_path_report(write_s, commit_at, sent_at, since, what, handed_to):
    """The line after ours' latency: ``what`` (the write call) p50/p99, and
    commit -> handed to ``handed_to`` p50/p99, for facts committed after
    ``since``."""
    write_ms = sorted(w * 1000.0 for w in write_s)
    to_send = sorted((sent_at[t] - c) * 1000.0 for t, c in commit_at.items()
                     if c >= since and t in sent_at)
    return (f"           {what} itself p50 {percentile(write_ms, 50):.2f} ms, p99 "
            f"{percentile(write_ms, 99):.2f} ms; commit -> handed to {handed_to} p50 "
            f"{percentile(to_send, 50):.2f} ms, p99 {percentile(to_send, 99):.2f} ms")


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
    transport by the handler's fan-out (rows from memory or the table)."""
    stamps = {}
    send_updates = handler.fanout.send_updates
    send_written = handler.fanout.send_written

    def stamped(stream_name, writer, prev, updates, upto):
        send_updates(stream_name, writer, prev, updates, upto)
        now = time.time()
        for t, _ in updates:
            stamps[t] = now

    def stamped_written(stream_name, writer, prev, page):
        send_written(stream_name, writer, prev, page)
        now = time.time()
        for t in page.tokens:
            stamps[t] = now

    handler.fanout.send_updates = stamped
    handler.fanout.send_written = stamped_written
    return stamps


async def standalone_main(module, dbname: str, argv) -> None:
    """``python scripts/bench/<module>.py [--only A,B] [--profile]`` for a bench
    module with ``PHASES`` and ``async run(dsn, only)``: its own durable
    PostgreSQL, and a cProfile of the parts it runs :class:`profiled` if
    asked."""
    global PROFILE
    import argparse
    import cProfile
    import pstats

    from tests.servers import PostgresServer

    p = argparse.ArgumentParser()
    p.add_argument("--only", default=",".join(module.PHASES))
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    if args.profile:
        PROFILE = cProfile.Profile()
    pg = PostgresServer(fsync=True)
    try:
        await module.run(pg.create_database(dbname), args.only.split(","))
    finally:
        pg.stop()
    if PROFILE is not None:
        pstats.Stats(PROFILE).sort_stats("tottime").print_stats(30)
