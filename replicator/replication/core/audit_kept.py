"""The delivery audit's findings (:mod:`.audit`) across a restart: each kept
in the database when it is found (:func:`keep`), and at the next start
(:func:`load`, before any reader runs) its stream stopped again, unless
every consumer keeping a position for that writer is below the finding's
first ID (the operator rewound them: the facts will be handed on again),
when the finding is dropped.  The rows and their table are
:mod:`replicator.storage.findings`; statements run in the pool.

Invariants: a finding that cannot be written is one error line and changes
nothing else (the stream is stopped all the same, until the restart); a
finding of a stream or writer no longer read here is kept, untouched, for
when it is again.
"""

from collections.abc import Callable, Iterable
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from ...consumers import Consumer
from ...storage import findings
from ...streams.registry import StreamRegistry
from .audit import Mismatch
from .delivery import consumers_for

log = Logger(namespace="replicator.replication.core.handler")


async def keep(db: Any, instance_name: str, found: Mismatch, clock: IReactorTime) -> None:
    """``found`` written to the database (an error line if it cannot be)."""
    try:
        await db.runInteraction(findings.save, db, instance_name, found.stream,
                                found.writer, found.first, found._asdict(),
                                int(clock.seconds() * 1000))
    except Exception as e:
        log.error("stream {stream}: the audit's finding was not kept in the database "
                  "({e}): a restart will not know of it", stream=found.stream, e=e)


async def load(registry: StreamRegistry, instance_name: str, consumers: Iterable[Consumer],
               stop: Callable[[Mismatch], None]) -> None:
    """Every finding an earlier run of ``instance_name`` kept: ``stop(found)``
    for each that still holds, the others deleted (a log line says why)."""
    consumers = list(consumers)
    db = registry.db
    for row in await db.runInteraction(findings.load, db, instance_name):
        key = (row["stream"], row["writer"])
        stream = registry.find(row["stream"])
        if stream is None or row["writer"] not in stream.config.writers:
            continue  # no longer read here: kept for when it is again
        takers = consumers_for(consumers, row["stream"])
        known = [p for p in (c.positions().get(key) for c in takers) if p is not None]
        if not known:
            log.error("stream {stream}: the audit found, before this restart, facts of "
                      "writer {writer} from {first} on that were not delivered; no "
                      "consumer keeps a position for it, so none can be handed them "
                      "again: the finding is dropped", stream=key[0], writer=key[1],
                      first=row["first_id"])
            await db.runInteraction(findings.delete, db, instance_name, *key)
            continue
        if all(p < row["first_id"] for p in known):
            log.info("stream {stream}: the audit's finding about writer {writer} is "
                     "resolved: every consumer is below {first} and is handed those facts "
                     "again", stream=key[0], writer=key[1], first=row["first_id"])
            await db.runInteraction(findings.delete, db, instance_name, *key)
            continue
        detail = dict(row["detail"])
        detail["how"] = f"{detail.get('how', 'audit')}, before a restart"
        stop(Mismatch(**detail))
