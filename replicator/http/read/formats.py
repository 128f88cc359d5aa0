"""The formats a page of the read API is answered in, and the choice of one
by a request's ``Accept`` (docs/read-api.md, "Page formats").

* :data:`JSON` (``application/json``, the default): one JSON object
  ``{"stream", "facts", "next"}``, each fact an object whose rows are
  objects keyed by the column names (:func:`.pages.page_body`).
* :data:`NDJSON` (``application/x-ndjson``): lines of JSON, each ending
  in ``\\n``.  The first is the head, ``{"stream", "columns", "next"}``;
  then one line per fact, ``[stream_id, writer, rows]``, each row an array
  of its values in the order of ``columns``.  The same facts and ``next``
  as a JSON page of the same request would hold, except where
  ``http.max_page_bytes`` cuts: the bound counts the bytes of the format
  answered (the fact lines here), so a compact page may hold more.

Invariants: a format's :meth:`PageFormat.fact` and :meth:`PageFormat.body`
are pure (they run in pool threads), and ``body`` of a page whose facts
came encoded by the same format's ``fact`` splices them as they are.
:func:`negotiate` never raises on what a client sends but a 406
(:class:`.params.ParameterError`, naming ``Accept``), and reads at most
:data:`MAX_RANGES` media ranges of it.
"""

import re
from collections.abc import Sequence

import orjson

from ...jsontext import kept
from .pages import fact_json, page_body
from .params import ParameterError
from .tokens import encode


class PageFormat:
    """One way of writing a page: its name (in read-ahead keys), media
    type, and whether a fact's rows may come as JSON objects built by
    PostgreSQL (:func:`replicator.streams.pages.row_json_sql`)."""

    def __init__(self, name: str, media_type: bytes, row_json: bool):
        self.name = name
        self.media_type = media_type
        self.row_json = row_json

    def fact(self, columns: Sequence[str], fact) -> bytes:
        """The bytes of one fact ``(stream_id, writer, rows, encoded)``
        (``encoded`` as they are if not None)."""
        raise NotImplementedError

    def body(self, stream_name: str, columns: list[str], page) -> bytes:
        """The whole answer for a :class:`.pages.Page`."""
        raise NotImplementedError


class _Json(PageFormat):
    def fact(self, columns, fact):
        return fact_json(columns, fact)

    def body(self, stream_name, columns, page):
        return page_body(stream_name, columns, page)


class _Ndjson(PageFormat):
    def fact(self, columns, fact):
        encoded = fact[3]
        if encoded is not None:
            return encoded
        return kept(orjson.dumps((fact[0], fact[1], fact[2]),
                                 option=orjson.OPT_APPEND_NEWLINE))

    def body(self, stream_name, columns, page):
        head = orjson.dumps({"stream": stream_name, "columns": columns,
                             "next": encode(stream_name, page.next)},
                            option=orjson.OPT_APPEND_NEWLINE)
        return b"".join([head, *[self.fact(columns, f) for f in page.facts]])


JSON = _Json("json", b"application/json", row_json=True)
NDJSON = _Ndjson("ndjson", b"application/x-ndjson", row_json=False)
#: Every format, the default first (it wins ties).
FORMATS = (JSON, NDJSON)

#: Media ranges of an ``Accept`` read at most (the rest is ignored).
MAX_RANGES = 32
_RANGE = re.compile(r"^([a-z0-9!#$&^_.+-]+|\*)/([a-z0-9!#$&^_.+-]+|\*)$")
_Q = re.compile(r"^(?:0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?)$")


def _ranges(header: str):
    """``(type, subtype, q)`` of each well-formed media range of ``header``
    (a malformed one is skipped)."""
    for item in header.split(",")[:MAX_RANGES]:
        parts = item.split(";")
        m = _RANGE.match(parts[0].strip().lower())
        if m is None:
            continue
        q = 1.0
        for param in parts[1:]:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                value = value.strip()
                if not _Q.match(value):
                    break
                q = float(value)
        else:
            if m.group(1) == "*" and m.group(2) != "*":
                continue  # (*/json is no media range)
            yield m.group(1), m.group(2), q


def negotiate(values: list[bytes] | None) -> PageFormat:
    """The format a request's ``Accept`` header(s) ``values`` ask for:
    the highest ``q``, then the most specific match, then the default;
    the default if no header or no well-formed media range; 406 if
    well-formed ranges accept none of :data:`FORMATS`."""
    if not values:
        return JSON
    header = b",".join(values).decode("latin-1")
    ranges = list(_ranges(header))
    if not ranges:
        return JSON
    best, best_score = None, (0.0, 0)
    for form in FORMATS:
        kind, sub = form.media_type.decode("ascii").split("/")
        q, specificity = None, -1
        for t, s, rq in ranges:
            if (t, s) == (kind, sub):
                level = 2
            elif t == kind and s == "*":
                level = 1
            elif (t, s) == ("*", "*"):
                level = 0
            else:
                continue
            if level > specificity:
                q, specificity = rq, level
        if q is not None and q > 0 and (q, specificity) > best_score:
            best, best_score = form, (q, specificity)
    if best is None:
        raise ParameterError(406, "Accept", "no page format acceptable: this route answers "
                             + " or ".join(f.media_type.decode() for f in FORMATS))
    return best
