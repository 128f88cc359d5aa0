"""Endpoint strings in a config: checked when parsed."""

from typing import Mapping, Optional

from .fields import ConfigError, get_str


def _endpoint(section: Mapping, name: str, key: str, kind: str) -> Optional[str]:
    """An endpoint string, checked by Twisted's own parser."""
    value = get_str(section, name, key, None)
    if value is None:
        return None
    from twisted.internet import endpoints, reactor

    path = f"{key}.{name}"
    try:
        if kind == "server":
            parsed = endpoints.serverFromString(reactor, value)
        else:
            parsed = endpoints.clientFromString(reactor, value)
    except Exception as e:  # Twisted raises several types for bad strings
        detail = " ".join((str(e) or type(e).__name__).split())
        raise ConfigError(path, f"cannot parse endpoint {value!r}: {detail}") from None
    _check_endpoint(parsed, path)
    return value


def _check_endpoint(parsed, path: str) -> None:
    """What Twisted's parser lets through but no listen or connect could use:
    a port out of range, an interface that is not an IP address, an absurd
    backlog.  (The endpoint classes keep these as attributes; an endpoint
    type without them is not checked further.)"""
    import ipaddress

    port = getattr(parsed, "_port", None)
    if isinstance(port, int) and not 0 <= port <= 65535:
        raise ConfigError(path, f"port {port} is not from 0 to 65535")
    interface = getattr(parsed, "_interface", None)
    if isinstance(interface, str) and interface:
        try:
            ipaddress.ip_address(interface.strip("[]"))
        except ValueError:
            raise ConfigError(path, f"interface {interface!r} is not an IP address") from None
    backlog = getattr(parsed, "_backlog", None)
    if isinstance(backlog, int) and not 1 <= backlog <= 65535:
        raise ConfigError(path, f"backlog {backlog} is not from 1 to 65535")
