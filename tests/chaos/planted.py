"""A planted defect, to show that the checker catches what it claims to.

:class:`DroppingJsonlConsumer` is the JSON-lines consumer with a reader bug
planted in front of it: it drops every ``drop_every``-th row it is handed
(as if that RDATA line had been lost).  A fact of one row then never
arrives (``lost``); a multi-row fact arrives without that row (``split``).
Configured as ``type: tests.chaos.planted:DroppingJsonlConsumer`` with
``drop_every: N`` (``python -m tests.chaos --plant drop-rdata``); the
daemons find the package through ``PYTHONPATH``.  Never used outside the
fault suite.
"""

from twisted.internet import reactor

from replicator.consumers import JsonlConsumer


class DroppingJsonlConsumer(JsonlConsumer):
    def __init__(self, path, streams=None, fsync=True, flush_interval=0.05, drop_every=100):
        super().__init__(path, streams=streams, fsync=fsync, flush_interval=flush_interval,
                         reactor=reactor)
        self.drop_every = int(drop_every)
        self.rows_seen = 0

    def on_facts(self, stream, writer, token, rows):
        kept = []
        for row in rows:
            self.rows_seen += 1
            if self.rows_seen % self.drop_every:
                kept.append(row)
        if rows and not kept:
            return None  # the fact's only RDATA line was "lost"
        return super().on_facts(stream, writer, token, kept)


class SkippingReaderJsonlConsumer(JsonlConsumer):
    """The JSON-lines consumer in a daemon whose *reader* has a planted
    skip: every ``skip_every``-th live fact (an RDATA whole fact) is never
    handed on, yet the reader's position moves past it — the silent skip
    the delivery audit exists to find (``--plant skip-fact``).  The patch
    is made when the consumer is built, so only the daemons of the run that
    configures it have it."""

    def __init__(self, path, streams=None, fsync=True, flush_interval=0.05, skip_every=50):
        super().__init__(path, streams=streams, fsync=fsync, flush_interval=flush_interval,
                         reactor=reactor)
        from replicator.replication.core import reader as reader_module

        every = int(skip_every)
        original = reader_module.Reader._hand_on
        if getattr(original, "planted", False):
            return
        seen = [0]

        async def hand_on(self, token, rows):
            seen[0] += 1
            if seen[0] % every == 0:
                return None  # the planted defect: not handed on, position moves on
            return await original(self, token, rows)

        hand_on.planted = True
        reader_module.Reader._hand_on = hand_on
