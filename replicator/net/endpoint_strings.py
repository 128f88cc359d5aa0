"""Reading Twisted endpoint strings where Twisted does not: which address a
listener binds (the loopback warning at startup) and which URL reaches it
(the CLI's HTTP commands).

This is the one parser for them (config parsing checks endpoint strings
with it too).  It follows Twisted's grammar: fields are separated by
unescaped ``:``; a backslash makes the next character literal
(``interface=\\:\\:1``); the first unescaped ``=`` of a field makes it a
keyword argument, any other field is positional, so ``tcp:9092`` and
``tcp:port=9092`` name the same port.  Building the endpoint (which reads
TLS files) stays with Twisted, in :func:`replicator.config.validate` and
where the instance listens or connects.
"""

import ipaddress
from typing import NamedTuple

_WILDCARDS = ("", "0.0.0.0", "::")


class Endpoint(NamedTuple):
    """An endpoint string split into its type, positional and keyword fields
    (escapes removed)."""
    kind: str
    args: list[str]
    kwargs: dict[str, str]


def parse(endpoint: str) -> Endpoint:
    """Split ``endpoint`` the way Twisted's endpoint parser does; ValueError
    if it ends in a lone backslash."""
    fields: list[list[str]] = [[""]]
    chars = iter(endpoint)
    for char in chars:
        if char == "\\":
            escaped = next(chars, None)
            if escaped is None:
                raise ValueError(f"{endpoint!r} ends in a lone backslash")
            fields[-1][-1] += escaped
        elif char == ":":
            fields.append([""])
        elif char == "=" and len(fields[-1]) == 1:
            fields[-1].append("")
        else:
            fields[-1][-1] += char
    args, kwargs = [], {}
    for field in fields:
        if len(field) == 1:
            args.append(field[0])
        else:
            kwargs[field[0]] = field[1]
    # Twisted's type is the first positional field.
    return Endpoint(args[0] if args else "", args[1:], kwargs)


def _host(parsed: Endpoint) -> str:
    return parsed.kwargs.get("interface", "").strip("[]")


def is_loopback(endpoint: str) -> bool:
    """Whether a server endpoint string is reachable only from this machine:
    a ``unix:`` socket, or a listener bound to a loopback address."""
    parsed = parse(endpoint)
    if parsed.kind == "unix":
        return True
    host = _host(parsed)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_url(endpoint: str) -> str:
    """The ``http://host:port`` that reaches a ``tcp:``/``tcp6:`` listener
    from this machine (a wildcard interface is reached on 127.0.0.1).

    Raises ValueError for any other kind of endpoint or one without a port.
    """
    parsed = parse(endpoint)
    if parsed.kind not in ("tcp", "tcp6"):
        raise ValueError(f"{endpoint!r} is not a tcp endpoint")
    port = parsed.kwargs.get("port", parsed.args[0] if parsed.args else "")
    if not port.isdigit():
        raise ValueError(f"{endpoint!r} has no port")
    host = _host(parsed)
    if host in _WILDCARDS:
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{int(port)}"


def client_address(endpoint: str) -> str:
    """Where a client endpoint string connects, for log lines: ``host:port``
    (``[v6]:port``) for ``tcp:``, ``tcp6:``, ``ssl:``, ``tls:`` and ``host:``
    endpoints, the path for ``unix:``, else the string itself."""
    try:
        parsed = parse(endpoint)
    except ValueError:
        return endpoint
    if parsed.kind == "unix":
        return parsed.kwargs.get("path", parsed.args[0] if parsed.args else endpoint)
    host = parsed.kwargs.get("host", parsed.args[0] if parsed.args else "")
    port = parsed.kwargs.get("port", parsed.args[1] if len(parsed.args) > 1 else "")
    if not host or not port:
        return endpoint
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"
