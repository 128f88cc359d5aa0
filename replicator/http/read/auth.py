"""Who may read which stream through the read API.

A reader proves itself with a secret: ``Authorization: Bearer SECRET``, or
(for a browser's ``EventSource``, which cannot set headers) the cookie
``replicator_reader=SECRET`` or the query parameter ``access_token=SECRET``.
Each ``http.readers[]`` secret reads the streams it lists (``*``: all); the
write secret (``http.secret``) reads every stream.  Secrets are compared in
constant time, every one of them each time; they never appear in an answer
or a log line (the access log shows no query, and the API's redactor hides
every secret).

No credential is 401; a secret nobody has, or one that does not cover the
stream, 403.
"""

import hmac
from collections.abc import Iterable

from ..answers import HttpError

COOKIE = b"replicator_reader"
QUERY = b"access_token"
#: The name a request authenticated with the write secret reads under.
WRITE_SECRET_READER = "secret"

_CHALLENGE = {b"www-authenticate": b'Bearer realm="replicator"'}


class Reader:
    """An authenticated reader: its name, and the streams it may read
    (None: every stream)."""

    def __init__(self, name: str, streams: tuple[str, ...] | None):
        self.name = name
        self.streams = streams

    def covers(self, stream: str) -> bool:
        return self.streams is None or "*" in self.streams or stream in self.streams


class ReaderAuth:
    """The read credentials of one instance."""

    def __init__(self, write_secret: str | None, readers: Iterable = ()):
        self._known: list[tuple[bytes, Reader]] = []
        if write_secret:
            self._known.append((write_secret.encode("utf-8"), Reader(WRITE_SECRET_READER, None)))
        for r in readers:
            if r.secret:
                self._known.append((r.secret.encode("utf-8"), Reader(r.name, tuple(r.streams))))

    @property
    def secrets(self) -> list[str]:
        """Every secret (for the redactor)."""
        return [s.decode("utf-8") for s, _ in self._known]

    def reader(self, request) -> Reader:
        """The reader ``request`` authenticates as; raises 401 or 403."""
        secret = credential(request)
        found = None
        for known, reader in self._known:
            if hmac.compare_digest(secret, known) and found is None:
                found = reader
        if found is None:
            raise HttpError(403, "wrong secret")
        return found

    def check(self, reader: Reader, stream: str) -> None:
        """403 unless ``reader`` may read ``stream``."""
        if not reader.covers(stream):
            raise HttpError(403, f"reader {reader.name} may not read stream {stream}")


def credential(request) -> bytes:
    """The secret a request carries (header, then cookie, then query); 401
    if none or the header is malformed."""
    values = request.requestHeaders.getRawHeaders(b"authorization")
    if values:
        scheme, _, token = values[0].strip().partition(b" ")
        token = token.strip()
        if len(values) != 1 or scheme.lower() != b"bearer" or not token:
            raise HttpError(401, "malformed Authorization header: expected 'Bearer <secret>'",
                            _CHALLENGE)
        return token
    cookie = request.getCookie(COOKIE)
    if cookie:
        return cookie
    tokens = (getattr(request, "args", None) or {}).get(QUERY)
    if tokens:
        if len(tokens) != 1 or not tokens[0]:
            raise HttpError(401, "access_token given more than once or empty", _CHALLENGE)
        return tokens[0]
    raise HttpError(401, "missing credential: expected 'Authorization: Bearer <secret>', the "
                         "cookie replicator_reader or the access_token parameter", _CHALLENGE)
