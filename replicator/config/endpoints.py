"""Endpoint strings in a config, checked without building an endpoint.

Parsing keeps the *string*: the instance builds its endpoints with its own
reactor when it listens or connects.  Here the string is split with the
project's one parser (:mod:`replicator.endpoint_strings`) and, for the types
users write (``tcp``, ``tcp6``, ``ssl``, ``unix`` listeners; ``tcp``, ``ssl``,
``tls``, ``unix`` clients), its fields are checked as Twisted would coerce
them, plus what Twisted lets through but no listen or connect could use: a
port out of range, an interface that is not an IP address, an absurd
backlog.  Anything else (a plugin's type, an unknown keyword, a TLS file)
is Twisted's to judge, in :func:`replicator.config.validate`.
"""

import ipaddress
from typing import Mapping, Optional

from ..endpoint_strings import Endpoint, parse
from .fields import ConfigError, get_str

#: Server types with a port (positional or ``port=``), an interface and a backlog.
_PORT_SERVERS = ("tcp", "tcp6", "ssl")
#: Client types with a host and a port (positional or keywords).
_PORT_CLIENTS = ("tcp", "ssl", "tls")


def get_endpoint(section: Mapping, name: str, key: str, kind: str) -> Optional[str]:
    """``section[name]`` as an endpoint string (``kind`` is ``server`` or
    ``client``), syntax checked; None if not given."""
    value = get_str(section, name, key, None)
    if value is None:
        return None
    path = f"{key}.{name}"
    try:
        if "\x00" in value:  # no host, port or path can hold one
            raise ValueError("it holds a NUL byte")
        parsed = parse(value)
        if kind == "server":
            _check_server(parsed)
        else:
            _check_client(parsed)
    except ValueError as e:
        raise ConfigError(path, f"cannot parse endpoint {value!r}: {_one_line(e)}") from None
    except _Unusable as e:
        raise ConfigError(path, str(e)) from None
    return value


class _Unusable(Exception):
    """A field Twisted would accept but no listen or connect could use."""


def _one_line(error: BaseException) -> str:
    return " ".join((str(error) or type(error).__name__).split())


def _check_server(parsed: Endpoint) -> None:
    if parsed.kind in _PORT_SERVERS:
        port = parsed.kwargs.get("port", parsed.args[0] if parsed.args else None)
        _port(port)
        interface = parsed.kwargs.get("interface", "")
        if interface:
            try:
                ipaddress.ip_address(interface.strip("[]"))
            except ValueError:
                raise _Unusable(f"interface {interface!r} is not an IP address") from None
        _backlog(parsed)
    elif parsed.kind == "unix":
        if not parsed.kwargs.get("address", parsed.args[0] if parsed.args else ""):
            raise ValueError("no socket path")
        int(parsed.kwargs.get("mode", "666"), 8)
        _backlog(parsed)


def _check_client(parsed: Endpoint) -> None:
    if parsed.kind in _PORT_CLIENTS:
        args, kwargs = parsed.args, parsed.kwargs
        if len(args) >= 2:
            host, port = args[0], args[1]
        elif len(args) == 1 and "host" in kwargs:
            host, port = kwargs["host"], args[0]
        else:
            host = args[0] if args else kwargs.get("host")
            port = kwargs.get("port")
        if not host:
            raise ValueError("no host")
        _port(port)
        if "timeout" in kwargs:
            int(kwargs["timeout"])
    elif parsed.kind == "unix":
        if not parsed.kwargs.get("path", parsed.args[0] if parsed.args else ""):
            raise ValueError("no socket path")


def _port(text: Optional[str]) -> None:
    if text is None:
        raise ValueError("no port")
    port = int(text)
    if not 0 <= port <= 65535:
        raise _Unusable(f"port {port} is not from 0 to 65535")


def _backlog(parsed: Endpoint) -> None:
    backlog = int(parsed.kwargs.get("backlog", "50"))
    if not 1 <= backlog <= 65535:
        raise _Unusable(f"backlog {backlog} is not from 1 to 65535")
