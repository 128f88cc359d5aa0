"""Admission: what a peer's RDATA and POSITION must satisfy before anything
acts on them (the relay, the reader, the ID generator).

Nothing on the wire proves a claim, but a claim can be bounded by what can
be true.  Readers share the writers' database, so:

* A token above the stream's sequence is a lie: no writer can have a fact
  with an ID the sequence never handed out.  The bound is the larger of the
  last value read from the sequence and the largest ID this instance knows
  (its own reservations, positions already admitted); a claim above it
  waits for a fresh read of the sequence (in a pool thread, never on the
  reactor), one *started after the claim arrived*, and is refused if it is
  still above.  Reads are shared by every claim of the stream waiting then.
* A row must fit the stream's layout (:class:`..streams.rows.WireRowCheck`).
* A writer's partial batches (``batch`` rows waiting for the row with the
  token), on all connections together, hold fewer than ``max_batch_rows``
  rows, at most ``max_batch_bytes`` bytes of lines, and rows that take at
  most ``DECODED_FACTOR * max_batch_bytes`` bytes once decoded
  (:func:`.parsing.decoded_size`, an over-estimate: what a fact costs in
  memory, not on the wire, when it completes and is parsed).  The rows of
  a partial batch are kept as their lines (see :mod:`.reader`), so what a
  peer makes us hold is about what it sent.
* A partial batch is legitimate only while its writer has sent nothing on
  that connection but ``batch`` lines of that stream since it opened (a
  writer sends a fact's lines in one go): any other RDATA or POSITION of
  the writer there ends it as stale (``stale``), e.g. the late half of a
  fact from a replaced Redis link, which must not join the writer's next
  fact.

Invariants:

* Per connection, RDATA and POSITION are admitted in arrival order: while a
  claim waits for a read, later RDATA/POSITION of that connection wait
  behind it and the connection stops reading (so what waits is bounded by
  one read's worth of data).
* A refused command reaches neither ``accept`` nor anything else: it moves
  no token, local or remote, and is never relayed.  ``refuse`` decides what
  happens to the peer (the handler closes a TCP peer with ``ERROR``; on
  Redis it drops the command and the writer's partial batch).
* What a connection holds here is dropped when it is lost or refused.
"""

from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from ...keys import Key
from ...net.backoff import Outage
from ...streams.registry import StreamRegistry
from ...streams.rows import WireRowCheck
from ...streams.stream import Stream
from ..interfaces import IReplicationConnection
from ..wire.parsing import decoded_size

log = Logger()


#: Reasons of a refusal (the ``reason`` label of the metric).
BEYOND_SEQUENCE = "beyond_sequence"
BAD_ROW = "bad_row"
BATCH_TOO_LARGE = "batch_too_large"

MAX_BATCH_ROWS = 10_000
MAX_BATCH_BYTES = 16 << 20
#: A partial batch's rows may take this many times ``max_batch_bytes`` once
#: decoded (estimated): a legitimate row takes 5 to 10 times its line.
DECODED_FACTOR = 4

#: ``accept(conn, key, cmd, line)`` / ``refuse(conn, key, reason, text)`` /
#: ``stale(conn, key)``
Accept = Callable[[Any, Key, Any, bytes | None], None]
Refuse = Callable[[Any, Key, str, str], None]
Stale = Callable[[Any, Key], None]


class _Gate:
    """One connection's admission state."""

    __slots__ = ("held", "waiting", "batches")

    def __init__(self) -> None:
        # Commands waiting behind a claim: (key, stream, cmd, line, needed read).
        self.held: deque[tuple[Any, ...]] = deque()
        self.waiting = False
        # writer -> (stream, [rows, bytes, decoded]) of its partial batch here
        self.batches: dict[str, tuple[str, list[int]]] = {}


class _Sequence:
    """What is known of one stream's sequence."""

    __slots__ = ("value", "started", "finished", "reading", "waiters", "outage")

    def __init__(self, outage: Outage) -> None:
        self.value = 0
        self.started = 0  # reads started so far
        self.finished = 0  # the number of the last read that answered
        self.reading = False
        self.waiters: list[Any] = []  # connections waiting for a read
        self.outage = outage  # reads failing: their backoff and log lines


class Admission:
    """Admits or refuses the RDATA/POSITION lines of every connection.

    ``registry`` gives each stream (its layout, ID generator and
    ``sequence_value``).  Admitted commands go to ``accept``, refused ones
    to ``refuse``, both in each connection's arrival order.
    """

    def __init__(self, registry: StreamRegistry, accept: Accept, refuse: Refuse,
                 clock: IReactorTime,
                 max_batch_rows: int = MAX_BATCH_ROWS, max_batch_bytes: int = MAX_BATCH_BYTES,
                 retry_delay: float = 1.0, stale: Stale | None = None) -> None:
        self.registry = registry
        self._accept = accept
        self._refuse = refuse
        self._stale = stale
        self._clock = clock
        self.max_batch_rows = max_batch_rows
        self.max_batch_bytes = max_batch_bytes
        self.retry_delay = retry_delay
        self._gates: dict[Any, _Gate] = {}
        # writer key -> [rows, bytes, decoded] of its partial batches, all connections
        self._writers: dict[Key, list[int]] = {}
        self._sequences: dict[str, _Sequence] = {}
        self._checks: dict[str, WireRowCheck] = {}
        self._retries: dict[str, Any] = {}
        self._stopping = False

    # ------------------------------------------------------------ lines in
    def offer(self, conn: IReplicationConnection, stream: Stream, key: Key, cmd: Any,
              line: bytes | None) -> None:
        """An RDATA or POSITION of ``key`` from ``conn`` (``line``: its wire
        bytes, newline included)."""
        gate = self._gates.get(conn)
        if gate is None:
            gate = self._gates[conn] = _Gate()
        if gate.waiting:
            gate.held.append((key, stream, cmd, line, 0))
            return
        self._admit(conn, gate, key, stream, cmd, line, 0)

    def _admit(self, conn: IReplicationConnection, gate: _Gate, key: Key, stream: Stream, cmd: Any,
               line: bytes | None, needed: int) -> bool:
        """Admit, refuse or hold one command; False once the gate waits."""
        rdata = cmd.NAME == "RDATA"
        open_batch = gate.batches.get(key[1])
        if open_batch is not None and not (rdata and open_batch[0] == key[0]):
            # Any other line of the writer: its batch here lost its end.
            self._end_batch(gate, key[1])
            if self._stale is not None:
                self._stale(conn, (open_batch[0], key[1]))
        if rdata:
            check = self._checks.get(stream.name)
            if check is None:
                check = self._checks[stream.name] = WireRowCheck(stream.config.columns)
            problem = check.check(cmd.row)
            if problem is not None:
                self._refused(conn, gate, key, BAD_ROW,
                              f"RDATA row of {key[0]}/{key[1]} does not fit the stream: "
                              f"{problem}")
                return True
            if cmd.token is None:
                too_large = self._add_to_batch(gate, key, line)
                if too_large is not None:
                    self._refused(conn, gate, key, BATCH_TOO_LARGE, too_large)
                    return True
                self._call_accept(conn, key, cmd, line)
                return True
            token = cmd.token
        else:
            token = max(cmd.prev_token, cmd.new_token)
        sequence = self._sequence(stream.name)
        if token > max(sequence.value, stream.id_gen.get_max_known()):
            if needed and sequence.finished >= needed:
                # A read started after the claim arrived says it is a lie.
                self._refused(conn, gate, key, BEYOND_SEQUENCE,
                              f"{cmd.NAME} token {token} of {key[0]}/{key[1]} is beyond "
                              f"the stream's sequence ({sequence.value})")
                return True
            gate.waiting = True
            gate.held.appendleft((key, stream, cmd, line, needed or sequence.started + 1))
            conn.pause_reading()  # while its claims wait
            sequence.waiters.append(conn)
            self._read(stream, sequence)
            return False
        # The row with the token ends the batch; a POSITION ended it above.
        self._end_batch(gate, key[1])
        self._call_accept(conn, key, cmd, line)
        return True

    def _add_to_batch(self, gate: _Gate, key: Key, line: bytes | None) -> str | None:
        """Count one ``batch`` line of ``key`` on ``gate``'s connection, for
        the connection and for the writer; why the writer's partial batches
        are now too large, or None."""
        held = gate.batches.get(key[1])
        if held is None:
            held = gate.batches[key[1]] = (key[0], [0, 0, 0])
        total = self._writers.get(key)
        if total is None:
            total = self._writers[key] = [0, 0, 0]
        size = len(line) if line is not None else 0
        decoded = decoded_size(line) if line is not None else 0
        counts = held[1]
        counts[0] += 1
        counts[1] += size
        counts[2] += decoded
        rows = total[0] = total[0] + 1
        size = total[1] = total[1] + size
        decoded = total[2] = total[2] + decoded
        if rows >= self.max_batch_rows or size > self.max_batch_bytes \
                or decoded > DECODED_FACTOR * self.max_batch_bytes:
            return (f"batch of {key[0]}/{key[1]} too large: {rows} rows, {size} bytes, "
                    f"about {decoded} bytes decoded (a fact has at most {self.max_batch_rows} "
                    f"rows, its batch lines {self.max_batch_bytes} bytes, "
                    f"{DECODED_FACTOR * self.max_batch_bytes} bytes decoded)")
        return None

    def _end_batch(self, gate: _Gate, writer: str) -> None:
        """The partial batch of ``writer`` on ``gate``'s connection is over
        (completed, stale, refused or gone): the writer's tally forgets it."""
        ended = gate.batches.pop(writer, None)
        if ended is None:
            return
        key = (ended[0], writer)
        total = self._writers.get(key)
        if total is not None:
            for i, n in enumerate(ended[1]):
                total[i] -= n
            if total[0] <= 0:
                del self._writers[key]

    def _call_accept(self, conn: IReplicationConnection, key: Key, cmd: Any,
                     line: bytes | None) -> None:
        try:
            self._accept(conn, key, cmd, line)
        except Exception:
            # A bug in processing one command is no reason to stall the
            # connection's later ones.
            log.failure("Processing {name} of {stream}/{writer} failed", name=cmd.NAME,
                        stream=key[0], writer=key[1])

    def _refused(self, conn: IReplicationConnection, gate: _Gate, key: Key, reason: str,
                 text: str) -> None:
        self._end_batch(gate, key[1])
        self._refuse(conn, key, reason, text)

    # ------------------------------------------------------------ sequence
    def _sequence(self, name: str) -> _Sequence:
        sequence = self._sequences.get(name)
        if sequence is None:
            sequence = self._sequences[name] = _Sequence(
                Outage(f"reading the sequence of {name} (claims above it wait)", self.retry_delay))
        return sequence

    def _read(self, stream: Stream, sequence: _Sequence) -> None:
        if sequence.reading or self._stopping or stream.name in self._retries:
            return
        sequence.reading = True
        sequence.started += 1
        number = sequence.started
        d = defer.ensureDeferred(stream.sequence_value())
        d.addCallbacks(self._read_done, self._read_failed,
                       callbackArgs=(stream, sequence, number),
                       errbackArgs=(stream, sequence))

    def _read_done(self, value: int, stream: Stream, sequence: _Sequence, number: int) -> None:
        sequence.reading = False
        sequence.outage.succeeded()
        sequence.finished = number
        if value > sequence.value:
            sequence.value = value
        self._wake(sequence)
        if sequence.waiters:
            # Claims that arrived after this read started need another.
            self._read(stream, sequence)

    def _read_failed(self, failure: Failure, stream: Stream, sequence: _Sequence) -> None:
        sequence.reading = False
        if self._stopping:
            return
        self._retries[stream.name] = self._clock.callLater(
            sequence.outage.failed(failure.value), self._retry_read, stream, sequence)

    def _retry_read(self, stream: Stream, sequence: _Sequence) -> None:
        self._retries.pop(stream.name, None)
        if sequence.waiters:
            self._read(stream, sequence)

    def _wake(self, sequence: _Sequence) -> None:
        waiters, sequence.waiters = sequence.waiters, []
        for conn in waiters:
            gate = self._gates.get(conn)
            if gate is None or not gate.waiting:
                continue
            gate.waiting = False
            self._release(conn, gate)

    def _release(self, conn: IReplicationConnection, gate: _Gate) -> None:
        """Go on with what a connection holds, in order, until it is empty or
        a claim waits again."""
        held = gate.held
        while held and self._gates.get(conn) is gate:
            key, stream, cmd, line, needed = held.popleft()
            if not self._admit(conn, gate, key, stream, cmd, line, needed):
                return
        if self._gates.get(conn) is gate:
            conn.resume_reading()

    # ------------------------------------------------------------ lifecycle
    def connection_lost(self, conn: IReplicationConnection) -> None:
        """Drop whatever the connection holds (it may be refused or gone)."""
        gate = self._gates.pop(conn, None)
        if gate is not None:
            gate.held.clear()
            for writer in list(gate.batches):
                self._end_batch(gate, writer)

    def idle(self) -> bool:
        """No connection's commands wait for a read of a sequence."""
        return not any(g.waiting for g in self._gates.values())

    def stop(self) -> None:
        self._stopping = True
        for call in self._retries.values():
            if call.active():
                call.cancel()
        self._retries.clear()

