"""Connections and their policies: the one reconnect backoff, reconnecting links, per-address caps,
endpoint strings and TLS."""
