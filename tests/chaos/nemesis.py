"""The nemesis: a fault schedule drawn from a seed, and its execution.

A schedule is a list of :class:`Fault` (start offset, kind, target,
seconds), made up front by :func:`make_schedule` from ``(scenario,
transport, seed, duration)`` alone, so the same seed replays the same
faults at the same offsets.  Faults run in *lanes*: one after another in a
lane, lanes side by side (``all`` has two: processes, and network plus
databases).  Every fault heals itself when its time is up.

Scenarios:

* ``crash``  ``kill -9`` of any instance, restarted after 0.2-4 s (a worker
  sometimes after 8-15 s, to come back thousands of facts behind; Redis:
  ``redis-server`` killed and restarted too);
* ``pause``  SIGSTOP of any instance for 1-3 s past the ping timeout, SIGCONT;
* ``net``    on any replication link's proxy: cut, partition (1-5 s),
  stall (0.5 s to past the ping timeout), slow-cut (0.5-3 s of trickle, then cut);
  Redis also hold-release: a writer's link held past the ping timeout, a
  random prefix of its bytes let go once the new link is up;
* ``pg``     ``pg_ctl restart -m immediate`` (a crash), ``-m fast``, and
  PostgreSQL down for 1-4 s;
* ``all``    all of the above in two lanes;
* ``idle``   ``caches`` with three writers of which two never write
  (:mod:`.cluster`), under crash and net faults in one lane;
* ``none``   no faults (a baseline, and what the planted-defect test uses).
"""

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from .cluster import INSTANCES, PING_INTERVAL, PING_TIMEOUT

SCENARIOS = ("crash", "pause", "net", "pg", "all", "idle", "foreign")


@dataclass
class Fault:
    at: float  # seconds after the start of the chaos phase
    lane: int
    kind: str
    target: str | None
    seconds: float

    def describe(self) -> str:
        target = f" {self.target}" if self.target else ""
        return f"t={self.at:6.2f} lane {self.lane}: {self.kind}{target} {self.seconds:.2f}s"


def _links(transport: str) -> list[str]:
    return ["worker1", "worker2"] if transport == "tcp" else list(INSTANCES)


def _draw(rng: random.Random, pool: str, transport: str):
    if pool == "crash":
        targets = list(INSTANCES) + (["redis"] if transport == "redis" else [])
        target = rng.choice(targets)
        if target == "redis":
            return "redis_restart", target, rng.uniform(0.2, 4)
        if target != "master" and rng.random() < 0.25:
            # long enough to come back thousands of facts behind
            return "kill9", target, rng.uniform(8, 15)
        return "kill9", target, rng.uniform(0.2, 4)
    if pool == "pause":
        return "pause", rng.choice(INSTANCES), PING_TIMEOUT + rng.uniform(1, 3)
    if pool == "net":
        link = rng.choice(_links(transport))
        kinds = ("cut", "partition", "stall", "slow_cut")
        if transport == "redis":
            # Every instance writes: each link is a writer's.  Twice the odds
            # of the others: a random cut lands right after a fact's first
            # lines about one time in three.
            kinds += ("hold_release", "hold_release")
        kind = rng.choice(kinds)
        seconds = {"cut": 0.0, "partition": rng.uniform(1, 5),
                   "stall": rng.uniform(0.5, PING_TIMEOUT + 2),
                   "slow_cut": rng.uniform(0.5, 3),
                   "hold_release": PING_INTERVAL + PING_TIMEOUT + rng.uniform(0.5, 2)}[kind]
        return kind, link, seconds
    if pool == "pg":
        kind = rng.choice(("pg_restart_immediate", "pg_restart_immediate", "pg_restart_fast",
                           "pg_down"))
        return kind, None, rng.uniform(1, 4) if kind == "pg_down" else 0.0
    raise ValueError(pool)


def make_schedule(scenario: str, transport: str, seed: int, duration: float) -> list[Fault]:
    if scenario == "none":
        return []
    lanes = {"crash": [["crash"]], "pause": [["pause"]], "net": [["net"]], "pg": [["pg"]],
             "all": [["crash", "pause"], ["net", "pg"]], "idle": [["crash", "net"]],
             "foreign": [["crash", "pause"], ["net", "pg"]]}[scenario]
    faults = []
    for lane, pools in enumerate(lanes):
        rng = random.Random(f"{seed}/{scenario}/{transport}/{lane}")
        t = rng.uniform(0.5, 2.0)
        while t < duration:
            kind, target, seconds = _draw(rng, rng.choice(pools), transport)
            faults.append(Fault(round(t, 2), lane, kind, target, round(seconds, 2)))
            t += seconds + rng.uniform(0.5, 3.0) + (2.0 if kind.startswith("pg") else 0.0)
    return sorted(faults, key=lambda f: f.at)


class Nemesis:
    """Executes a schedule against a running cluster."""

    def __init__(self, schedule: list[Fault], instances: dict[str, object],
                 proxies: dict[str, object], pg, redis=None,
                 say: Callable[[str], None] = print):
        self.schedule = schedule
        self.instances = instances
        self.proxies = proxies
        self.pg = pg
        self.redis = redis
        self.say = say
        self.injected: dict[str, int] = {}
        self.t0 = 0.0

    async def run(self):
        self.t0 = time.monotonic()
        lanes: dict[int, list[Fault]] = {}
        for fault in self.schedule:
            lanes.setdefault(fault.lane, []).append(fault)
        await asyncio.gather(*(self._lane(faults) for faults in lanes.values()))

    async def _lane(self, faults: list[Fault]):
        for fault in faults:
            delay = self.t0 + fault.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self.say(f"  fault at t={time.monotonic() - self.t0:6.2f}: {fault.describe()}")
            try:
                await self._inject(fault)
            except Exception as e:  # a fault that could not be injected is reported
                self.say(f"  fault {fault.describe()} failed: {type(e).__name__}: {e}")
                continue
            self.injected[fault.kind] = self.injected.get(fault.kind, 0) + 1

    async def _inject(self, fault: Fault):
        kind, seconds = fault.kind, fault.seconds
        if kind == "kill9":
            instance = self.instances[fault.target]
            instance.kill9()
            await asyncio.sleep(seconds)
            instance.start()
        elif kind == "pause":
            instance = self.instances[fault.target]
            instance.pause()
            await asyncio.sleep(seconds)
            instance.resume()
        elif kind == "cut":
            self.proxies[fault.target].cut()
        elif kind == "partition":
            await self.proxies[fault.target].partition(seconds)
        elif kind == "stall":
            await self.proxies[fault.target].stall(seconds)
        elif kind == "slow_cut":
            await self.proxies[fault.target].slow_cut(seconds)
        elif kind == "hold_release":
            await self.proxies[fault.target].hold_release(seconds)
        elif kind == "pg_restart_immediate":
            await asyncio.to_thread(self.pg.restart, "immediate")
        elif kind == "pg_restart_fast":
            await asyncio.to_thread(self.pg.restart, "fast")
        elif kind == "pg_down":
            await asyncio.to_thread(self.pg.halt, "immediate")
            await asyncio.sleep(seconds)
            await asyncio.to_thread(self.pg.start)
        elif kind == "redis_restart":
            self.redis.kill()
            await asyncio.sleep(seconds)
            await asyncio.to_thread(self.redis.start)
        else:
            raise ValueError(kind)
