"""Findings that are known defects still open on main, each with where it is
tracked.  The seeded slice in ``make test`` (``tests/test_fuzz.py``) fails
on any finding *not* listed here; ``make fuzz`` reports every finding,
listed or not.  Remove an entry as soon as its fix is on main: the slice
then guards it.
"""

import re
from typing import List

from .results import Finding

# (phase, kind, signature regex, why it is excluded)
KNOWN_OPEN = [
    ("1-lines", "position_poisoned", r".*",
     "issue 11 item 1: a peer's POSITION moves the local writers' tokens past the sequence"),
    ("3-peers", "position_poisoning", r".*",
     "issue 11 item 1: a peer's POSITION above the stream's sequence moves tokens"),
    ("3-peers", "relay_sent_bad_line", r".*",
     "issue 11 item 4: a relayed LOCK_RELEASED is re-encoded with ASCII escapes past "
     "max_line_length"),
    ("4-http", "non_json_error", r"status 4\d\d",
     "issue 11 item 13: malformed HTTP gets twisted.web's bare 400 (or 405 for `POST *`) "
     "with an empty body"),
    ("4-http", "no_answer", r".*",
     "issue 11 items 8/13: an over-long header or an unfinished request line is closed "
     "silently or held"),
    ("4-http", "server_error", r"status 50[03]",
     "issue 11 item 10: a deeply nested json value answers 5xx"),
    ("4-http", "daemon_critical", r".*Recursion.*",
     "issue 11 item 10: a deeply nested json value logs a traceback"),
    ("5-configs", "traceback", r"RecursionError: maximum recursion depth exceeded",
     "found by this suite: a config with a YAML value nested ~5,000 deep makes the YAML "
     "parser recurse out (traceback, exit 1)"),
]


def is_known(finding: Finding) -> bool:
    return any(finding.phase == phase and finding.kind == kind
               and re.fullmatch(pattern, finding.signature)
               for phase, kind, pattern, _ in KNOWN_OPEN)


def unknown(findings) -> List[Finding]:
    return [f for f in findings if not is_known(f)]
