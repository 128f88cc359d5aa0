"""Writing an event stream's shared bytes straight to its socket.

A live pass (:mod:`.live`) gives the same bytes to every live client at
the same place in its log.
Through ``Request.write`` each client costs the reactor a trip through
twisted.web (headers check, chunk framing, ``HTTPChannel.write``), a
transport buffer, an ``epoll`` registration, a later ``doWrite`` and an
unregistration: at 1,000 clients that was about a third of the daemon's
time, beside the ``send`` itself.  :class:`Direct` does what the fan-out's
``transport.write`` would do later, at once: when nothing is waiting in
the transport's buffer it sends the bytes with the transport's own
``writeSomeData`` (non-blocking, never more than the socket takes) and
hands only what the socket did not take to ``transport.write``, where
Twisted's buffer, its backpressure (the client is paused past the
transport's bound) and its error handling (a lost connection is found by
the next ``doWrite``) apply as before.  Order is kept: bytes go straight
to the socket only when nothing is queued before them.

Only a plain TCP transport qualifies (not TLS, whose bytes must go
through the TLS layer; not a test's fake request): for the others
:meth:`Direct.write` is ``request.write``.
"""


from twisted.internet import tcp

from ...net.twisted_private import plain_tcp, queued


def chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk (what ``Request.write`` sends when
    the answer is chunked), made once for every client."""
    return b"%x\r\n" % len(data) + data + b"\r\n"


class Frames:
    """A live pass's bytes for the clients at one place: as they are, and as one
    chunk (made at the first chunked client's write, once)."""

    __slots__ = ("data", "_chunked")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._chunked: bytes | None = None

    def chunked(self) -> bytes:
        if self._chunked is None:
            self._chunked = chunk(self.data)
        return self._chunked


class Direct:
    """Writes to one event stream's answer (see the module docstring).

    Made after the first body write (the head is sent): ``chunked`` is
    then settled for the answer."""

    __slots__ = ("request", "chunked", "transport")

    def __init__(self, request) -> None:
        self.request = request
        self.chunked = bool(getattr(request, "chunked", False))
        channel = getattr(request, "channel", None)
        self.transport: tcp.Connection | None = plain_tcp(getattr(channel, "transport", None))

    def write_frames(self, frames: Frames) -> None:
        """A live pass's bytes (:class:`Frames`)."""
        self.write(frames.data, frames.chunked() if self.chunked and self.transport else None)

    def write(self, data: bytes, chunked: bytes | None = None) -> None:
        """Write ``data`` (``chunked``: the same as one chunk, if made
        already) after everything written before."""
        transport = self.transport
        if transport is None or self.request.finished:
            self.request.write(data)
            return
        if not data:
            return
        framed = (chunked if chunked is not None else chunk(data)) if self.chunked else data
        self.request.sentLength += len(data)  # (the access log's length)
        if queued(transport):
            transport.write(framed)  # queued behind what is there
            return
        sent = transport.writeSomeData(framed)
        if isinstance(sent, int) and sent >= len(framed):
            return
        # The rest (all of it when the connection is lost: then the
        # reactor's doWrite finds the loss and closes it).
        transport.write(framed[sent:] if isinstance(sent, int) and sent > 0 else framed)
