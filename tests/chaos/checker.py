"""The invariants of a run, checked over plain data once it is quiescent.

Per instance and (stream, writer) it reads (its JSON-lines file):

* ``lost``        a fact in the table that never reached the consumer;
* ``duplicated``  a token delivered twice;
* ``reordered``   a token delivered after a larger one;
* ``split``       a delivered fact whose rows are not exactly the table's
                  rows of that ID (a fact is the multiset of its rows);
* ``phantom``     a delivered fact with rows the table does not have at all.

Per write request (the clients' records):

* ``history``     an acked write not in the table whole with its acked ID and
                  writer; a failed or timed-out write partly there, or split
                  over IDs; one ID holding rows of two requests; rows no
                  request sent.

Per claim (see :mod:`tests.chaos.observer`):

* ``claim``       a position claimed before every fact at or below it had
                  committed.

Once quiescent, per stream:

* ``frozen``      a linear token (an instance's positions API) or a writer's
                  row in ``stream_positions`` still below the stream's last
                  fact a few seconds after quiescence (e.g. idle writers
                  holding each other, and the linear token, in place).

And of the processes: ``exit`` (a daemon died without being killed, or
did not exit 0 on SIGTERM at the end) and
``health`` (``/health`` not 200 on a healed, quiescent cluster).

Every function here is pure: data in, ``Violations`` out.
"""

import json
from collections import Counter, defaultdict
from collections.abc import Iterable

Key = tuple[str, str]
KINDS = ("lost", "duplicated", "reordered", "split", "phantom", "history", "claim", "frozen",
         "exit", "health", "audit")
EXAMPLES_PER_KIND = 5


def canonical(rows: Iterable[list]) -> list[str]:
    return sorted(json.dumps(r, sort_keys=True, separators=(",", ":")) for r in rows)


class Violations:
    """Counts per kind and a few examples each (with their evidence)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)

    def add(self, kind: str, detail: str):
        assert kind in KINDS, kind
        self.counts[kind] += 1
        if len(self.examples[kind]) < EXAMPLES_PER_KIND:
            self.examples[kind].append(detail)

    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict:
        return {kind: self.counts.get(kind, 0) for kind in KINDS}


def file_facts(lines: Iterable[dict]) -> dict[Key, list[tuple[int, list]]]:
    """Fact lines of a JSON-lines file per key, in file order."""
    facts: dict[Key, list[tuple[int, list]]] = defaultdict(list)
    for entry in lines:
        if "rows" in entry:
            facts[(entry["stream"], entry["writer"])].append((entry["token"], entry["rows"]))
    return facts


def check_deliveries(v: Violations, instance: str, keys: Iterable[Key],
                     delivered: dict[Key, list[tuple[int, list]]],
                     table: dict[Key, dict[int, list]]):
    keys = list(keys)
    for key in delivered:
        if key not in keys:
            v.add("phantom", f"{instance}: facts of {key[0]}/{key[1]}, a writer it hosts "
                             f"itself: {delivered[key][:3]}")
    for key in keys:
        want = table.get(key, {})
        got = delivered.get(key, [])
        seen = set()
        top = 0
        for token, rows in got:
            where = f"{instance}: {key[0]}/{key[1]} token {token}"
            if token in seen:
                v.add("duplicated", f"{where} delivered again")
                continue
            seen.add(token)
            if token < top:
                v.add("reordered", f"{where} delivered after {top}")
            top = max(top, token)
            if token not in want:
                if rows:
                    v.add("phantom", f"{where}: {rows[:3]} not in the table")
            elif canonical(rows) != canonical(want[token]):
                v.add("split", f"{where}: delivered {len(rows)} rows {rows[:4]}, "
                               f"table has {len(want[token])} rows {want[token][:4]}")
        for token in sorted(set(want) - seen):
            v.add("lost", f"{instance}: {key[0]}/{key[1]} token {token} "
                          f"({len(want[token])} rows) never delivered")


def check_writes(v: Violations, writes: list[dict], table: dict[Key, dict[int, list]],
                 tag_of):
    """``tag_of(row)``: the request tag of a table row (``client.n``)."""
    by_tag: dict[str, list[tuple[Key, int, list]]] = defaultdict(list)
    tags_at: dict[tuple[Key, int], set] = defaultdict(set)
    for key, facts in table.items():
        for stream_id, rows in facts.items():
            for row in rows:
                tag = tag_of(row)
                by_tag[tag].append((key, stream_id, row))
                tags_at[(key[0], stream_id)].add(tag)
    for (stream, stream_id), tags in tags_at.items():
        if len(tags) > 1:
            v.add("history", f"{stream} ID {stream_id} holds rows of {len(tags)} requests: "
                             f"{sorted(tags)[:4]}")
    sent = set()
    for w in writes:
        tag = f"{w['client']}.{w['n']}"
        sent.add(tag)
        key = (w["stream"], w["instance"])
        found = by_tag.get(tag, [])
        what = (f"{w['outcome']} write {tag} ({len(w['rows'])} rows) to {w['instance']} "
                f"{w['stream']}" + (f" acked ID {w['stream_id']}" if "stream_id" in w else ""))
        ids = {stream_id for _, stream_id, _ in found}
        whole = (canonical(r for _, _, r in found) == canonical(w["rows"]) and len(ids) <= 1
                 and all(k == key for k, _, _ in found))
        if w["outcome"] == "acked":
            if not whole or (found and ids != {w["stream_id"]}):
                v.add("history", f"{what}: table has {len(found)} rows at IDs {sorted(ids)}")
            elif not w["rows"] and w["stream_id"] in table.get(key, {}):
                v.add("history", f"{what}: the acked ID holds rows "
                                 f"{table[key][w['stream_id']][:3]}")
        elif found and not whole:
            v.add("history", f"{what}: partly in the table ({len(found)} rows at IDs "
                             f"{sorted(ids)})")
    for tag, found in by_tag.items():
        if tag not in sent:
            v.add("history", f"rows of request {tag} that was never sent: {found[:2]}")


def check_claims(v: Violations, first_seen: dict[Key, dict[int, int]],
                 claims: dict[Key, list[tuple[int, int, str]]], snapshot_times: list[float],
                 final_index: int):
    """A fact first seen in snapshot ``f`` (``final_index`` if only at the
    end) must not be at or below any claim attributed to a snapshot ``< f``."""
    for key, facts in first_seen.items():
        made = sorted(claims.get(key, []))
        if not made:
            continue
        # prefix maximum of claimed positions by snapshot index
        best: list[tuple[int, int, str]] = []  # (snapshot index, max position, evidence)
        for k, position, evidence in made:
            if best and best[-1][1] >= position:
                best.append((k, best[-1][1], best[-1][2]))
            else:
                best.append((k, position, evidence))
        indexes = [b[0] for b in best]
        import bisect

        for stream_id, f in facts.items():
            i = bisect.bisect_left(indexes, f) - 1  # last claim with index < f
            if i >= 0 and best[i][1] >= stream_id:
                seen_at = snapshot_times[f] if f < len(snapshot_times) else "the end"
                v.add("claim", f"{key[0]}/{key[1]} fact {stream_id} first committed by "
                               f"snapshot {f} (t={seen_at}), but {best[i][2]} "
                               f"(attributed to snapshot {best[i][0]})")


def check_frozen(v: Violations, last_fact: dict[str, int],
                 linear: dict[tuple[str, str], int | None],
                 persisted: dict[Key, int], writers: dict[str, list[str]]):
    """Every linear token (``(instance, stream)`` -> what its positions API
    said, None without an answer) and every configured writer's persisted
    position (``(stream, writer)`` -> ``stream_positions``, absent: none)
    at or past its stream's last fact (``last_fact``: the largest ID in its
    table)."""
    for (instance, stream), token in sorted(linear.items()):
        last = last_fact.get(stream, 0)
        if token is None or token < last:
            v.add("frozen", f"{instance}: {stream} linear token {token}, last fact {last}")
    for stream, names in sorted(writers.items()):
        last = last_fact.get(stream, 0)
        for writer in names:
            position = persisted.get((stream, writer))
            if position is None or position < last:
                v.add("frozen", f"stream_positions {stream}/{writer}={position}, "
                                f"last fact {last}")


def check_processes(v: Violations, exits: dict[str, list[int]], health: dict[str, tuple],
                    stop_codes: dict[str, int] = None):
    for name, codes in exits.items():
        for code in codes:
            v.add("exit", f"{name} exited by itself with status {code}")
    for name, code in (stop_codes or {}).items():
        if code not in (0, None):
            v.add("exit", f"{name} did not stop cleanly on SIGTERM (status {code})")
    for name, (status, reason) in health.items():
        if status != 200:
            v.add("health", f"{name} /health {status} on a healed, quiescent cluster: {reason}")


def check_audit(v: Violations, audit: dict[str, dict[str, float]]):
    """A run with nothing planted: the delivery audit finds no difference
    and the table contradicts no POSITION (either would be a false alarm,
    or a defect of ours the audit caught)."""
    for name, counts in audit.items():
        if counts.get("mismatch"):
            v.add("audit", f"{name}: the delivery audit stopped {counts['mismatch']:g} "
                           f"reader(s) on a run with nothing planted")
        if counts.get("contradicted"):
            v.add("audit", f"{name}: {counts['contradicted']:g} POSITION(s) contradicted by "
                           f"the table on a run with nothing planted")
