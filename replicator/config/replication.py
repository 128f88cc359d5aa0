"""The ``replication`` section: listeners, upstream, Redis, limits, who may
connect."""

import os
from collections.abc import Mapping
from typing import Any

from ..net.backoff import RECONNECT_INITIAL_DELAY, RECONNECT_MAX_DELAY
from ..net.endpoint_strings import is_loopback
from .endpoints import get_endpoint
from .fields import (
    WIRE_NAME,
    ConfigError,
    as_mapping,
    get_bool,
    get_int,
    get_list,
    get_names,
    get_number,
    get_path,
    get_str,
    kind_of,
    no_unknown,
)
from .model import REDIS_CHANNELS, RedisConfig, RedisKeys, ReplicationConfig, WriterSecret


def parse_redis(value: Any, key: str) -> RedisConfig | None:
    """Redis by ``endpoint``, or through ``sentinels`` + ``master_name``."""
    if value is None:
        return None
    section = as_mapping(value, key)
    no_unknown(section, ("endpoint", "password", "dbid", "sentinels", "master_name",
                         "channels", "cluster", "keys"), key)
    cluster = _cluster(section, key)
    endpoint = get_endpoint(section, "endpoint", key, "client")
    sentinels = _sentinels(section, key)
    if endpoint is not None and cluster:
        raise ConfigError(f"{key}.endpoint", "give endpoint or cluster, not both")
    if endpoint is not None and sentinels:
        raise ConfigError(f"{key}.sentinels",
                          "not with endpoint: Sentinel names the master's address")
    if sentinels and cluster:
        raise ConfigError(f"{key}.sentinels",
                          "not with cluster: a cluster's nodes are found through cluster")
    if endpoint is None and not sentinels and not cluster:
        raise ConfigError(f"{key}.endpoint",
                          "missing (or give sentinels and master_name, or cluster)")
    if cluster:
        endpoint = cluster[0]
    master_name = get_str(section, "master_name", key, None)
    if sentinels and master_name is None:
        raise ConfigError(f"{key}.master_name", "missing (the name the sentinels monitor)")
    if master_name is not None and not sentinels:
        raise ConfigError(f"{key}.master_name", "needs sentinels")
    dbid = get_int(section, "dbid", key, None, minimum=0, maximum=65535)
    if cluster and dbid:
        raise ConfigError(f"{key}.dbid", "a Redis cluster has database 0 only")
    channels = _channels(section, key, "per_stream" if cluster else REDIS_CHANNELS[0])
    if cluster and channels != "per_stream":
        raise ConfigError(f"{key}.channels", "a cluster uses shard channels per stream: "
                          "per_stream (the default with cluster)")
    return RedisConfig(endpoint, get_str(section, "password", key, None), dbid,
                       sentinels, master_name, channels=channels, cluster=cluster,
                       keys=_keys(section.get("keys"), f"{key}.keys"))


def _keys(value: Any, key: str) -> RedisKeys | None:
    """``keys``: this instance's Ed25519 private key and the others' public
    keys (paths; the files are read in validate())."""
    if value is None:
        return None
    section = as_mapping(value, key)
    no_unknown(section, ("private_key", "public_keys", "accept_unsigned"), key)
    private_key = get_path(section, "private_key", key)
    public = as_mapping(section.get("public_keys", {}), f"{key}.public_keys")
    pairs = []
    for name in public:
        if not isinstance(name, str) or not WIRE_NAME.fullmatch(name):
            raise ConfigError(f"{key}.public_keys", f"{name!r} is not an instance name")
        pairs.append((name, get_path(public, name, f"{key}.public_keys")))
    return RedisKeys(private_key, tuple(pairs),
                     get_bool(section, "accept_unsigned", key, False))

def _sentinels(section: Mapping[str, Any], key: str) -> tuple[tuple[str, int], ...]:
    """``sentinels``: ``host:port`` strings (``[v6]:port``), as pairs."""
    if section.get("sentinels") is None:
        return ()
    out = []
    for i, item in enumerate(get_list(section, "sentinels", key,
                                      empty="an empty list names no Sentinel")):
        path = f"{key}.sentinels[{i}]"
        host, _, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(path, f"expected host:port (like 127.0.0.1:26379), "
                                    f"got {item!r}" if isinstance(item, str)
                              else f"expected host:port, got {kind_of(item)}")
        out.append((host, int(port)))
    return tuple(out)

def _cluster(section: Mapping[str, Any], key: str) -> tuple[str, ...]:
    """``cluster``: a Redis cluster's seed nodes, client endpoint strings."""
    if section.get("cluster") is None:
        return ()
    nodes = get_list(section, "cluster", key, empty="name at least one node")
    for i, node in enumerate(nodes):
        get_endpoint({f"cluster[{i}]": node}, f"cluster[{i}]", key, "client")
        if not node.startswith("tcp:"):
            raise ConfigError(f"{key}.cluster[{i}]",
                              "expected a tcp: endpoint like tcp:host=10.0.0.1:port=7000")
    return tuple(nodes)


def _channels(section: Mapping[str, Any], key: str, default: str) -> str:
    """``channels``: the layout of :mod:`replicator.replication.transport.redis_channels`."""
    value = section.get("channels", default)
    if not isinstance(value, str) or value not in REDIS_CHANNELS:
        raise ConfigError(f"{key}.channels",
                          f"{value!r} is not one of {', '.join(REDIS_CHANNELS)}")
    return value


def _allowed_peers(section: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
    if section.get("allowed_peers") is None:
        return None
    return get_names(section, "allowed_peers", key, "an empty list would refuse every peer")


def _allowed_networks(section: Mapping[str, Any], key: str, listen: str | None
                      ) -> tuple[str, ...] | None:
    if section.get("allowed_networks") is None:
        return None
    import ipaddress

    networks = get_list(section, "allowed_networks", key,
                        empty="an empty list would refuse every peer")
    for i, network in enumerate(networks):
        path = f"{key}.allowed_networks[{i}]"
        if not isinstance(network, str):
            raise ConfigError(path, f"expected a network like 10.0.0.0/8, got {kind_of(network)}")
        try:
            ipaddress.ip_network(network)
        except ValueError as e:
            raise ConfigError(path, str(e).replace("\n", " ")) from None
    if listen is not None and not listen.startswith(("tcp", "ssl")):
        raise ConfigError(f"{key}.allowed_networks", "needs a tcp: or ssl: listener")
    return tuple(networks)


def _file(path: str) -> str:
    """A relative path as the daemon reads it (from its working directory)."""
    return path if os.path.isabs(path) else os.path.join(".", path)


def _writer_secrets(section: Mapping[str, Any], key: str, listen: str | None
                    ) -> tuple[WriterSecret, ...]:
    """``writer_secrets``: ``{writer: secret file}``, the remote writers that
    prove their NAME to this listener (the files are read by validate();
    parse_instance checks that each is a remote writer)."""
    value = section.get("writer_secrets")
    if value is None:
        return ()
    where = f"{key}.writer_secrets"
    mapping = as_mapping(value, where)
    if not mapping:
        raise ConfigError(where, "an empty mapping names no writer (leave it out)")
    if listen is None:
        raise ConfigError(where, "needs replication.listen: the instance writers connect to "
                                 "checks their proofs")
    out = []
    for name in mapping:
        if not isinstance(name, str) or not WIRE_NAME.fullmatch(name):
            raise ConfigError(where, f"{name!r} is not an instance name (a name without spaces)")
        out.append(WriterSecret(name, _file(get_path(mapping, name, where))))
    return tuple(out)


def _protected(listen: str | None, client_ca: str | None,
               allowed_networks: tuple[str, ...] | None, opted_in: bool, key: str) -> None:
    """Refuse a listener beyond loopback that anyone could use (Redis's
    protected mode): without ``client_ca`` or ``allowed_networks`` every
    peer that reaches it reads every fact, unless the operator says so."""
    if listen is None or opted_in or client_ca is not None or allowed_networks is not None:
        return
    if is_loopback(listen):
        return
    raise ConfigError(f"{key}.listen",
                      "listens beyond loopback with neither client_ca nor allowed_networks, so "
                      "anyone who reaches it reads every fact: bind it to 127.0.0.1, set "
                      f"client_ca or allowed_networks, or set {key}.insecure_public_listener: "
                      "true")


def parse_replication(value: Any, key: str = "replication") -> ReplicationConfig:
    section = as_mapping(value if value is not None else {}, key)
    no_unknown(section, ("listen", "upstream", "redis", "client_ca", "ping_interval",
                          "ping_timeout", "max_queued_lines", "max_line_length", "fetch_limit",
                          "fanout_interval", "allowed_peers", "allowed_networks",
                          "max_user_syncs", "max_user_ips", "max_federation_acks",
                          "bookkeeping_max_age", "max_queued_bytes", "idle_timeout",
                          "max_connections", "max_connections_per_address",
                          "max_unidentified", "identify_timeout", "reconnect_initial_delay",
                          "reconnect_max_delay", "max_batch_rows", "max_batch_bytes",
                          "insecure_public_listener", "audit", "audit_recheck",
                          "writer_secrets", "secret_file"), key)
    ping_interval = get_number(section, "ping_interval", key, 5.0, minimum=0.1, maximum=300)
    ping_timeout = get_number(section, "ping_timeout", key, 15.0, minimum=1, maximum=3600)
    if ping_timeout <= ping_interval:
        raise ConfigError(f"{key}.ping_timeout",
                          f"must be longer than ping_interval ({ping_interval:g}s)")
    listen = get_endpoint(section, "listen", key, "server")
    client_ca = get_path(section, "client_ca", key, None)
    # Its file is read in validate().
    if client_ca is not None and (listen is None or not listen.startswith("ssl:")):
        raise ConfigError(f"{key}.client_ca", "needs an ssl: listener in replication.listen")
    allowed_networks = _allowed_networks(section, key, listen)
    insecure_public_listener = get_bool(section, "insecure_public_listener", key, False)
    _protected(listen, client_ca, allowed_networks, insecure_public_listener, key)
    max_line_length = get_int(section, "max_line_length", key, 16_384, minimum=1024,
                           maximum=16 << 20)
    max_batch_rows = get_int(section, "max_batch_rows", key, 10_000, minimum=1,
                          maximum=1_000_000)
    max_batch_bytes = get_int(section, "max_batch_bytes", key, 16 << 20, minimum=65536,
                           maximum=1 << 30)
    if max_batch_bytes <= max_line_length:
        raise ConfigError(f"{key}.max_batch_bytes",
                          f"must be larger than max_line_length ({max_line_length})")
    max_queued_bytes = get_int(section, "max_queued_bytes", key, 16 << 20, minimum=64 << 10,
                            maximum=2 << 30)
    if max_queued_bytes <= max_line_length:
        raise ConfigError(f"{key}.max_queued_bytes",
                          f"must be more than max_line_length ({max_line_length})")
    initial_delay = get_number(section, "reconnect_initial_delay", key,
                               RECONNECT_INITIAL_DELAY, minimum=0.01, maximum=60)
    max_delay = get_number(section, "reconnect_max_delay", key, RECONNECT_MAX_DELAY,
                           minimum=0.01, maximum=3600)
    if max_delay < initial_delay:
        raise ConfigError(f"{key}.reconnect_max_delay",
                          f"must be at least reconnect_initial_delay ({initial_delay:g}s)")
    max_connections = get_int(section, "max_connections", key, 256, minimum=1, maximum=65_536)
    secret_file = get_path(section, "secret_file", key, None)
    upstream = get_endpoint(section, "upstream", key, "client")
    if secret_file is not None and upstream is None:
        raise ConfigError(f"{key}.secret_file", "needs replication.upstream: a worker proves "
                                                "its NAME to the instance it connects to")
    redis = parse_redis(section.get("redis"), f"{key}.redis")
    if redis is not None and redis.keys is not None and listen is not None:
        raise ConfigError(f"{key}.redis.keys",
                          "not with listen: the TCP workers' lines this master passes on to "
                          "Redis would carry its signature, not theirs, and be refused")
    return ReplicationConfig(
        writer_secrets=_writer_secrets(section, key, listen),
        secret_file=_file(secret_file) if secret_file is not None else None,
        listen=listen,
        client_ca=client_ca,
        upstream=upstream,
        redis=redis,
        ping_interval=ping_interval,
        ping_timeout=ping_timeout,
        max_queued_lines=get_int(section, "max_queued_lines", key, 10_000, minimum=1,
                              maximum=10_000_000),
        max_line_length=max_line_length,
        max_queued_bytes=max_queued_bytes,
        idle_timeout=get_number(section, "idle_timeout", key, 60.0, minimum=1, maximum=86_400),
        max_connections=max_connections,
        max_connections_per_address=get_int(section, "max_connections_per_address", key,
                                            min(32, max_connections),
                                            minimum=1, maximum=max_connections),
        max_unidentified=get_int(section, "max_unidentified", key, 64, minimum=1,
                                 maximum=65_536),
        identify_timeout=get_number(section, "identify_timeout", key, 10.0, minimum=0.1,
                                    maximum=3600),
        reconnect_initial_delay=initial_delay,
        reconnect_max_delay=max_delay,
        fetch_limit=get_int(section, "fetch_limit", key, 1000, minimum=1, maximum=100_000),
        fanout_interval=get_number(section, "fanout_interval", key, 0.003, minimum=0,
                                maximum=1),
        allowed_peers=_allowed_peers(section, key),
        allowed_networks=allowed_networks,
        insecure_public_listener=insecure_public_listener,
        max_user_syncs=get_int(section, "max_user_syncs", key, 50_000, minimum=1,
                            maximum=10_000_000),
        max_user_ips=get_int(section, "max_user_ips", key, 20_000, minimum=1, maximum=10_000_000),
        max_federation_acks=get_int(section, "max_federation_acks", key, 1_000, minimum=1,
                                 maximum=100_000),
        bookkeeping_max_age=get_number(section, "bookkeeping_max_age", key, 86_400.0,
                                    minimum=60, maximum=31_536_000),
        max_batch_rows=max_batch_rows,
        max_batch_bytes=max_batch_bytes,
        audit=get_bool(section, "audit", key, True),
        audit_recheck=get_number(section, "audit_recheck", key, 300.0, minimum=1,
                                 maximum=86_400),
    )
