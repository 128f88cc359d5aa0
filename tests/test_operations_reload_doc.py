"""docs/operations.md "Reload" against :func:`replicator.daemon.reload.plan`:
its table of what applies live and its paragraph of what needs a restart
name each key once, in one of the two, and the one ``plan`` puts it in."""

import dataclasses
import os
import re

import yaml
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import ConsumerConfig, parse_instance
from replicator.daemon import reload as reloading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Top-level keys a change of which the page's lists can name by themselves.
TOP_KEYS = ("instance_name", "server_name", "synapse", "consumers", "log_level", "log_format")


def reload_lists():
    """``(live, restart)``: the backticked names of the first column of the
    "what applies live" table and of the "What needs a restart" paragraph."""
    with open(os.path.join(ROOT, "docs", "operations.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Reload\n", 1)[1].split("\n## ", 1)[0]
    live = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| Key "):
            live += re.findall(r"`([^`]+)`", line.split(" | ")[0])
    paragraph = section.split("What needs a restart:", 1)[1].split("\n\n", 1)[0]
    paragraph = re.sub(r"\([^)]*\)", "", paragraph)  # examples in brackets
    return live, re.findall(r"`([^`]+)`", paragraph)


class ReloadListsTests(SynchronousTestCase):
    def test_each_key_is_named_once_in_the_list_plan_puts_it_in(self):
        live, restart = reload_lists()
        self.assertIn("consumers", live)
        for name in set(live) | set(restart):
            self.assertEqual(live.count(name) + restart.count(name), 1,
                             f"{name!r}: named {live.count(name)} times as live and "
                             f"{restart.count(name)} times as needing a restart")
        with open(os.path.join(ROOT, "conf", "master.yaml")) as f:
            running = parse_instance(yaml.safe_load(f))
        for key in TOP_KEYS:
            if key == "consumers":
                read = dataclasses.replace(running, consumers=running.consumers + (
                    ConsumerConfig("log", None, {}),))
            elif key == "log_level":
                read = dataclasses.replace(running, log_level="debug")
            elif key == "log_format":
                read = dataclasses.replace(running, log_format="json")
            else:
                read = dataclasses.replace(running, **{key: object()})
            result = reloading.plan(running, read)
            named = [n for n in live + restart if n == key or n.startswith(key + ",")]
            self.assertTrue(named, f"{key} is in neither list")
            self.assertEqual(key in restart, bool(result.restart),
                             f"{key}: plan says applied {result.applied}, restart "
                             f"{result.restart}")
