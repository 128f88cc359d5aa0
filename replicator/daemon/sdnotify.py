"""Tell systemd how the daemon is doing: the sd_notify(3) protocol, stdlib only.

The units in ``systemd/`` use ``Type=notify``: systemd considers the service
started only once it receives ``READY=1``, and shows ``STATUS=`` text in
``systemctl status``.  The protocol is one datagram of ``KEY=VALUE`` lines
sent to the AF_UNIX socket named by ``$NOTIFY_SOCKET``.

The daemon calls :func:`ready` once it listens, :func:`stopping` when a
clean shutdown begins, and :func:`status` whenever a one-line summary helps
an operator.

Invariants:

* Outside systemd (``$NOTIFY_SOCKET`` unset or empty) every call is a no-op
  returning False, so the daemon runs the same in a terminal or under tests.
* ``$NOTIFY_SOCKET`` is a filesystem path (``/run/systemd/notify``) or an
  abstract socket written ``@name``; the ``@`` stands for the leading NUL
  byte of the abstract address.  Other forms (e.g. systemd 253's ``vsock:``)
  are not supported: logged, False.
* Never raises and never blocks the reactor: the socket is non-blocking and
  any error (nobody listening, queue full, bad address) is logged as a
  warning through :mod:`twisted.logger` and reported as False.  A lost
  notification costs at most a start timeout; a crash would cost the service.
* One call sends one datagram holding exactly one assignment: a ``STATUS``
  text has its line breaks replaced by spaces so it cannot smuggle in other
  assignments such as ``READY=1``.
"""

import os
import socket

from twisted.logger import Logger

log = Logger()


def _address(raw: str) -> str | None:
    """``$NOTIFY_SOCKET`` as a socket address, or None if unsupported."""
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to systemd.

    True if the datagram was sent; False if not running under a notify-type
    unit or if sending failed (logged, never raised).
    """
    raw = os.environ.get("NOTIFY_SOCKET")
    if not raw:
        return False
    address = _address(raw)
    if address is None:
        log.warn("sd_notify: unsupported NOTIFY_SOCKET {socket!r}; {state!r} not sent",
                 socket=raw, state=state)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.sendto(state.encode("utf-8"), address)
    except (OSError, ValueError) as e:  # ValueError: unencodable text, NUL in a path
        log.warn("sd_notify: sending {state!r} to {socket!r} failed: {error}",
                 state=state, socket=raw, error=e)
        return False
    return True


def ready() -> bool:
    """The daemon is listening and serving: systemd marks the unit started."""
    return notify("READY=1")


def reloading() -> bool:
    """A reload of the config has begun; :func:`ready` says it ended."""
    return notify("RELOADING=1")


def stopping() -> bool:
    """A clean shutdown has begun (systemd shows the unit as deactivating)."""
    return notify("STOPPING=1")


def status(text: str) -> bool:
    """A one-line human-readable state, shown by ``systemctl status``."""
    return notify("STATUS=" + " ".join(text.splitlines()))
