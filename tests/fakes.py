"""Test doubles that stand in for the parts of replication, each declaring
the interface it stands in for (:mod:`replicator.replication.interfaces`)
and checked against it in ``tests/test_interfaces.py``, so that they cannot
drift from what the real ones provide."""

from typing import List, Optional, Tuple

from zope.interface import implementer

from replicator.replication.interfaces import IRedisBus, IReplicationConnection


@implementer(IReplicationConnection)
class FakeConnection:
    """A connection that records what is sent to it.  ``accepted``: the
    peer connected to us (server side); ``instance_name``: the name it gave."""

    role = "client"
    current_line: Optional[bytes] = None
    queued = 0
    queued_bytes = 0
    transport = None

    def __init__(self, instance_name: Optional[str] = None, accepted: bool = True):
        self.instance_name = instance_name
        self.accepted = accepted
        self.role = "client" if accepted else "upstream"
        self.sent: List[Tuple[str, List[bytes]]] = []
        self.paused = False
        self.stopped = False

    @property
    def name(self) -> str:
        return self.instance_name or "unnamed"

    def __repr__(self) -> str:
        return f"<conn {self.instance_name}>"

    def send_lines(self, lines, command_name="RDATA"):
        if self.stopped:
            return False
        self.sent.append((command_name, list(lines)))
        return True

    def send_command(self, cmd):
        return self.send_lines([(cmd.to_line() + "\n").encode("utf-8")], cmd.NAME)

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False

    def stop(self, reason_text="server stopping"):
        self.stopped = True


@implementer(IRedisBus)
class FakeBus:
    """A Redis link's owner, as far as the handler's connection needs one:
    nothing held back (no Synapse probe under way), published lines kept."""

    channel = "hs.test"

    def __init__(self):
        self.published: List[bytes] = []
        self.paused = False

    def hold(self, lines, command_name):
        return False

    def publish_lines(self, lines, channel=None):
        self.published.extend(lines)

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False
