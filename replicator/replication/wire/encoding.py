"""Wire lines built directly as bytes, for the fan-out.

The RDATA fan-out does not go through the command classes of
:mod:`.commands`: :func:`encode_rdata_lines` and :func:`encode_position_line`
build the wire bytes once per fact, for writing to every connection; the
lines are exactly those of ``RdataCommand``/``PositionCommand.to_line()``
(tests check it).  JSON as :mod:`replicator.jsontext` writes it: compact,
and ``NaN``/``Infinity`` refused (such a row is dropped and counted).
"""

from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Any

import orjson

from ...jsontext import any_non_finite, encode_json_line, non_finite

_dumps = orjson.dumps

#: Default maximum length of one line in bytes, without the ``\n``.
MAX_LINE_LENGTH = 16384


class EncodedLines(Sequence[bytes]):
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
        self._lines: list[bytes] | None = list(lines)
        self._count = len(self._lines)
        self._joined: bytes | None = None
        self.dropped = 0

    @classmethod
    def of_joined(cls, data: bytes, count: int) -> "EncodedLines":
        """``count`` lines given joined (no ``\\r`` in them: they are split
        at line ends when read one by one)."""
        self = cls.__new__(cls)
        self._lines, self._count, self._joined, self.dropped = None, count, data, 0
        return self

    def _list(self) -> list[bytes]:
        lines = self._lines
        if lines is None:
            assert self._joined is not None
            lines = self._lines = self._joined.splitlines(True)
        return lines

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        return self._list()[index]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
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
    updates: Sequence[tuple[int, Sequence[Any]]],
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
    data = _encode_at_once(prefix, list(map(_first, updates)), list(map(_second, updates)),
                           max_line_length)
    if data is not None:
        return EncodedLines.of_joined(data, len(updates))
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


#: Between the elements given to orjson by :func:`_encode_at_once`: bytes
#: orjson never writes itself (it escapes control characters in strings).
_SEPARATOR = orjson.Fragment(b"\x00")
_SPLIT = b",\x00,"
#: A batch line's token field, written by orjson as it is.
_BATCH = orjson.Fragment(b"batch")
_first = itemgetter(0)
_second = itemgetter(1)


def _marks(tokens: Sequence[int], batched: bool) -> Sequence[Any]:
    """Each row's token field: its token, or the ``batch`` fragment for every
    row but the last of a fact (``batched``: some fact has several rows)."""
    if not batched:
        return tokens
    marks: list[Any] = list(tokens)
    for i in range(len(tokens) - 1):
        if tokens[i] == tokens[i + 1]:
            marks[i] = _BATCH
    return marks


def _encode_at_once(prefix: bytes, tokens: Sequence[int], rows: Sequence[Any],
                    max_line_length: int) -> bytes | None:
    """The joined RDATA lines of ``rows`` from ONE orjson call, or None
    where that does not apply (then the caller encodes row by row).

    orjson writes tokens and rows alternately, separated by a fragment it
    copies as it is (``\\x00``, which its own output never holds), so
    ``t1,\\x00,[r1],\\x00,t2,...``: orjson formats the integers (several
    times faster than ``%d``), and one split at ``,\\x00,`` gives every
    token's and row's JSON, whatever the rows hold.  A batch line's token
    is the fragment ``batch``.  One join with the prefix, space and newline
    pieces writes the lines.  None when orjson refuses a token or row, a
    row holds ``NaN``/``Infinity``, the prefix holds a ``\\r`` (lines are
    split at line ends afterwards), or a row's line might not fit in
    ``max_line_length`` with the longest token.
    """
    n = len(rows)
    if b"\r" in prefix or not n:
        return None
    marks = _marks(tokens, len(set(tokens)) < n)
    items: list[Any] = [None, _SEPARATOR] * (2 * n)
    items[0::4] = marks
    items[2::4] = rows
    del items[-1]
    try:
        data = _dumps(items)
    except TypeError:
        return None
    if b"null" in data and any(map(non_finite, rows)):
        return None
    widest = max(len(b"%d" % tokens[0]), len(b"%d" % tokens[-1]), len(b"batch"))
    room = max_line_length - len(prefix) - widest - 1  # for a row's JSON
    pieces = data.split(_SPLIT)
    if len(pieces) != 2 * n:  # a row holds a fragment (never from a table)
        return None
    pieces[0] = pieces[0][1:]
    pieces[-1] = pieces[-1][:-1]
    if not _gaps_within(data, room) and max(map(len, pieces[1::2])) > room:
        return None
    out: list[Any] = [b"\n" + prefix, None, b" ", None] * n
    out[0] = prefix
    out[1::2] = pieces
    out.append(b"\n")
    return b"".join(out)


def _gaps_within(data: bytes, bound: int, sep: bytes = _SPLIT) -> bool:
    """Whether, cheaply, every run of ``data`` between two separators
    ``sep`` (:data:`_SPLIT`, or a line end), or before the first or after
    the last, is at most ``bound`` bytes long; False only means "not shown
    this way".

    Looks for a separator in every window of ``(bound + 1) // 2`` bytes up
    to the last one (then two consecutive ones are at most ``bound`` apart):
    a few searches, where measuring every piece would cost one call per
    row."""
    half = (bound + 1) // 2
    if half < 256:
        return False
    last = data.rfind(sep)
    if last < 0 or len(data) - last - len(sep) > bound:
        return False
    find = data.find
    stop = half + len(sep) - 1
    for k in range(0, last, half):
        if find(sep, k, k + stop) < 0:
            return False
    return True


def encode_written(stream_name: str, instance_name: str, tokens: Sequence[int],
                   rows: Sequence[bytes], facts: int,
                   max_line_length: int = MAX_LINE_LENGTH) -> EncodedLines | None:
    """The RDATA lines of rows encoded when they were written, joined:
    ``rows[i]`` is a row's JSON line (:func:`.jsontext.encode_json_line`,
    newline included) and ``tokens[i]`` its fact's token, ascending;
    ``facts`` is how many distinct tokens there are (fewer than rows: some
    fact has several rows, written as a batch).

    The same bytes as :func:`encode_rdata_lines` of the decoded rows; only
    prefix, token (or ``batch``) and row are concatenated.  None when a
    row's line might exceed ``max_line_length`` (the bound of
    :func:`encode_rdata_lines`, which drops such rows): the caller then
    takes the facts one by one (:func:`encode_written_fact`).
    """
    n = len(rows)
    if not n:
        return EncodedLines()
    prefix = _prefix(stream_name, instance_name)
    if b"\r" in prefix:
        return None  # lines are split at line ends when read one by one
    marks = _marks(tokens, facts < n)
    heads = _dumps(marks)[1:-1].split(b",")
    out: list[Any] = [prefix, None, b" ", None] * n
    out[1::4] = heads
    out[3::4] = rows
    data = b"".join(out)
    # A row's JSON line may take max_line_length - len(prefix) - max(digits
    # of its token, len("batch")) bytes.  Every row is within that if every
    # line (prefix, token or "batch", space, JSON) is within the widest such
    # mark less the narrowest: shown by the length of all of them (a few
    # rows), else searched for, not measured line by line.
    last = len(heads[-1])  # the last row's token: its fact's last row
    first = len(heads[0]) if heads[0] != b"batch" else len(b"%d" % tokens[0])
    widest = max(first, last, 5)
    bound = max_line_length - widest + (min(first, 5) if tokens[0] > 0 else 1)
    if len(data) > bound and not _gaps_within(data, bound, b"\n") and \
            max(map(len, rows)) > max_line_length - len(prefix) - widest:
        return None
    return EncodedLines.of_joined(data, n)


_prefixes: dict[tuple[str, str], bytes] = {}


def _prefix(stream_name: str, instance_name: str) -> bytes:
    """``RDATA <stream> <instance> `` (kept: the fan-out's writers are few)."""
    key = (stream_name, instance_name)
    prefix = _prefixes.get(key)
    if prefix is None:
        if len(_prefixes) >= 256:
            _prefixes.clear()
        prefix = _prefixes[key] = (b"RDATA " + stream_name.encode() + b" "
                                   + instance_name.encode() + b" ")
    return prefix


def encode_written_fact(stream_name: str, instance_name: str, token: int,
                        rows: Sequence[bytes],
                        max_line_length: int = MAX_LINE_LENGTH) -> list[bytes] | None:
    """The RDATA lines of one fact from its rows' JSON lines (see
    :func:`encode_written`); None if one of them is too long (exactly the
    rows :func:`encode_rdata_lines` would drop)."""
    prefix = _prefix(stream_name, instance_name)
    head = b"%d" % token
    room = max_line_length - len(prefix) - max(len(head), 5)  # JSON + newline
    if max(map(len, rows)) > room:
        return None
    batch = prefix + b"batch "
    out = [batch + row for row in rows[:-1]]
    out.append(prefix + head + b" " + rows[-1])
    return out


def _encode_rdata_lines_each(
    stream_name: str,
    instance_name: str,
    updates: Iterable[tuple[int, Sequence[Any]]],
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
    pending: bytes | None = None
    token_prefix = b""
    current: int | None = None
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


def encode_position_line(stream_name: str, instance_name: str, prev_token: int,
                         new_token: int) -> bytes:
    """The POSITION wire line, ending in ``b"\\n"``."""
    return b"POSITION %s %s %d %d\n" % (
        stream_name.encode(),
        instance_name.encode(),
        prev_token,
        new_token,
    )
