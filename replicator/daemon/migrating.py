"""``replicator migrate -c FILE [--dry-run]``: the database's schema made
current by hand, as a start does by itself unless ``database.auto_migrate``
is false (:mod:`replicator.storage.migrations`).

One line per step as it runs (the same lines a start logs), or ``schema:
already at version N``; ``--dry-run`` lists the steps due and changes
nothing.  A schema newer than this replicator is refused (exit 2), a step
that fails is rolled back (exit 1), as at a start.
"""

import os
from collections.abc import Callable
from typing import Any

from ..config.model import InstanceConfig
from ..storage import migrations
from .checking import connect, written_here
from .startup import StartupError


async def migrate_instance(config: InstanceConfig, dry_run: bool, out: Callable[[str], None],
                           reactor: Any) -> None:
    """Migrate (or, ``dry_run``, list the steps due for) the database of
    ``config``, saying what through ``out``; :class:`.StartupError` naming
    ``database.<engine>`` if it cannot."""
    db_config = config.database
    key = f"database.{db_config.engine}"
    owns = bool(written_here(config))
    if (db_config.engine == "sqlite" and not os.path.exists(db_config.path or "")
            and (dry_run or not owns)):
        version = 0
        db = None
    else:
        db = await connect(config)
    try:
        if db is not None:
            version = await migrations.current_version(db)
        if version > migrations.CURRENT_VERSION:
            raise migrations.too_new(version)
        if not owns:
            out(f"schema: {migrations.assess(version, owns, True)}; nothing to migrate")
            return
        due = migrations.pending(version)
        if not due:
            out(f"schema: already at version {version}")
        elif dry_run:
            if version == 0:
                out(f"schema: would create version {migrations.CURRENT_VERSION} (new database)")
            for step in due if version else ():
                out(f"schema: would migrate {step.to - 1} -> {step.to}: {step.what}")
        else:
            said = []

            def announce(line: str) -> None:
                said.append(line)
                reactor.callFromThread(out, line)

            assert db is not None  # only a dry run or a reader goes without one
            reached = await migrations.migrate(db, announce, reactor, config.instance_name)
            # No step ran here: another process took the lock first and did them.
            out(f"schema: at version {reached}" if said else
                f"schema: at version {reached} (migrated meanwhile by another process)")
    except migrations.SchemaProblem as e:
        raise StartupError(key, str(e), code=e.code) from None
    finally:
        if db is not None:
            db.close()
