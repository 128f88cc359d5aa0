"""How lines travel: one connection's framing, the TCP protocol and its factories, Redis pub/sub,
and who may connect."""
