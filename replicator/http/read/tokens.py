"""Resume tokens of the read API: where a reader is in one stream.

A token names the stream and every writer's position in it (the ID of the
last fact of that writer the reader has, or the ID below which it has seen
everything of that writer).  It is opaque to clients, URL-safe, and stable
across restarts and versions: the text is ``v1.`` followed by the
unpadded base64url of the UTF-8 JSON array ``[STREAM, [[WRITER, POSITION],
...]]``, writers sorted by name.  A later encoding would start ``v2.``;
every version ever issued stays readable.

Invariants: :func:`encode` is canonical (the same positions give the same
text, so the same page has the same URL for a cache) and the only text
read: :func:`decode` refuses any other spelling of the same positions
(writers unsorted, whitespace, no writer); :func:`decode` of an
:func:`encode` gives the positions back; :func:`decode` never raises
anything but :class:`TokenError`, whatever the text, and reads at most
:data:`MAX_TOKEN` characters.
"""

import base64
import binascii
from collections.abc import Iterable, Mapping

import orjson

Positions = dict[str, int]

PREFIX = "v1."
#: The longest token read (a stream of many writers with long names fits).
MAX_TOKEN = 8192
#: The largest position: stream IDs are positive 63-bit integers.
MAX_POSITION = 2 ** 63 - 1


class TokenError(ValueError):
    """A token that cannot be read, or that is not one of this stream."""


def encode(stream: str, positions: Mapping[str, int]) -> str:
    """The token of ``positions`` (writer -> position) in ``stream``."""
    payload = orjson.dumps([stream, [[w, positions[w]] for w in sorted(positions)]])
    return PREFIX + base64.urlsafe_b64encode(payload).rstrip(b"=").decode("ascii")


def decode(text: str, stream: str, writers: Iterable[str]) -> Positions:
    """The positions ``text`` names in ``stream``, one per writer of
    ``writers`` (a writer the token does not name is at 0: it joined the
    stream after the token was issued).  Raises :class:`TokenError` for a
    malformed token, one of another stream, or one naming a writer that is
    not in ``writers``."""
    stream_name, named = parse(text)
    if stream_name != stream:
        raise TokenError(f"token of another stream ({stream_name[:60]!r}), "
                         f"not of {stream!r}")
    known = set(writers)
    for writer in named:
        if writer not in known:
            raise TokenError(f"token names writer {writer[:60]!r}, not a writer "
                             f"of stream {stream!r}")
    return {w: named.get(w, 0) for w in sorted(known)}


def parse(text: str):
    """``(stream, {writer: position})`` of a token, checked for shape only."""
    if not isinstance(text, str) or len(text) > MAX_TOKEN:
        raise TokenError(f"malformed token: longer than {MAX_TOKEN} characters")
    if not text.startswith(PREFIX):
        raise TokenError("malformed token: unknown version (tokens start with 'v1.')")
    body = text[len(PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != body:
            raise ValueError("not canonical base64url")
        doc = orjson.loads(raw)
    except (binascii.Error, ValueError, UnicodeError, orjson.JSONDecodeError):
        raise TokenError("malformed token: not one this server issued") from None
    if not (isinstance(doc, list) and len(doc) == 2 and isinstance(doc[0], str)
            and isinstance(doc[1], list)):
        raise TokenError("malformed token: not one this server issued")
    positions: Positions = {}
    for item in doc[1]:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and type(item[1]) is int and 0 <= item[1] <= MAX_POSITION
                and item[0] not in positions):
            raise TokenError("malformed token: not one this server issued")
        positions[item[0]] = item[1]
    if not positions or encode(doc[0], positions) != text:
        # (Every token issued names every writer, sorted, in compact JSON.)
        raise TokenError("malformed token: not one this server issued (not canonical)")
    return doc[0], positions
