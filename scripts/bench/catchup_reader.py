#!/usr/bin/env python3
"""The reader process of the catch-up benchmark (``catchup.py`` starts it).

A real replicator instance (``replicator.daemon.service.Instance``, the same one
``replicator run`` starts) built from the JSON config given on the command
line; it follows ``--stream``/``--writer`` from its upstream.  Inside it, a
``LoopingCall`` every ``--tick`` seconds measures how late the reactor
runs it (the worst lateness is the worst reactor stall) and watches the
reader's position; once it reaches ``--target`` the instance is stopped
(its JSON-lines consumer flushed) and one JSON line is printed::

    {"seconds": <first catch-up fetch -> position reached>, "stall_max_ms": ...,
     "stall_p99_ms": ..., "gc_max_ms": <longest garbage collection>, "ticks": n, "rss_start_kb":
     ..., "rss_peak_kb": ..., "pages": ...}

``--profile PATH`` writes a cProfile of the catch-up (``pstats`` format).
"""

import argparse
import gc
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from twisted.internet import defer, task  # noqa: E402


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def threads_cpu() -> dict:
    """CPU seconds (user + system) of each live thread of this process, by
    thread name (the reactor is ``MainThread``; pool threads are summed)."""
    import threading

    out: dict = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = "pool" if "PoolThread" in t.name else t.name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf(
            "SC_CLK_TCK")
    return out


def rss_now_kb() -> int:
    return _status_kb("VmRSS:")


def peak_rss_kb() -> int:
    """This process's peak resident memory (``VmHWM``, which is the new
    program's from ``exec`` on; ``ru_maxrss`` is not: it keeps the peak of
    the process that forked it, here the bench's)."""
    return _status_kb("VmHWM:")


async def main(reactor, args):
    from replicator.config import parse_instance
    from replicator.daemon.service import Instance
    from replicator.replication.core import reader as reader_module

    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
    started = []
    pages = [0]
    original = reader_module.Reader._catch_up

    async def timed_catch_up(self, since, until):
        if not started:
            started.append(time.monotonic())
            if profile is not None:
                profile.enable()
        return await original(self, since, until)

    reader_module.Reader._catch_up = timed_catch_up
    instance = Instance(parse_instance(json.loads(args.config)), reactor)
    source_of = {}

    def count_pages(reader):
        if reader in source_of:
            return
        inner = reader._source

        async def counted(*a):
            pages[0] += 1
            return await inner(*a)
        reader._source = counted
        source_of[reader] = inner

    rss_start = rss_now_kb()
    await instance.start()
    key = (args.stream, args.writer)
    reader = instance.handler._readers[key]
    count_pages(reader)
    done = defer.Deferred()
    state = {"last": time.monotonic(), "worst": 0.0, "ticks": 0, "ended": None,
             "late": [], "gc_worst": 0.0, "gc_at": None}

    def gc_timer(phase, info):  # the longest garbage collection, a cause of stalls
        if phase == "start":
            state["gc_at"] = time.monotonic()
        elif state["gc_at"] is not None and started and state["ended"] is None:
            state["gc_worst"] = max(state["gc_worst"], time.monotonic() - state["gc_at"])
    gc.callbacks.append(gc_timer)

    def tick():
        now = time.monotonic()
        late = now - state["last"] - args.tick
        state["last"] = now
        state["ticks"] += 1
        if started and state["ended"] is None:
            state["worst"] = max(state["worst"], late)
            state["late"].append(late)
            if (reader.position or 0) >= args.target:
                state["ended"] = now
                if profile is not None:
                    profile.disable()
                done.callback(None)

    loop = task.LoopingCall(tick)
    loop.clock = reactor
    loop.start(args.tick, now=False)
    timeout = reactor.callLater(args.timeout, lambda: done.called or done.errback(
        TimeoutError(f"position {reader.position} after {args.timeout}s")))
    cpu_start = threads_cpu()
    try:
        await done
        cpu = threads_cpu()
        cpu = {k: round(v - cpu_start.get(k, 0.0), 2) for k, v in cpu.items()}
    finally:
        if timeout.active():
            timeout.cancel()
        loop.stop()
        await instance.stop()
    if profile is not None:
        profile.dump_stats(args.profile)
    print(json.dumps({
        "seconds": state["ended"] - started[0], "stall_max_ms": state["worst"] * 1000,
        "stall_p99_ms": sorted(state["late"])[int(0.99 * (len(state["late"]) - 1))] * 1000
        if state["late"] else 0.0, "gc_max_ms": state["gc_worst"] * 1000,
        "ticks": state["ticks"], "rss_start_kb": rss_start,
        "rss_peak_kb": peak_rss_kb(),
        "pages": pages[0], "position": reader.position, "threads_cpu": cpu,
    }), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the instance config, as JSON")
    p.add_argument("--stream", required=True)
    p.add_argument("--writer", required=True)
    p.add_argument("--target", type=int, required=True)
    p.add_argument("--tick", type=float, default=0.005)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--profile", default=None)
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, p.parse_args())))
