"""What an instance calls itself: ``master`` or ``worker``.

One definition, used by ``/health``, the status page and the service:

* over TCP, the **master** is the hub: it has ``replication.listen`` (and,
  the config guarantees it, no ``replication.upstream``); a **worker** has
  ``replication.upstream``.
* over Redis there is no hub: every instance publishes its own writers'
  facts and reads the others'.  There the **master** is the instance named
  ``master`` (``instance_name: master``, Synapse's name for its main
  process, which the shipped configs follow); every other instance is a
  **worker**.
* an instance with no replication at all (nothing to connect to, no one
  connecting) is a ``master``: it is the only instance.

Whether an instance *depends on a replication link* for its health is a
different question (:func:`has_replication_link`): a worker does, and so
does every instance on Redis, the master included (its facts reach no one
while its Redis link is down).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import InstanceConfig

MASTER = "master"
WORKER = "worker"

#: The instance name that makes a Redis peer the master.
REDIS_MASTER_NAME = "master"


def role(config: "InstanceConfig") -> str:
    """``master`` or ``worker`` for an :class:`~replicator.config.InstanceConfig`."""
    rep = config.replication
    if rep.upstream:
        return WORKER
    if rep.redis and not rep.listen:
        return MASTER if config.instance_name == REDIS_MASTER_NAME else WORKER
    return MASTER


def has_replication_link(config: "InstanceConfig") -> bool:
    """Whether the instance's health depends on a link it makes itself (an
    upstream, or Redis): then a link down, a reader lagging and a writer
    never heard of are health problems."""
    rep = config.replication
    return bool(rep.upstream or rep.redis)
