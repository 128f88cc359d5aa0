"""Which database column types hold a stream's declared column types
(docs/configuration.md, "Column types").

A start (``replicator run``, and ``replicator check`` before it) compares
every configured column with its table's column through :func:`mismatch`,
so that a type the table cannot give back is one config line at start, not
a refused RDATA (and a reconnect) per fact.

A table column fits a declared type when every value the database hands back
for it is the declared wire value once :func:`replicator.streams.rows.reader`
has shaped it: a ``bigint`` an integer, a ``text`` a string, a ``boolean``
true/false, a ``json`` a decoded JSON value.  For a stream this instance
writes, the column must also take every value the row check lets through:
``bigint`` needs ``bigint`` (not ``integer``), ``text`` a column without a
length limit, ``json`` a JSON column (JSON text in an array column is
refused by the database).

The database's type is first sorted into a *kind* (:func:`postgres_kind`,
:func:`sqlite_kind`); the tables here say which kinds fit which declared
type.  Pure functions: the queries are :func:`.schema.column_types`'s.
"""

from typing import NamedTuple


class TableType(NamedTuple):
    """A column's type as its table has it: ``kind`` (a key of the tables
    below, or ``other``) and ``shown``, its name for a message."""

    kind: str
    shown: str


# ------------------------------------------------------------- PostgreSQL
#: information_schema's data_type of the scalar types that have a kind.
_PG_SCALAR = {
    "bigint": "bigint", "integer": "integer", "smallint": "integer",
    "text": "text", "boolean": "boolean", "json": "json", "jsonb": "json",
}
#: Element types (pg_type names) of the arrays psycopg2 decodes into JSON
#: values (lists of strings, integers, booleans or JSON), and their names.
_PG_ARRAY_ELEMENTS = {
    "text": "text", "varchar": "character varying", "bpchar": "character",
    "int2": "smallint", "int4": "integer", "int8": "bigint", "bool": "boolean",
    "json": "json", "jsonb": "jsonb",
}


def postgres_kind(data_type: str, udt_name: str, max_length: int | None) -> TableType:
    """The kind of a PostgreSQL column from ``information_schema.columns``
    (``data_type``, ``udt_name``, ``character_maximum_length``; a domain
    has its underlying type there)."""
    if data_type in _PG_SCALAR:
        return TableType(_PG_SCALAR[data_type], data_type)
    if data_type in ("character varying", "character"):
        if max_length is None:  # varchar without a limit: text
            return TableType("text" if data_type == "character varying" else "bounded_text",
                             data_type)
        return TableType("bounded_text", f"{data_type}({max_length})")
    if data_type == "ARRAY":
        element = udt_name[1:]  # the array type's name is _<element>
        if element in _PG_ARRAY_ELEMENTS:
            return TableType("array", _PG_ARRAY_ELEMENTS[element] + "[]")
        return TableType("other", element + "[]")
    if data_type == "USER-DEFINED":
        return TableType("other", udt_name)
    return TableType("other", data_type)


#: Declared type → (kinds a column of a stream only read here may have,
#: kinds a column of a stream written here may have).
_PG_FITS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "bigint": (frozenset({"bigint", "integer"}), frozenset({"bigint"})),
    "text": (frozenset({"text", "bounded_text"}), frozenset({"text"})),
    "boolean": (frozenset({"boolean"}), frozenset({"boolean"})),
    "json": (frozenset({"json", "array"}), frozenset({"json"})),
}
#: A preset's JSON-in-text column (Synapse's ``receipts_linearized.data``):
#: decoded when read, whether the column is text or JSON.
_PG_JSON_TEXT = (frozenset({"json", "text", "bounded_text"}), frozenset({"json", "text"}))
#: The types of each kind, for a message.
_PG_NAMES: dict[str, tuple[str, ...]] = {
    "bigint": ("bigint",), "integer": ("integer", "smallint"), "text": ("text",),
    "bounded_text": ("character varying", "character"), "boolean": ("boolean",),
    "json": ("json", "jsonb"), "array": ("an array of text, integers, booleans or JSON",),
}

# ----------------------------------------------------------------- SQLite
# SQLite stores any value in any column; what it converts a value to is the
# column's affinity, from its declared type (sqlite.org/datatype3.html,
# 3.1): the first of these rules that matches.


def sqlite_kind(declared: str) -> TableType:
    """The kind of a SQLite column from its declared type (``PRAGMA
    table_info``): its affinity, except that ``BOOLEAN`` and ``BOOL``
    (NUMERIC affinity: Synapse's booleans, stored as 0 and 1) are
    ``boolean``."""
    upper = declared.upper()
    shown = declared or "no declared type"
    if "INT" in upper:
        return TableType("integer", shown)
    if "CHAR" in upper or "CLOB" in upper or "TEXT" in upper:
        return TableType("text", shown)
    if upper.strip() in ("BOOLEAN", "BOOL"):
        return TableType("boolean", shown)
    return TableType("other", shown)


#: Declared type → kinds that fit it, read or written (SQLite integers are
#: 64-bit whatever the declared type, and text has no limit).  A ``json``
#: value is stored as its JSON text, so it needs TEXT affinity: a NUMERIC
#: column (``JSON``) would turn the JSON text ``1`` into the number 1.
_SQLITE_FITS: dict[str, frozenset[str]] = {
    "bigint": frozenset({"integer"}),
    "text": frozenset({"text"}),
    "boolean": frozenset({"integer", "boolean"}),
    "json": frozenset({"text"}),
}
_SQLITE_NAMES: dict[str, tuple[str, ...]] = {
    "integer": ("INTEGER affinity (a type with INT in its name)",),
    "text": ("TEXT affinity (a type with CHAR, CLOB or TEXT in its name)",),
    "boolean": ("BOOLEAN",),
}

_ORDER = ("bigint", "integer", "text", "bounded_text", "boolean", "json", "array")


def mismatch(declared: str, json_text: bool, found: TableType, postgres: bool,
             written: bool) -> str | None:
    """None when a column of ``found`` type fits ``declared`` (one of
    :data:`replicator.config.model.COLUMN_TYPES`); else what fits, to close
    the message: ``bigint reads from bigint, integer or smallint``.
    ``written``: the stream is written here (it stores values too)."""
    if postgres:
        read, write = _PG_JSON_TEXT if json_text else _PG_FITS[declared]
        kinds, names = (write if written else read), _PG_NAMES
    else:
        kinds, names = _SQLITE_FITS[declared], _SQLITE_NAMES
    if found.kind in kinds:
        return None
    listed = [name for k in _ORDER if k in kinds for name in names[k]]
    allowed = listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " or " + listed[-1]
    if postgres and written:
        return f"written here, {declared} needs {allowed}"
    return f"{declared} reads from {allowed}"
