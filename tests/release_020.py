"""The databases release 0.2.0 made (``tests/fixtures/release-0.2.0``, by
``scripts/release_fixture.py``, loaded as :data:`release`): where they are
(:data:`FIXTURES`), the facts they hold (:data:`RELEASE_FACTS`) and a
fresh PostgreSQL database restored from the dump (:func:`postgres_copy`).
Test modules take them from here, never from one another."""

import importlib.util
import os

from tests.servers import PostgresServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "release-0.2.0")


def _release_fixture():
    spec = importlib.util.spec_from_file_location(
        "release_fixture", os.path.join(ROOT, "scripts", "release_fixture.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


release = _release_fixture()


#: The facts the fixtures hold, as the tables hold them: (ID, rows).
RELEASE_FACTS = [(1, [["get_user", ["@alice:hs.test"], 1000]]),
                 (2, [["get_user", ["@bob:hs.test"], 1001], ["get_rooms", None, 1001]]),
                 (4, [["get_room", ["!room:hs.test"], 1003]])]


def postgres_copy() -> str:
    """A fresh database holding the release's PostgreSQL dump; its DSN."""
    return release.restore_postgres(PostgresServer.shared(),
                                    os.path.join(FIXTURES, "postgres.sql"))
