"""The checks of a parsed config that need files or Twisted: run by the CLI
after parsing, before anything starts.

Parsing (:func:`.instance.parse_instance`) is pure: it checks syntax and
keeps endpoint strings.  :func:`validate` builds every endpoint once with
the reactor it is given (Twisted reads an ``ssl:`` listener's key and
certificate, a ``tls:`` client's trust roots, a plugin checks its own
fields), loads ``replication.client_ca``, and reads ``http.secret_file`` and the
replication secrets (``replication.secret_file``, ``writer_secrets``).
Each mistake is one :class:`ConfigError` naming the key, as in parsing.
The endpoints built here are thrown away: the instance builds its own.
"""

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from twisted.internet import endpoints

from ..net.endpoint_strings import parse
from .fields import ConfigError, one_line
from .instance import MIN_SECRET
from .model import HttpConfig, InstanceConfig, ReaderConfig, ReplicationConfig


def validate(config: InstanceConfig, reactor: Any) -> InstanceConfig:
    """``config`` checked against its files, with the secret read from
    ``http.secret_file`` (the one change: every other value is as parsed)."""
    if config.synapse is not None and config.synapse.redis:
        _build(reactor, config.synapse.redis, "synapse.redis", "client")
    replication = validate_replication(config.replication, reactor)
    validate_redis_keys(config)
    http = validate_http(config.http, reactor)
    if http is config.http and replication is config.replication:
        return config
    return dataclasses.replace(config, http=http, replication=replication)


def validate_replication(rep: ReplicationConfig, reactor: Any,
                         key: str = "replication") -> ReplicationConfig:
    """The listener (with its client CA), the upstream and Redis endpoints;
    ``rep`` with the writers' secrets (and the worker's own) read from
    their files."""
    if rep.client_ca is not None:
        from ..net.tls import load_ca_certificates, server_endpoint

        try:
            load_ca_certificates(rep.client_ca)
            server_endpoint(reactor, rep.listen or "", rep.client_ca)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}.client_ca", " ".join(str(e).split())) from None
    elif rep.listen is not None:
        _build(reactor, rep.listen, f"{key}.listen", "server")
    if rep.upstream is not None:
        _build(reactor, rep.upstream, f"{key}.upstream", "client")
    if rep.redis is not None and rep.redis.endpoint is not None:
        _build(reactor, rep.redis.endpoint, f"{key}.redis.endpoint", "client")
    return read_replication_secrets(rep, key)


def read_replication_secrets(rep: ReplicationConfig,
                             key: str = "replication") -> ReplicationConfig:
    """``rep`` with ``secret_file`` and each of ``writer_secrets`` read (at
    least :data:`MIN_SECRET` characters; no two writers alike: one would
    prove the other's NAME)."""
    changes: dict[str, object] = {}
    if rep.secret_file is not None:
        changes["secret"] = _min_secret(read_secret(rep.secret_file, f"{key}.secret_file"),
                                        f"{key}.secret_file")
    if rep.writer_secrets:
        out = []
        seen: dict[str, str] = {}
        for writer in rep.writer_secrets:
            where = f"{key}.writer_secrets.{writer.name}"
            secret = _min_secret(read_secret(writer.secret_file, where), where)
            if secret in seen:
                raise ConfigError(where, f"the same secret as writer {seen[secret]!r}: each "
                                         "writer needs its own")
            seen[secret] = writer.name
            out.append(dataclasses.replace(writer, secret=secret))
        changes["writer_secrets"] = tuple(out)
    return dataclasses.replace(rep, **changes) if changes else rep  # type: ignore[arg-type]


def _min_secret(secret: str, key: str) -> str:
    if len(secret) < MIN_SECRET:
        raise ConfigError(key, f"the secret must be at least {MIN_SECRET} characters")
    return secret


def validate_redis_keys(config: InstanceConfig, key: str = "replication.redis.keys") -> None:
    """The key files of ``replication.redis.keys`` read (Ed25519, PEM), and
    a public key for every other writer of a stream on our own channels
    (without one, every fact of that writer would be refused)."""
    redis = config.replication.redis
    if redis is None or redis.keys is None:
        return
    from ..replication.transport.redis_signing import load_keys

    _, public = load_keys(redis.keys, key)
    for stream in config.streams:
        if config.synapse is not None and stream.preset is not None:
            continue  # Synapse's stream, on Synapse's channel: never signed
        for writer in stream.writers:
            if writer != config.instance_name and writer not in public:
                raise ConfigError(f"{key}.public_keys",
                                  f"no key for {writer}, a writer of {stream.name}: every "
                                  f"line it publishes would be refused")


def validate_http(http: HttpConfig, reactor: Any, key: str = "http") -> HttpConfig:
    """The listener, and the secret read from ``secret_file``."""
    if http.listen is not None:
        _build(reactor, http.listen, f"{key}.listen", "server")
    if http.secret_file is not None:
        secret = read_secret(http.secret_file, f"{key}.secret_file")
        if len(secret) < MIN_SECRET:
            raise ConfigError(f"{key}.secret", f"must be at least {MIN_SECRET} characters")
        http = dataclasses.replace(http, secret=secret)
    if http.readers:
        http = dataclasses.replace(http, readers=read_reader_secrets(http.readers, key,
                                                                     http.secret))
    return http


def read_reader_secrets(readers: Iterable[ReaderConfig], key: str = "http",
                        write_secret: str | None = None) -> tuple[ReaderConfig, ...]:
    """``http.readers`` with each reader's secret read from its file (at
    least :data:`MIN_SECRET` characters, no two readers alike, none the
    write secret: a reader would write, and read as ``secret``)."""
    out = []
    seen: dict[str, str] = {}
    for i, reader in enumerate(readers):
        where = f"{key}.readers[{i}].secret_file"
        secret = read_secret(reader.secret_file, where)
        if len(secret) < MIN_SECRET:
            raise ConfigError(where, f"the secret must be at least {MIN_SECRET} characters")
        if write_secret is not None and secret == write_secret:
            raise ConfigError(where, "the same secret as the write secret (http.secret or "
                                     "http.secret_file): each reader needs its own")
        if secret in seen:
            raise ConfigError(where, f"the same secret as reader {seen[secret]!r}: each "
                                     "reader needs its own")
        seen[secret] = reader.name
        out.append(dataclasses.replace(reader, secret=secret))
    return tuple(out)


#: A file name that may be a secret pasted where its path goes: a long run
#: of the characters secrets are made of (``secrets.token_urlsafe``), no dot.
SECRET_LIKE = re.compile(r"[A-Za-z0-9_\-]{20,}")


def shown_path(path: str) -> str:
    """``path`` for an error message, unless its last part looks like a
    secret (an operator who pasted the secret where its file's path goes
    must not find it in the journal)."""
    head, _, tail = path.rpartition("/")
    if SECRET_LIKE.fullmatch(tail):
        return f"{head}/" * bool(head) + "<a name like a secret, not shown>"
    return path


def read_secret(path: str, key: str) -> str:
    """The stripped text of a secret file; unreadable or empty is a ConfigError."""
    shown = shown_path(path)
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ConfigError(key, f"cannot read secret file {shown}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(key, f"secret file {shown} is not UTF-8 text") from None
    if not secret:
        raise ConfigError(key, f"secret file {shown} is empty")
    return secret


def _build(reactor: Any, value: str, path: str, kind: str) -> object | None:
    """Let Twisted build the endpoint ``value`` (and read its files); a
    ``tls:`` listener's directory must hold its key and certificate, a
    ``tls:`` client's files what :func:`..net.tls.check_client_files` says."""
    try:
        if kind == "server":
            parsed = parse(value)
            if parsed.kind == "tls":
                from ..net.tls import check_pem_directory

                check_pem_directory(parsed.kwargs.get("path", parsed.args[0]))
            server: object = endpoints.serverFromString(reactor, value)
            return server
        parsed = parse(value)
        if parsed.kind == "tls":
            from ..net.tls import check_client_files

            check_client_files(parsed.kwargs)
        client: object = endpoints.clientFromString(reactor, value)
        return client
    except Exception as e:  # Twisted raises several types for bad strings and files
        raise ConfigError(path, f"cannot parse endpoint {value!r}: {one_line(e)}") from None
