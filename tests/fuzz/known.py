"""Findings that are known defects still open on main, each with where it is
tracked.  The seeded slice in ``make test`` (``tests/test_fuzz.py``) fails
on any finding *not* listed here; ``make fuzz`` reports every finding,
listed or not.  Remove an entry as soon as its fix is on main: the slice
then guards it.
"""

import re

from .results import Finding

# (phase regex, kind, signature regex, why it is excluded)
KNOWN_OPEN = [
]


def is_known(finding: Finding) -> bool:
    return any(re.fullmatch(phase, finding.phase) and finding.kind == kind
               and re.fullmatch(pattern, finding.signature)
               for phase, kind, pattern, _ in KNOWN_OPEN)


def unknown(findings) -> list[Finding]:
    return [f for f in findings if not is_known(f)]


def stale(phases) -> list:
    """Entries of phases that ran but matched no finding (fixed since?)."""
    out = []
    for entry in KNOWN_OPEN:
        phase, kind, pattern, _ = entry
        ran = [p for p in phases if re.fullmatch(phase, p.phase)]
        if ran and not any(re.fullmatch(phase, f.phase) and f.kind == kind
                           and re.fullmatch(pattern, f.signature)
                           for p in ran for f in p.findings.values()):
            out.append(entry)
    return out
