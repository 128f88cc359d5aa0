"""What must never be shown: the secrets of an instance (the HTTP secret,
the readers' secrets, the Redis password), in any spelling, and the value
of any request parameter that may carry a credential.

A secret reaches a log line or an answer in a spelling of its own when a
client percent-encodes it (``%48unter2``, twice: ``%2548unter2``) or writes
a space of it as ``+``: a text is therefore searched as it is and as
percent-decoded once, twice, ... (up to :data:`DECODE_ROUNDS` times), and
whatever spells a secret in any of these forms is replaced, in the text as
given, by ``[redacted]``.  A request path is also searched, in each of its
forms (``%3F`` in a path, ``%61ccess_token``, ``%3D`` spell a parameter
too), for parameters whose name says they carry a credential
(:data:`CREDENTIAL`): their values are replaced whether or not they are a
known secret (a wrong or an old secret is still somebody's).

Invariants: the text shown keeps its form (a path stays percent-encoded);
what is replaced is the whole span of the text as given that any decoding
turns into a secret or a credential's value; a text is cut only after
that, and searched only as far beyond the cut as a secret's longest
spelling reaches (a hostile 16 KB path costs what a short one does); a
short text without ``%`` (or, in a path, ``=`` and ``+``) costs one
``str.replace`` per secret, as before.
"""

import re
from collections.abc import Sequence

from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger(namespace="replicator.http")

REDACTED = "[redacted]"
#: How much of a request path a log line shows.
PATH_LIMIT = 200
#: How many times a text is percent-decoded in search of a secret: the
#: server decodes once; more rounds catch a secret a client encoded twice.
DECODE_ROUNDS = 3
#: What makes a request parameter a credential (case-insensitive): a name
#: holding one of these words (``access_token``, the read API's, and what
#: clients name theirs), then ``=``; its value runs to the next ``&`` or
#: ``;`` (it may hold ``/`` and ``?``).
CREDENTIAL = re.compile(rb"(?i)(?:token|secret|pass|auth|key|cred|sig)[^=&;]*=([^&;]*)")

_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")

Spans = list[tuple[int, int]]


def _decoded(data: bytes, spans: Spans) -> tuple[bytes, Spans]:
    """``data`` percent-decoded once, and for each of its bytes the span of
    the original text it comes from (``spans``: that of each byte of
    ``data``)."""
    out = bytearray()
    out_spans: Spans = []
    pos = 0
    for match in _ESCAPE.finditer(data):
        start, end = match.span()
        out += data[pos:start]
        out_spans += spans[pos:start]
        out.append(int(match.group(1), 16))
        out_spans.append((spans[start][0], spans[end - 1][1]))
        pos = end
    out += data[pos:]
    out_spans += spans[pos:]
    return bytes(out), out_spans


def _merged(marks: Spans) -> Spans:
    merged: Spans = []
    for start, end in sorted(marks):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


#: Runs of this many characters of a hidden string are hidden too, for
#: hidden strings of at least :data:`FRAGMENTED` characters (a random
#: secret's 8 characters appear in other text by chance about never; a
#: short password is hidden whole only).
FRAGMENT = 8
FRAGMENTED = 16


class Redactor:
    """Removes hidden strings (the secrets, the Redis password), in any
    spelling, from text shown in answers and logs; and credentials'
    values from request paths (:meth:`path`)."""

    def __init__(self, hidden: Sequence[str | None]):
        self._hidden: list[str] = []
        self._hidden_bytes: list[bytes] = []
        self.hide(hidden)

    def hide(self, hidden: Sequence[str | None]) -> None:
        """Hide these strings too (a reload's new secrets)."""
        for s in hidden:
            if s and s not in self._hidden:
                self._hidden.append(s)
                self._hidden_bytes.append(s.encode("utf-8", "surrogatepass"))

    # ------------------------------------------------------------ finding
    def _marks(self, data: bytes, parameters: bool) -> Spans:
        """The spans of ``data`` that spell a hidden string (or, with
        ``parameters``, a credential parameter's value) in ``data`` or in a
        percent-decoded form of it."""
        marks: Spans = []
        form, spans = data, [(i, i + 1) for i in range(len(data))]
        for round_ in range(DECODE_ROUNDS + 1):
            variants = [form]
            if parameters and b"+" in form:
                variants.append(form.replace(b"+", b" "))  # a query's space
            for variant in variants:
                for hidden in self._hidden_bytes:
                    at = variant.find(hidden)
                    while at >= 0:
                        marks.append((spans[at][0], spans[at + len(hidden) - 1][1]))
                        at = variant.find(hidden, at + 1)
            if parameters:
                for match in CREDENTIAL.finditer(form):
                    start, end = match.span(1)
                    if start < end:
                        marks.append((spans[start][0], spans[end - 1][1]))
            if round_ == DECODE_ROUNDS or b"%" not in form:
                break
            decoded, spans = _decoded(form, spans)
            if decoded == form:
                break
            form = decoded
        return marks

    def _redact_bytes(self, data: bytes, parameters: bool = False,
                      keep: int | None = None) -> bytes:
        """``data`` with what spells a secret (or, with ``parameters``, a
        credential's value) replaced; with ``keep``, only its first
        ``keep`` bytes (and whole replacements that start there): it is
        searched only as far as a secret's longest spelling goes beyond,
        so a hostile 16 KB path costs what a short one does."""
        if keep is not None and len(data) > keep:
            longest = max(map(len, self._hidden_bytes), default=0)
            data = data[:keep + (2 * DECODE_ROUNDS + 1) * longest + 64]
        else:
            keep = None
        if keep is None and b"%" not in data \
                and not (parameters and (b"=" in data or b"+" in data)):
            for hidden in self._hidden_bytes:
                data = data.replace(hidden, REDACTED.encode())
            return data
        marks = _merged(self._marks(data, parameters))
        end = len(data) if keep is None else keep
        out, pos = [], 0
        for start, stop in marks:
            if start >= end:
                break
            out += [data[pos:start], REDACTED.encode()]
            pos = stop
        if pos < end:
            out.append(data[pos:end])
        return b"".join(out)

    def _redact_text(self, text: str, keep: int | None = None) -> str:
        if "%" not in text and (keep is None or len(text) <= keep):
            for hidden in self._hidden:
                text = text.replace(hidden, REDACTED)
            return self._without_fragments(text)
        data = self._redact_bytes(text.encode("utf-8", "surrogatepass"), keep=keep)
        try:
            text = data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:  # a cut in a character, or odd bytes decoded
            text = data.decode("utf-8", "replace")
        return self._without_fragments(text)

    def _without_fragments(self, text: str) -> str:
        """``text`` without a run of :data:`FRAGMENT` characters of a hidden
        string of :data:`FRAGMENTED` or more: a value an error message cut
        (``excerpt``) may end or begin inside a secret, which the search
        for the whole of it then misses."""
        for hidden in self._hidden:
            if len(hidden) < FRAGMENTED:
                continue
            spans = []
            for i in range(len(hidden) - FRAGMENT + 1):
                fragment = hidden[i:i + FRAGMENT]
                at = text.find(fragment)
                while at >= 0:
                    spans.append((at, at + FRAGMENT))
                    at = text.find(fragment, at + 1)
            if spans:
                out, pos = [], 0
                for start, stop in _merged(spans):
                    out += [text[pos:start], REDACTED]
                    pos = stop
                out.append(text[pos:])
                text = "".join(out)
        return text

    def lines(self, text: str) -> str:
        """``text`` without a hidden string in any spelling, its lines kept."""
        return self._redact_text(text)

    def shows_hidden(self, text: str) -> bool:
        """Whether ``text`` holds a hidden string in any spelling."""
        return self.lines(text) != text

    # ------------------------------------------------------------ showing
    def __call__(self, text: str) -> str:
        """One line, without a hidden string, at most 2000 characters."""
        return self._redact_text(" ".join(str(text).splitlines()), keep=2000)[:2000]

    def log_failure(self, fmt: str, failure: Failure, **fields) -> None:
        """``log.failure``, unless the traceback text would show a hidden
        string: then the redacted traceback is logged as text instead."""
        text = failure.getTraceback()
        if self.shows_hidden(text):
            log.error(fmt + "\n{traceback}", traceback=self.lines(text), **fields)
        else:
            log.failure(fmt, failure, **fields)

    def path(self, raw: bytes) -> str:
        """A request path (or request target) fit for a log line: still
        percent-encoded as received, but without a hidden string or a
        credential parameter's value in any spelling."""
        data = self._redact_bytes(raw, parameters=True, keep=PATH_LIMIT)
        path = self(data.decode("ascii", "backslashreplace"))
        if len(raw) > PATH_LIMIT or len(path) > PATH_LIMIT:
            return path[:PATH_LIMIT] + "..."
        return path

    def method(self, raw) -> str:
        return self(raw.decode("ascii", "backslashreplace"))[:20] \
            if isinstance(raw, bytes) else "-"
