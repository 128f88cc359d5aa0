"""One page of a stream for the read API: the facts after a token, never
past what is safe, and the token to ask from next.

The safe bound of writer W is its *current token* as this instance knows
it (docs/streams.md, "Tokens"): every fact of W at or below it is committed
and final, and no unfinished ID of W is at or below it.  A page holds the
facts of each writer W with ``since[W] < stream_id <= bound[W]``, merged in
ascending ``stream_id`` (so in order per writer), at most ``limit`` of them,
each whole (every row of its ID), and, with ``max_bytes``, facts until
their JSON reaches ``max_bytes``: the fact that reaches or crosses it is
the page's last (a fact is never split: one bigger than the bound is a
page by itself).

Invariants:

* ``next`` names, per writer, a position such that every fact of that
  writer at or below it is in this page or an earlier one: nothing is
  skipped and nothing given twice when a reader asks from ``next``.
* A *full* page (``limit`` facts, or ``max_bytes`` reached) ends at its
  last fact: ``next[W]`` is at most that fact's ID for every writer, so
  the page depends only on the token, ``limit`` and ``max_bytes``.  If
  that ID is at or below the stream's linear token, every fact the page could hold is final: the
  page is *final*
  (and cacheable forever if also at or below the persisted positions,
  :mod:`.persisted`).  A page that is not full ends at the bounds, which
  move: it is never final.
"""

import hashlib
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import orjson
from twisted.internet import threads

from ...jsontext import kept
from ...streams.stream import Stream
from ..answers import Response
from .tokens import Positions, encode

if TYPE_CHECKING:  # formats encodes with this module's functions
    from twisted.web.http import Request

    from .formats import PageFormat

#: A fact as a page holds it: ``(stream_id, writer, rows, json)``, ``json``
#: being the fact as the API shows it, encoded (:func:`fact_json`), or None
#: when it is encoded only when needed.  (When PostgreSQL built the JSON,
#: ``rows`` holds each row's JSON text, not its values.)
PageFact = tuple[int, str, list[Any], bytes | None]
_first = itemgetter(0)


class Page:
    """The facts of one page, where it ends, and whether it is final."""

    __slots__ = ("facts", "next", "full", "final")

    def __init__(self, facts: list[PageFact], next_positions: Positions, full: bool,
                 final: bool):
        self.facts = facts
        self.next = next_positions
        self.full = full
        self.final = final


async def read_page(stream: Stream, since: Positions, bounds: Mapping[str, int], limit: int,
                    final_below: int | None = None,
                    columns: Sequence[str] | None = None,
                    max_bytes: int | None = None, form: "PageFormat | None" = None) -> Page:
    """The page of ``stream`` after ``since`` (a position per writer),
    bounded by ``bounds`` (per writer), at most ``limit`` facts.  A full
    page ending at or below ``final_below`` (the linear token) is final.

    With ``columns`` (the stream's column names), what memory cannot
    answer is read from the table in one trip to a pool thread for every
    writer, counted in facts, and those facts come encoded (their JSON
    built by PostgreSQL or in the pool thread); without, one
    :meth:`.Stream.fact_page` at a time.  Both give the same page, byte for byte
    once encoded (tests/test_read_api_json.py).

    With ``max_bytes`` (and ``columns``) every fact of the page comes
    encoded, and the page ends at the fact whose JSON brings the page to
    ``max_bytes``; what the table gave past that point in a writer is
    dropped in the pool thread, before it is encoded.

    ``form`` (a :class:`.formats.PageFormat`, JSON if None) is how facts
    are encoded, and what ``max_bytes`` counts."""
    encode_fact = fact_json if form is None else form.fact
    found: list[PageFact] = []
    scanned: dict[str, int] = {}
    table: list[tuple[str, int, int, int]] = []  # (writer, from, to, facts) to read
    writers_found: set[str] = set()
    for writer in sorted(since):
        start = since[writer]
        bound = bounds.get(writer, start)
        pos = start
        mine = 0
        while pos < bound and mine < limit:
            if columns is not None:
                answer = stream.memory_fact_page(writer, pos, bound, limit - mine)
                if answer is None:
                    table.append((writer, pos, bound, limit - mine))
                    break
            else:
                answer = await stream.fact_page(writer, pos, bound, limit - mine)
            facts, upto, limited = answer
            found.extend([(stream_id, writer, rows, None) for stream_id, rows in facts])
            mine += len(facts)
            pos = upto
            if not limited:
                break
        scanned[writer] = max(start, pos)
        if mine:
            writers_found.add(writer)
    if table:
        assert columns is not None
        names = list(columns)
        json_rows = stream.json_rows and (form is None or form.row_json)

        def encode_facts(pages: list[Any]) -> list[list[PageFact]]:
            """Each writer's facts as a page holds them, encoded (in the
            pool thread); with ``max_bytes``, each writer's page cut after
            the fact that reaches it (the merged page ends there or before:
            it holds at least as many bytes by then)."""
            out: list[list[PageFact]] = []
            for i, ((writer, _, _, _), page) in enumerate(zip(table, pages)):
                if json_rows:
                    jsons = rows_json_facts(writer, page[0])
                else:
                    jsons = [encode_fact(names, (stream_id, writer, rows, None))
                             for stream_id, rows in page[0]]
                end = bytes_end(jsons, max_bytes)
                if end < len(jsons):
                    del jsons[end:]
                    pages[i] = (page[0][:end], page[0][end - 1][0], True)
                out.append([(stream_id, writer, rows, j)
                            for (stream_id, rows), j in zip(pages[i][0], jsons)])
            return out

        pages, encoded = await stream.table_fact_pages(table, encode_facts, json_rows)
        for (writer, _, _, _), (facts, upto, _), held in zip(table, pages, encoded):
            if found:
                found.extend(held)
            else:
                found = held
            scanned[writer] = max(scanned[writer], upto)
            if facts:
                writers_found.add(writer)
    if len(writers_found) > 1:
        found.sort(key=_first)
    full = len(found) >= limit
    del found[limit:]
    if max_bytes is not None and columns is not None and found:
        found, reached = await with_json(list(columns), found, max_bytes, encode_fact)
        full = full or reached  # (then it ends at its last fact, as one of limit facts)
    if full:
        last = found[-1][0]
        next_positions = {w: max(since[w], min(scanned[w], last)) for w in since}
        # (And within every writer's bound: all of the page was readable.)
        final = final_below is not None and last <= min(
            [final_below, *(bounds.get(w, since[w]) for w in since)])
    else:
        next_positions = scanned
        final = False
    return Page(found, next_positions, full, final)


def bytes_end(jsons: Sequence[bytes], max_bytes: int | None) -> int:
    """How many of ``jsons`` a page holds: up to the one whose bytes bring
    the total to ``max_bytes`` (all with None)."""
    if max_bytes is None:
        return len(jsons)
    size = 0
    for i, j in enumerate(jsons):
        size += len(j)
        if size >= max_bytes:
            return i + 1
    return len(jsons)


#: Pages of more rows than this left to encode (read from memory) are
#: encoded in a thread; what the table gave is encoded in its pool thread.
THREAD_ENCODE_ROWS = 256


async def with_json(columns: list[str], facts: list[PageFact], max_bytes: int,
                    encode_fact: Callable[[Sequence[str], PageFact], bytes] | None = None,
                    ) -> tuple[list[PageFact], bool]:
    """``(facts, reached)``: ``facts`` each encoded (by ``encode_fact``,
    by default its JSON, :func:`fact_json`)
    up to the one whose JSON brings them to ``max_bytes`` (none encoded
    after it), and whether they reached it.  Many rows left to encode are
    encoded in a thread."""
    encode = encode_fact or fact_json

    def encode_all() -> tuple[list[PageFact], bool]:
        out: list[PageFact] = []
        size = 0
        for f in facts:
            j = f[3]
            if j is None:  # (else kept as it is: no new tuple)
                j = encode(columns, f)
                f = (f[0], f[1], f[2], j)
            out.append(f)
            size += len(j)
            if size >= max_bytes:
                return out, True
        return out, False

    if sum(len(f[2]) for f in facts if f[3] is None) > THREAD_ENCODE_ROWS:
        return await threads.deferToThread(encode_all)
    return encode_all()


def fact_object(columns: Sequence[str], fact: Sequence[Any]) -> dict[str, Any]:
    """A fact as the API shows it (in a page and in an event), from
    ``(stream_id, writer, rows, ...)``."""
    stream_id, writer, rows = fact[0], fact[1], fact[2]
    if len(rows) == 1:
        return {"stream_id": stream_id, "writer": writer, "rows": [dict(zip(columns, rows[0]))]}
    return {"stream_id": stream_id, "writer": writer,
            "rows": [dict(zip(columns, row)) for row in rows]}


def fact_json(columns: Sequence[str], fact: PageFact) -> bytes:
    """:func:`fact_object` as JSON: the bytes the page holds already, else
    encoded now, in a bytes object of its own size (a page keeps them:
    :func:`replicator.jsontext.kept`).  Pure: may run in a thread."""
    encoded = fact[3]
    return encoded if encoded is not None else kept(orjson.dumps(fact_object(columns, fact)))


def rows_json_facts(writer: str, facts: list[tuple[int, list[str]]]) -> list[bytes]:
    """Each fact's JSON (as :func:`fact_json`) from its rows as JSON texts
    (PostgreSQL built them: :func:`replicator.streams.table_pages.row_json_sql`)."""
    w = orjson.dumps(writer)
    return [b'{"stream_id":%d,"writer":%b,"rows":[%b]}' % (stream_id, w,
                                                           ",".join(rows).encode("utf-8"))
            for stream_id, rows in facts]


_BODY_START = b'{"stream":'
_BODY_FACTS = b',"facts":['
_BODY_NEXT = b'],"next":'


def page_body(stream_name: str, columns: list[str], page: Page) -> bytes:
    """A page's JSON answer (one line): exactly ``orjson.dumps({"stream",
    "facts", "next"})``, with each fact's JSON spliced in as
    :func:`fact_json` gives it (so facts encoded in the pool thread are
    not encoded again).  Pure: may run in a thread."""
    return b"".join((_BODY_START, orjson.dumps(stream_name), _BODY_FACTS,
                     b",".join([fact_json(columns, f) for f in page.facts]), _BODY_NEXT,
                     orjson.dumps(encode(stream_name, page.next)), b"}\n"))


def unencoded_rows(page: Page) -> int:
    """Rows of the page's facts not encoded yet (the work left for
    :func:`page_body`)."""
    return sum(len(f[2]) for f in page.facts if f[3] is None)


def etag(body: bytes) -> bytes:
    """A strong entity tag of a page's body."""
    return b'"' + hashlib.sha256(body).hexdigest()[:40].encode("ascii") + b'"'


def unless_cached(request: "Request", body: bytes, content_type: bytes,
                  headers: dict[bytes, bytes]) -> Response | None:
    """``body`` as the answer, or (None) a 304 with ``headers`` written on
    ``request`` when its ``If-None-Match`` names ``headers``' ETag."""
    if matches(request.getHeader(b"if-none-match"), headers[b"etag"]):
        request.setResponseCode(304)
        for k, v in headers.items():
            request.setHeader(k, v)
        request.finish()
        return None
    return Response(body, content_type, headers)


def matches(if_none_match: bytes | None, tag: bytes) -> bool:
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
