"""Telling a Synapse on our Redis channel apart from our own instances.

Without the config's ``synapse:`` section our instances publish on the
channel ``<server_name>``, which is Synapse's channel if an operator
pointed ``replication.redis`` at Synapse's Redis.  There every POSITION of
ours for a stream Synapse does not know raises in Synapse's subscription
handler (it drops and remakes its Redis connection) and every RDATA is an
ERROR in its log.  This module only decides *whether* a line proves a
Synapse; :mod:`.redis` stops publishing once one did.

What proves it: a POSITION or RDATA for a stream Synapse has
(:data:`replicator.synapse.STREAM_NAMES`) that this instance's config does
not define.  Synapse announces a POSITION for every stream it writes
(``events``, ``typing``, ``to_device``, ``receipts``, ``caches``, ... from
``master`` or its stream writers) each time it subscribes and each time it
hears a REPLICATE, so it is seen within a round trip.  Our own instances
publish RDATA/POSITION only for the streams of their configs, and every
instance of a deployment has the same streams.

What does not: ``REPLICATE`` (ours is written like Synapse's, ``REPLICATE
``), a writer named ``master`` (ours may be), a Synapse stream name that our
config defines (``caches`` is a common name of ours), any other unknown
stream, and USER_SYNC/USER_IP/FEDERATION_ACK (read as bookkeeping; Synapse
always announces positions too).
"""

from collections.abc import Iterable
from typing import Any

from ... import synapse

#: Commands whose stream may prove a Synapse.
_STREAM_COMMANDS = ("POSITION", "RDATA")


class SynapseWatch:
    """Watches the commands heard on one channel.

    Invariant: :attr:`evidence` is set once, by the first proving command,
    and never cleared (the instance stays off the channel until restarted
    with the ``synapse:`` section).
    """

    def __init__(self, channel: str, own_streams: Iterable[str]) -> None:
        self.channel = channel
        #: Synapse's streams no config of ours defines here.
        self.proving_streams = synapse.STREAM_NAMES - set(own_streams)
        #: What proved a Synapse, as one sentence (None: nothing yet).
        self.evidence: str | None = None

    def observe(self, cmd: Any) -> str | None:
        """The evidence if ``cmd`` is the first command that proves a
        Synapse on the channel; else None (also for any later one)."""
        if self.evidence is not None or cmd.NAME not in _STREAM_COMMANDS:
            return None
        if cmd.stream_name not in self.proving_streams:
            return None
        self.evidence = (
            f"a Synapse publishes on redis channel {self.channel} "
            f"({cmd.NAME} {cmd.stream_name} {cmd.instance_name} ...: a stream "
            f"no config here defines); not publishing there, so as not to break "
            f"Synapse's subscription: add the `synapse:` section (synapse.server_name: "
            f"{self.channel}) to every instance's config and restart")
        return self.evidence
