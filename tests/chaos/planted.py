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
