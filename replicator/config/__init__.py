"""YAML → typed, validated configuration of one replicator instance.

Every mistake is reported as one :class:`ConfigError` whose text names the key
(as a dotted path, e.g. ``streams[1].columns[0]``) and the problem; the CLI
prints that line and exits with code 2 before anything listens.

The package, one job a module:

- :mod:`.fields`: :class:`ConfigError`, name patterns, typed getters (the
  invariants every parser keeps: ``fullmatch`` for names, a range for every
  number, one-line messages);
- :mod:`.model`: the frozen dataclasses the parsers build;
- :mod:`.streams`: ``database`` and ``streams`` (with Synapse presets);
- :mod:`.endpoints`: endpoint strings;
- :mod:`.replication`: the ``replication`` section;
- :mod:`.instance`: the file, ``http``/``health``/``consumers``/``synapse``
  and the checks across sections;
- :mod:`.validate`: what needs files or Twisted (TLS files, the secret
  file, every endpoint built once), run by the CLI after parsing.

Parsing is pure: it imports no reactor, reads no file but the YAML one and
builds no endpoint (endpoints stay strings; the instance builds them with
its own reactor).

Everything a caller needs is importable from here.
"""

from .fields import (
                     IDENTIFIER,
                     SQL_KEYWORDS,
                     WIRE_NAME,
                     ConfigError,
                     get_bool,
                     get_int,
                     get_list,
                     get_names,
                     get_number,
                     get_path,
                     get_str,
                     no_unknown,
)
from .instance import (
                     INSTANCE_KEYS,
                     MAX_CONFIG_SIZE,
                     load_config,
                     load_yaml,
                     parse_consumers,
                     parse_health,
                     parse_http,
                     parse_instance,
                     parse_synapse,
)
from .model import (
                     COLUMN_TYPES,
                     LOG_LEVELS,
                     POSITIONS_TABLE,
                     ColumnConfig,
                     ConsumerConfig,
                     DatabaseConfig,
                     HealthConfig,
                     HttpConfig,
                     InstanceConfig,
                     ReaderConfig,
                     RedisConfig,
                     RedisKeys,
                     ReplicationConfig,
                     RetentionConfig,
                     StreamConfig,
                     SynapseConfig,
)
from .replication import parse_redis, parse_replication
from .streams import (
                     MAX_POOL,
                     MAX_WRITE_GROUP,
                     parse_column,
                     parse_database,
                     parse_retention,
                     parse_stream,
                     parse_streams,
)
from .validate import read_secret, validate, validate_http, validate_replication

__all__ = [
    "IDENTIFIER", "SQL_KEYWORDS", "WIRE_NAME", "ConfigError", "get_bool", "get_int",
    "get_list", "get_names", "get_number", "get_path", "get_str", "no_unknown",
    "INSTANCE_KEYS", "MAX_CONFIG_SIZE", "load_config", "load_yaml", "parse_consumers",
    "parse_health", "parse_http", "parse_instance", "parse_synapse", "COLUMN_TYPES",
    "LOG_LEVELS", "POSITIONS_TABLE", "ColumnConfig", "ConsumerConfig", "DatabaseConfig",
    "HealthConfig", "HttpConfig", "InstanceConfig", "ReaderConfig", "RedisConfig", "RedisKeys",
    "ReplicationConfig", "RetentionConfig",
    "StreamConfig", "SynapseConfig", "parse_redis", "parse_replication", "MAX_POOL",
    "MAX_WRITE_GROUP", "parse_column", "parse_database", "parse_retention", "parse_stream",
    "parse_streams",
    "read_secret", "validate", "validate_http", "validate_replication",
]
