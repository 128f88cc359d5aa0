"""The one reconnect backoff policy of the project, for every outgoing link
(the TCP upstream and both Redis connections).

A :class:`Backoff` is a ``ClientService`` ``retryPolicy`` that keeps its own
count of consecutive failures instead of trusting the attempt number
``ClientService`` passes in: that one starts over on every accepted
connection, so an upstream that accepts and closes at once would be retried
at the initial delay forever (a reconnect storm).  Here the count goes back
to zero only when the owner calls :meth:`Backoff.reset`, which it does once
a connection has proven healthy (its handshake done and alive for
``ping_interval``).

Each delay is ``min(initial * factor**(n-1), maximum)`` for the ``n``-th
failure in a row, shortened by a random fraction of at most ``jitter`` so
that many instances that lost the same server (a Redis restart) do not all
come back in the same instant.  With ``factor >= 2`` and ``jitter < 0.5``
every delay is longer than the one before until the maximum is reached;
no delay is ever longer than ``maximum`` nor shorter than
``initial * (1 - jitter)``.
"""

import random
from collections.abc import Callable

from twisted.logger import Logger

from ..observe import metrics

log = Logger()

#: Defaults of every outgoing link (seconds): the first wait, and the cap,
#: one that suits a peer on the local network: a link is back within this
#: of its peer's return.  With the jitter, a link whose peer stays away
#: tries at most once per ``(1 - JITTER) * RECONNECT_MAX_DELAY`` seconds,
#: a load no server notices (the configuration's
#: ``replication.reconnect_initial_delay`` and ``reconnect_max_delay``).
RECONNECT_INITIAL_DELAY = 0.5
RECONNECT_MAX_DELAY = 2.0
#: The cap of the retries of work against the database (:class:`Outage`).
OUTAGE_MAX_DELAY = 30.0
FACTOR = 2.0
JITTER = 0.25


class Backoff:
    """Exponential backoff with jitter and an explicit reset; one instance
    per reconnecting link (it holds that link's failure count)."""

    def __init__(self, initial: float = RECONNECT_INITIAL_DELAY,
                 maximum: float = RECONNECT_MAX_DELAY,
                 factor: float = FACTOR, jitter: float = JITTER,
                 rng: Callable[[], float] | None = None, name: str = "link"):
        if not 0 < initial <= maximum:
            raise ValueError("need 0 < initial <= maximum")
        if factor < 1 or not 0 <= jitter < 1:
            raise ValueError("need factor >= 1 and 0 <= jitter < 1")
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.jitter = jitter
        self.name = name
        self._random = rng if rng is not None else random.random
        #: Failed attempts and lost connections since the last reset.
        self.failures = 0
        #: The last delay chosen (0 before any).
        self.last_delay = 0.0
        metrics.RECONNECT_DELAY.labels(name).set(0)

    def delay(self) -> float:
        """Count one more failure and return the wait before the next try."""
        self.failures += 1
        exponent = min(self.failures - 1, 64)
        base = min(self.initial * self.factor ** exponent, self.maximum)
        wait = base * (1.0 - self.jitter * self._random())
        metrics.RECONNECT_DELAY.labels(self.name).set(wait)
        self.last_delay = wait
        return wait

    def __call__(self, attempt: int = 0) -> float:
        """``ClientService``'s ``retryPolicy``: ``attempt`` is ignored."""
        return self.delay()

    def reset(self) -> None:
        """A connection proved healthy: the next failure waits ``initial``."""
        if self.failures:
            log.debug("{name}: connection healthy; backoff reset after {n} failures",
                      name=self.name, n=self.failures)
        self.failures = 0
        metrics.RECONNECT_DELAY.labels(self.name).set(0)


class Outage:
    """Retries of one piece of work against the database (a fan-out, a
    reader's pipeline) while it keeps failing.

    :meth:`failed` returns the wait before the next try (this module's
    policy, starting at ``initial``) and logs one warning when an outage
    starts; :meth:`succeeded` logs one line when it ends.  Nothing is logged
    per retry, so an outage of any length costs two log lines per task.
    """

    def __init__(self, what: str, initial: float):
        self.what = what
        self.initial = initial
        self._backoff: Backoff | None = None

    def failed(self, error: BaseException | None) -> float:
        if self._backoff is None:
            self._backoff = Backoff(self.initial, max(self.initial, OUTAGE_MAX_DELAY),
                                    name=self.what)
            log.warn("{what} failed, an outage ({error}); retrying with backoff",
                     what=self.what, error=f"{type(error).__name__}: {error}")
        return self._backoff.delay()

    def succeeded(self) -> None:
        if self._backoff is not None:
            log.info("{what}: outage over after {n} failed attempts",
                     what=self.what, n=self._backoff.failures)
            self._backoff.reset()
            self._backoff = None
