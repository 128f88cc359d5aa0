"""replicator: Synapse-style stream replication for PostgreSQL-backed systems.

``__version__`` is the one place the version is written: packaging reads it
(setup.cfg), and so do ``replicator --version``, ``/health``, the status
page and the ``replicator_build_info`` metric.
"""

__version__ = "0.3.0.dev0"
