"""The Twisted internals replicator relies on, read in one place.

Twisted has no public call for how much a transport still has to send, or
for whether an HTTP channel's transport has paused it; the event stream's
direct writes (:mod:`replicator.http.read.direct`, :mod:`replicator.http.read.sse`)
and the unsent-bytes gauge (:mod:`replicator.observe.instance_metrics`)
need both.  So every use of a Twisted ``_private`` name is here, and
nowhere else: tests/test_twisted_private.py checks that the installed
Twisted is in the range setup.cfg declares, that these names still exist
and that they behave as the functions below assume.  A Twisted release
that moves them fails that test, not a client's event stream.

What is relied on (Twisted 24.3 to 26.x, ``twisted.internet.abstract.FileDescriptor``):

- ``dataBuffer`` (bytes) from ``offset`` on is what a partial send left;
  ``_tempDataLen`` counts bytes ``write`` took that are not joined into
  ``dataBuffer`` yet; ``_writeDisconnected`` is true once the write half is
  shut (``loseWriteConnection``, or a lost connection's ``doWrite``).
- ``writeSomeData`` (public but undocumented) sends what the socket takes
  at once and returns the count.
- ``twisted.web.http.HTTPChannel._waitingForTransport`` is true between
  the transport's ``pauseProducing`` and its ``resumeProducing``: a
  producer registered meanwhile is not told to pause by the channel.
"""


from twisted.internet import tcp

#: The Twisted range (setup.cfg's requirement) these internals were checked
#: against; the test fails when the declaration moves away from it.
CHECKED = "<27,>=24.3"


def plain_tcp(transport: object) -> tcp.Connection | None:
    """``transport`` if its bytes may go straight to its socket: a plain TCP
    connection (not TLS, whose bytes must go through the TLS layer) with the
    write buffer described above; else None."""
    if isinstance(transport, tcp.Connection) and not getattr(transport, "TLS", False) \
            and hasattr(transport, "dataBuffer") and hasattr(transport, "_tempDataLen"):
        return transport
    return None


def queued(transport: tcp.Connection) -> bool:
    """Whether a write to ``transport`` must queue behind others: bytes wait
    in its buffer, or it no longer writes (not connected, disconnecting, its
    write half shut).  When False, ``writeSomeData`` may send at once without
    reordering anything."""
    return bool(transport._tempDataLen or len(transport.dataBuffer) > transport.offset
                or not transport.connected or transport.disconnecting
                or transport._writeDisconnected)


def unsent_bytes(transport: object) -> int:
    """Bytes written to ``transport`` that have not reached the kernel:
    ``dataBuffer`` from ``offset`` on plus ``_tempDataLen``.  A TLS
    transport hands these attribute lookups on to the TCP connection
    underneath, so there it counts ciphertext.  Anything else (a test
    transport, a closed connection) counts 0."""
    buffered = getattr(transport, "dataBuffer", None)
    if not isinstance(buffered, bytes):
        return 0
    offset: int = getattr(transport, "offset", 0)
    pending: int = getattr(transport, "_tempDataLen", 0)
    return len(buffered) - offset + pending


def waiting_for_transport(channel: object) -> bool:
    """Whether ``channel`` (an ``HTTPChannel``) is paused by its transport
    now: a streaming producer registered on one of its requests must then
    start paused, as the channel does not tell it."""
    return bool(getattr(channel, "_waitingForTransport", False))
