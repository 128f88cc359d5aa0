"""Endpoint strings in a config, checked without building an endpoint.

Parsing keeps the *string*: the instance builds its endpoints with its own
reactor when it listens or connects.  Here the string is split with the
project's one parser (:mod:`replicator.net.endpoint_strings`) and, for the types
users write (``tcp``, ``tcp6``, ``ssl``, ``tls``, ``unix`` listeners; ``tcp``,
``ssl``, ``tls``, ``unix`` clients), its fields are checked as Twisted would
coerce them, plus what Twisted lets through but no listen or connect could
use: a port out of range, an interface that is not an IP address, an absurd
backlog.  A listener never falls back on Twisted's defaults: its port is
written out (``tls:`` would listen on 443), and so are its TLS files (an
``ssl:`` listener's ``privateKey``, which Twisted would look for as
``server.pem`` in the working directory; a ``tls:`` listener's directory of
PEM files).  Anything else (a plugin's type, an unknown keyword, what a TLS
file holds) is Twisted's to judge, in :func:`replicator.config.validate`.
"""

import ipaddress
from collections.abc import Mapping
from typing import Any

from ..net.endpoint_strings import Endpoint, parse
from .fields import ConfigError, did_you_mean, get_str, one_line

#: Server types with a port (positional or ``port=``), an interface and a backlog.
_PORT_SERVERS = ("tcp", "tcp6", "ssl")
#: What an ``ssl:`` listener without its key is told.
NO_PRIVATE_KEY = ("an ssl: listener needs privateKey= (its key file; certKey= too if the "
                  "certificate is in another file)")
#: Client types with a host and a port (positional or keywords).
_PORT_CLIENTS = ("tcp", "ssl", "tls")


def get_endpoint(section: Mapping[str, Any], name: str, key: str, kind: str) -> str | None:
    """``section[name]`` as an endpoint string (``kind`` is ``server`` or
    ``client``), syntax checked; None if not given."""
    value: str | None = get_str(section, name, key, None)
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
        raise ConfigError(path, f"cannot parse endpoint {value!r}: {one_line(e)}") from None
    except _Unusable as e:
        raise ConfigError(path, str(e)) from None
    return value


class _Unusable(Exception):
    """A field Twisted would accept but no listen or connect could use."""


#: The keyword options of the endpoint types an operator writes (Twisted's
#: parsers' own keywords), to name a typo before Twisted's TypeError would.
_SERVER_OPTIONS = {
    "tcp": ("port", "interface", "backlog"),
    "tcp6": ("port", "interface", "backlog"),
    "ssl": ("port", "interface", "backlog", "privateKey", "certKey", "sslmethod",
            "extraCertChain", "dhParameters"),
    "unix": ("address", "mode", "backlog", "lockfile"),
}
_CLIENT_OPTIONS = {
    "tcp": ("host", "port", "timeout", "bindAddress"),
    "ssl": ("host", "port", "timeout", "bindAddress", "certKey", "privateKey", "caCertsDir"),
    "tls": ("host", "port", "timeout", "bindAddress", "certificate", "privateKey",
            "trustRoots", "endpoint"),
    "unix": ("path", "timeout", "checkPID"),
}


def _known_options(parsed: Endpoint, options: dict[str, Any], role: str) -> None:
    """An option the endpoint's type does not have is named, with the
    options it has (and the one probably meant)."""
    known = options.get(parsed.kind)
    if known is None:
        return
    for name in parsed.kwargs:
        if name not in known:
            raise _Unusable(f"a {parsed.kind}: {role} has no option {name!r}"
                            f"{did_you_mean(name, known)}; its options: {', '.join(known)}")


def _check_server(parsed: Endpoint) -> None:
    _known_options(parsed, _SERVER_OPTIONS, "listener")
    if parsed.kind in _PORT_SERVERS:
        _port(parsed.kwargs.get("port", parsed.args[0] if parsed.args else None))
        _interface_and_backlog(parsed)
        if parsed.kind == "ssl" and not parsed.kwargs.get("privateKey"):
            raise _Unusable(NO_PRIVATE_KEY)
    elif parsed.kind == "tls":
        # Twisted's tls:PATH:PORT, an SNI listener serving the PEM files
        # in the directory PATH.
        args = list(parsed.args)
        path = parsed.kwargs.get("path", args.pop(0) if args else "")
        if not path or path.isdigit():
            raise _Unusable("a tls: listener needs the directory of its PEM files (private "
                            "key and certificate) first: tls:DIRECTORY:PORT")
        _port(parsed.kwargs.get("port", args[0] if args else None))
        _interface_and_backlog(parsed)
    elif parsed.kind == "unix":
        if not parsed.kwargs.get("address", parsed.args[0] if parsed.args else ""):
            raise ValueError("no socket path")
        int(parsed.kwargs.get("mode", "666"), 8)
        _backlog(parsed)


def _interface_and_backlog(parsed: Endpoint) -> None:
    interface = parsed.kwargs.get("interface", "")
    if interface:
        try:
            ipaddress.ip_address(interface.strip("[]"))
        except ValueError:
            raise _Unusable(f"interface {interface!r} is not an IP address") from None
    _backlog(parsed)


def _check_client(parsed: Endpoint) -> None:
    _known_options(parsed, _CLIENT_OPTIONS, "client")
    if parsed.kind in _PORT_CLIENTS:
        args, kwargs = parsed.args, parsed.kwargs
        host: str | None
        port: str | None
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


def _port(text: str | None) -> None:
    if not text:
        raise ValueError("no port")
    port = int(text)
    if not 0 <= port <= 65535:
        raise _Unusable(f"port {port} is not from 0 to 65535")


def _backlog(parsed: Endpoint) -> None:
    backlog = int(parsed.kwargs.get("backlog", "50"))
    if not 1 <= backlog <= 65535:
        raise _Unusable(f"backlog {backlog} is not from 1 to 65535")
