"""``replicator check -c FILE``: everything a start would check, changing
nothing (like ``nginx -t``), so that a unit's ``ExecReload=`` or an operator
can try a file before it is used.

Checked: the file itself and every key (parsing), what needs files or
Twisted (:func:`replicator.config.validate`: endpoints built once, TLS keys
and trust roots, ``client_ca``, ``secret_file``), the built-in consumers'
options (their files are not opened), the database reachable, its schema
version (:mod:`.storage.migrations`: current, due a migration the start
makes, or one it refuses: too new, or older with ``auto_migrate: false``),
and its tables as the streams declare them (a table this instance would
create may be missing; one that exists must have every configured column,
with a type that holds it (:mod:`.storage.column_types`); a read-only
stream's table that exists must have its sequence).  A read-only stream's
table that is missing (``create``, not a preset) is its writer's to create
at its first start: the summary says so, and that this instance starts
after it (a start before refuses the stream), without failing.  Not
checked: whether the listen ports are free (the running daemon holds them).

A SQLite database file that does not exist yet is not created: start will.

Warned about (stderr, the exit stays 0): each remote writer a replication
listener takes writes from without a proof of its NAME
(:func:`unbound_writers`).
"""

import os

from ..config.model import InstanceConfig
from ..storage import migrations, schema
from ..storage.database import Database
from .startup import StartupError, hide_password


async def check_instance(config: InstanceConfig) -> str:
    """The summary line of a config that passes; ConfigError naming the
    key of the first problem otherwise (StartupError for an unreachable
    database)."""
    from ..consumers.loading import check_consumers

    check_consumers(config.consumers)
    db_config = config.database
    key = f"database.{db_config.engine}"
    if db_config.engine == "sqlite" and not os.path.exists(db_config.path or ""):
        return (f"config ok: instance {config.instance_name}, {len(config.streams)} streams; "
                f"{db_config.path} does not exist yet (start creates it){redis_trust(config)}")
    db = await connect(config)
    try:
        keys = {s.name: f"streams[{i}]" for i, s in enumerate(config.streams)}
        written = written_here(config)
        try:
            state = migrations.assess(await migrations.current_version(db), bool(written),
                                      db_config.auto_migrate)
        except migrations.SchemaProblem as e:
            raise StartupError(key, str(e), code=e.code) from None
        awaiting: list[str] = []
        await db.runInteraction(schema.ensure_schema, list(config.streams), db.is_postgres,
                                keys, written, True, awaiting_writer=awaiting)
    finally:
        db.close()
    return (f"config ok: instance {config.instance_name}, {len(config.streams)} streams; "
            f"database reachable, tables as declared; {state}"
            f"{awaiting_writers(config, awaiting)}{redis_trust(config)}")


def awaiting_writers(config: InstanceConfig, names: list[str]) -> str:
    """What the summary says of the read-only streams whose tables do not
    exist yet ("" when there are none): their writers create them."""
    if not names:
        return ""
    parts = []
    for name in names:
        stream = next(s for s in config.streams if s.name == name)
        who = (f"its writer ({stream.writers[0]})" if len(stream.writers) == 1 else
               f"the first of its writers ({', '.join(stream.writers)})")
        parts.append(f"{stream.table} (stream {name}) is created by {who} at its first start")
    return "; " + "; ".join(parts) + "; start this instance after it"


def redis_trust(config: InstanceConfig) -> str:
    """What the summary says of our own Redis channels when a publisher
    there is believed without proof ("" when lines are signed and checked)."""
    redis = config.replication.redis
    if redis is None:
        return ""
    if redis.keys is None:
        return ("; WARNING: our own Redis channels are unauthenticated: any Redis client "
                "that may PUBLISH there can forge facts and positions of any writer (set "
                "replication.redis.keys)")
    if redis.keys.accept_unsigned:
        return ("; WARNING: replication.redis.keys.accept_unsigned: unsigned lines on our "
                "own Redis channels are still taken (for a rolling upgrade only)")
    return ""


def written_here(config: InstanceConfig) -> set[str]:
    """The streams this instance writes: only these get tables (and the
    schema version) from it."""
    return {s.name for s in config.streams if config.instance_name in s.writers}


async def connect(config: InstanceConfig) -> Database:
    """The instance's database, one query made; :class:`.StartupError`
    (exit 1) naming ``database.<engine>`` if it does not answer."""
    db_config = config.database
    db = Database(db_config)
    try:
        await db.runQuery("SELECT 1")
    except Exception as e:
        db.close()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise StartupError(f"database.{db_config.engine}",
                           "cannot connect: " + hide_password(first, db_config.dsn)) from None
    return db


def unbound_writers(config: InstanceConfig) -> list[str]:
    """One line per remote writer whose NAME this instance's replication
    listener believes without proof: neither ``client_ca`` (NAME bound to
    the certificate) nor a ``writer_secrets`` entry.  Empty without a
    listener (a worker takes no writes)."""
    rep = config.replication
    if rep.listen is None or rep.client_ca is not None:
        return []
    bound = {w.name for w in rep.writer_secrets}
    out = []
    seen: set[str] = set()
    for stream in config.streams:
        for writer in stream.writers:
            if writer == config.instance_name or writer in bound or writer in seen:
                continue
            seen.add(writer)
            streams = [s.name for s in config.streams if writer in s.writers]
            out.append(f"replication.writer_secrets: remote writer {writer!r} (of "
                       f"{', '.join(streams)}) proves nothing: any connection saying NAME "
                       f"{writer} is taken for it (give it a secret, or set client_ca)")
    return out
