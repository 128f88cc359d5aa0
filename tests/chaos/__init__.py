"""Our own fault suite: real ``replicator run`` processes under a nemesis.

A *run* starts PostgreSQL (and, for the Redis transport, ``redis-server``),
a master and two workers as separate processes, a TCP proxy of our own on
every replication link, HTTP clients that write continuously and record the
outcome of every request, and an observer that polls every instance's
positions API and samples ``stream_positions`` and the tables.  A nemesis
injects faults at times drawn from a seeded RNG (the same seed replays the
same schedule); then everything is healed, the run waits for quiescence and
:mod:`tests.chaos.checker` proves the invariants (see its docstring).

Modules, one job each:

* :mod:`.servers`   PostgreSQL under ``pg_ctl`` (restartable, crash-restartable)
* :mod:`.proxy`     the loopback TCP proxy: cut, partition, stall, slow-cut
* :mod:`.cluster`   the three instances: configs, processes, signals
* :mod:`.clients`   HTTP writers and the outcome of every request
* :mod:`.observer`  claims (positions API, ``stream_positions``) and table snapshots
* :mod:`.nemesis`   the seeded fault schedule and its execution
* :mod:`.checker`   the invariants, over plain data (unit-testable)
* :mod:`.planted`   a consumer with a planted defect, to show the checker bites
* :mod:`.run`       one run end to end; result rows and the summary table

``python -m tests.chaos --help`` (``make chaos``) is the entry point.
"""
