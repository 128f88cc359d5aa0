#!/usr/bin/env python3
"""What signing costs on Redis (``replication.redis.keys``), in one
process and on one core, no server: messages per second through our
transport's publishing step (:func:`replicator.replication.transport.redis_bus.routed`,
a fan-out's block of 20 one-row facts at a time) and its receiving step
(the verifier, then the line parsed), signed beside unsigned, for one-row
RDATA lines of about 100 bytes (a cache invalidation) and 1 KB.

    .venv/bin/python scripts/bench/redis_signing_bench.py [--seconds 2]

Not part of ``make bench``: it measures our code against itself, not
against a baseline outside it (docs/operations.md, "Redis: signed lines").
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from twisted.internet import task  # noqa: E402

from replicator.replication.transport.redis_bus import routed  # noqa: E402
from replicator.replication.transport.redis_channels import ChannelLayout  # noqa: E402
from replicator.replication.transport.redis_signing import Signer, Verifier  # noqa: E402
from replicator.replication.wire.commands import parse_line  # noqa: E402

BLOCK = 20


def rate(step, per_call: int, seconds: float) -> float:
    """Messages per second of ``step()`` (``per_call`` messages a call)."""
    n, started = 0, time.perf_counter()
    while True:
        step()
        n += per_call
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return n / elapsed


def measure(key, size: int, seconds: float) -> str:
    """One line of figures for one-row RDATA lines of about ``size`` bytes."""
    layout = ChannelLayout("hs.test", "hs.test")
    pad = "x" * max(1, size - 60)
    lines = [b'RDATA caches master %d ["%s",null,1490197670513]\n' % (1000 + i, pad.encode())
             for i in range(BLOCK)]
    signer = Signer(key, "master")
    unsigned_out = rate(lambda: routed(layout, lines, None, None), BLOCK, seconds)
    signed_out = rate(lambda: routed(layout, lines, None, signer), BLOCK, seconds)
    payloads, channels = routed(layout, lines, None, Signer(key, "master"))
    bare = [line[:-1].decode() for line in lines]
    verifier = Verifier({"master": key.public_key()}, "reader", False, task.Clock())

    def receive_signed():
        verifier.reset()
        for channel, payload in zip(channels, payloads):
            parse_line(verifier.check(channel, payload).line)

    def receive_unsigned():
        for line in bare:
            parse_line(line)

    unsigned_in = rate(receive_unsigned, BLOCK, seconds)
    signed_in = rate(receive_signed, BLOCK, seconds)
    return (f"{len(lines[0])} B lines: publish {signed_out:,.0f} msg/s signed, "
            f"{unsigned_out:,.0f} unsigned; receive {signed_in:,.0f} msg/s verified, "
            f"{unsigned_in:,.0f} unsigned; {len(payloads[0]) - len(lines[0]) + 1} B more "
            f"per message")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    key = Ed25519PrivateKey.generate()
    for size in (100, 1000):
        print(measure(key, size, args.seconds))


if __name__ == "__main__":
    main()
