"""A stream's row layout: checking rows on write, shaping them on read.

An RDATA row is a JSON array of the stream's declared columns, in order,
carrying real JSON values: ``bigint`` an integer, ``boolean`` true/false,
``json`` nested JSON (never a JSON string of it), ``text`` a string, and
``null`` only where the column is nullable.
"""

from collections.abc import Callable, Sequence
from typing import Any

import orjson

from ..config import ColumnConfig
from ..jsontext import encode_json_line

#: A ``json`` column value may nest arrays and objects this deep (the value
#: itself is level 1); deeper is refused (encoders and peers' decoders recurse).
MAX_JSON_DEPTH = 100


class RowError(ValueError):
    """A row that does not fit the stream's layout; the text says why."""


def _check_value(column: ColumnConfig, value: Any, where: str) -> None:
    if value is None:
        if not column.nullable:
            raise RowError(f"{where}: column {column.name!r} may not be null")
        return
    t = column.type
    if t == "text":
        ok = isinstance(value, str)
    elif t == "bigint":
        ok = isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    elif t == "boolean":
        ok = isinstance(value, bool)
    else:  # json
        ok = True
    if not ok:
        got = type(value).__name__
        # JSON parsers give a float for an integer beyond 64 bits (rounded:
        # -2^63-1 becomes -2^63.0, so a float is out of range from 2^63 on).
        if t == "bigint" and not isinstance(value, bool) and (
                (isinstance(value, int) and not -(2**63) <= value < 2**63)
                or (isinstance(value, float) and not abs(value) < 2**63)):
            got = "a number out of its range (-2^63 to 2^63-1)"
        raise RowError(f"{where}: column {column.name!r} expects {t}, got {got}")
    if t == "text" and "\x00" in value:
        raise RowError(f"{where}: column {column.name!r} contains a NUL character")


def check_rows(columns: Sequence[ColumnConfig], rows: Sequence[Any]) -> list[list[Any]]:
    """Validate rows for writing; returns them as lists."""
    width = len(columns)
    out = []
    for i, row in enumerate(rows):
        where = f"row {i}"
        if not isinstance(row, (list, tuple)):
            raise RowError(f"{where}: expected a list of {width} values")
        if len(row) != width:
            raise RowError(f"{where}: expected {width} values, got {len(row)}")
        for column, value in zip(columns, row):
            _check_value(column, value, where)
        out.append(list(row))
    return out


class WireRowCheck:
    """Checks a row received from a peer (RDATA) against the stream's layout.

    ``check(row)`` returns None when the row fits, else a short reason.
    The rules of :func:`check_rows` (arity, types, ``bigint`` in 64 bits,
    no NUL in text, ``null`` only where nullable), except that a
    ``boolean`` may also come as the integer 0 or 1: Synapse writes some
    booleans so.  What fits is handed on as received.
    """

    _EXACT: dict[str, Any] = {"text": str, "bigint": int, "boolean": bool, "json": None}

    def __init__(self, columns: Sequence[ColumnConfig]) -> None:
        self.columns = list(columns)
        self.width = len(self.columns)
        self._fast = [(i, self._EXACT[c.type], c.nullable) for i, c in enumerate(self.columns)]

    def check(self, row: Any) -> str | None:
        if type(row) is not list:
            return f"expected a list of {self.width} values"
        if len(row) != self.width:
            return f"expected {self.width} values, got {len(row)}"
        for i, kind, nullable in self._fast:
            v = row[i]
            if v is None:
                if nullable:
                    continue
            elif kind is None:
                continue
            elif type(v) is kind and (kind is not str or "\x00" not in v) and (
                    kind is not int or -(2**63) <= v < 2**63):
                continue
            problem = self._slow(i, v)
            if problem is not None:
                return problem
        return None

    def _slow(self, i: int, value: Any) -> str | None:
        column = self.columns[i]
        if column.type == "boolean" and type(value) is int and value in (0, 1):
            return None
        try:
            _check_value(column, value, "row")
        except RowError as e:
            return str(e)[len("row: "):]
        return None


def json_problem(value: Any) -> str | None:
    """What makes a decoded ``json`` column value unfit to store and
    replicate: a NUL in a string or key, nesting deeper than
    :data:`MAX_JSON_DEPTH`, or NaN/±Infinity (JSON cannot carry them: they
    would become ``null``).  Iterative, so any depth a parser accepted is
    checked without recursion."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return "contains a NUL character"
        elif isinstance(v, float):
            if v - v != 0.0:  # NaN - NaN and inf - inf are NaN
                return "holds NaN or Infinity, which JSON cannot carry"
        elif isinstance(v, (list, tuple, dict)):
            if depth > MAX_JSON_DEPTH:
                return f"is nested deeper than {MAX_JSON_DEPTH} levels"
            if not isinstance(v, dict):
                stack.extend((item, depth + 1) for item in v)
            else:
                for k, item in v.items():
                    if "\x00" in k:
                        return "contains a NUL character"
                    stack.append((item, depth + 1))
    return None


def reader(columns: Sequence[ColumnConfig], postgres: bool) -> Callable[[tuple[Any, ...]],
                                                                        list[Any]] | None:
    """A function shaping a database row (row columns only) into a wire row.

    None when the database already returns wire values (PostgreSQL decodes
    JSONB and BOOLEAN itself).
    """
    fixes = []
    for i, column in enumerate(columns):
        if column.type == "json" and (column.json_text or not postgres):
            fixes.append((i, _json_text if postgres else orjson.loads))
        elif column.type == "boolean" and not postgres:
            fixes.append((i, bool))
    if not fixes:
        return None

    def shape(values: Any) -> list[Any]:
        row = list(values)
        for i, fn in fixes:
            if row[i] is not None:
                row[i] = fn(row[i])
        return row

    return shape


def _json_text(value: Any) -> Any:
    """JSON kept in a TEXT column (e.g. Synapse's ``receipts_linearized.data``);
    PostgreSQL hands JSON columns over decoded already."""
    return orjson.loads(value) if isinstance(value, str) else value


class RowCodec:
    """A stream's rows checked and converted in one pass (the write path):
    the one check every written row goes through.

    Same rules and messages as :func:`check_rows`, plus: a ``json`` value
    passes :func:`json_problem`, and, when a line limit is given, the row's
    RDATA line fits in it (a longer one could never be replicated).  JSON
    columns come out as JSON text.  The common case (exact types) is checked
    inline, anything else takes the general path, which raises the precise
    :class:`RowError`.  Pure: may run in a thread.
    """

    _EXACT: dict[str, Any] = {"text": str, "bigint": int, "boolean": bool}

    def __init__(self, columns: Sequence[ColumnConfig]) -> None:
        self.columns = list(columns)
        self.width = len(self.columns)
        self._typed = [(i, self._EXACT[c.type], c.nullable, c.type == "text")
                       for i, c in enumerate(self.columns) if c.type != "json"]
        self._json = [(i, c.nullable) for i, c in enumerate(self.columns) if c.type == "json"]

    def _check(self, row: Sequence[Any], n: int) -> None:
        try:
            check_rows(self.columns, [row])
        except RowError as e:
            raise RowError(f"row {n}{str(e)[len('row 0'):]}") from None

    def prepare(self, facts: Any, line_prefix: int = 0, max_line_length: int | None = None,
                first_row: int = 0
                ) -> "tuple[list[list[list[Any]]], list[list[list[Any]]], list[list[bytes]]]":
        """``(wire, params, lines)``: per fact, its rows as wire values, as
        statement parameters (JSON columns as JSON text), and as the JSON
        line each row is in RDATA (:func:`.jsontext.encode_json_line`,
        encoded once here, so the fan-out only puts the prefix in front).
        A row that is not encodable as JSON is a :class:`RowError`.

        With ``max_line_length``, ``line_prefix`` is the length of ``RDATA
        <stream> <writer> <token> `` with the longest token, and a row whose
        line would be longer is a :class:`RowError`.  Errors number a
        fact's rows from ``first_row`` (``facts`` being a slice of it)."""
        room = None if max_line_length is None else max_line_length - line_prefix
        columns = self.columns
        width = self.width
        typed = self._typed
        json_cols = self._json
        dumps = orjson.dumps
        wire_facts, param_facts, line_facts = [], [], []
        for rows in facts:
            wire_rows, param_rows, line_rows = [], [], []
            for n, row in enumerate(rows, first_row):
                if type(row) is not list and type(row) is not tuple or len(row) != width:
                    self._check(row, n)  # raises the precise error
                ok = True
                for i, kind, nullable, text in typed:
                    v = row[i]
                    if v is None:
                        if not nullable:
                            ok = False
                            break
                    elif type(v) is not kind or (text and "\x00" in v) or (
                            kind is int and not -(2**63) <= v < 2**63):
                        ok = False
                        break
                if not ok:
                    self._check(row, n)  # subclasses of the exact types pass
                for i, nullable in json_cols:
                    value = row[i]
                    if value is None:
                        if not nullable:
                            self._check(row, n)
                    else:
                        problem = json_problem(value)
                        if problem is not None:
                            raise RowError(f"row {n}: column {columns[i].name!r} {problem}")
                wire = list(row)
                # encode_json_line's bytes, inline: NaN and infinities were
                # refused above (json_problem), so orjson's output is it.
                try:
                    line = dumps(wire) + b"\n"
                except TypeError:
                    try:
                        line = encode_json_line(wire)
                    except (TypeError, ValueError, RecursionError):
                        raise RowError(f"row {n}: not encodable as JSON") from None
                if room is not None and len(line) - 1 > room:
                    raise RowError(
                        f"row {n}: its RDATA line would be {line_prefix + len(line) - 1} "
                        f"bytes, more than replication.max_line_length ({max_line_length}): "
                        "it could never be replicated")
                params = wire.copy()
                for i, _ in json_cols:
                    if params[i] is not None:
                        params[i] = dumps(params[i]).decode()
                wire_rows.append(wire)
                param_rows.append(params)
                line_rows.append(line)
            wire_facts.append(wire_rows)
            param_facts.append(param_rows)
            line_facts.append(line_rows)
        return wire_facts, param_facts, line_facts
