"""Ed25519 keys for ``replication.redis.keys`` in tests: key files made
on the spot, an instance's ``RedisKeys`` among them, and the refusal
counter.  Test modules import them from here, never from one another."""

import os

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from replicator.config import RedisKeys
from replicator.observe import metrics


def write_keys(directory, *names):
    """An Ed25519 key pair per name in ``directory``: {name: (private path,
    public path)}, PEM as ``openssl genpkey -algorithm ed25519`` writes."""
    out = {}
    for name in names:
        key = Ed25519PrivateKey.generate()
        private = os.path.join(directory, f"{name}.key")
        public = os.path.join(directory, f"{name}.pub")
        with open(private, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        with open(public, "wb") as f:
            f.write(key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        out[name] = (private, public)
    return out


def keys_for(paths, name, accept_unsigned=False):
    """The ``RedisKeys`` of instance ``name`` among ``paths`` (write_keys)."""
    return RedisKeys(paths[name][0], tuple((n, p[1]) for n, p in sorted(paths.items())),
                     accept_unsigned)


def refused(reason):
    return metrics.REDIS_REFUSED.labels(reason)._value.get()
