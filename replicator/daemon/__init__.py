"""One running instance: its services and their order, the checks made before it binds, listeners,
reload, systemd and `replicator check`."""
