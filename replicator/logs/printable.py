"""Untrusted text (from a peer, a request or a file) made safe for one log
line: the one place that decides what is escaped."""

import re

# C0 and C1 controls, DEL, line/paragraph separators and the bidirectional
# overrides and isolates: anything that could end a log line, move the
# cursor, recolour a terminal or reorder what a reader sees.
_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(match: "re.Match[str]") -> str:
    char = match.group()
    short = _SHORT.get(char)
    if short is not None:
        return short
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, limit: int | None = 200) -> str:
    """``text`` (anything a peer, request or file supplied) made safe for one
    log line: control characters written as ``\\xNN``/``\\uNNNN`` escapes
    (``\\n``, ``\\r``, ``\\t`` as such), and cut to ``limit`` characters
    with ``...`` (no cut when ``limit`` is None).  Bytes are decoded as
    UTF-8 with invalid sequences replaced.  Use it for every piece of
    untrusted text that goes into a log event."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    elif not isinstance(text, str):
        text = str(text)
    cut = limit is not None and len(text) > limit
    if cut:
        text = text[:limit]
    text = _UNPRINTABLE.sub(_escape_char, text)
    return text + "..." if cut else text
