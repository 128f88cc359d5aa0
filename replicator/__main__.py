"""``python -m replicator``: the ``replicator`` command."""

from .cli import main

main()
