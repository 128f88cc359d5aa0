"""What a fuzz run found: per phase, the inputs tried and the findings,
deduplicated by (kind, signature), each with its first reproducer.

A finding is something an invariant forbids (an exception escaping, an
unhandled error logged, an invalid line accepted, an honest client harmed,
a stall, a traceback...).  ``Results.table()`` is the stdout summary;
``Results.write_jsonl(path)`` appends one JSON object per phase and per
finding.
"""

import json
import re
import time


def show(data, limit: int = 160) -> str:
    """A short printable reproducer for bytes/str input: runs of one byte
    folded (``b'\\r' * 16374``), cut at ``limit`` characters (length noted)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    data = bytes(data)
    parts, i = [], 0
    for m in re.finditer(rb"(.)\1{15,}", data, re.S):
        if m.start() > i:
            parts.append(repr(data[i:m.start()]))
        parts.append(f"{bytes([data[m.start()]])!r} * {m.end() - m.start()}")
        i = m.end()
    if i < len(data) or not parts:
        parts.append(repr(data[i:]))
    text = " + ".join(parts)
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{text} ({len(data)} bytes)" if len(data) > 60 else text


def normalize(signature: str) -> str:
    """Numbers and long runs folded, so one defect is one finding."""
    signature = re.sub(r"\d{4,}", "N", signature)
    return re.sub(r"(.)\1{7,}", r"\1\1\1...", signature)[:160]


class Finding:
    __slots__ = ("phase", "kind", "signature", "family", "reproducer", "detail", "count")

    def __init__(self, phase, kind, signature, family, reproducer, detail):
        self.phase = phase
        self.kind = kind
        self.signature = signature
        self.family = family
        self.reproducer = reproducer
        self.detail = detail
        self.count = 1

    def as_dict(self) -> dict:
        return {"phase": self.phase, "kind": self.kind, "signature": self.signature,
                "family": self.family, "count": self.count, "reproducer": self.reproducer,
                "detail": self.detail}


class PhaseResult:
    """Inputs tried and findings of one phase."""

    def __init__(self, phase: str):
        self.phase = phase
        self.inputs: dict[str, int] = {}  # family -> inputs tried
        self.findings: dict[tuple, Finding] = {}
        self.figures: dict[str, object] = {}
        self.started = time.monotonic()
        self.seconds = 0.0

    def tried(self, family: str, n: int = 1) -> None:
        self.inputs[family] = self.inputs.get(family, 0) + n

    def found(self, kind: str, signature: str, family: str = "-", reproducer: str = "",
              detail: str = "") -> None:
        signature = normalize(signature)
        key = (kind, signature)
        existing = self.findings.get(key)
        if existing is not None:
            existing.count += 1
            return
        self.findings[key] = Finding(self.phase, kind, signature, family, reproducer, detail)

    def figure(self, name: str, value) -> None:
        self.figures[name] = value

    def done(self) -> "PhaseResult":
        self.seconds = time.monotonic() - self.started
        return self

    @property
    def total_inputs(self) -> int:
        return sum(self.inputs.values())

    def problems(self, exclude_kinds=()) -> list[Finding]:
        return [f for f in self.findings.values() if f.kind not in exclude_kinds]

    def describe(self, exclude_kinds=()) -> str:
        """Every finding, one paragraph each (for a test failure message)."""
        out = []
        for f in self.problems(exclude_kinds):
            out.append(f"[{f.phase}] {f.kind}: {f.signature} (x{f.count}, family {f.family})\n"
                       f"    input: {f.reproducer}\n    detail: {f.detail}")
        return "\n".join(out)


class Results:
    def __init__(self, seed: int):
        self.seed = seed
        self.phases: list[PhaseResult] = []

    def add(self, result: PhaseResult) -> PhaseResult:
        self.phases.append(result)
        return result

    def table(self) -> str:
        rows = [("phase", "inputs", "findings", "kinds", "seconds")]
        for p in self.phases:
            kinds = sorted({f.kind for f in p.findings.values()})
            rows.append((p.phase, str(p.total_inputs), str(len(p.findings)),
                         ", ".join(kinds) or "-", f"{p.seconds:.0f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
        for p in self.phases:
            fams = ", ".join(f"{k} {v}" for k, v in sorted(p.inputs.items()))
            lines.append(f"\n{p.phase}: {fams}")
            for name, value in sorted(p.figures.items()):
                text = str(value)
                lines.append(f"  {name}: {text if len(text) < 200 else text[:200] + '...'}")
            for f in p.findings.values():
                lines.append(f"  FINDING {f.kind}: {f.signature} (x{f.count}, {f.family})")
                lines.append(f"    input: {f.reproducer}")
                if f.detail:
                    lines.append(f"    detail: {f.detail}")
        return "\n".join(lines)

    def write_jsonl(self, path: str, when: str | None = None) -> None:
        when = when or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with open(path, "a") as f:
            for p in self.phases:
                f.write(json.dumps({"when": when, "seed": self.seed, "phase": p.phase,
                                    "inputs": p.inputs, "total_inputs": p.total_inputs,
                                    "findings": len(p.findings), "seconds": round(p.seconds, 1),
                                    "figures": p.figures}) + "\n")
                for finding in p.findings.values():
                    f.write(json.dumps({"when": when, "seed": self.seed,
                                        **finding.as_dict()}) + "\n")
