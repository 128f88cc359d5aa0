"""One chaos run end to end, and the result table.

:func:`run_once` starts everything (PostgreSQL, ``redis-server`` for the
Redis transport, proxies, master and two workers), lets the clients write
while the nemesis injects the seeded schedule, heals, waits for quiescence
(every consumer file holds what the tables hold, or a deadline), takes the
last observations, checks, and returns one result row (also appended to the
results file as one JSON line).  A run's directory (configs, logs, consumer
files, the clients' records) is kept when something was violated.
"""

import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import time
from collections import defaultdict

from replicator.config import parse_streams
from tests.servers import PostgresServer, RedisServer, free_port
from tests.support import create_stream_tables, without_time

from . import checker
from .clients import Writer, http_request, row_tag
from .cluster import (
    AUDIT_RECHECK,
    INSTANCES,
    SECRET,
    SERVER_NAME,
    STREAMS,
    TABLES,
    Instance,
    build_configs,
    make_base_dir,
    read_keys,
    streams_for,
    write_targets_for,
)
from .forger import LateCommitter, PositionForger, tripped
from .nemesis import Nemesis, make_schedule
from .observer import Observer
from .proxy import Proxy
from .sqlwriters import WRITERS, SqlWriter

CLIENTS_PER_TARGET = 2
QUIESCENCE_TIMEOUT = 90.0
#: After quiescence, every linear token and persisted position is at the
#: last fact within this long (a few ping intervals) or is ``frozen``.
FROZEN_TIMEOUT = 10.0
HEALTH_TIMEOUT = 30.0
#: Planted defects: a consumer put in (the checker must catch what it
#: does), or None for a fault from outside (:mod:`.forger`) the daemons'
#: delivery audit and checked POSITIONs must catch.
PLANTS = {"drop-rdata": {"type": "tests.chaos.planted:DroppingJsonlConsumer",
                         "drop_every": 100},
          "skip-fact": {"type": "tests.chaos.planted:SkippingReaderJsonlConsumer",
                        "skip_every": 50},
          "forge-position": None,
          "late-sql": None}
#: Seconds within which a plant must have tripped the audit (or a checked
#: POSITION): a few audit passes, plus the chaos configs' audit_recheck.
TRIP_BOUND = {"skip-fact": 10.0, "forge-position": 10.0, "late-sql": 10.0 + AUDIT_RECHECK}
LEVELS = ("ERROR ", "CRITICAL ")
EXCEPTION = re.compile(r"(?:^|\s)((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Transition)"
                       r"(?::\s.*|$))")


def logged_errors(text: str) -> list[str]:
    """One summary per ERROR/CRITICAL event of a daemon's log: its first
    words and the exception it ended with, if any (tracebacks follow on
    indented lines, or inline for Twisted's legacy "Unhandled Error")."""
    events: list[list[str]] = []
    for line in text.splitlines():
        line = without_time(line)
        if line.startswith(LEVELS):
            events.append([line, ""])
        elif line.startswith("    ") and events:
            m = EXCEPTION.search(line.strip())
            if m:
                events[-1][1] = m.group(1)
        else:
            continue
        m = EXCEPTION.findall(events[-1][0]) if not events[-1][1] else None
        if m:
            events[-1][1] = m[-1]
    out = [f"{head[:70]} -> {exc[:120]}" if exc else head[:120] for head, exc in events]
    return [re.sub(r"\d+", "N", line) for line in out]  # ports, IDs: one summary per kind


def read_table(dsn: str) -> dict[tuple, dict[int, list]]:
    """``{(stream, writer): {id: [row, ...]}}`` of every stream's table."""
    import psycopg2

    conn = psycopg2.connect(dsn, connect_timeout=5)
    try:
        cur = conn.cursor()
        facts: dict[tuple, dict[int, list]] = {}
        for stream in STREAMS:
            table, writer_column, cols = TABLES[stream["name"]]
            if writer_column:
                cur.execute(f"SELECT stream_id, {writer_column}, {cols} FROM {table} "
                            "ORDER BY stream_id, ctid")
                for stream_id, writer, *row in cur.fetchall():
                    facts.setdefault((stream["name"], writer), {}).setdefault(
                        stream_id, []).append(row)
            else:
                writer = stream["writers"][0]
                cur.execute(f"SELECT stream_id, {cols} FROM {table} ORDER BY stream_id, ctid")
                for stream_id, *row in cur.fetchall():
                    facts.setdefault((stream["name"], writer), {}).setdefault(
                        stream_id, []).append(row)
        return facts
    finally:
        conn.close()


def read_last_facts(dsn: str) -> dict[str, int]:
    """Each stream's largest fact ID (0 for an empty table)."""
    import psycopg2

    conn = psycopg2.connect(dsn, connect_timeout=5)
    try:
        cur = conn.cursor()
        last = {}
        for stream in STREAMS:
            table = TABLES[stream["name"]][0]
            cur.execute(f"SELECT coalesce(max(stream_id), 0) FROM {table}")
            last[stream["name"]] = cur.fetchone()[0]
        return last
    finally:
        conn.close()


def read_jsonl(path: str) -> list[dict]:
    """Every complete line of a consumer file (a partial last line is ignored)."""
    out = []
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.endswith(b"\n") and line.strip():
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


def caught_up(name: str, facts_path: str, streams: list[dict], table) -> str:
    """``"match"``: the consumer file holds exactly the table's facts;
    ``"passed"``: it differs, but its position of every key is at or past
    the table's last fact (what is missing is never coming); else ``""``."""
    lines = read_jsonl(facts_path)
    delivered = checker.file_facts(lines)
    positions: dict[tuple, int] = {}
    for entry in lines:
        key = (entry["stream"], entry["writer"])
        token = entry.get("token", entry.get("position", 0))
        positions[key] = max(positions.get(key, 0), token)
    state = "match"
    for key in read_keys(name, streams):
        want = {t: checker.canonical(rows) for t, rows in table.get(key, {}).items()}
        got = {t: checker.canonical(rows) for t, rows in delivered.get(key, [])}
        if want != got:
            if positions.get(key, 0) < max(want, default=0):
                return ""
            state = "passed"
    return state


def quiescence_states(dsn: str, readers: list[tuple[str, str, list[dict]]]) -> set[str]:
    """:func:`caught_up` of every ``(name, facts path, streams)`` against
    the tables as they are now.  Run in a process of its own
    (:func:`wait_quiescent`): at a million facts one round is tens of
    seconds of CPU, and on the run's event loop it would stop the proxies
    of every replication link meanwhile (links timed out for silence, and
    the readers fell behind, because of the check)."""
    table = read_table(dsn)
    return {caught_up(name, path, streams, table) for name, path, streams in readers}


async def wait_quiescent(instances: dict[str, Instance], dsn: str, timeout: float,
                         states=quiescence_states) -> bool:
    """Until every reader's file holds the tables' facts, or every reader
    is past the end for five rounds in a row (the rest is not coming), or
    ``timeout``; whether it got there.  Each round runs ``states`` in a
    process of its own, so the run's event loop (the proxies, the
    observer) goes on meanwhile."""
    import concurrent.futures
    import multiprocessing

    readers = [(i.name, i.facts_path, i.config["streams"]) for i in instances.values()]
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    passed = 0
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        while time.monotonic() - started < timeout:
            try:
                found = await loop.run_in_executor(pool, states, dsn, readers)
            except Exception:
                found = {""}
            if found == {"match"}:
                return True
            passed = passed + 1 if "" not in found else 0
            if passed >= 5:
                return True
            await asyncio.sleep(1.0)
    return False


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        return ""


async def wait_answering(instance: Instance, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if instance.running() and not instance.paused:
            try:
                status, _ = await http_request(instance.http_port, "GET",
                                               "/_replicator/v1/positions", secret=SECRET,
                                               timeout=2)
                if status == 200:
                    return True
            except (TimeoutError, OSError, ValueError, IndexError):
                pass
        await asyncio.sleep(0.1)
    return False


def read_positions(dsn: str) -> dict[tuple, int]:
    """``{(stream, writer): position}`` of ``stream_positions``."""
    import psycopg2

    conn = psycopg2.connect(dsn, connect_timeout=5)
    try:
        cur = conn.cursor()
        cur.execute("SELECT stream_name, instance_name, stream_id FROM stream_positions")
        return {(stream, writer): int(p) for stream, writer, p in cur.fetchall()}
    finally:
        conn.close()


async def wait_unfrozen(instances: dict[str, Instance], dsn: str, streams: list[dict],
                        timeout: float = FROZEN_TIMEOUT) -> checker.Violations:
    """Poll until every instance's linear token and every writer's
    persisted position of each stream reach the stream's last fact (with no
    write meanwhile: the clients have stopped), or ``timeout``; the
    ``frozen`` violations of the last poll."""
    writers = {s["name"]: s["writers"] for s in streams}
    deadline = time.monotonic() + timeout
    while True:
        v = checker.Violations()
        try:
            last = await asyncio.to_thread(read_last_facts, dsn)
            persisted = await asyncio.to_thread(read_positions, dsn)
        except Exception as e:
            last, persisted = None, {}
            v.add("frozen", f"tables not readable: {type(e).__name__}: {e}")
        if last is not None:
            linear = {}
            for instance in instances.values():
                for stream in writers:
                    linear[(instance.name, stream)] = None
                try:
                    status, body = await http_request(
                        instance.http_port, "GET", "/_replicator/v1/positions",
                        secret=SECRET, timeout=2)
                    if status == 200:
                        for stream, entry in json.loads(body)["streams"].items():
                            if stream in writers:
                                linear[(instance.name, stream)] = entry.get("linear")
                except (TimeoutError, OSError, ValueError, IndexError, KeyError):
                    pass
            checker.check_frozen(v, last, linear, persisted, writers)
        if not v.total() or time.monotonic() > deadline:
            return v
        await asyncio.sleep(0.2)


async def supervise(instances: dict[str, Instance], say, stop: asyncio.Event):
    """Restart an instance that exited by itself (as systemd would), after
    recording the exit and the last lines of its log."""
    while not stop.is_set():
        for instance in instances.values():
            if not instance.expected_down and instance.proc is not None \
                    and instance.proc.poll() is not None:
                instance.note_exit()
                tail = instance.log_text().strip().splitlines()[-3:]
                say(f"  {instance.name} exited by itself ({instance.proc.returncode}): "
                    f"{' | '.join(tail)}")
                await asyncio.sleep(1.0)
                if not instance.held_down:  # else the fault restarts it
                    instance.start()
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def run_once(scenario: str, transport: str, seed: int, duration: float = 30.0,
                   plant: str | None = None, results_path: str | None = None,
                   keep: bool = False, say=print,
                   quiescence_timeout: float = QUIESCENCE_TIMEOUT,
                   health_timeout: float = HEALTH_TIMEOUT) -> dict:
    started = time.monotonic()
    schedule = make_schedule(scenario, transport, seed, duration)
    say(f"== chaos {scenario}/{transport} seed={seed} duration={duration}s"
        + (f" plant={plant}" if plant else "")
        + f" (replay: make chaos SCENARIO={scenario} TRANSPORT={transport} SEED={seed}"
        + (f" DURATION={duration:g}" if duration != 30 else "") + ")")
    for fault in schedule:
        say("  planned " + fault.describe())
    base = make_base_dir()
    pg = redis = None
    proxies: dict[str, Proxy] = {}
    instances: dict[str, Instance] = {}
    writes: list[dict] = []
    result: dict = {}
    stop_supervisor = asyncio.Event()
    try:
        # fsync=off is harmless here (the operating system never crashes during
        # a run); synchronous_commit stays on, or an immediate restart would lose
        # acknowledged commits and the run would blame the daemon for it.
        pg = await asyncio.to_thread(PostgresServer, synchronous_commit=True)
        dsn = await asyncio.to_thread(pg.create_database, "chaos")
        # Every stream's table, as its writers create them: an instance that
        # only reads a stream creates nothing, and any may start first.
        streams = streams_for(scenario)
        await asyncio.to_thread(create_stream_tables, dsn, parse_streams(streams))
        rng = random.Random(f"{seed}/proxy")
        if transport == "tcp":
            master_port = free_port()
            for name in ("worker1", "worker2"):
                proxies[name] = await Proxy(name, master_port, random.Random(rng.random())).start()
        else:
            master_port = None
            redis = await asyncio.to_thread(RedisServer)
            for name in INSTANCES:
                proxies[name] = await Proxy(name, redis.port, random.Random(rng.random())).start()
        configs = build_configs(transport, dsn, master_port,
                                {n: p.port for n, p in proxies.items()},
                                PLANTS[plant] if plant else None, streams)
        for name in INSTANCES:
            instances[name] = Instance(name, base, configs[name])
        for name in INSTANCES:  # the master creates the tables first
            instances[name].start()
            if not await wait_answering(instances[name]):
                raise RuntimeError(f"{name} did not start: {instances[name].log_text()[-2000:]}")

        observer = Observer(dsn, instances)
        observer_task = asyncio.ensure_future(observer.run())
        supervisor_task = asyncio.ensure_future(supervise(instances, say, stop_supervisor))
        writers = []
        client_rng = random.Random(f"{seed}/clients")
        for instance_name, stream in write_targets_for(scenario):
            for i in range(CLIENTS_PER_TARGET):
                tag = f"{instance_name}-{stream}-{i}"
                writers.append(Writer(tag, instances[instance_name], stream,
                                      random.Random(client_rng.random()), writes))
        if scenario == "foreign":
            table = TABLES["caches"][0]
            for i in range(WRITERS):
                writers.append(SqlWriter(f"sql-{i}", dsn, table,
                                         random.Random(client_rng.random()), writes))
        writer_tasks = [asyncio.ensure_future(w.run()) for w in writers]
        await asyncio.sleep(1.0)
        planter = plant_task = None
        plant_started = time.monotonic()
        if plant == "forge-position":
            if redis is None:
                raise ValueError("--plant forge-position needs the Redis transport")
            planter = PositionForger(redis.port, SERVER_NAME, ["account_data", "caches"])
        elif plant == "late-sql":
            config = {s.name: s for s in parse_streams(streams)}["account_data"]
            planter = LateCommitter(dsn, config.table, config.sequence,
                                    list(config.column_names))
        if planter is not None:
            plant_task = asyncio.ensure_future(planter.run())
        trips: dict = {}
        watch = asyncio.ensure_future(watch_trips(instances, trips)) if plant else None

        nemesis = Nemesis(schedule, instances, proxies, pg, redis, say)
        await nemesis.run()
        remaining = duration - (time.monotonic() - nemesis.t0)
        if remaining > 0:
            await asyncio.sleep(remaining)

        if planter is not None:
            planter.stopping = True
            await plant_task
        # Heal: every fault heals itself; make sure, then let writes settle.
        for proxy in proxies.values():
            proxy.heal()
        for instance in instances.values():
            instance.resume()
        say(f"  healed after {time.monotonic() - nemesis.t0:.1f}s; stopping the clients")
        for w in writers:
            w.stopping = True
        await asyncio.gather(*writer_tasks)

        quiet_started = time.monotonic()
        quiescent = await wait_quiescent(instances, dsn, quiescence_timeout)
        quiescence_s = time.monotonic() - quiet_started
        say(f"  quiescent={quiescent} after {quiescence_s:.1f}s")
        frozen = await wait_unfrozen(instances, dsn, streams)
        observer.stopping = True
        await observer_task
        await observer.final()

        health = {}
        deadline = time.monotonic() + health_timeout
        for instance in instances.values():
            status, reason = None, "no answer"
            while True:
                try:
                    status, body = await http_request(instance.http_port, "GET", "/health",
                                                      timeout=2)
                    reason = json.loads(body).get("reason", "")
                except (TimeoutError, OSError, ValueError, IndexError) as e:
                    status, reason = None, f"{type(e).__name__}: {e}"
                if status == 200 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            health[instance.name] = (status, reason)

        audit = await tripped({n: i.http_port for n, i in instances.items()})
        if watch is not None:
            watch.cancel()
        plant_at = getattr(planter, "first_at", None) or plant_started
        trip_s = (round(trips["at"] - plant_at, 1) if "at" in trips else None)
        stop_supervisor.set()
        await supervisor_task
        exit_codes = {name: i.terminate() for name, i in instances.items()}
        observer.close()

        table = await asyncio.to_thread(read_table, dsn)
        final_index = len(observer.snapshots)
        for key, facts in table.items():
            seen = observer.first_seen.setdefault(key, {})
            for stream_id in facts:
                seen.setdefault(stream_id, final_index)

        v = checker.Violations()
        for instance in instances.values():
            delivered = checker.file_facts(read_jsonl(instance.facts_path))
            checker.check_deliveries(v, instance.name, read_keys(instance.name, streams),
                                     delivered, table)
        checker.check_writes(v, writes, table, row_tag)
        checker.check_claims(v, observer.first_seen, observer.claims, observer.snapshots,
                             final_index)
        v.counts.update(frozen.counts)
        for kind, examples in frozen.examples.items():
            v.examples[kind].extend(examples)
        checker.check_processes(v, {n: i.unexpected_exits for n, i in instances.items()},
                                health, exit_codes)
        if plant is None:
            checker.check_audit(v, audit)

        log_errors = defaultdict(int)
        for instance in instances.values():
            for event in logged_errors(instance.log_text()):
                log_errors[event] += 1
        outcomes = defaultdict(int)
        sql_outcomes = defaultdict(int)  # the plain-SQL writers' (scenario foreign)
        for w in writes:
            outcomes[w["outcome"]] += 1
            if w["client"].startswith("sql-"):
                sql_outcomes[w["outcome"]] += 1
        result = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": git_commit(), "scenario": scenario, "transport": transport,
            "seed": seed, "duration": duration, "plant": plant,
            "faults": sum(nemesis.injected.values()), "faults_by_kind": nemesis.injected,
            "writes": len(writes), "outcomes": dict(outcomes),
            "sql_outcomes": dict(sql_outcomes),
            "facts": sum(len(f) for f in table.values()),
            "rows": sum(len(r) for f in table.values() for r in f.values()),
            "claims_checked": sum(len(c) for c in observer.claims.values()),
            "snapshots": len(observer.snapshots),
            "quiescent": quiescent, "quiescence_s": round(quiescence_s, 1),
            "violations": v.as_dict(), "examples": dict(v.examples),
            "audit": audit, "trip_s": trip_s,
            "planted": (len(planter.committed) if isinstance(planter, LateCommitter)
                        else getattr(planter, "forged", None)),
            "exit_codes": exit_codes,
            "startup_db_exits": {n: i.startup_db_exits for n, i in instances.items()
                                 if i.startup_db_exits},
            "log_errors": dict(sorted(log_errors.items(), key=lambda kv: -kv[1])[:10]),
            "elapsed_s": round(time.monotonic() - started, 1),
        }
        if sql_outcomes:
            say(f"  plain-SQL transactions {dict(sql_outcomes)}")
        say(f"  {result['writes']} writes {dict(outcomes)}, {result['facts']} facts, "
            f"{result['faults']} faults, {result['claims_checked']} claims, "
            f"violations {v.total()}: "
            + ", ".join(f"{k}={n}" for k, n in v.as_dict().items() if n))
        for line, n in result["log_errors"].items():
            say(f"    logged {n}x: {line}")
        for kind, examples in v.examples.items():
            for example in examples:
                say(f"    {kind}: {example}")
        if v.total() or keep:
            result["dir"] = base
            with open(os.path.join(base, "writes.jsonl"), "w") as f:
                for w in writes:
                    f.write(json.dumps(w) + "\n")
            say(f"  kept {base}")
        if results_path:
            with open(results_path, "a") as f:
                f.write(json.dumps(result) + "\n")
        return result
    finally:
        stop_supervisor.set()
        for instance in instances.values():
            if instance.running():
                instance.expected_down = True
                instance.resume()
                instance.proc.kill()
                instance.proc.wait()
        for proxy in proxies.values():
            await proxy.close()
        if redis is not None:
            await asyncio.to_thread(redis.stop)
        if pg is not None:
            await asyncio.to_thread(pg.stop)
        if not result.get("dir") and not keep:
            shutil.rmtree(base, ignore_errors=True)


async def watch_trips(instances: dict[str, Instance], trips: dict) -> None:
    """Poll every instance's metrics until the audit or a checked POSITION
    says something: ``trips["at"]`` is when it first did."""
    while "at" not in trips:
        counts = await tripped({n: i.http_port for n, i in instances.items()})
        if any(c["mismatch"] or c["contradicted"] for c in counts.values()):
            trips["at"] = time.monotonic()
            return
        await asyncio.sleep(0.5)


def summary_table(results: list[dict]) -> str:
    """One line per (scenario, transport): runs, faults, writes, violations by kind."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        groups[(r["scenario"], r["transport"], r.get("plant"))].append(r)
    kinds = checker.KINDS
    head = ["scenario", "transport", "runs", "seeds", "faults", "writes", "acked"] + list(kinds)
    rows = [head]
    for (scenario, transport, plant), rs in groups.items():
        name = scenario + (f"+{plant}" if plant else "")
        rows.append([name, transport, str(len(rs)), ",".join(str(r["seed"]) for r in rs),
                     str(sum(r["faults"] for r in rs)), str(sum(r["writes"] for r in rs)),
                     str(sum(r["outcomes"].get("acked", 0) for r in rs))]
                    + [str(sum(r["violations"][k] for r in rs)) for k in kinds])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
