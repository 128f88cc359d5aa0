"""The pieces every config section is parsed with: :class:`ConfigError`,
the name patterns, and typed getters that take a mapping, a key and the key
path it came from, and raise one :class:`ConfigError` naming that path.

Invariants (new getters must keep them): a name is checked with
``fullmatch``; every number has a range (NaN and infinities are never in
range); a message is one line (values and unknown keys appear as ``repr``).
"""

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Optional

# Always used with fullmatch.
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# Stream and instance names travel as single words on the wire: no space,
# no control character.
WIRE_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,200}")
#: Words PostgreSQL or SQLite refuse as an unquoted table, column or
#: sequence name (checked against both: CREATE, INSERT, SELECT ... GROUP BY).
#: Table and column names are written into SQL unquoted, so these are refused.
SQL_KEYWORDS = frozenset("""
    add all alter analyse analyze and any array as asc asymmetric authorization
    autoincrement between binary both case cast check collate collation column
    commit concurrently constraint create cross current_catalog current_date
    current_role current_schema current_time current_timestamp current_user
    default deferrable delete desc distinct do drop else end escape except
    exists false fetch for foreign freeze from full grant group having if ilike
    in index initially inner insert intersect into is isnull join lateral
    leading left like limit localtime localtimestamp natural not nothing
    notnull null offset on only or order outer overlaps placing primary raise
    references returning right select session_user set similar some symmetric
    table tablesample then to trailing transaction true union unique update
    user using values variadic verbose when where window with
""".split())


class ConfigError(ValueError):
    """A configuration mistake: ``key`` names where, ``problem`` says what."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"config: {key}: {problem}")
        self.key = key
        self.problem = problem



def as_mapping(value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping, got {kind_of(value)}")
    return value


def kind_of(value: Any) -> str:
    if value is None:
        return "nothing"
    return type(value).__name__


def _key_name(name: Any) -> str:
    """A key as it may appear in a message: itself if it is a plain word,
    else its repr (one line whatever it holds)."""
    if isinstance(name, str) and IDENTIFIER.fullmatch(name):
        return name
    return repr(name)


def no_unknown(section: Mapping[str, Any], allowed: Iterable[str], key: str) -> None:
    """A ConfigError naming the first key of ``section`` not in ``allowed``
    (``key`` is the section's own path, "" at the top), with the allowed
    key it probably meant when one is close (a typo: ``levle``)."""
    for name in section:
        if name not in allowed:
            prefix = f"{key}." if key else ""
            raise ConfigError(f"{prefix}{_key_name(name)}",
                              "unknown key" + did_you_mean(name, allowed))


def one_line(error: BaseException) -> str:
    """An exception's text on one line (its type's name if it has none)."""
    return " ".join((str(error) or type(error).__name__).split())


def did_you_mean(name: Any, allowed: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the one allowed key closest to
    ``name``, or "" when none is close."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, sorted(a for a in allowed if isinstance(a, str)),
                                      n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def sql_name(value: str, path: str) -> str:
    """An unquoted SQL identifier: valid, and no keyword of either engine."""
    if value.lower() in SQL_KEYWORDS:
        raise ConfigError(path, f"{value!r} is an SQL keyword")
    return value


def get_str(section: Mapping[str, Any], name: str, key: str, default: Any = ...,
            pattern: Optional["re.Pattern[str]"] = None, what: str = "") -> Any:
    """``section[name]``: a non-empty string (matching ``pattern``, which
    ``what`` describes), else ``default``; missing without a default is a
    ConfigError naming ``key.name``."""
    path = _path(key, name)
    if name not in section or section[name] is None:
        if default is ...:
            raise ConfigError(path, "missing")
        return default
    value = section[name]
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected a non-empty string, got {kind_of(value)}")
    if pattern is not None and not pattern.fullmatch(value):
        raise ConfigError(path, f"{value!r} is not {what or 'valid'}")
    return value


def get_path(section: Mapping[str, Any], name: str, key: str, default: Any = ...) -> Any:
    """``section[name]``: a file path (a non-empty string without a NUL byte,
    which no file name can hold); the file itself is not looked at."""
    value = get_str(section, name, key, default)
    if isinstance(value, str) and "\x00" in value:
        raise ConfigError(_path(key, name), f"{value!r} is not a file path (it holds a NUL "
                                            f"byte)")
    return value


def get_int(section: Mapping[str, Any], name: str, key: str, default: Any = ..., *, minimum: int,
         maximum: int) -> int:
    """An integer in ``[minimum, maximum]`` (both required: every number has
    a range)."""
    if not _given(section, name, key, default):
        given: int = default
        return given
    path, value = _path(key, name), section[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"expected an integer, got {kind_of(value)}")
    if not minimum <= value <= maximum:
        raise ConfigError(path, f"must be an integer from {minimum} to {maximum}, "
                                f"got {value}")
    return value


def get_number(section: Mapping[str, Any], name: str, key: str, default: float, *, minimum: float,
               maximum: float) -> float:
    """A finite number (int or float) in ``[minimum, maximum]``."""
    path = _path(key, name)
    value = section.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(path, f"expected a number, got {kind_of(value)}")
    if not (math.isfinite(value) and minimum <= value <= maximum):
        raise ConfigError(path, f"must be a number from {minimum:g} to {maximum:g}, "
                                f"got {value}")
    return float(value)


def get_bool(section: Mapping[str, Any], name: str, key: str, default: bool) -> bool:
    """``section[name]`` as a YAML boolean (``default`` if missing)."""
    path = _path(key, name)
    value = section.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {kind_of(value)}")
    return value


def get_list(section: Mapping[str, Any], name: str, key: str, default: Any = ...,
             empty: str | None = None) -> list[Any]:
    """``section[name]``: a list (with ``empty``, a non-empty one: ``empty``
    says why none is wrong)."""
    if not _given(section, name, key, default):
        given: list[Any] = default
        return given
    path, value = _path(key, name), section[name]
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list, got {kind_of(value)}")
    if empty is not None and not value:
        raise ConfigError(path, empty)
    return value


def get_names(section: Mapping[str, Any], name: str, key: str, empty: str) -> tuple[str, ...]:
    """``section[name]``: a non-empty list of instance names (as they travel
    on the wire)."""
    names = get_list(section, name, key, empty=empty)
    for i, item in enumerate(names):
        if not isinstance(item, str) or not WIRE_NAME.fullmatch(item):
            raise ConfigError(f"{_path(key, name)}[{i}]", f"{item!r} is not an instance name")
    return tuple(names)


def _path(key: str, name: str) -> str:
    """The dotted path of ``name`` in the section at ``key``."""
    return f"{key}.{name}" if key else name


def _given(section: Mapping[str, Any], name: str, key: str, default: Any) -> bool:
    """Whether ``section`` has ``name``; missing without a default (``...``)
    is a ConfigError."""
    if name in section:
        return True
    if default is ...:
        raise ConfigError(_path(key, name), "missing")
    return False
