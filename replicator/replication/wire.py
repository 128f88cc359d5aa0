"""Wire lines built directly as bytes, for the fan-out.

The RDATA fan-out does not go through the command classes of
:mod:`.commands`: :func:`encode_rdata_lines` and :func:`encode_position_line`
build the wire bytes once per fact, for writing to every connection; the
lines are exactly those of ``RdataCommand``/``PositionCommand.to_line()``
(tests check it).  JSON as :mod:`replicator.jsontext` writes it: compact,
and ``NaN``/``Infinity`` refused (such a row is dropped and counted).
"""

from typing import Any, Iterable, Optional, Sequence, Tuple

import orjson

from ..jsontext import any_non_finite, encode_json_line

#: Default maximum length of one line in bytes, without the ``\n``.
MAX_LINE_LENGTH = 16384


class EncodedLines(list):
    """Wire lines (each ending in ``b"\\n"``) plus ``dropped``: how many rows
    were left out because their line would exceed the maximum length or they
    are not JSON-serializable.  The caller logs and counts those.

    :func:`joined` concatenates the lines once and keeps the result, so a
    fan-out hands the same bytes object to every connection.  Invariant:
    the list is not changed once it was joined (it is built, then only
    read)."""

    __slots__ = ("dropped", "_joined")

    def __init__(self, lines: Iterable[bytes] = ()) -> None:
        super().__init__(lines)
        self.dropped = 0
        self._joined: Optional[bytes] = None


def joined(lines: Sequence[bytes]) -> bytes:
    """The concatenation of ``lines``: what one ``transport.write`` sends
    instead of a ``writeSequence`` of them (whose cost grows with the number
    of lines, per connection).  Computed once per :class:`EncodedLines`."""
    if type(lines) is EncodedLines:
        data = lines._joined
        if data is None:
            data = lines._joined = b"".join(lines)
        return data
    if len(lines) == 1:
        return lines[0]
    return b"".join(lines)


def encode_rdata_lines(
    stream_name: str,
    instance_name: str,
    updates: Sequence[Tuple[int, Sequence[Any]]],
    max_line_length: int = MAX_LINE_LENGTH,
) -> EncodedLines:
    """Encode ``(token, row)`` pairs as RDATA wire lines, once for all
    connections.

    ``updates`` is in ascending token order; consecutive pairs with the same
    token form a batch: every line of it but the last carries ``batch``, the
    last one the token.  Each row is encoded once (orjson) and concatenated
    with a prefix.

    A row whose line would be longer than ``max_line_length`` bytes (newline
    excluded) is dropped and counted in the result's ``dropped``; the batch
    it belonged to still ends with a numeric line if any of its rows remain.
    The bound is checked against the longer of ``batch`` and the token, so a
    row within a few bytes of the limit may be dropped even as a batch line.

    Fast path: every line built in one comprehension, and the bound checked
    on the longest line, conservatively (with the widest difference between
    the token's and ``batch``'s prefix added).  If a row might be dropped,
    orjson refuses a row or a row holds ``NaN``/``Infinity`` (which orjson
    would write as ``null``), the rows are encoded one by one instead
    (:func:`_encode_rdata_lines_each`): the same bytes either way.
    """
    if not isinstance(updates, (list, tuple)):
        updates = list(updates)
    if not updates:
        return EncodedLines()
    prefix = b"RDATA " + stream_name.encode() + b" " + instance_name.encode() + b" "
    batch_prefix = prefix + b"batch "
    dumps = orjson.dumps
    newline = orjson.OPT_APPEND_NEWLINE
    following = [t for t, _ in updates]
    following.append(None)
    try:
        lines = EncodedLines([
            (batch_prefix if token == following[i] else b"%s%d " % (prefix, token))
            + dumps(row, option=newline)
            for i, (token, row) in enumerate(updates, 1)
        ])
    except TypeError:
        return _encode_rdata_lines_each(stream_name, instance_name, updates, max_line_length)
    data = lines._joined = b"".join(lines)
    if any_non_finite([row for _, row in updates], data):
        return _encode_rdata_lines_each(stream_name, instance_name, updates, max_line_length)
    # A line's prefix is the token's or "batch"'s; the row-by-row bound uses
    # the longer of the two, which differ by at most this much.
    slack = max(len(b"batch "), len(b"%d " % max(abs(following[0]), abs(updates[-1][0]))) + 1)
    if max(map(len, lines)) + slack > max_line_length + 1:
        return _encode_rdata_lines_each(stream_name, instance_name, updates, max_line_length)
    return lines


def _encode_rdata_lines_each(
    stream_name: str,
    instance_name: str,
    updates: Iterable[Tuple[int, Sequence[Any]]],
    max_line_length: int = MAX_LINE_LENGTH,
) -> EncodedLines:
    """:func:`encode_rdata_lines` row by row: drops the rows whose line
    would be too long and the rows :func:`.jsontext.encode_json_line`
    refuses (not JSON, or ``NaN``/``Infinity``)."""
    prefix = b"RDATA " + stream_name.encode() + b" " + instance_name.encode() + b" "
    batch_prefix = prefix + b"batch "
    out = EncodedLines()
    append = out.append
    dropped = 0
    # The previous kept row of the current token: written as a batch line if
    # another kept row of the same token follows, else with the token.
    pending: Optional[bytes] = None
    token_prefix = b""
    current: Optional[int] = None
    room = 0
    for token, row in updates:
        if token != current:
            if pending is not None:
                append(token_prefix + pending)
                pending = None
            current = token
            token_prefix = prefix + b"%d " % token
            # Room for the JSON plus its newline.
            room = max_line_length + 1 - max(len(token_prefix), len(batch_prefix))
        try:
            data = encode_json_line(row)
        except (TypeError, ValueError):
            dropped += 1
            continue
        if len(data) > room:
            dropped += 1
            continue
        if pending is not None:
            append(batch_prefix + pending)
        pending = data
    if pending is not None:
        append(token_prefix + pending)
    out.dropped = dropped
    return out


def encode_position_line(stream_name: str, instance_name: str, prev_token: int, new_token: int) -> bytes:
    """The POSITION wire line, ending in ``b"\\n"``."""
    return b"POSITION %s %s %d %d\n" % (
        stream_name.encode(),
        instance_name.encode(),
        prev_token,
        new_token,
    )
