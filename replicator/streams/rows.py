"""A stream's row layout: checking rows on write, shaping them on read.

An RDATA row is a JSON array of the stream's declared columns, in order,
carrying real JSON values: ``bigint`` an integer, ``boolean`` true/false,
``json`` nested JSON (never a JSON string of it), ``text`` a string, and
``null`` only where the column is nullable.
"""

from typing import Any, Callable, List, Optional, Sequence

import orjson

from ..config import ColumnConfig


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
        raise RowError(f"{where}: column {column.name!r} expects {t}, got {type(value).__name__}")
    if t == "text" and "\x00" in value:
        raise RowError(f"{where}: column {column.name!r} contains a NUL character")


def check_rows(columns: Sequence[ColumnConfig], rows: Sequence[Any]) -> List[list]:
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


def db_params(columns: Sequence[ColumnConfig], row: Sequence[Any]) -> List[Any]:
    """A checked row as statement parameters (JSON columns as JSON text)."""
    params = list(row)
    for i, column in enumerate(columns):
        if column.type == "json" and params[i] is not None:
            params[i] = orjson.dumps(params[i]).decode()
    return params


def reader(columns: Sequence[ColumnConfig], postgres: bool) -> Optional[Callable[[tuple], list]]:
    """A function shaping a database row (row columns only) into a wire row.

    None when the database already returns wire values (PostgreSQL decodes
    JSONB and BOOLEAN itself).
    """
    fixes = []
    for i, column in enumerate(columns):
        if column.type == "json" and not postgres:
            fixes.append((i, orjson.loads))
        elif column.type == "boolean" and not postgres:
            fixes.append((i, bool))
    if not fixes:
        return None

    def shape(values) -> list:
        row = list(values)
        for i, fn in fixes:
            if row[i] is not None:
                row[i] = fn(row[i])
        return row

    return shape
