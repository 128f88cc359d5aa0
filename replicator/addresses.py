"""How a connection's peer is named in the status page, the disconnect
history and log lines: its address, when its transport has one."""

from typing import Any


def peer_address(conn: Any) -> str | None:
    """``host:port`` of a connection's peer (``conn.transport.getPeer()``),
    if it has one."""
    try:
        peer = conn.transport.getPeer()
    except Exception:
        return None
    host, port = getattr(peer, "host", None), getattr(peer, "port", None)
    return f"{host}:{port}" if host is not None else None

