"""Findings that are known defects still open on main, each with where it is
tracked.  The seeded slice in ``make test`` (``tests/test_fuzz.py``) fails
on any finding *not* listed here; ``make fuzz`` reports every finding,
listed or not.  Remove an entry as soon as its fix is on main: the slice
then guards it.
"""

import re
from typing import List

from .results import Finding

# (phase regex, kind, signature regex, why it is excluded)
KNOWN_OPEN = [
    ("2-sockets.*", "daemon_critical",
     r"TypeError: str is not valid UTF-8: surrogates not allowed at pages.py:build_page",
     "found by this suite: a USER_IP whose JSON holds a lone surrogate (\\ud800) makes "
     "GET /_replicator/v1/user_ips answer 500 with a traceback (orjson refuses the str)"),
    ("3-peers", "queue_unbounded_in_bytes", r".*",
     "issue 11 item 7: lines queued for a reader that does not read are bounded in count only"),
    ("5-configs", "traceback", r"RecursionError: maximum recursion depth exceeded.*"
     r"|unfinished traceback in yaml/.*",
     "found by this suite: a config with a YAML value nested ~900+ deep makes the YAML "
     "parser recurse out: a 3,000-line traceback, exit 1, after 3-12 s"),
    ("5-configs", "neither_ready_nor_exited", r"deep nesting: .*",
     "found by this suite: the same deeply nested YAML, on a loaded machine"),
]


def is_known(finding: Finding) -> bool:
    return any(re.fullmatch(phase, finding.phase) and finding.kind == kind
               and re.fullmatch(pattern, finding.signature)
               for phase, kind, pattern, _ in KNOWN_OPEN)


def unknown(findings) -> List[Finding]:
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
