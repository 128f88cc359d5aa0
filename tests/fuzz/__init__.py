"""The adversarial suite: hostile protocol lines, connections, peers, HTTP
requests and configs thrown at the daemon, with invariants checked after
every input.

Phases (each a module; ``python -m tests.fuzz`` runs them all, ``make fuzz``
at full size; ``tests/test_fuzz.py`` runs a seeded slice inside ``make
test``):

1. ``lines``: protocol lines against the server and client protocols
   in-process (StringTransport + Clock, a real handler on SQLite).
2. ``sockets``: the same over real sockets against a ``replicator run``
   process, beside an honest writer (HTTP) and an honest reader (TCP).
3. ``peers``: forged peers (position poisoning, NAME impersonation, writes to
   others' bookkeeping, a relayed over-long line).
4. ``http``: malformed and hostile HTTP requests.
5. ``configs``: mutated YAML configs given to ``replicator run``.
6. a reactor-stall monitor inside every daemon under test (``stallmon``).

Every input is generated from a seeded ``random.Random``: the same seed
gives the same inputs.  Findings are deduplicated by (phase, kind,
signature) and keep their first reproducer.
"""
