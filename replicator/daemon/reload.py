"""What a reload (SIGHUP) changes: the running config against the file's.

:func:`plan` is pure: it compares the running :class:`InstanceConfig` with
the one just read and says which keys apply live, which need a restart, and
the config the instance runs on afterwards (the file's values where they
apply live, the running values everywhere else).  The instance applies the
plan (:meth:`replicator.daemon.service.Instance.reload`).

Live: ``log_level``, ``log_format``, ``health``,
``replication.allowed_peers``, ``replication.allowed_networks``,
``replication.writer_secrets`` (their files read again) and
``replication.client_ca`` (with the ``ssl:`` listener's files, which every
reload reads again), ``http.readers`` (their secret files read again), a
new stream, other instances' ``writers`` of a running stream, and
``consumers`` (:class:`ConsumerChange`: one whose config is in both files
goes on, one only in the running config stops, one only in the file
starts).  Everything else that differs needs a restart and
keeps its running value: the database, names, ``pid_file``, endpoints, the other
``replication`` and ``http`` keys, ``synapse``, a stream removed, and a stream whose
columns, table, retention or own writer changed (or which this instance writes alone:
its ID generator has no room for another writer).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..config import ConsumerConfig, InstanceConfig, StreamConfig

#: ``replication`` keys a reload applies.
LIVE_REPLICATION = ("allowed_peers", "allowed_networks", "client_ca", "writer_secrets")


@dataclass
class ConsumerChange:
    """Consumers of the running config against the file's, by index.

    A consumer whose config is the same in both goes on (wherever it moved
    in the list); one only in the running config stops; one only in the
    file starts (from its own persisted position).  A changed consumer is
    one of each with the same type and ``path`` option: it restarts."""

    kept: dict[int, int] = field(default_factory=dict)  # file index -> running index
    stopped: list[int] = field(default_factory=list)  # running indices
    started: list[int] = field(default_factory=list)  # file indices
    #: Started ones that replace a stopped one (file index -> running index):
    #: the same type and ``path`` option, other options changed.
    restarted: dict[int, int] = field(default_factory=dict)


@dataclass
class Plan:
    """What a reload does: ``config`` is what runs afterwards."""

    config: InstanceConfig
    applied: list[str] = field(default_factory=list)  # keys, in file order
    restart: list[str] = field(default_factory=list)  # keys changed that need a restart
    logging: bool = False
    health: bool = False
    peers: bool = False
    readers: bool = False  # http.readers changed (or a secret file's text)
    new_streams: list[tuple[str, StreamConfig]] = field(default_factory=list)  # (key, config)
    writers: list[tuple[str, StreamConfig]] = field(default_factory=list)  # (key, config)
    consumers: ConsumerChange | None = None  # None: the same consumers


def plan(running: InstanceConfig, read: InstanceConfig) -> Plan:
    """The reload from ``running`` to the file's ``read`` (both validated)."""
    result = Plan(config=running)
    live: dict[str, Any] = {}
    for key in ("instance_name", "server_name", "synapse", "pid_file"):
        if getattr(running, key) != getattr(read, key):
            result.restart.append(key)
    if running.database != read.database:
        result.restart.append(f"database.{running.database.engine}")
    if (running.log_level, running.log_format) != (read.log_level, read.log_format):
        result.logging = True
        live.update(log_level=read.log_level, log_format=read.log_format)
        result.applied += [k for k in ("log_level", "log_format")
                           if getattr(running, k) != getattr(read, k)]
    if running.health != read.health:
        result.health = True
        live["health"] = read.health
        result.applied.append("health")
    replication = running.replication
    for f in dataclasses.fields(replication):
        before, after = getattr(running.replication, f.name), getattr(read.replication, f.name)
        if before == after:
            continue
        if f.name in LIVE_REPLICATION:
            result.peers = True
            replication = dataclasses.replace(replication, **{f.name: after})
            result.applied.append(f"replication.{f.name}")
        else:
            result.restart.append(f"replication.{f.name}")
    live["replication"] = replication
    for f in dataclasses.fields(running.http):
        if getattr(running.http, f.name) == getattr(read.http, f.name):
            continue
        if f.name == "readers":
            result.readers = True
            live["http"] = dataclasses.replace(running.http, readers=read.http.readers)
            result.applied.append("http.readers")
        else:
            result.restart.append(f"http.{f.name}")
    live["streams"] = _streams(running, read, result)
    if running.consumers != read.consumers:
        result.consumers = _consumers(running, read, result)
        live["consumers"] = read.consumers
    result.config = dataclasses.replace(running, **live)
    return result


def _streams(running: InstanceConfig, read: InstanceConfig,
             result: Plan) -> tuple[StreamConfig, ...]:
    """The streams after the reload, in running order then new ones."""
    me = running.instance_name
    new = {s.name: (i, s) for i, s in enumerate(read.streams)}
    streams = []
    for i, old in enumerate(running.streams):
        if old.name not in new:
            result.restart.append(f"streams[{i}] (stream {old.name} removed)")
            streams.append(old)
            continue
        j, s = new[old.name]
        key = f"streams[{j}]"
        if s == old:
            streams.append(old)
        elif (dataclasses.replace(old, writers=s.writers) == s
              and (me in old.writers) == (me in s.writers)
              and old.writers != (me,)):
            result.writers.append((key, s))
            result.applied.append(f"{key}.writers")
            streams.append(s)
        else:
            result.restart.append(key if old.writers != (me,) or
                                  dataclasses.replace(old, writers=s.writers) != s
                                  else f"{key}.writers (written here alone)")
            streams.append(old)
    names = {s.name for s in running.streams}
    for j, s in enumerate(read.streams):
        if s.name not in names:
            result.new_streams.append((f"streams[{j}]", s))
            result.applied.append(f"streams[{j}] (stream {s.name})")
            streams.append(s)
    return tuple(streams)


def _consumers(running: InstanceConfig, read: InstanceConfig, result: Plan) -> ConsumerChange:
    """Which consumers go on, stop and start; their keys in ``result.applied``."""
    change = ConsumerChange()
    unmatched = list(range(len(running.consumers)))
    for j, config in enumerate(read.consumers):
        i = next((i for i in unmatched if running.consumers[i] == config), None)
        if i is None:
            change.started.append(j)
        else:
            unmatched.remove(i)
            change.kept[j] = i
    change.stopped = list(unmatched)
    for j in change.started:
        i = next((i for i in unmatched if _identity(running.consumers[i]) ==
                  _identity(read.consumers[j])), None)
        if i is not None:
            unmatched.remove(i)
            change.restarted[j] = i
        result.applied.append(f"consumers[{j}] ({read.consumers[j].type}) "
                              f"{'restarted' if i is not None else 'started'}")
    for i in unmatched:
        result.applied.append(f"consumers[{i}] ({running.consumers[i].type}) stopped")
    return change


def _identity(config: ConsumerConfig) -> tuple[str, str]:
    """What makes two consumer configs one consumer changed: the type and
    the ``path`` option (a file consumer's file), if any."""
    return config.type, repr(config.options.get("path"))
