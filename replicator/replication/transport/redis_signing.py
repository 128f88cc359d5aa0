"""Signed lines on our own Redis channels (``replication.redis.keys``;
README, "Security model").

Without keys every publisher on the channel is believed: anyone who may
PUBLISH there can say ``POSITION caches master T T+2`` and readers skip
what lies in between.  With keys, every line an instance publishes on its
own channels (never on Synapse's, which stays Synapse's wire) but
REPLICATE is wrapped and signed with its Ed25519 private key::

    SIGNED <signer> <meta> <signature> <line>

``signature`` (base64, no padding) covers the channel, ``signer``,
``meta`` and ``line``: a line replayed on another channel, or under
another name, does not verify.  A receiver takes a line only if it
verifies against ``signer``'s public key from its config and, when the
line names an instance (RDATA, POSITION, USER_SYNC, CLEAR_USER_SYNC,
FEDERATION_ACK), ``signer`` is that instance.  REPLICATE stays bare (it
claims nothing: it makes instances announce their positions, and a Synapse
on the channel must still answer it, :mod:`.synapse_watch`).

Replay of a line once signed is harmless by construction, without clocks
or sequence numbers: a POSITION ``prev new`` says there is no fact of its
writer in ``(prev, new]`` unsent before it (:mod:`..core.fanout`), which
stays true forever, and a reader at or above ``new`` ignores it.  An RDATA
line says less on its own (a reader takes its fact as the next one), so
its ``meta`` is ``prev:token:index``: the fact's token, the row's index in
the fact and ``prev``, the token the writer announced before that fact
(nothing of the writer lies in ``(prev, token)``).  Receiving:

* the first row of a fact (index 0) whose ``prev`` is not the last token
  taken from that writer here, or that arrives while another fact is
  open, is preceded by ``POSITION stream writer prev prev`` handed to the
  handler: a reader below ``prev`` reads ``(position, prev]`` from the
  table first, a stale open batch is dropped; a replayed old fact is then
  at or below the position and dropped;
* a later row (index > 0) is taken only as the next row of the fact open
  from that writer; anything else is refused (a replayed ``batch`` row
  cannot join another fact).

So a replayed line moves nothing past a fact it did not carry.  What
replay still can do: make a reader hear a writer again (its "last heard"
for ``/health``), repeat USER_SYNC/CLEAR_USER_SYNC/FEDERATION_ACK lines
that were once true, and cost a verification per line.

Refused lines are never handed on: counted in
``replicator_redis_refused_total{reason}`` and logged once per burst.
"""

import base64
import binascii
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from twisted.logger import Logger

from ...config.fields import ConfigError
from ...config.model import RedisKeys
from ...logs.printable import printable
from ...observe import metrics

log = Logger()

PREFIX = b"SIGNED "
_PREFIX_TEXT = PREFIX.decode()
#: What a signature covers starts so: a signature for anything else (a
#: future version, another use of the key) never verifies here.
DOMAIN = b"replicator-redis-line-v1\x00"
#: Commands whose line names an instance: only that instance may sign them.
#: (The field after the command, the stream, for RDATA/POSITION.)
NAMED = {"RDATA": 2, "POSITION": 2, "USER_SYNC": 1, "CLEAR_USER_SYNC": 1,
         "FEDERATION_ACK": 1}
#: Seconds between two log lines about refused lines (a burst: one line).
LOG_EVERY = 10.0

#: Reasons (the metric's label).
UNSIGNED = "unsigned"
MALFORMED = "malformed"
UNKNOWN_SIGNER = "unknown_signer"
WRONG_SIGNER = "wrong_signer"
BAD_SIGNATURE = "bad_signature"
OUT_OF_ORDER = "out_of_order"


def load_keys(keys: RedisKeys, key: str) -> tuple[Any, dict[str, Any]]:
    """(private key, {instance: public key}) from the files ``keys``
    names; one :class:`ConfigError` naming the key of the first file that
    is missing or not an Ed25519 key in PEM."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )
    from cryptography.hazmat.primitives.serialization import (
        load_pem_private_key,
        load_pem_public_key,
    )

    def read(path: str, where: str, private: bool) -> Any:
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 16)
        except OSError as e:
            raise ConfigError(where, f"cannot read {path}: {e.strerror or e}") from None
        try:
            loaded = (load_pem_private_key(data, None) if private
                      else load_pem_public_key(data))
        except (ValueError, TypeError) as e:
            raise ConfigError(where, f"{path} is not a PEM "
                                     f"{'private' if private else 'public'} key without a "
                                     f"passphrase ({' '.join(str(e).split())[:100]})") from None
        wanted = Ed25519PrivateKey if private else Ed25519PublicKey
        if not isinstance(loaded, wanted):
            raise ConfigError(where, f"{path} is not an Ed25519 key "
                                     f"(openssl genpkey -algorithm ed25519)")
        return loaded

    private = read(keys.private_key, f"{key}.private_key", True)
    public = {name: read(path, f"{key}.public_keys.{name}", False)
              for name, path in keys.public_keys}
    return private, public


def _signed_bytes(channel: bytes, signer: bytes, meta: bytes, line: bytes) -> bytes:
    return b"".join((DOMAIN, channel, b"\x00", signer, b"\x00", meta, b"\x00", line))


class Signer:
    """Wraps and signs the lines this instance publishes on its own
    channels (see the module).

    Keeps, per (stream, writer) of ours, the last token published (a
    POSITION's ``new``, a fact's token): the ``prev`` of the next fact.
    Lines go through :meth:`sign` in the order they are published, which
    is the order the fan-out wrote them; before a writer's first line here
    (none: its position is announced first on every registration) ``prev``
    is ``token - 1``, which is always true, merely dearer (a reader below
    it reads the table)."""

    def __init__(self, private_key: Any, instance_name: str) -> None:
        self._key = private_key
        self._name = instance_name.encode("utf-8")
        self._last: dict[tuple[bytes, bytes], int] = {}

    def sign(self, payloads: Sequence[bytes], channels: Sequence[bytes]) -> list[bytes]:
        """``payloads`` (lines without newline, in publishing order) as they
        go on ``channels`` (one each): REPLICATE as it is, every other line
        wrapped."""
        fact_of = self._fact_tokens(payloads)
        index: dict[tuple[bytes, bytes], int] = {}
        out = []
        for i, (payload, channel) in enumerate(zip(payloads, channels)):
            if payload == b"REPLICATE" or payload.startswith(b"REPLICATE "):
                out.append(payload)
                continue
            meta = b"-"
            if payload.startswith((b"RDATA ", b"POSITION ")):
                parts = payload.split(b" ", 4)
                key = (parts[1], parts[2]) if len(parts) == 5 else None
                if key is not None and parts[0] == b"RDATA" and i in fact_of:
                    token = fact_of[i]
                    k = index.get(key, 0)
                    prev = self._last.get(key, token - 1) if k == 0 else 0
                    meta = b"%d:%d:%d" % (prev, token, k)
                    if parts[3] == b"batch":
                        index[key] = k + 1
                    else:
                        index.pop(key, None)
                        self._last[key] = token
                elif key is not None and parts[0] == b"POSITION" and parts[4].isdigit():
                    self._last[key] = max(int(parts[4]), self._last.get(key, -1))
            signature = self._key.sign(_signed_bytes(channel, self._name, meta, payload))
            out.append(b"%s%s %s %s %s" % (PREFIX, self._name, meta,
                                            base64.b64encode(signature).rstrip(b"="), payload))
        return out

    @staticmethod
    def _fact_tokens(payloads: Sequence[bytes]) -> dict[int, int]:
        """Index of each RDATA line in ``payloads`` -> the token of its
        fact (a ``batch`` row takes that of the next numbered row of its
        writer: the fan-out writes a fact's rows in one call)."""
        out: dict[int, int] = {}
        following: dict[tuple[bytes, bytes], int] = {}
        for i in range(len(payloads) - 1, -1, -1):
            payload = payloads[i]
            if not payload.startswith(b"RDATA "):
                continue
            parts = payload.split(b" ", 4)
            if len(parts) < 5:
                continue
            key = (parts[1], parts[2])
            if parts[3] == b"batch":
                if key in following:
                    out[i] = following[key]
            elif parts[3].isdigit():
                following[key] = out[i] = int(parts[3])
        return out


class Verified:
    """A line that verified: ``line`` (text, as it came before wrapping)
    and, if the handler must hear it first, a ``POSITION s w prev prev``
    line (``before``)."""

    __slots__ = ("line", "before")

    def __init__(self, line: str, before: str | None = None) -> None:
        self.line = line
        self.before = before


class Verifier:
    """Checks the lines heard on our own channels (see the module).

    :meth:`check` gives a :class:`Verified`, or None for a line not to hand
    on: our own echo (not counted) or a refusal (counted by reason, one log
    line per burst).  State per (stream, writer) of lines that verified:
    the last token taken and the fact open, if any (a writer's lines
    arrive in the order published: one channel per stream and writer)."""

    def __init__(self, public_keys: Mapping[str, Any], instance_name: str,
                 accept_unsigned: bool, clock: Any,
                 reads: Callable[[str, str], bool] | None = None) -> None:
        #: ``reads(stream, writer)``: whether RDATA/POSITION of that writer
        #: matter here; those that do not are dropped unverified (the
        #: handler would drop them), so that an instance reading one stream
        #: of many on one channel verifies that one's lines only.
        self._reads = reads
        self._keys = {name.encode("utf-8"): key for name, key in public_keys.items()
                      if name != instance_name}
        self._own = instance_name.encode("utf-8")
        self.accept_unsigned = accept_unsigned
        self._clock = clock
        self._last: dict[tuple[str, str], int] = {}
        self._open: dict[tuple[str, str], tuple[int, int]] = {}
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def reset(self) -> None:
        """A new registration: what was open or last heard is forgotten
        (the first fact of each writer is then preceded by its POSITION)."""
        self._last.clear()
        self._open.clear()

    def check(self, channel: Any, message: Any) -> Verified | None:
        if isinstance(channel, str):
            channel = channel.encode("utf-8")
        raw = message if isinstance(message, bytes) else message.encode("utf-8",
                                                                         "surrogatepass")
        if not raw.startswith(PREFIX):
            if raw.rstrip() == b"REPLICATE":  # (Synapse and we send "REPLICATE ")
                return Verified("REPLICATE")  # claims nothing (see the module)
            if self.accept_unsigned:
                metrics.REDIS_UNSIGNED_ACCEPTED.inc()
                text = raw.decode("utf-8", "replace")
                self._unsigned_seen(text)
                return Verified(text)
            return self._refuse(UNSIGNED, channel, raw)
        parts = raw.split(b" ", 4)
        if len(parts) < 5:
            return self._refuse(MALFORMED, channel, raw)
        _, signer, meta, signature, line = parts
        if signer == self._own:
            return None  # our own echo
        key = self._keys.get(signer)
        if key is None:
            return self._refuse(UNKNOWN_SIGNER, channel, raw)
        try:
            sig = base64.b64decode(signature + b"=" * (-len(signature) % 4), validate=True)
        except (binascii.Error, ValueError):
            return self._refuse(MALFORMED, channel, raw)
        fields = line.split(b" ", 4)
        command = fields[0].decode("ascii", "replace")
        named = NAMED.get(command)
        if named is not None and (len(fields) <= named or fields[named] != signer):
            return self._refuse(WRONG_SIGNER, channel, raw)
        if named == 2 and self._reads is not None and not self._reads(
                fields[1].decode("utf-8", "replace"), fields[2].decode("utf-8", "replace")):
            metrics.COMMANDS_DROPPED.labels(command, "unknown_stream").inc()
            return None
        try:
            key.verify(sig, _signed_bytes(channel, signer, meta, line))
        except Exception:  # cryptography's InvalidSignature; a bad length alike
            return self._refuse(BAD_SIGNATURE, channel, raw)
        text = line.decode("utf-8", "replace")
        if fields[0] == b"POSITION" and len(fields) == 5:
            return self._position(text, fields)
        if fields[0] == b"RDATA":
            return self._rdata(text, fields, meta, channel, raw)
        return Verified(text)

    def _position(self, text: str, fields: list[bytes]) -> Verified:
        key = (fields[1].decode("utf-8", "replace"), fields[2].decode("utf-8", "replace"))
        self._open.pop(key, None)
        if fields[4].isdigit():
            self._last[key] = int(fields[4])
        return Verified(text)

    def _rdata(self, text: str, fields: list[bytes], meta: bytes, channel: bytes,
               raw: bytes) -> Verified | None:
        numbers = meta.split(b":")
        if len(fields) < 5 or len(numbers) != 3 or not all(n.isdigit() for n in numbers):
            return self._refuse(MALFORMED, channel, raw)
        prev, token, index = (int(n) for n in numbers)
        batch = fields[3] == b"batch"
        if not batch and fields[3] != numbers[1]:
            return self._refuse(MALFORMED, channel, raw)
        key = (fields[1].decode("utf-8", "replace"), fields[2].decode("utf-8", "replace"))
        open_fact = self._open.get(key)
        before = None
        if index == 0:
            if open_fact is not None or self._last.get(key) != prev:
                before = f"POSITION {key[0]} {key[1]} {prev} {prev}"
        elif open_fact != (token, index):
            return self._refuse(OUT_OF_ORDER, channel, raw)
        if batch:
            self._open[key] = (token, index + 1)
        else:
            self._open.pop(key, None)
            self._last[key] = token
        return Verified(text, before)

    def _unsigned_seen(self, text: str) -> None:
        """With ``accept_unsigned``: one log line per burst, naming a line."""
        if self._burst_over("unsigned"):
            log.warn("redis: taking unsigned lines (accept_unsigned), e.g. {line}",
                     line=printable(text, 80))

    def _refuse(self, reason: str, channel: bytes, raw: bytes) -> Verified | None:
        metrics.REDIS_REFUSED.labels(reason).inc()
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        if self._burst_over("refused"):
            counts = ", ".join(f"{n} {r}" for r, n in sorted(self._unlogged.items()))
            self._unlogged.clear()
            log.warn("redis: refused lines on {channel} ({counts}; each counted in "
                     "replicator_redis_refused_total), e.g. {line}",
                     channel=printable(channel.decode("utf-8", "replace"), 100),
                     counts=counts, line=printable(raw.decode("utf-8", "replace"), 120))
        return None

    def _burst_over(self, what: str) -> bool:
        now = self._clock.seconds()
        last = self._logged_at.get(what)
        if last is not None and now - last < LOG_EVERY:
            return False
        self._logged_at[what] = now
        return True



def signing(keys: RedisKeys | None, instance_name: str, clock: Any, registry: Any
            ) -> tuple[Signer | None, Verifier | None]:
    """The signer and verifier of a Redis bus under ``keys`` (both None
    without keys: lines go bare and every publisher is believed); the
    verifier checks the lines of writers of ``registry``'s streams only."""
    if keys is None:
        return None, None
    private, public = load_keys(keys, "replication.redis.keys")

    def reads(stream: str, writer: str) -> bool:
        if stream not in registry:
            return False
        return writer in registry.get(stream).config.writers

    return (Signer(private, instance_name),
            Verifier(public, instance_name, keys.accept_unsigned, clock, reads))


def take(verifier: Verifier, channel: Any, message: Any,
         hand_on: Any) -> bool:
    """Check one message of our own channels and give what verified to
    ``hand_on(line)``, a POSITION first where one is due; False if it was
    not handed on."""
    verified = verifier.check(channel, message)
    if verified is None:
        return False
    if verified.before is not None:
        hand_on(verified.before)
    hand_on(verified.line)
    return True


def is_signed(message: Any) -> bool:
    return (message.startswith(PREFIX) if isinstance(message, bytes)
            else message.startswith(_PREFIX_TEXT))
