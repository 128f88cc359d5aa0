"""Which Redis channel each line goes to, and which channels an instance
subscribes to (``replication.redis.channels``; docs/protocol.md, "Redis").

Two layouts:

``single`` (the default, as before): every line on one channel,
``<server_name>`` (``<server_name>/replicator`` beside a Synapse), USER_IP
on ``<channel>/USER_IP``.  Every instance hears every line of every stream.

``per_stream``: the project's own prefix ``<server_name>/replicator``,
never a Synapse's channel, with or without a ``synapse:`` section:

- ``<prefix>/stream/<stream>`` carries the RDATA and POSITION lines of one
  stream, and only those;
- ``<prefix>`` (the control channel) carries what names no stream:
  REPLICATE, USER_SYNC, CLEAR_USER_SYNC, FEDERATION_ACK, anything else;
- ``<prefix>/USER_IP`` carries USER_IP.

An instance subscribes to the control channel, the USER_IP channel and the
channel of each stream its configuration defines (beside a Synapse, not of
Synapse's streams: those it reads on Synapse's channel, whose layout is
Synapse's), so an instance that reads 1 of 10 streams receives about a
tenth of the stream traffic.

Ordering and atomicity hold per stream, which is all a reader relies on:
the lines of one write still go in one ``MULTI`` ... ``EXEC`` (each line
PUBLISHed on its own channel inside it), so a fact reaches its stream's
channel whole or not at all, and a writer's RDATA and POSITION of one
stream share one channel, in the order written.  A POSITION answering a
REPLICATE goes on its stream's channel, so only that stream's readers
hear it; the REPLICATE itself is on the control channel every instance
reads.  Instances of one deployment must agree on the layout: one on
``single`` and one on ``per_stream`` hear nothing of each other.
"""

from collections.abc import Iterable
from typing import Any

from ...config.model import REDIS_CHANNELS as LAYOUTS

#: Our prefix beside a Synapse (and always in ``per_stream``):
#: ``<server_name>`` + this.
OWN_CHANNEL_SUFFIX = "/replicator"
#: What a stream's channel is under the prefix.
STREAM_INFIX = "/stream/"

_STREAM_COMMANDS = (b"RDATA ", b"POSITION ")


class ChannelLayout:
    """Routes lines to channels; says what to subscribe to.

    Invariants: :attr:`channel` (the control channel) is never a Synapse's
    channel when ``synapse_server_name`` is given (ValueError otherwise),
    and in ``per_stream`` never ``<server_name>`` or its USER_IP channel;
    every line has exactly one channel.
    """

    def __init__(self, server_name: str, synapse_server_name: str | None = None,
                 layout: str = "single") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown channel layout {layout!r}")
        self.layout = layout
        self.per_stream = layout == "per_stream"
        if synapse_server_name is None and not self.per_stream:
            self.channel = server_name
        else:
            self.channel = server_name + OWN_CHANNEL_SUFFIX
        if synapse_server_name is not None and self.channel in (
                synapse_server_name, synapse_server_name + "/USER_IP"):
            raise ValueError(f"channel {self.channel!r} is Synapse's")
        self.synapse_channel = synapse_server_name
        self.user_ip_channel = f"{self.channel}/USER_IP"
        self._channel = self.channel.encode("utf-8")
        self._user_ip_channel = self.user_ip_channel.encode("utf-8")
        #: Stream name (bytes) -> its channel (bytes); only streams whose
        #: lines this instance publishes, so bounded by its configuration.
        self._stream_channels: dict[bytes, bytes] = {}

    def stream_channel(self, stream_name: str) -> str:
        """The channel of one stream's lines in ``per_stream``."""
        return f"{self.channel}{STREAM_INFIX}{stream_name}"

    def route(self, payload: bytes) -> bytes:
        """The channel of one line (without its newline)."""
        if payload.startswith(b"USER_IP "):
            return self._user_ip_channel
        if self.per_stream and payload.startswith(_STREAM_COMMANDS):
            parts = payload.split(b" ", 2)
            if len(parts) == 3:
                channel = self._stream_channels.get(parts[1])
                if channel is None:
                    channel = self._stream_channels[parts[1]] = (
                        self.stream_channel(parts[1].decode("utf-8", "replace"))
                        .encode("utf-8"))
                return channel
        return self._channel

    def subscriptions(self, streams: Iterable[Any]) -> list[str]:
        """The channels to subscribe to for ``streams`` (the registry's
        :class:`~replicator.streams.stream.Stream` objects), in order:
        control, USER_IP, the streams' own channels, Synapse's."""
        channels = [self.channel, self.user_ip_channel]
        if self.per_stream:
            for stream in streams:
                if self.synapse_channel is not None and stream.config.preset is not None:
                    continue  # Synapse's stream: on Synapse's channel
                channels.append(self.stream_channel(stream.name))
        if self.synapse_channel is not None:
            channels.append(self.synapse_channel)
        return channels
