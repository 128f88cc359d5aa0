"""The master's bookkeeping of USER_SYNC, CLEAR_USER_SYNC, FEDERATION_ACK
and USER_IP.

What other instances report is kept here for the HTTP API and the metrics:

* ``user_syncs``: instance -> {(user_id, device_id): last_sync_ms} of users
  syncing now; an instance's entries go with the connection that reported
  them, and with CLEAR_USER_SYNC.
* ``federation_acks``: instance -> last acknowledged token.
* ``user_ips``: (user_id, device_id) -> what USER_IP last said.
"""

from typing import Any, Dict, Optional, Set, Tuple

User = Tuple[str, Optional[str]]


class Bookkeeping:
    def __init__(self):
        self.user_syncs: Dict[str, Dict[User, int]] = {}
        self.federation_acks: Dict[str, int] = {}
        self.user_ips: Dict[User, dict] = {}
        self._instances: Dict[Any, Set[str]] = {}  # conn -> instances it reported

    def user_sync(self, conn, cmd, track: bool = True) -> None:
        """USER_SYNC; ``track``: expire it when ``conn`` is lost."""
        syncing = self.user_syncs.setdefault(cmd.instance_id, {})
        user = (cmd.user_id, cmd.device_id)
        if cmd.is_syncing:
            syncing[user] = cmd.last_sync_ms
        else:
            syncing.pop(user, None)
        if track:
            self._instances.setdefault(conn, set()).add(cmd.instance_id)

    def clear_user_sync(self, conn, cmd) -> None:
        self.user_syncs.pop(cmd.instance_id, None)

    def federation_ack(self, conn, cmd) -> None:
        self.federation_acks[cmd.instance_name] = cmd.token

    def user_ip(self, conn, cmd) -> None:
        self.user_ips[(cmd.user_id, cmd.device_id)] = {
            "access_token_seen": True, "ip": cmd.ip, "user_agent": cmd.user_agent,
            "last_seen": cmd.last_seen,
        }

    def connection_lost(self, conn) -> None:
        """The users that ``conn``'s instances reported syncing are gone."""
        for instance in self._instances.pop(conn, ()):
            self.user_syncs.pop(instance, None)
