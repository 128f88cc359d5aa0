"""One page of a stream for the read API: the facts after a token, never
past what is safe, and the token to ask from next.

The safe bound of writer W is its *current token* as this instance knows
it (docs/streams.md, "Tokens"): every fact of W at or below it is committed
and final, and no unfinished ID of W is at or below it.  A page holds the
facts of each writer W with ``since[W] < stream_id <= bound[W]``, merged in
ascending ``stream_id`` (so in order per writer), at most ``limit`` of them,
each whole (every row of its ID).

Invariants:

* ``next`` names, per writer, a position such that every fact of that
  writer at or below it is in this page or an earlier one: nothing is
  skipped and nothing given twice when a reader asks from ``next``.
* A *full* page (``limit`` facts) ends at its last fact: ``next[W]`` is at
  most that fact's ID for every writer, so the page depends only on the
  token and ``limit``.  If that ID is at or below the stream's linear
  token, every fact the page could hold is final: the page is *final*
  (and cacheable forever if also at or below the persisted positions,
  :mod:`.persisted`).  A page that is not full ends at the bounds, which
  move: it is never final.
"""

import hashlib
from operator import itemgetter
from typing import Dict, List, Mapping, Optional, Tuple

import orjson

from .tokens import Positions, encode

#: A fact as a page holds it: ``(stream_id, writer, rows)``.
PageFact = Tuple[int, str, List[list]]
_first = itemgetter(0)


class Page:
    """The facts of one page, where it ends, and whether it is final."""

    __slots__ = ("facts", "next", "full", "final")

    def __init__(self, facts: List[PageFact], next_positions: Positions, full: bool,
                 final: bool):
        self.facts = facts
        self.next = next_positions
        self.full = full
        self.final = final


async def read_page(stream, since: Positions, bounds: Mapping[str, int], limit: int,
                    final_below: Optional[int] = None) -> Page:
    """The page of ``stream`` after ``since`` (a position per writer),
    bounded by ``bounds`` (per writer), at most ``limit`` facts.  A full
    page ending at or below ``final_below`` (the linear token) is final."""
    found: List[PageFact] = []
    scanned: Dict[str, int] = {}
    writers_found = 0
    for writer in sorted(since):
        start = since[writer]
        bound = bounds.get(writer, start)
        pos = start
        mine = 0
        while pos < bound and mine < limit:
            facts, upto, limited = await stream.fact_page(writer, pos, bound, limit - mine)
            found.extend([(stream_id, writer, rows) for stream_id, rows in facts])
            mine += len(facts)
            pos = upto
            if not limited:
                break
        scanned[writer] = max(start, pos)
        writers_found += mine > 0
    if writers_found > 1:
        found.sort(key=_first)
    full = len(found) >= limit
    if full:
        del found[limit:]
        last = found[-1][0]
        next_positions = {w: max(since[w], min(scanned[w], last)) for w in since}
        # (And within every writer's bound: all of the page was readable.)
        final = final_below is not None and last <= min(
            [final_below, *(bounds.get(w, since[w]) for w in since)])
    else:
        next_positions = scanned
        final = False
    return Page(found, next_positions, full, final)


def fact_object(columns: List[str], fact: PageFact) -> dict:
    """A fact as the API shows it (in a page and in an event)."""
    stream_id, writer, rows = fact
    if len(rows) == 1:
        return {"stream_id": stream_id, "writer": writer, "rows": [dict(zip(columns, rows[0]))]}
    return {"stream_id": stream_id, "writer": writer,
            "rows": [dict(zip(columns, row)) for row in rows]}


def page_body(stream_name: str, columns: List[str], page: Page) -> bytes:
    """A page's JSON answer (one line).  Pure: may run in a thread."""
    return orjson.dumps({"stream": stream_name,
                         "facts": [fact_object(columns, f) for f in page.facts],
                         "next": encode(stream_name, page.next)}) + b"\n"


def etag(body: bytes) -> bytes:
    """A strong entity tag of a page's body."""
    return b'"' + hashlib.sha256(body).hexdigest()[:40].encode("ascii") + b'"'


def matches(if_none_match: Optional[bytes], tag: bytes) -> bool:
    """Whether an ``If-None-Match`` header names ``tag`` (weak comparison,
    as RFC 9110 asks for If-None-Match)."""
    if not if_none_match:
        return False
    for item in if_none_match.split(b","):
        item = item.strip()
        if item == b"*":
            return True
        if item.startswith(b"W/"):
            item = item[2:]
        if item == tag:
            return True
    return False
