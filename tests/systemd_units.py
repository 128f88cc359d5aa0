"""The systemd units the repository ships (``systemd/``): their names and
the settings of a section of one, as the tests of the units and of the
installed tree read them.  Test modules take them from here, never from
one another."""

import os

UNIT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "systemd")
UNITS = ("replicator-master.service", "replicator-worker@.service", "replicator.target")
SERVICES = UNITS[:2]

def settings(text: str, section: str) -> list:
    """(key, value) pairs of one section, in order, duplicates kept."""
    pairs, current = [], None
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
        elif current == section:
            key, _, value = line.partition("=")
            pairs.append((key.strip(), value.strip()))
    return pairs
