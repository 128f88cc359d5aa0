"""Reading Twisted endpoint strings where Twisted does not: which address a
listener binds (the loopback warning at startup) and which URL reaches it
(the CLI's HTTP commands).

This is the one parser for them.  It follows Twisted's grammar: fields are
separated by unescaped ``:``; ``\\:`` is a literal colon (``interface=\\:\\:1``);
a field with ``=`` is a keyword argument, any other one positional, so
``tcp:9092`` and ``tcp:port=9092`` name the same port.  Checking that a
string is valid stays with Twisted (``serverFromString`` in config parsing).
"""

import ipaddress
import re
from typing import Dict, List, NamedTuple

_SPLIT = re.compile(r"(?<!\\):")
_WILDCARDS = ("", "0.0.0.0", "::")


class Endpoint(NamedTuple):
    """An endpoint string split into its type, positional and keyword fields
    (escapes removed)."""
    kind: str
    args: List[str]
    kwargs: Dict[str, str]


def parse(endpoint: str) -> Endpoint:
    """Split ``endpoint`` the way Twisted's endpoint parser does."""
    kind, *fields = [p.replace("\\:", ":") for p in _SPLIT.split(endpoint)]
    args, kwargs = [], {}
    for field in fields:
        if "=" in field:
            key, value = field.split("=", 1)
            kwargs[key] = value
        else:
            args.append(field)
    return Endpoint(kind, args, kwargs)


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
