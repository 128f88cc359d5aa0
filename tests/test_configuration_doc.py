"""docs/configuration.md against the code, so it stays true.

* **Keys.**  Every section's table lists exactly the keys the parser of
  that section accepts.  The accepted keys are taken from the parsers
  themselves: every ``no_unknown`` (the check that refuses an unknown key)
  is recorded while a config with every section is parsed and the built-in
  consumers are built; and every ``no_unknown`` call in the package must
  have been reached by that, so a section added with a parser of its own
  fails here until this test gives it a config and the page a table.
* **Defaults.**  A default given as a YAML value (in backticks) is the
  value the parser fills in when the key is left out.
* **Reload.**  The reload column says ``live`` exactly where
  :func:`replicator.daemon.reload.plan` applies a change of that key, ``restart``
  where it keeps the running value.
"""

import ast
import dataclasses
import importlib
import os
import pkgutil
import re
import sys

import yaml
from twisted.trial.unittest import TestCase

import replicator
from replicator.config import ConsumerConfig, ReaderConfig, fields, parse_instance
from replicator.daemon import reload as reloading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "configuration.md")
TOP = "(top level)"

#: Parsed with every section present (two documents: one database each).
EVERY_SECTION = {
    "server_name": "example.com",
    "instance_name": "master",
    "database": {"postgres": "host=127.0.0.1 dbname=replicator"},
    "streams": [{"name": "facts", "table": "facts", "writers": ["master", "worker1"],
                 "columns": [{"key": "text"}, {"ts": "bigint"}],
                 "timestamp_column": "ts", "retention": {"max_age": "7d"}}],
    "replication": {"listen": "tcp:9092:interface=127.0.0.1",
                    "redis": {"endpoint": "tcp:host=127.0.0.1:port=6379"}},
    "http": {"listen": "tcp:9093:interface=127.0.0.1", "secret": "s" * 16,
             "readers": [{"name": "dashboard", "secret_file": "dashboard.secret",
                          "streams": ["*"]}]},
    "consumers": [{"type": "jsonl", "path": "facts.jsonl"}, {"type": "log"}],
    "health": {},
    "synapse": {"server_name": "matrix.example.com"},
}
SQLITE = dict(EVERY_SECTION, database={"sqlite": "state.sqlite"},
              streams=[dict(EVERY_SECTION["streams"][0], writers=["master"])],
              # keys are not for a TCP master: a Redis peer alone.
              replication={"redis": {"endpoint": "tcp:host=127.0.0.1:port=6379",
                                     "keys": {"private_key": "master.key",
                                              "public_keys": {"worker1": "worker1.pub"}}}})


class _Reached(Exception):
    """Stops a built-in consumer's build once its keys are recorded."""


def section_of(key: str, context: str) -> str:
    """The page's section name of a ``no_unknown`` key path."""
    if key == "":
        return TOP
    key = re.sub(r"\[\d+\]", "[]", key)
    return f"{key} ({context})" if context else key


def accepted_keys() -> tuple[dict[str, set[str]], set[tuple[str, int]]]:
    """{section: keys the parser accepts} and the ``no_unknown`` call sites
    reached, by parsing :data:`EVERY_SECTION` (and :data:`SQLITE`) and
    building the built-in consumers."""
    for info in pkgutil.walk_packages(replicator.__path__, "replicator."):
        if ".export" not in info.name:
            importlib.import_module(info.name)
    real = fields.no_unknown
    found: dict[str, set[str]] = {}
    sites: set[tuple[str, int]] = set()
    context = [""]

    def recording(section, allowed, key):
        caller = sys._getframe(1)
        sites.add((os.path.realpath(caller.f_code.co_filename), caller.f_lineno))
        found.setdefault(section_of(key, context[0]), set()).update(allowed)
        real(section, allowed, key)
        if context[0]:
            raise _Reached()

    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("replicator") and getattr(m, "no_unknown", None) is real]
    for module in patched:
        module.no_unknown = recording
    try:
        for doc in (EVERY_SECTION, SQLITE):
            config = parse_instance(doc)
        from replicator.consumers.loading import BUILTINS

        for name, build in sorted(BUILTINS.items()):
            context[0] = name
            try:
                build(ConsumerConfig(name), "/nonexistent", "consumers[0]", None)
            except _Reached:
                pass
    finally:
        for module in patched:
            module.no_unknown = real
    # parse_consumers takes these two and hands the rest to the consumer.
    found["consumers[]"] = {"type", "streams"}
    assert config.synapse is not None and config.replication.redis is not None
    return found, sites


def no_unknown_call_sites() -> set[tuple[str, int]]:
    """Every ``no_unknown(...)`` call in the package's source (not the
    exporter's, which reads only ``database`` and ``streams``)."""
    sites = set()
    base = os.path.dirname(replicator.__file__)
    for directory, _dirs, files in os.walk(base):
        if os.sep + "export" in directory[len(base):]:
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.realpath(os.path.join(directory, name))
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "no_unknown"):
                    sites.add((path, node.lineno))
    return sites


def documented() -> dict[str, list[list[str]]]:
    """{section: [cells of each row]} of the page's tables."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    tables = {}
    for match in re.finditer(r"<!-- section: (.+?) -->\n((?:\|.*\n)+)", text):
        rows = match.group(2).splitlines()[2:]
        cells = [[c.strip() for c in row.strip().strip("|").split(" | ")] for row in rows]
        assert match.group(1) not in tables, f"section {match.group(1)} twice"
        tables[match.group(1)] = cells
    return tables


def key_of(cell: str) -> str:
    match = re.fullmatch(r"`([a-z_]+)`", cell)
    assert match, f"a key cell is one `key`, got {cell!r}"
    return match.group(1)


class ConfigurationDocTests(TestCase):
    def test_every_key_in_code_is_documented_and_no_other(self):
        found, _sites = accepted_keys()
        tables = documented()
        self.assertEqual(set(tables), set(found))
        for section, keys in sorted(found.items()):
            listed = [key_of(row[0]) for row in tables[section]]
            self.assertEqual(len(listed), len(set(listed)), f"{section}: a key twice")
            self.assertEqual(
                set(listed), keys,
                f"docs/configuration.md, section {section}: missing "
                f"{sorted(keys - set(listed))}, not in the code {sorted(set(listed) - keys)}")

    def test_every_parser_of_keys_is_reached(self):
        """A ``no_unknown`` this test's configs never reach is a section
        whose keys the page is not checked against: give it a config here."""
        _found, reached = accepted_keys()
        self.assertEqual(no_unknown_call_sites() - reached, set())

    def test_defaults(self):
        config = parse_instance(yaml.safe_load(
            "server_name: s\ninstance_name: i\ndatabase: {postgres: dbname=x}\n"
            "streams: [{name: n, table: t, writers: [i], columns: [{c: text}]}]\n"
            "replication: {redis: {endpoint: 'tcp:host=h:port=1'}}\n"))
        parsed = {TOP: config, "database": config.database, "streams[]": config.streams[0],
                  "replication": config.replication, "replication.redis": config.replication.redis,
                  "http": config.http, "health": config.health}
        renamed = {("database", "postgres"): None, ("database", "sqlite"): None}
        checked = 0
        for section, rows in documented().items():
            if section not in parsed:
                continue
            for row in rows:
                key, default = key_of(row[0]), row[2]
                literal = re.fullmatch(r"`([^`<>]+)`", default)
                if not literal or (section, key) in renamed:
                    continue
                want = getattr(parsed[section], key)
                if dataclasses.is_dataclass(want) or (
                        isinstance(want, tuple) and want and dataclasses.is_dataclass(want[0])):
                    continue  # a section: its keys have rows of their own
                got = yaml.safe_load(literal.group(1))
                if isinstance(want, tuple):
                    want = list(want)
                self.assertEqual(got, want, f"{section}.{key}: the page says {default}")
                checked += 1
        self.assertGreater(checked, 30)

    def test_reload_column(self):
        """``live`` where :func:`replicator.daemon.reload.plan` applies the key,
        ``restart`` where it keeps the running value; ``per key`` for a
        section whose keys differ."""
        with open(os.path.join(ROOT, "conf", "master.yaml")) as f:
            running = parse_instance(yaml.safe_load(f))
        self.assertIn("worker1", running.streams[0].writers)
        sections = {"database": "database", "replication": "replication", "http": "http",
                    "health": "health", "replication.redis": "replication.redis",
                    "streams[]": "streams"}
        fields_of = {"database": {"sqlite": "path", "postgres": "dsn"}}

        def changed(section: str, key: str):
            """The running config with ``key`` of ``section`` changed."""
            new = object()
            if section == TOP and key == "consumers":
                more = running.consumers + (ConsumerConfig("log", None, {}),)
                return dataclasses.replace(running, consumers=more)
            if section == TOP:
                return dataclasses.replace(running, **{key: new})
            if section == "streams[]":
                stream = running.streams[0]
                value = stream.writers + ("worker9",) if key == "writers" else new
                name = {"name": "table"}.get(key, key)  # a rename: a removal and an addition
                if key == "name":
                    stream = dataclasses.replace(stream, name="renamed")
                else:
                    stream = dataclasses.replace(stream, **{name: value})
                return dataclasses.replace(running, streams=(stream,) + running.streams[1:])
            if section == "http.readers[]":
                reader = ReaderConfig("dashboard", "dashboard.secret", ("*",))
                return dataclasses.replace(running, http=dataclasses.replace(
                    running.http, readers=running.http.readers + (reader,)))
            if section == "streams[].retention":
                stream = dataclasses.replace(running.streams[0], retention=new)
                return dataclasses.replace(running, streams=(stream,) + running.streams[1:])
            if section in ("replication.redis", "replication.redis.keys"):
                return dataclasses.replace(running, replication=dataclasses.replace(
                    running.replication, redis=new))
            attr = sections[section]
            field = fields_of.get(section, {}).get(key, key)
            return dataclasses.replace(running, **{attr: dataclasses.replace(
                getattr(running, attr), **{field: new})})

        checked = 0
        for section, rows in documented().items():
            for row in rows:
                key, reload_cell = key_of(row[0]), row[3]
                word = reload_cell.split()[0] if reload_cell else ""
                if section == TOP and key in sections.values():
                    self.assertEqual(reload_cell, "per key", key)
                    continue
                if section.startswith("consumers[]"):
                    # plan() compares consumers whole: one more is a change.
                    result = reloading.plan(running, changed(TOP, "consumers"))
                elif section.startswith("synapse"):
                    # plan() compares the section whole.
                    result = reloading.plan(running, changed(TOP, "synapse"))
                else:
                    result = reloading.plan(running, changed(section, key))
                self.assertTrue(result.applied or result.restart, (section, key))
                want = "restart" if result.restart else "live"
                self.assertEqual(word, want, f"{section}.{key}: the page says {reload_cell!r}, "
                                             f"a reload: applied {result.applied}, "
                                             f"restart {result.restart}")
                checked += 1
        self.assertGreater(checked, 60)
