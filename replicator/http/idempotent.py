"""``Idempotency-Key`` on ``POST .../streams/{stream}/facts``: a retry of a
write answers the first write's ``stream_id`` and writes nothing.

Like Stripe's ``Idempotency-Key`` (one key per logical write, chosen by the
client, kept for a window), not Durable Streams' idempotent producers
(``Producer-Id``/epoch/sequence): a retry must learn the ID its first
attempt got, which a producer's "duplicate, already there" does not say;
and a producer must send its requests in sequence and keep the sequence
across its own restarts, which neither a CLI invocation nor a pool of
independent HTTP requests does.  README, "HTTP API", says what a client
sees.

* The header: 1 to :data:`MAX_KEY_LENGTH` characters of printable ASCII
  without space (``!`` to ``~``), given once; anything else is 400 naming
  the header, before the body is parsed.
* The record is written in the fact's transaction
  (:mod:`replicator.streams.idempotency`); a retry that finds it answers
  200 ``{"stream_id": N}``, the first answer, with ``Idempotent-Replayed:
  true``; one whose rows differ answers 422.
* A retry while the first is still in flight on this instance answers 409
  with ``Retry-After``; on another instance of the deployment (PostgreSQL)
  it waits in the database for the first's transaction, then answers as
  above (or writes, if the first rolled back).  The keys in flight here
  are at most the requests under way (bounded by ``http.max_connections``).
* A write that failed (400, 503...) recorded nothing: a retry writes.
"""

from collections.abc import Awaitable, Callable, Sequence

from ..streams.idempotency import IdempotencyKeys, KeyTaken, fingerprint
from ..streams.trimmed import boundary_key
from ..streams.writes import PreparedFacts, TxnHook
from .answers import HttpError

HEADER = b"idempotency-key"
#: The longest key accepted (Stripe's bound too).
MAX_KEY_LENGTH = 255
#: Sent with a 409 for a key in flight: retry after this many seconds.
RETRY_AFTER = b"1"

Write = Callable[[PreparedFacts, Sequence[TxnHook]], Awaitable[int]]


def idempotency_key(request) -> str | None:
    """The request's ``Idempotency-Key`` (None without one); 400 naming
    the header if it is given twice, empty, too long or not printable
    ASCII without space."""
    values = request.requestHeaders.getRawHeaders(HEADER)
    if not values:
        return None
    if len(values) != 1:
        raise HttpError(400, "Idempotency-Key header given more than once")
    value = values[0]
    if not 0 < len(value) <= MAX_KEY_LENGTH:
        got = f"{len(value)} bytes"
    elif any(not 0x21 <= b <= 0x7E for b in value):
        got = "a space, control or non-ASCII byte"
    else:
        return value.decode("ascii")
    raise HttpError(400, f"Idempotency-Key header must be 1 to {MAX_KEY_LENGTH} printable "
                         f"ASCII characters without space (e.g. a UUID), got {got}")


class IdempotentWrites:
    """Writes with a key: recorded with their fact, answered again."""

    def __init__(self, keys: IdempotencyKeys) -> None:
        self.keys = keys
        self._in_flight: set[tuple[str, str]] = set()

    async def write(self, stream, prepared: PreparedFacts, key: str,
                    write: Write) -> tuple[int, bool]:
        """``(stream_id, replayed)``: the write of ``prepared`` with
        ``key``, by ``write(prepared, hooks)`` (which answers its own
        failures), or the first write's ID; else 409/422."""
        table = boundary_key(stream.config)
        slot = (table, key)
        if slot in self._in_flight:
            raise _in_flight()
        print_ = fingerprint(stream.name, prepared.lines[0])
        self._in_flight.add(slot)
        try:
            try:
                stream_id = await write(prepared, [self.keys.hook(table, key, print_)])
            except KeyTaken:
                recorded = await self.keys.lookup(table, key)
                if recorded is None:  # pruned, or replaced, meanwhile
                    raise _in_flight() from None
                if recorded.fingerprint != print_:
                    raise HttpError(422, "Idempotency-Key was used for another write "
                                         f"(stream {stream.name}, other rows): use a new key "
                                         "for a new write") from None
                return recorded.stream_id, True
            return stream_id, False
        finally:
            self._in_flight.discard(slot)


def _in_flight() -> HttpError:
    return HttpError(409, "a request with this Idempotency-Key is still in flight: "
                          "retry it later", {b"retry-after": RETRY_AFTER})
