"""Wire lines built directly as bytes, for the fan-out.

The RDATA fan-out does not go through the command classes of
:mod:`.commands`: :func:`encode_rdata_lines` and :func:`encode_position_line`
build the wire bytes once per fact, for writing to every connection; the
lines are exactly those of ``RdataCommand``/``PositionCommand.to_line()``
(tests check it).  JSON as :mod:`replicator.jsontext` writes it: compact,
and ``NaN``/``Infinity`` refused (such a row is dropped and counted).
"""

from collections.abc import Sequence
from typing import Any, Iterable, List, Optional, Tuple

import orjson

from ..jsontext import any_non_finite, encode_json_line, non_finite

_dumps = orjson.dumps

#: Default maximum length of one line in bytes, without the ``\n``.
MAX_LINE_LENGTH = 16384


class EncodedLines(Sequence):
    """Wire lines (each ending in ``b"\\n"``) plus ``dropped``: how many rows
    were left out because their line would exceed the maximum length or they
    are not JSON-serializable.  The caller logs and counts those.

    :func:`joined` concatenates the lines once and keeps the result, so a
    fan-out hands the same bytes object to every connection.  Lines encoded
    all at once are kept only joined (:meth:`of_joined`) and split into
    lines the first time anything reads them one by one (a paused
    connection queueing them, a Redis publisher): a fan-out to connections
    that are all writing never splits them.  ``len()`` is known without
    splitting.  Appending drops the joined bytes (built, then only read)."""

    __slots__ = ("dropped", "_lines", "_joined", "_count")

    def __init__(self, lines: Iterable[bytes] = ()) -> None:
        self._lines: Optional[List[bytes]] = list(lines)
        self._count = len(self._lines)
        self._joined: Optional[bytes] = None
        self.dropped = 0

    @classmethod
    def of_joined(cls, data: bytes, count: int) -> "EncodedLines":
        """``count`` lines given joined (no ``\\r`` in them: they are split
        at line ends when read one by one)."""
        self = cls()
        self._lines, self._count, self._joined = None, count, data
        return self

    def _list(self) -> List[bytes]:
        lines = self._lines
        if lines is None:
            lines = self._lines = self._joined.splitlines(True)
        return lines

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        return self._list()[index]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        if isinstance(other, (EncodedLines, list)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"EncodedLines({list(self)!r}, dropped={self.dropped})"

    def append(self, line: bytes) -> None:
        self._list().append(line)
        self._count += 1
        self._joined = None

    def extend(self, lines: Iterable[bytes]) -> None:
        mine = self._list()
        mine.extend(lines)
        self._count = len(mine)
        self._joined = None


def joined(lines: Sequence[bytes]) -> bytes:
    """The concatenation of ``lines``: what one ``transport.write`` sends
    instead of a ``writeSequence`` of them (whose cost grows with the number
    of lines, per connection).  Computed once per :class:`EncodedLines`."""
    if type(lines) is EncodedLines:
        data = lines._joined
        if data is None:
            data = lines._joined = b"".join(lines._list())
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

    Fast paths, the same bytes as row by row: first all rows in one orjson
    call (:func:`_encode_at_once`); if that cannot be used, every line built
    in one comprehension, and the bound checked on the longest line,
    conservatively (with the widest difference between the token's and
    ``batch``'s prefix added).  If a row might be dropped, orjson refuses a
    row or a row holds ``NaN``/``Infinity`` (which orjson would write as
    ``null``), the rows are encoded one by one
    (:func:`_encode_rdata_lines_each`).
    """
    if not isinstance(updates, (list, tuple)):
        updates = list(updates)
    if not updates:
        return EncodedLines()
    prefix = b"RDATA " + stream_name.encode() + b" " + instance_name.encode() + b" "
    tokens, rows = zip(*updates)
    data = _encode_at_once(prefix, tokens, rows, max_line_length)
    if data is not None:
        return EncodedLines.of_joined(data, len(rows))
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


_ARRAYS = frozenset({list, tuple})


def _encode_at_once(prefix: bytes, tokens: Tuple[int, ...], rows: Tuple[Any, ...],
                    max_line_length: int) -> Optional[bytes]:
    """The joined RDATA lines of ``rows`` from ONE orjson call, or None
    where that does not apply (then the caller encodes row by row).

    orjson writes the list of rows as ``[[r1],[r2],...]``: its inside split
    at ``],[`` gives each row's JSON without its brackets, exactly when the
    split yields one part per row (every boundary between two rows is one
    ``],[``, which cannot overlap another; one more part means a row holds
    ``],[`` itself: None).  Then one bytes ``%`` formatting writes every line
    (prefix, token or ``batch``, ``[``, row, ``]``, newline).  None too when
    a row is not a list or tuple, orjson refuses a row, a row holds
    ``NaN``/``Infinity``, the prefix holds a ``\r`` (lines are split at
    line ends afterwards), or the longest row might not fit in
    ``max_line_length`` with the longest token.
    """
    if not set(map(type, rows)) <= _ARRAYS or b"\r" in prefix:
        return None
    try:
        data = _dumps(rows)
    except TypeError:
        return None
    n = len(rows)
    contents = data[2:-2].split(b"],[")
    if len(contents) != n:
        return None
    if b"null" in data and any(map(non_finite, rows)):
        return None
    widest = max(len(b"%d" % tokens[0]), len(b"%d" % tokens[-1]), len(b"batch"))
    if len(prefix) + widest + 3 + max(map(len, contents)) > max_line_length:
        return None
    prefix = prefix.replace(b"%", b"%%")
    numeric = prefix + b"%d [%s]\n"
    if len(set(tokens)) == n:  # no batch
        args: list = [None] * (2 * n)
        args[0::2] = tokens
        args[1::2] = contents
        return numeric * n % tuple(args)
    batch = prefix + b"batch [%s]\n"
    formats, args = [], []
    for token, following, content in zip(tokens, tokens[1:] + (None,), contents):
        if token == following:
            formats.append(batch)
        else:
            formats.append(numeric)
            args.append(token)
        args.append(content)
    return b"".join(formats) % tuple(args)


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
