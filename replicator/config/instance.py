"""A whole instance's file: reading the YAML, the ``http``, ``health``,
``consumers`` and ``synapse`` sections, and the checks across sections."""

import os
import re
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import yaml

from .endpoints import get_endpoint
from .fields import (
    WIRE_NAME,
    ConfigError,
    as_mapping,
    get_int,
    get_list,
    get_number,
    get_path,
    get_str,
    kind_of,
    no_unknown,
)
from .model import (
    LOG_FORMATS,
    LOG_LEVELS,
    ConsumerConfig,
    HealthConfig,
    HttpConfig,
    InstanceConfig,
    ReaderConfig,
    ReplicationConfig,
    StreamConfig,
    SynapseConfig,
)
from .replication import parse_replication
from .streams import _check_dsn, parse_database, parse_streams

#: A config is a few kilobytes; this bounds what a wrong path could make us read.
MAX_CONFIG_SIZE = 1 << 20


def load_yaml(path: str) -> Any:
    """Read a YAML file; unreadable or malformed files are ConfigErrors."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_SIZE + 1)
    except OSError as e:
        raise ConfigError("file", f"cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_CONFIG_SIZE:
        raise ConfigError("file", f"{path} is larger than {MAX_CONFIG_SIZE} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("file", f"{path} is not UTF-8 text: byte 0x{data[e.start]:02x} at "
                                  f"offset {e.start}") from None
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise ConfigError("file", f"{path} nests too deeply to be a config") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError("file", f"{path} is not valid YAML{where}: {problem}") from None



HOST_PORT = re.compile(r"(?P<host>[^\s:]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})")


#: The shortest secret accepted (inline, or read from secret_file by validate()).
MIN_SECRET = 16


def parse_http(value: Any, key: str = "http") -> HttpConfig:
    """The ``http`` section; a ``secret_file`` is only named here (relative
    to the working directory): :func:`.validate.validate` reads it."""
    section = as_mapping(value if value is not None else {}, key)
    no_unknown(section, ("listen", "secret", "secret_file", "metrics_listen", "header_timeout",
                          "body_timeout", "max_connections", "max_connections_per_address",
                          "reserved_for_health", "reserved_for_writers",
                          "readers", "max_waiting_reads", "max_waiting_reads_per_address",
                          "heartbeat_interval", "max_page_bytes", "idempotency_window",
                          "ds_long_poll"),
               key)
    if "secret" in section and "secret_file" in section:
        raise ConfigError(key, "give either secret or secret_file, not both")
    secret = get_str(section, "secret", key, None)
    secret_file = get_path(section, "secret_file", key, None)
    if secret_file is not None and not os.path.isabs(secret_file):
        secret_file = os.path.join(".", secret_file)
    if secret is not None and len(secret) < MIN_SECRET:
        raise ConfigError(f"{key}.secret", f"must be at least {MIN_SECRET} characters")
    listen = get_endpoint(section, "listen", key, "server")
    if listen is not None and secret is None and secret_file is None:
        raise ConfigError(f"{key}.secret", "missing: the write API always needs a secret "
                                           "(secret or secret_file)")
    metrics_listen = get_str(section, "metrics_listen", key, None)
    if metrics_listen is not None:
        m = HOST_PORT.fullmatch(metrics_listen)
        if not m or not 0 < int(m.group("port")) < 65536:
            raise ConfigError(f"{key}.metrics_listen",
                              f"expected host:port, got {metrics_listen!r}")
    max_connections = get_int(section, "max_connections", key, 256, minimum=1, maximum=100_000)
    # Half the connections by default: long-polls and event streams never
    # keep a health check or a write out.
    max_waiting = get_int(section, "max_waiting_reads", key,
                          max(1, min(128, max_connections // 2)),
                          minimum=1, maximum=max_connections)
    return HttpConfig(
        listen=listen, secret=secret, metrics_listen=metrics_listen, secret_file=secret_file,
        header_timeout=get_number(section, "header_timeout", key, 10.0, minimum=0.1,
                                  maximum=3600),
        body_timeout=get_number(section, "body_timeout", key, 30.0, minimum=0.1, maximum=3600),
        max_connections=max_connections,
        max_connections_per_address=get_int(section, "max_connections_per_address", key,
                                            min(64, max_connections),
                                            minimum=1, maximum=max_connections),
        reserved_for_health=get_int(section, "reserved_for_health", key, 4,
                                    minimum=0, maximum=1000),
        reserved_for_writers=get_int(section, "reserved_for_writers", key, 16,
                                     minimum=0, maximum=1000),
        readers=parse_readers(section.get("readers"), f"{key}.readers"),
        max_waiting_reads=max_waiting,
        max_waiting_reads_per_address=get_int(section, "max_waiting_reads_per_address", key,
                                              min(32, max_waiting), minimum=1,
                                              maximum=max_waiting),
        heartbeat_interval=get_number(section, "heartbeat_interval", key, 15.0, minimum=0.1,
                                      maximum=3600),
        max_page_bytes=get_int(section, "max_page_bytes", key, 4 * 1024 * 1024,
                               minimum=1024, maximum=1 << 30),
        idempotency_window=get_number(section, "idempotency_window", key, 86_400.0,
                                      minimum=60, maximum=30 * 86_400),
        ds_long_poll=get_number(section, "ds_long_poll", key, 20.0, minimum=0.1,
                                maximum=30),
    )


def parse_readers(value: Any, key: str) -> tuple[ReaderConfig, ...]:
    """``http.readers``: ``[{name, secret_file, streams}]`` (the streams are
    checked against the config's by :func:`parse_instance`; the files are
    read by :func:`.validate.validate`)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list, got {kind_of(value)}")
    out = []
    names = set()
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        section = as_mapping(item, where)
        no_unknown(section, ("name", "secret_file", "streams"), where)
        name = get_str(section, "name", where, pattern=WIRE_NAME, what="a name without spaces")
        if name in names:
            raise ConfigError(f"{where}.name", f"{name!r} is named twice")
        names.add(name)
        secret_file = get_path(section, "secret_file", where)
        if not os.path.isabs(secret_file):
            secret_file = os.path.join(".", secret_file)
        streams = get_list(section, "streams", where, empty="a reader reads some stream "
                                                            '(or ["*"]: every stream)')
        for j, s in enumerate(streams):
            if not isinstance(s, str) or not s:
                raise ConfigError(f"{where}.streams[{j}]",
                                  f"expected a stream name or \"*\", got {kind_of(s)}")
        out.append(ReaderConfig(name, secret_file, tuple(streams)))
    return tuple(out)


def parse_health(value: Any, key: str = "health") -> HealthConfig:
    section = as_mapping(value if value is not None else {}, key)
    no_unknown(section, ("lag_grace", "check_interval"), key)
    return HealthConfig(
        lag_grace=get_number(section, "lag_grace", key, 10.0, minimum=0.0, maximum=3600.0),
        check_interval=get_number(section, "check_interval", key, 5.0, minimum=0.1,
                               maximum=3600.0))


def parse_consumers(value: Any, stream_names: AbstractSet[str],
                    key: str = "consumers") -> tuple[ConsumerConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list, got {kind_of(value)}")
    out = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        section = as_mapping(item, where)
        type_ = get_str(section, "type", where)
        streams = None
        if "streams" in section:
            names = get_list(section, "streams", where)
            for j, name in enumerate(names):
                if not isinstance(name, str) or name not in stream_names:
                    raise ConfigError(f"{where}.streams[{j}]", f"unknown stream {name!r}")
            streams = tuple(names)
        options = {k: v for k, v in section.items() if k not in ("type", "streams")}
        out.append(ConsumerConfig(type_, streams, options))
    return tuple(out)


INSTANCE_KEYS = ("server_name", "instance_name", "database", "streams", "replication", "http",
                 "consumers", "log_level", "log_format", "health", "synapse", "pid_file")


def parse_synapse(value: Any, key: str = "synapse") -> SynapseConfig | None:
    if value is None:
        return None
    section = as_mapping(value, key)
    no_unknown(section, ("server_name", "database", "redis"), key)
    server_name = get_str(section, "server_name", key, pattern=WIRE_NAME,
                       what="a name without spaces")
    database = get_str(section, "database", key, None)
    if database is not None:
        _check_dsn(database, f"{key}.database")
    redis = get_endpoint(section, "redis", key, "client")
    return SynapseConfig(server_name, database, redis)


def _check_synapse_streams(streams: Sequence[StreamConfig], instance_name: str,
                           synapse_config: SynapseConfig | None) -> None:
    """No local writer of a Synapse stream: of a preset stream always, of
    any stream named like one of Synapse's when a Synapse shares the
    deployment (its ID generators and sync tokens would take our IDs)."""
    from .. import synapse

    for i, stream in enumerate(streams):
        if instance_name not in stream.writers:
            continue
        if stream.preset is not None or (synapse_config is not None
                                         and stream.name in synapse.STREAM_NAMES):
            raise ConfigError(f"streams[{i}].writers",
                              f"{stream.name!r} is Synapse's stream: replicator may read it, "
                              f"never write it (remove {instance_name!r}, or name the stream "
                              f"otherwise)")


def _check_reader_streams(http: HttpConfig, stream_names: AbstractSet[str]) -> None:
    for i, reader in enumerate(http.readers):
        for j, name in enumerate(reader.streams):
            if name != "*" and name not in stream_names:
                raise ConfigError(f"http.readers[{i}].streams[{j}]", f"unknown stream {name!r}")


def _check_writer_secrets(replication: ReplicationConfig, streams: Sequence[StreamConfig],
                          instance_name: str) -> None:
    """Each name in ``replication.writer_secrets`` writes a stream here and
    is not this instance (whose own writes need no proof)."""
    remote = {w for s in streams for w in s.writers} - {instance_name}
    for secret in replication.writer_secrets:
        if secret.name not in remote:
            why = ("is this instance" if secret.name == instance_name
                   else "is not a writer of any stream")
            raise ConfigError(f"replication.writer_secrets.{secret.name}",
                              f"{secret.name!r} {why}: only remote writers prove their NAME")


def parse_instance(doc: Any, path: str | None = None) -> InstanceConfig:
    """A whole instance config from its parsed YAML document."""
    # Relative paths (SQLite file, secret file, consumer files) are relative
    # to the working directory, as for the daemon's state directory.
    section = as_mapping(doc, "") if doc is not None else {}
    if not section:
        raise ConfigError("file", "is empty")
    no_unknown(section, INSTANCE_KEYS, "")
    server_name = get_str(section, "server_name", "", pattern=WIRE_NAME,
                          what="a name without spaces")
    instance_name = get_str(section, "instance_name", "", pattern=WIRE_NAME,
                         what="a name without spaces")
    synapse_config = parse_synapse(section.get("synapse"))
    database_section = section.get("database")
    if database_section is None and synapse_config is not None and synapse_config.database:
        database_section = {"postgres": synapse_config.database}
    database = parse_database(database_section)
    streams = parse_streams(section.get("streams"))
    _check_synapse_streams(streams, instance_name, synapse_config)
    replication_section = section.get("replication")
    if synapse_config is not None and synapse_config.redis:
        replication_section = dict(as_mapping(replication_section or {}, "replication"))
        replication_section.setdefault("redis", {"endpoint": synapse_config.redis})
    replication = parse_replication(replication_section)
    if synapse_config is not None and replication.redis and replication.redis.cluster:
        raise ConfigError("replication.redis.cluster",
                          "not beside a Synapse (the synapse: section): Synapse speaks plain "
                          "pub/sub on one channel")
    http = parse_http(section.get("http"))
    _check_reader_streams(http, {s.name for s in streams})
    consumers = parse_consumers(section.get("consumers"), {s.name for s in streams})
    health = parse_health(section.get("health"))
    log_level = section.get("log_level", "info")
    if log_level not in LOG_LEVELS:
        raise ConfigError("log_level", f"{log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    log_format = section.get("log_format", "text")
    if not isinstance(log_format, str) or log_format not in LOG_FORMATS:
        raise ConfigError("log_format",
                          f"{log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    if database.engine == "sqlite":
        for i, stream in enumerate(streams):
            if stream.foreign_writers:
                raise ConfigError(f"streams[{i}].foreign_writers",
                                  "needs PostgreSQL: an embedded SQLite database has no "
                                  "sequence a plain-SQL writer could take IDs from")
            others = [w for w in stream.writers if w != instance_name]
            if others:
                raise ConfigError(f"streams[{i}].writers",
                                  f"{others[0]!r} cannot write an embedded SQLite database of "
                                  f"{instance_name!r}: use PostgreSQL for several writers")
    _check_writer_secrets(replication, streams, instance_name)
    pid_file = get_path(section, "pid_file", "", None)
    if replication.upstream and replication.listen:
        raise ConfigError("replication.upstream", "an instance either listens (master) or "
                                                  "connects upstream (worker), not both")
    return InstanceConfig(
        server_name=server_name, instance_name=instance_name, database=database,
        streams=streams, replication=replication, http=http, consumers=consumers,
        log_level=log_level, log_format=log_format, path=path, health=health,
        synapse=synapse_config,
        pid_file=pid_file,
    )


def load_config(path: str) -> InstanceConfig:
    """Read and validate one instance's YAML file."""
    return parse_instance(load_yaml(path), path)
