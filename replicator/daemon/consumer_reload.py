"""Consumers changed by a reload (SIGHUP), while the instance runs.

:func:`change_consumers` applies a :class:`replicator.daemon.reload.ConsumerChange`:

* every reader is held between two facts first, so no consumer is in the
  middle of one while the list changes;
* a consumer no longer in the file is closed (which persists what it has:
  the JSON-lines file is flushed and unlocked) before anything starts, so a
  changed consumer's new self can open the same file;
* a consumer new in the file is built off the reactor thread (opening a
  JSON-lines file reads it whole) and starts from its own persisted
  position, or with none where its ``start`` says (``beginning``: after the
  stream's trim boundary, read again now); a reader that is past it
  catches the facts in between up from the table, for it alone
  (:func:`replicator.replication.core.delivery.rewire`);
* consumers in both files go on where they were, no fact twice.

A consumer that cannot be built is one line naming its key; a changed one
then gets its running config back (restarted as it was), a new one is left
out (the next reload tries again).
"""

from collections.abc import Sequence
from typing import Any

from twisted.internet import defer, threads
from twisted.logger import Logger

from ..config import ConsumerConfig
from ..config.fields import one_line
from ..consumers.base import Consumer
from ..consumers.loading import build_consumer
from ..replication.core.handler import ReplicationHandler
from .reload import ConsumerChange

log = Logger(namespace="replicator.daemon.service")


async def change_consumers(handler: ReplicationHandler, running: Sequence[Consumer],
                           running_configs: Sequence[ConsumerConfig],
                           read_configs: Sequence[ConsumerConfig], change: ConsumerChange,
                           reactor: Any, base_dir: str = "."
                           ) -> tuple[list[Consumer], tuple[ConsumerConfig, ...], list[str]]:
    """Apply ``change`` to the ``handler``'s readers: ``(consumers, their
    configs, keys that failed)``, in the file's order."""
    for stream in handler.registry:
        await stream.read_trim_boundary()  # where a new "start: beginning" consumer starts
    await handler.pause_readers()
    try:
        for i in change.stopped:
            try:
                await defer.maybeDeferred(running[i].close)
            except Exception as e:
                log.error("reload: consumers[{i}]: closing it failed: {error}", i=i,
                          error=one_line(e)[:300])
        consumers: list[Consumer] = []
        configs: list[ConsumerConfig] = []
        started: list[Consumer] = []
        failed: list[str] = []
        for j, config in enumerate(read_configs):
            if j in change.kept:
                consumers.append(running[change.kept[j]])
                configs.append(config)
                continue
            where = f"consumers[{j}]"
            try:
                consumer = await _build(config, base_dir, reactor, where)
            except Exception as e:
                failed.append(f"{where} ({config.type})")
                before = running_configs[change.restarted[j]] if j in change.restarted else None
                log.error("reload: {where}: cannot start: {error}; {what}", where=where,
                          error=one_line(e)[:300],
                          what="restarting the running one" if before else "left out")
                if before is None:
                    continue
                try:
                    consumer, config = await _build(before, base_dir, reactor, where), before
                except Exception as again:
                    log.error("reload: {where}: cannot restart the running one either: "
                              "{error}", where=where, error=one_line(again)[:300])
                    continue
            consumers.append(consumer)
            configs.append(config)
            started.append(consumer)
        handler.set_consumers(consumers, started)
    finally:
        handler.resume_readers()
    return consumers, tuple(configs), failed


def _build(config: ConsumerConfig, base_dir: str, reactor: Any,
           where: str) -> "defer.Deferred[Consumer]":
    return threads.deferToThreadPool(reactor, reactor.getThreadPool(), build_consumer,
                                     config, base_dir, reactor, where)
