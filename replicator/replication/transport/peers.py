"""Who may connect to the replication port, and which names peers may take.

Synapse's replication protocol has no authentication: a client says who it
is with ``NAME`` and is believed.  :class:`PeerPolicy` is what this instance
checks on top of that, on the accepting (server) side only:

* never: a peer naming itself after this instance or one of its local
  writers (their facts and bookkeeping are this instance's own);
* never: a second ``NAME`` that differs from the first (an identity is set
  once per connection);
* with ``client_ca``: ``NAME`` must be a name the peer's certificate carries
  (CN or DNS SAN), so a certificate for ``worker1`` cannot say ``NAME master``;
* with ``allowed_peers``: ``NAME`` must be listed, and nothing but ``PING``
  and ``NAME`` is accepted before it;
* with ``allowed_networks``: the peer's address must be in one of the
  networks, checked as soon as the connection is made;
* with ``writer_secrets``: a peer naming itself after one of those writers
  must prove it holds the writer's secret (:mod:`.proof`) before its
  RDATA/POSITION is taken, and holds the name only from then on.

A refusal is ``ERROR <why>`` and a close.  Without ``client_ca``,
``allowed_peers`` and ``allowed_networks`` nothing a Synapse peer sends is
refused here (wire compatibility).

Metric labels are bounded by :func:`replicator.replication.interfaces.metrics_label` (core and
transports both label by it): a peer-supplied name is a label only if the
configuration knows it.
"""

import ipaddress
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...config import ReplicationConfig
    from ..interfaces import IReplicationHandler

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class PeerPolicy:
    """The checks of the module docstring; the empty policy refuses only
    names in ``reserved`` and renames."""

    reserved: frozenset[str] = frozenset()
    certificate_names: bool = False  # client_ca is set: NAME must be in the certificate
    allowed_peers: frozenset[str] | None = None
    allowed_networks: tuple[Network, ...] | None = None
    #: The remote writers that must prove their NAME: name -> secret.
    writer_secrets: Mapping[str, str] = field(default_factory=dict, repr=False, hash=False)

    def secret_for(self, name: str) -> str | None:
        """The secret ``name`` must prove it holds, or None (not bound)."""
        return self.writer_secrets.get(name)

    @property
    def name_required(self) -> bool:
        """Whether a peer must send NAME before any command but PING."""
        return self.allowed_peers is not None

    def check_address(self, host: str | None) -> str | None:
        """Why a peer at ``host`` (an IP address, None for a non-IP peer)
        may not connect, or None if it may."""
        if self.allowed_networks is None:
            return None
        try:
            address = ipaddress.ip_address((host or "").split("%", 1)[0])
        except ValueError:
            return "address not allowed"
        mapped = getattr(address, "ipv4_mapped", None)
        for candidate in (address, mapped):
            if candidate is not None and any(
                    candidate.version == net.version and candidate in net
                    for net in self.allowed_networks):
                return None
        return "address not allowed"

    def check_name(self, name: str, previous: str | None,
                   cert_names: AbstractSet[str] | None) -> str | None:
        """Why a peer may not call itself ``name`` (it said ``previous``
        before; ``cert_names`` are its certificate's names, None without
        one), or None if it may."""
        if previous is not None and name != previous:
            return "NAME already given"
        if name in self.reserved:
            return "NAME is taken by the server"
        if self.certificate_names and (cert_names is None or name not in cert_names):
            return "NAME does not match the client certificate"
        if self.allowed_peers is not None and name not in self.allowed_peers:
            return "NAME not allowed"
        return None


def policy_from_config(replication: "ReplicationConfig", reserved: AbstractSet[str]) -> PeerPolicy:
    """The policy a :class:`~replicator.config.ReplicationConfig` asks for."""
    networks = replication.allowed_networks
    peers = replication.allowed_peers
    return PeerPolicy(
        reserved=frozenset(reserved),
        certificate_names=replication.client_ca is not None,
        allowed_peers=frozenset(peers) if peers is not None else None,
        allowed_networks=tuple(ipaddress.ip_network(n) for n in networks)
        if networks is not None else None,
        writer_secrets={w.name: w.secret for w in replication.writer_secrets
                        if w.secret is not None},
    )


def local_names(handler: "IReplicationHandler") -> frozenset[str]:
    """The names no peer of ``handler`` may take: its instance's and its
    local writers'."""
    names = {handler.instance_name}
    for stream in handler.registry:
        names.update(stream.local_writers)
    return frozenset(names)

