"""The read API's query parameters, checked: each bad one is a JSON 400
naming it (``{"error": "...", "parameter": "limit"}``)."""

import re
from collections.abc import Mapping

from ..answers import HttpError, excerpt
from .tokens import Positions, TokenError, decode

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_WAIT = 30


class ParameterError(HttpError):
    """A 4xx about one parameter (named in the answer's ``parameter``)."""

    def __init__(self, code: int, parameter: str, message: str,
                 headers: dict[bytes, bytes] | None = None):
        super().__init__(code, message, headers)
        self.extra = {"parameter": parameter}


class TrimmedError(ParameterError):
    """410: facts after the token in ``parameter`` were trimmed by retention
    (docs/streams.md, "Retention"); the answer names the boundary."""

    def __init__(self, parameter: str, writer: str, since: int, boundary: int):
        super().__init__(410, parameter, f"facts after {since} of writer {writer} were "
                                         f"trimmed by retention (up to {boundary}); start "
                                         "again from a token at or after the boundary, or "
                                         f"without {parameter}")
        self.extra = {"parameter": parameter, "trimmed_through": boundary}
        self.writer = writer
        self.since = since
        self.boundary = boundary

    def named(self, parameter: str) -> "TrimmedError":
        """The same refusal about another parameter (``Last-Event-ID``)."""
        return TrimmedError(parameter, self.writer, self.since, self.boundary)


def one(args: Mapping[bytes, list], name: str) -> str | None:
    """The value of parameter ``name`` (None if absent); 400 if given twice
    or not UTF-8."""
    values = args.get(name.encode("ascii"))
    if not values:
        return None
    if len(values) != 1:
        raise ParameterError(400, name, f"{name} given {len(values)} times")
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise ParameterError(400, name, f"{name} is not UTF-8") from None


def bounded_int(args, name: str, default: int, low: int, high: int) -> int:
    text = one(args, name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()) or len(text) > 12 or not low <= int(text) <= high:
        raise ParameterError(400, name, f"{name} must be an integer from {low} to {high}, "
                                        f"got {excerpt(text)}")
    return int(text)


def limit_of(args) -> int:
    return bounded_int(args, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)


_SECONDS = re.compile(r"[0-9]{1,2}(\.[0-9]{1,3})?")


def wait_of(args) -> float:
    """``wait``: seconds, 0 to 30, at most three decimals."""
    text = one(args, "wait")
    if text is None:
        return 0.0
    if not _SECONDS.fullmatch(text) or float(text) > MAX_WAIT:
        raise ParameterError(400, "wait", f"wait must be a number of seconds from 0 to "
                                          f"{MAX_WAIT}, got {excerpt(text)}")
    return float(text)


def positions_of(text: str | None, stream, now: Positions) -> Positions:
    """The positions a ``from`` token names in ``stream`` (absent: 0, the
    beginning, which the routes move up to the trim boundary; ``now``:
    ``now``); 400 for a malformed or foreign token."""
    writers = stream.config.writers
    if text is None:
        return {w: 0 for w in writers}
    if text == "now":
        return dict(now)
    try:
        return decode(text, stream.name, writers)
    except TokenError as e:
        raise ParameterError(400, "from", str(e)) from None
