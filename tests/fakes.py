"""Test doubles that stand in for the parts of replication, each declaring
the interface it stands in for (:mod:`replicator.replication.interfaces`)
and checked against it in ``tests/test_interfaces.py``, so that they cannot
drift from what the real ones provide."""


from twisted.internet.task import Clock
from zope.interface import implementer

from replicator.replication.core.connections import Connections
from replicator.replication.interfaces import IRedisBus, IReplicationConnection, IReplicationView


@implementer(IReplicationConnection)
class FakeConnection:
    """A connection that records what is sent to it.  ``accepted``: the
    peer connected to us (server side); ``instance_name``: the name it gave."""

    role = "client"
    current_line: bytes | None = None
    queued = 0
    queued_bytes = 0
    transport = None

    def __init__(self, instance_name: str | None = None, accepted: bool = True):
        self.instance_name = instance_name
        self.accepted = accepted
        self.role = "client" if accepted else "upstream"
        self.sent: list[tuple[str, list[bytes]]] = []
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
        self.published: list[bytes] = []
        self.paused = False

    def hold(self, lines, command_name):
        return False

    def publish_lines(self, lines, channel=None):
        self.published.extend(lines)

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False


@implementer(IReplicationView)
class FakeView:
    """The core as observers see it, with settable tables: ``connections``
    (a real :class:`~replicator.replication.core.connections.Connections`
    on ``clock``), ``positions``, ``lags``, ``heard`` (key -> when),
    ``announced``, ``core_findings``; ``busy``: work queued."""

    instance_name = "master"

    def __init__(self, clock=None):
        self.connections = Connections(clock if clock is not None else Clock())
        self.positions = {}
        self.lags = {}
        self.heard = {}
        self.announced = {}
        self.core_findings = []
        self.busy = False
        self.user_syncs = {}
        self.federation_acks = {}
        self.user_ips = {}

    def open_connections(self):
        return self.connections.seen()

    def last_lost(self, name):
        return self.connections.last_lost.get(name)

    def recent_disconnects(self):
        return self.connections.disconnects()

    def reader_positions(self):
        return dict(self.positions)

    def reader_lag(self):
        return dict(self.lags)

    def reader_heard(self):
        return set(self.heard)

    def reader_heard_at(self):
        return dict(self.heard)

    def announced_positions(self):
        return dict(self.announced)

    def idle(self):
        return not self.busy

    def findings(self):
        return list(self.core_findings)

    def bookkeeping_samples(self):
        return []
