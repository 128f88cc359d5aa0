"""A writer's proof of identity on the TCP protocol (replicator's extension
of Synapse's wire, docs/protocol.md, "Proof of a writer's identity").

Synapse's protocol believes a client's ``NAME``.  Where the server's
configuration gives a remote writer a secret (``replication.writer_secrets``),
a connection saying ``NAME <writer>`` must prove it holds that secret before
any of its RDATA/POSITION is taken:

* the server answers that ``NAME`` with ``AUTH_CHALLENGE <nonce>``, a fresh
  random nonce per connection (so a recorded proof is worth nothing on
  another connection);
* the client answers ``AUTH <proof>``, the HMAC-SHA256 (hex) under its
  secret of the server name, its instance name and the nonce: the secret
  never crosses the wire, and a proof for one name or deployment is not one
  for another.

Only a server of ours sends ``AUTH_CHALLENGE``, and only to a name its
configuration gives a secret (a replicator writer, never a Synapse worker);
a client sends ``AUTH`` only when asked.  Everything here is pure.
"""

import hashlib
import hmac
import re
import secrets

#: What the HMAC covers first: a proof of this scheme is never one of another.
CONTEXT = b"replicator AUTH v1"
#: A nonce as servers send them (a client signs nothing else).
NONCE = re.compile(r"[0-9a-f]{32,128}")
#: A proof's form (64 hex digits).
PROOF = re.compile(r"[0-9a-f]{64}")


def new_nonce() -> str:
    """A fresh nonce: 128 random bits, hex."""
    return secrets.token_hex(16)


def proof(secret: str, server_name: str, instance_name: str, nonce: str) -> str:
    """The answer of ``instance_name`` holding ``secret`` to ``nonce`` from
    the server of ``server_name``."""
    message = b"\n".join((CONTEXT, server_name.encode("utf-8", "surrogatepass"),
                          instance_name.encode("utf-8", "surrogatepass"), nonce.encode("ascii")))
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def verify(secret: str, server_name: str, instance_name: str, nonce: str, answer: str) -> bool:
    """Whether ``answer`` is the proof of ``instance_name`` for ``nonce``
    (compared in constant time)."""
    if not PROOF.fullmatch(answer):
        return False
    expected = proof(secret, server_name, instance_name, nonce)
    return hmac.compare_digest(expected, answer)
