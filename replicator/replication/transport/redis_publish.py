"""Publishing a block of lines on Redis by hand, all in one write.

Both Redis transports (:mod:`.redis`: ``PUBLISH``; :mod:`.redis_cluster`:
``SPUBLISH`` on each channel's master) publish the lines of one call this
way, and only this way: the commands are encoded here as RESP, more than
one inside ``MULTI`` ... ``EXEC``, and written together, so they reach
Redis all or nothing (it runs a block at its ``EXEC`` and drops it unrun
when the connection closes before).  txredisapi's own ``publish`` writes
one command per call and its ``multi`` writes MULTI, each command and EXEC
apart, so neither can do that, and both cost a Deferred chain per line.

The replies are read from txredisapi's reply queue (``replyQueue``: one
Deferred per reply, in order; error replies and a lost connection come as
values, never as failures).
"""

from collections.abc import Sequence
from typing import Any

from twisted.internet import defer

#: What brackets the commands of one write of several lines.
MULTI = b"*1\r\n$5\r\nMULTI\r\n"
EXEC = b"*1\r\n$4\r\nEXEC\r\n"


def publish_command(verb: bytes, channel: bytes, payload: bytes) -> bytes:
    """``verb`` (``PUBLISH`` or ``SPUBLISH``) of ``payload`` on ``channel``, in RESP."""
    return b"*3\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
        len(verb), verb, len(channel), channel, len(payload), payload)


def write_publishes(publisher: Any, verb: bytes, lines: Sequence[tuple[bytes, bytes]],
                    ) -> "list[defer.Deferred[Any]]":
    """Write ``verb`` of each ``(channel, payload)`` of ``lines`` to
    ``publisher`` (a connected txredisapi protocol) in one write; more than
    one inside ``MULTI`` ... ``EXEC``.  Returns the Deferreds of their
    replies, in order: one for one line; for a block ``+OK`` (MULTI), one
    ``+QUEUED`` per command, then EXEC's, the last, which says whether the
    block ran (a list: one reply per command)."""
    commands = [publish_command(verb, channel, payload) for channel, payload in lines]
    replies = publisher.replyQueue
    if len(commands) == 1:
        publisher.transport.write(commands[0])
        return [replies.get()]
    publisher.transport.write(b"".join([MULTI, *commands, EXEC]))
    return [replies.get() for _ in range(len(commands) + 2)]


def at_rest(publisher: Any) -> None:
    """After a block's EXEC: txredisapi counts the QUEUED replies of its
    own MULTI, which a publisher never uses; keep its counter at rest."""
    publisher.transactions = 0
