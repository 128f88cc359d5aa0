"""The master's bookkeeping of USER_SYNC, CLEAR_USER_SYNC, FEDERATION_ACK
and USER_IP: who may change it, and how much of it is kept.

What other instances report is kept here for the HTTP API and the metrics:

* ``user_syncs``: instance ID -> {(user_id, device_id): last_sync_ms} of
  users syncing now; an instance ID's entries go with the connection that
  owns it, and with CLEAR_USER_SYNC.
* ``federation_acks``: instance -> last acknowledged token.
* ``user_ips``: (user_id, device_id) -> what USER_IP last said.

Who may change what (connections accepted here; one we did not accept —
the upstream, or Redis, where every publisher is trusted — is not checked):

* ``FEDERATION_ACK <instance>`` only from the connection that named itself
  ``<instance>`` (Synapse acks with its own instance name, which is its NAME).
* ``USER_SYNC`` / ``CLEAR_USER_SYNC <instance_id>``: Synapse puts a random
  per-process ID here, not its NAME, so an ID belongs to the connection that
  used it first, for as long as it lives (a later connection with the same
  NAME takes it over: that is the peer reconnecting).  An ID that is a name
  — this instance's, a configured one, or another live connection's NAME —
  belongs to the connection of that name only.  A connection owns at most
  :data:`MAX_IDS_PER_CONNECTION` IDs.
* ``USER_IP`` names no instance: any connection may report one.

A refused command changes nothing; the caller answers ``ERROR`` and closes
(a Synapse peer never sends what is refused here).

Bounds (invariants): at most ``max_user_syncs`` users syncing,
``max_user_ips`` USER_IP entries and ``max_federation_acks`` acks; when a
table is full the entry updated longest ago makes room.  USER_IP and
FEDERATION_ACK entries not updated for ``max_age`` seconds are dropped
(checked on every update and every PING).  Each table's order is its update
order, so both checks cost O(1) per entry dropped.

Everything runs on the reactor thread except :meth:`metric_samples`, which
only reads snapshots.
"""

from collections.abc import Set as AbstractSet
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from ...observe import metrics
from ..interfaces import IReplicationConnection, metrics_label

log = Logger()

User = tuple[str, str | None]

#: Instance IDs one connection may use in USER_SYNC (Synapse uses one).
MAX_IDS_PER_CONNECTION = 16

NOT_YOURS = "{command} for another instance"


class Bookkeeping:
    """The tables of the module docstring.

    ``known_names`` are the names the configuration knows (this instance,
    every configured writer, allowed peers): no other connection may use
    them as an instance ID, and metrics are labelled only by them.
    """

    def __init__(self, clock: IReactorTime, known_names: AbstractSet[str]=frozenset(),
                 max_user_syncs: int = 50_000,
                 max_user_ips: int = 20_000, max_federation_acks: int = 1_000,
                 max_age: float = 86_400.0) -> None:
        self._clock = clock
        self.known_names = frozenset(known_names)
        self.max_user_syncs = max_user_syncs
        self.max_user_ips = max_user_ips
        self.max_federation_acks = max_federation_acks
        self.max_age = max_age
        self.user_syncs: dict[str, dict[User, int]] = {}
        self.federation_acks: dict[str, int] = {}
        self.user_ips: dict[User, dict[Any, Any]] = {}
        # Update order and time of each table's entries, oldest first.
        self._sync_order: dict[tuple[str, User], None] = {}
        self._ack_times: dict[str, float] = {}
        self._ip_times: dict[User, float] = {}
        self._owners: dict[str, Any] = {}  # instance ID -> owning connection
        self._owned: dict[Any, set[str]] = {}  # connection -> instance IDs it owns
        self._named: dict[str, set[Any]] = {}  # NAME -> live connections of that name

    # ------------------------------------------------------------ identity
    def named(self, conn: IReplicationConnection, name: str) -> None:
        """``conn`` named itself ``name`` (once: the protocol refuses renames)."""
        self._named.setdefault(name, set()).add(conn)

    def connection_lost(self, conn: IReplicationConnection) -> None:
        """The users syncing on ``conn``'s instance IDs are gone."""
        for instance in self._owned.pop(conn, ()):
            self._owners.pop(instance, None)
            self._clear(instance)
        name = _name(conn)
        if name is not None:
            conns = self._named.get(name)
            if conns is not None:
                conns.discard(conn)
                if not conns:
                    del self._named[name]
        self.expire()

    def _claim(self, conn: IReplicationConnection, instance: str, command: str) -> str | None:
        """Why ``conn`` may not change ``instance``'s syncs, or None after
        making sure ``conn`` owns it."""
        name = _name(conn)
        owner = self._owners.get(instance)
        if instance != name:
            # A name is its connection's, even if another claimed it first.
            if instance in self.known_names or instance in self._named:
                return NOT_YOURS.format(command=command)
            if owner is not None and owner is not conn and (
                    name is None or _name(owner) != name):
                return NOT_YOURS.format(command=command)
        if owner is conn:
            return None
        owned = self._owned.setdefault(conn, set())
        if len(owned) >= MAX_IDS_PER_CONNECTION:
            return "too many instance IDs"
        if owner is not None:  # the same NAME again: the peer reconnected
            self._owned.get(owner, set()).discard(instance)
        self._owners[instance] = conn
        owned.add(instance)
        return None

    # ------------------------------------------------------------ commands
    def user_sync(self, conn: IReplicationConnection, cmd: Any, track: bool = True) -> str | None:
        """USER_SYNC; ``track``: ``conn`` is a live connection, whose IDs
        are checked and expire with it.  Returns why it was refused."""
        instance = cmd.instance_id
        if track and conn.accepted:
            refusal = self._claim(conn, instance, "USER_SYNC")
            if refusal is not None:
                return refusal
        elif track and instance not in self._owners:
            self._owners[instance] = conn
            self._owned.setdefault(conn, set()).add(instance)
        user = (cmd.user_id, cmd.device_id)
        key = (instance, user)
        if not cmd.is_syncing:
            if key in self._sync_order:
                self._drop_sync(instance, user)
            return None
        if self._sync_order.pop(key, ...) is ...:
            while len(self._sync_order) >= self.max_user_syncs:
                self._drop_sync(*next(iter(self._sync_order)))
                metrics.BOOKKEEPING_EVICTED.labels("user_syncs").inc()
        self.user_syncs.setdefault(instance, {})[user] = cmd.last_sync_ms
        self._sync_order[key] = None
        return None

    def clear_user_sync(self, conn: IReplicationConnection, cmd: Any) -> str | None:
        if conn.accepted:
            refusal = self._claim(conn, cmd.instance_id, "CLEAR_USER_SYNC")
            if refusal is not None:
                return refusal
        self._clear(cmd.instance_id)
        return None

    def federation_ack(self, conn: IReplicationConnection, cmd: Any) -> str | None:
        instance = cmd.instance_name
        if conn.accepted and instance != _name(conn):
            return NOT_YOURS.format(command="FEDERATION_ACK")
        now = self._clock.seconds()
        _put(self.federation_acks, self._ack_times, instance, cmd.token, now,
             self.max_federation_acks, "federation_acks")
        self.expire(now)
        return None

    def user_ip(self, conn: IReplicationConnection, cmd: Any) -> str | None:
        now = self._clock.seconds()
        entry = {"access_token_seen": True, "ip": cmd.ip, "user_agent": cmd.user_agent,
                 "last_seen": cmd.last_seen}
        _put(self.user_ips, self._ip_times, (cmd.user_id, cmd.device_id), entry, now,
             self.max_user_ips, "user_ips")
        self.expire(now)
        return None

    # ------------------------------------------------------------ bounds
    def expire(self, now: float | None = None) -> None:
        """Drop USER_IP and FEDERATION_ACK entries older than ``max_age``."""
        if now is None:
            now = self._clock.seconds()
        limit = now - self.max_age
        bounded: tuple[tuple[dict[Any, Any], dict[Any, float], str], ...] = (
            (self.user_ips, self._ip_times, "user_ips"),
            (self.federation_acks, self._ack_times, "federation_acks"))
        for table, times, name in bounded:
            n = 0
            while times:
                key, at = next(iter(times.items()))
                if at >= limit:
                    break
                del times[key]
                del table[key]
                n += 1
            if n:
                metrics.BOOKKEEPING_EXPIRED.labels(name).inc(n)

    def _clear(self, instance: str) -> None:
        for user in self.user_syncs.pop(instance, {}):
            self._sync_order.pop((instance, user), None)
        self._release(instance)

    def _drop_sync(self, instance: str, user: User) -> None:
        del self._sync_order[(instance, user)]
        syncing = self.user_syncs[instance]
        del syncing[user]
        if not syncing:
            del self.user_syncs[instance]
            self._release(instance)

    def _release(self, instance: str) -> None:
        """An ID without syncs stays owned by a checked connection (nobody
        else may take it while that lives) but not by one we did not accept
        (whose IDs are unbounded in number)."""
        owner = self._owners.get(instance)
        if owner is not None and not owner.accepted:
            del self._owners[instance]
            owned = self._owned.get(owner)
            if owned is not None:
                owned.discard(instance)

    # ------------------------------------------------------------ metrics
    def label(self, instance: str) -> str:
        """The metrics label of an instance (ID): itself if the
        configuration knows it, else its owner's NAME if known, else
        ``other``."""
        if instance in self.known_names:
            return instance
        return metrics_label(_name(self._owners.get(instance)), self.known_names)

    def metric_samples(self) -> list[metrics.Sample]:
        """The USER_SYNC / FEDERATION_ACK gauges' samples, one series per
        known name plus ``other`` (syncs summed, the highest ack).  Reads
        snapshots only: it may run in a scrape thread (a metrics source)."""
        syncs: dict[str, int] = {}
        for instance, users in list(self.user_syncs.items()):
            label = self.label(instance)
            syncs[label] = syncs.get(label, 0) + len(users)
        acks: dict[str, int] = {}
        limit = self._clock.seconds() - self.max_age
        times = dict(self._ack_times)
        for instance, token in list(self.federation_acks.items()):
            if times.get(instance, limit) < limit:
                continue  # expired, not yet dropped
            label = metrics_label(instance, self.known_names)
            acks[label] = max(acks.get(label, token), token)
        samples: list[metrics.Sample] = [
            (metrics.USER_SYNCS, (label,), n) for label, n in syncs.items()]
        samples += [(metrics.FEDERATION_ACK_POSITION, (label,), t) for label, t in acks.items()]
        return samples


def _name(conn: IReplicationConnection | None) -> str | None:
    """The NAME a connection gave itself (None: none, or not a connection
    we accepted)."""
    if conn is None or not conn.accepted:
        return None
    name: str | None = conn.instance_name
    return name


def _put(table: dict[Any, Any], times: dict[Any, float], key: Any, value: Any, now: float,
         limit: int, name: str) -> None:
    """Set ``table[key]`` as its newest entry, making room if full."""
    if times.pop(key, None) is None:
        while len(times) >= limit:
            oldest = next(iter(times))
            del times[oldest]
            del table[oldest]
            metrics.BOOKKEEPING_EVICTED.labels(name).inc()
    else:
        del table[key]
    table[key] = value
    times[key] = now
