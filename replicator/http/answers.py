"""What an HTTP route gives back: a JSON value, a :class:`Response` (any
other content), or a raised :class:`HttpError`; and the secret check the
routes that need one start with."""

import hmac
from typing import Any

JSON_TYPE = b"application/json"


class HttpError(Exception):
    """An answer other than success: status, one-line message, extra headers."""

    #: The key the message goes under in the JSON answer.
    key = "error"
    #: Other members of the JSON answer.
    extra: dict[str, Any] = {}

    def __init__(self, code: int, message: str, headers: dict[bytes, bytes] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.headers = headers or {}


class Response:
    """A successful answer that is not JSON (metrics, the status page, a
    page encoded in a thread)."""

    def __init__(self, body: bytes, content_type: bytes,
                 headers: dict[bytes, bytes] | None = None):
        self.body = body
        self.content_type = content_type
        self.headers = headers or {}


def excerpt(text: str, limit: int = 60) -> str:
    """``text`` quoted and cut for an error message."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


_CHALLENGE = {b"www-authenticate": b'Bearer realm="replicator"'}


def authorize(request, secret: bytes | None) -> None:
    """Raise 401 (no or malformed ``Authorization: Bearer``) or 403 (no
    secret configured, or a wrong one, compared in constant time)."""
    values = request.requestHeaders.getRawHeaders(b"authorization")
    if not values:
        raise HttpError(401, "missing Authorization header: expected 'Bearer <secret>'",
                        _CHALLENGE)
    scheme, _, token = values[0].strip().partition(b" ")
    token = token.strip()
    if len(values) != 1 or scheme.lower() != b"bearer" or not token:
        raise HttpError(401, "malformed Authorization header: expected 'Bearer <secret>'",
                        _CHALLENGE)
    if secret is None:
        raise HttpError(403, "no http secret is configured on this instance")
    if not hmac.compare_digest(token, secret):
        raise HttpError(403, "wrong secret")
