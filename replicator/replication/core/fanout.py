"""Fan-out: the writer side of replication.

For each (stream, writer) written by this instance, the rows between the
last token announced and the writer's current token are taken from memory
as the JSON lines the write path encoded (``encoded_since``: only prefix
and token are put in front, :func:`.encoding.encode_written`), or, when memory
cannot answer (after a restart, facts written behind our back), read with
``updates_since`` and encoded; joined once (one bytes object per fan-out,
see :func:`.encoding.joined`), the same bytes are handed to every replicating
connection in one ``transport.write`` each.  Both give the same bytes.

Invariants:

* Rows sharing a token form one ``batch`` run written in one call, so no
  connection ever gets half of a fact from us.
* An advance without rows is a POSITION.
* Nothing a receiver must reject is sent: a fact with more rows than
  ``max_batch_rows``, batch lines over ``max_batch_bytes`` (or over
  ``DECODED_FACTOR`` times it once decoded, :mod:`.admission`), or a row whose
  line would exceed ``max_line_length`` goes out as ``POSITION t t`` (its
  token, nothing unsent up to it): a reader whose position is below reads
  the fact from the table, whole, before anything later.  Counted in
  ``replicator_facts_announced_by_position_total``.  A fact with too many
  rows is told by its row count alone, never encoded: what one fan-out
  encodes on the reactor is at most ``max(fetch_limit, max_batch_rows)``
  rows, whatever the size of a fact.
* ``announced`` only moves after the lines were written, and REPLICATE is
  answered with ``announced``: a new connection never misses a fact.
* One fan-out runs per (stream, writer) at a time.  Coalescing is
  adaptive: an advance while other writes of the writer are queued or in a
  transaction (more commits on their way) waits out the rest of
  ``fanout_interval`` since the last fan-out, so that they go together; a
  commit alone (nothing else of its writer in flight) goes out at once,
  however soon after the last one.
"""

import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from ...background import Background
from ...keys import Key
from ...net.backoff import Outage
from ...observe import metrics
from ...streams.recent import EncodedPage
from ...streams.stream import Stream
from ...streams.trimmed import FactsTrimmed
from ..wire.encoding import (
    EncodedLines,
    encode_position_line,
    encode_rdata_lines,
    encode_written,
    encode_written_fact,
    joined,
)
from ..wire.parsing import MAX_DECODED_PER_BYTE, decoded_size
from .admission import DECODED_FACTOR, MAX_BATCH_BYTES, MAX_BATCH_ROWS

log = Logger()

_token_of = itemgetter(0)
Broadcast = Callable[[Sequence[bytes], str], None]


class Fanout:
    """Announces the facts of this instance's writers.

    ``broadcast(lines, name)`` writes lines to every replicating connection;
    each pass of a writer's fan-out writes ``(prev, upto]`` through
    :meth:`send_updates`.
    """

    def __init__(self, broadcast: Broadcast, clock: IReactorTime, fetch_limit: int = 1000,
                 max_line_length: int = 0, retry_delay: float = 1.0,
                 fanout_interval: float = 0.003,
                 max_batch_rows: int = MAX_BATCH_ROWS, max_batch_bytes: int = MAX_BATCH_BYTES,
                 background: Background | None = None) -> None:
        self._broadcast = broadcast
        self._background = background if background is not None else Background()
        self._clock = clock
        self.fetch_limit = fetch_limit
        self.max_line_length = max_line_length
        self.retry_delay = retry_delay
        self.fanout_interval = fanout_interval
        self.max_batch_rows = max_batch_rows
        self.max_batch_bytes = max_batch_bytes
        self.announced: dict[Key, int] = {}
        self._running: set[Key] = set()
        self._timers: dict[Key, Any] = {}
        self._retries: dict[Key, Any] = {}
        self._outages: dict[Key, Outage] = {}
        self._last: dict[Key, float] = {}
        self._stopping = False

    def add_writer(self, stream: Stream, writer: str) -> None:
        """Start announcing ``writer`` of ``stream`` (a local writer) from
        its current token; call before anything is written."""
        self.announced[(stream.name, writer)] = stream.id_gen.get_current_token(writer)
        stream.keep_recent_facts()

    def advanced(self, stream: Stream, writer: str) -> None:
        """A local writer's token moved: fan out now, or, if more of its
        commits are on their way, at most one fan-out per interval."""
        key = (stream.name, writer)
        if key in self._running or key in self._timers or self._stopping:
            return
        wait = self._last.get(key, -1e9) + self.fanout_interval - self._clock.seconds()
        if wait > 0 and stream.writing(writer):
            self._timers[key] = self._clock.callLater(wait, self._start, stream, writer, key)
        else:
            self._start(stream, writer, key)

    def _start(self, stream: Stream, writer: str, key: Key) -> None:
        self._timers.pop(key, None)
        if key in self._running or self._stopping:
            return
        self._running.add(key)
        self._last[key] = self._clock.seconds()
        try:
            done = self._from_memory(stream, writer, key)
        except Exception as e:
            self._running.discard(key)
            self._failed(stream, writer, key, e)
            return
        if done:
            self._running.discard(key)
        else:
            self._background.run("fanout", self._run(stream, writer, key))

    def _from_memory(self, stream: Stream, writer: str, key: Key) -> bool:
        """Fan out from memory (``encoded_since``), at once: no coroutine,
        no Deferred, as far as memory answers.  Whether everything up to
        the writer's token went out (else :meth:`_run` reads the table)."""
        while not self._stopping:
            target = stream.id_gen.get_current_token(writer)
            announced = self.announced[key]
            if target <= announced:
                return True
            started = time.monotonic()
            page = stream.encoded_since(writer, announced, target, self.fetch_limit)
            if page is None:
                return False
            outage = self._outages.get(key)
            if outage is not None:
                outage.succeeded()
            self.send_written(stream.name, writer, announced, page)
            stream.forget(writer, page.upto)
            metrics.FANOUT_LATENCY.observe(time.monotonic() - started)
        return True

    async def _run(self, stream: Stream, writer: str, key: Key) -> None:
        """What memory cannot answer, from the table (in a pool thread)."""
        try:
            while not self._stopping and not self._from_memory(stream, writer, key):
                target = stream.id_gen.get_current_token(writer)
                announced = self.announced[key]
                started = time.monotonic()
                try:
                    updates, upto, _ = await stream.updates_since(
                        writer, announced, target, self.fetch_limit)
                except FactsTrimmed as e:
                    self._trimmed(stream, writer, key, e)
                    continue
                self._outage(key).succeeded()
                self.send_updates(stream.name, writer, announced, updates, upto)
                stream.forget(writer, upto)
                metrics.FANOUT_LATENCY.observe(time.monotonic() - started)
        except Exception as e:
            self._failed(stream, writer, key, e)
        finally:
            self._running.discard(key)

    def _trimmed(self, stream: Stream, writer: str, key: Key, gap: FactsTrimmed) -> None:
        """Facts not yet announced were trimmed by retention (a fan-out that
        fell that far behind): ``POSITION b b`` for the boundary ``b``, so a
        reader below it reads the table, meets the trim and stops, instead
        of taking later facts as the next ones; then on from ``b``."""
        log.warn("Fan-out of {stream}/{writer} was at {since}, below the retention boundary "
                 "{boundary}: announced by POSITION, readers below it stop",
                 stream=stream.name, writer=writer, since=gap.since, boundary=gap.boundary)
        self._broadcast([encode_position_line(stream.name, writer, gap.boundary, gap.boundary)],
                        "POSITION")
        self.announced[key] = gap.boundary
        stream.forget(writer, gap.boundary)

    def _failed(self, stream: Stream, writer: str, key: Key, e: Exception) -> None:
        """A fan-out failed (the table could not be read): retry later."""
        delay = self._outage(key).failed(e)
        if key not in self._retries:
            self._retries[key] = self._clock.callLater(delay, self._retry, stream, writer)

    def _outage(self, key: Key) -> Outage:
        outage = self._outages.get(key)
        if outage is None:
            outage = self._outages[key] = Outage(f"fan-out {key[0]}/{key[1]}", self.retry_delay)
        return outage

    def _retry(self, stream: Stream, writer: str) -> None:
        self._retries.pop((stream.name, writer), None)
        self.advanced(stream, writer)

    def send_updates(self, stream_name: str, writer: str, prev: int,
                     updates: list[tuple[int, list[Any]]], upto: int) -> None:
        """Write rows ``(prev, upto]`` of a local writer to every connection.

        ``updates`` are ``(token, row)`` pairs in ascending token order.
        """
        if updates:
            lines = None
            if len(updates) < self.max_batch_rows:
                lines = encode_rdata_lines(stream_name, writer, updates, self.max_line_length)
            if lines is None or lines.dropped or not self._fits(lines, len(updates)):
                lines = EncodedLines()
                start, n = 0, len(updates)
                while start < n:
                    token = updates[start][0]
                    end = bisect_right(updates, token, start, key=_token_of)  # tokens ascend
                    fact = None
                    if end - start <= self.max_batch_rows:
                        fact = encode_rdata_lines(stream_name, writer, updates[start:end],
                                                  self.max_line_length)
                    self._fact_or_position(lines, stream_name, writer, token, end - start,
                                           None if fact is None or fact.dropped else fact)
                    start = end
            self._announce(stream_name, writer, lines, updates[-1][0], upto)
        else:
            self._announce(stream_name, writer, None, prev, upto)

    def send_written(self, stream_name: str, writer: str, prev: int, page: EncodedPage) -> None:
        """:meth:`send_updates` of the rows of ``page`` (``encoded_since``:
        their JSON lines kept from the write), ``(prev, page.upto]``; the
        same bytes, only concatenated."""
        tokens = page.tokens
        if tokens:
            rows = page.lines
            lines = None
            if len(rows) < self.max_batch_rows:
                lines = encode_written(stream_name, writer, tokens, rows, page.facts,
                                       self.max_line_length)
            if lines is None or not self._fits(lines, len(rows)):
                lines = EncodedLines()
                start, n = 0, len(tokens)
                while start < n:
                    token = tokens[start]
                    end = bisect_right(tokens, token, start)  # tokens ascend
                    fact = None
                    if end - start <= self.max_batch_rows:
                        fact = encode_written_fact(stream_name, writer, token, rows[start:end],
                                                   self.max_line_length)
                    self._fact_or_position(lines, stream_name, writer, token, end - start, fact)
                    start = end
            self._announce(stream_name, writer, lines, tokens[-1], page.upto)
        else:
            self._announce(stream_name, writer, None, prev, page.upto)

    def _announce(self, stream_name: str, writer: str, lines: Sequence[bytes] | None,
                  last: int, upto: int) -> None:
        """Write ``lines`` (the facts up to ``last``), then ``POSITION last
        upto`` if ``upto`` is past it; ``upto`` is announced."""
        if lines:
            self._broadcast(lines, "RDATA")
        if upto > last:
            self._broadcast([encode_position_line(stream_name, writer, last, upto)], "POSITION")
        self.announced[(stream_name, writer)] = upto

    def _fits(self, lines: EncodedLines, rows: int) -> bool:
        """Whether ``lines`` of ``rows`` rows may go out as they are: within
        every bound a receiver holds a batch to (else the facts are taken
        one by one)."""
        if rows >= self.max_batch_rows:
            return False
        data = joined(lines)
        return len(data) <= self.max_batch_bytes and not self._too_dear(data, len(data))

    def _fact_or_position(self, out: EncodedLines, stream_name: str, writer: str, token: int,
                          rows: int, lines: Sequence[bytes] | None) -> None:
        """Append the ``lines`` of fact ``token`` (of ``rows`` rows; None:
        one is too long for a line) to ``out``, or, if it is too big for a
        receiver, ``POSITION t t``."""
        batch = b"".join(lines[:-1]) if lines else b""
        if not lines or rows > self.max_batch_rows \
                or len(batch) > self.max_batch_bytes or self._too_dear(batch, len(batch)):
            metrics.FACTS_BY_POSITION.labels(stream_name).inc()
            log.warn("Fact {token} of {stream}/{writer} ({n} rows) is too big for one "
                     "batch or line; announced by POSITION, readers read it from the table",
                     token=token, stream=stream_name, writer=writer, n=rows)
            out.append(encode_position_line(stream_name, writer, token, token))
        else:
            out.extend(lines)

    def _too_dear(self, data: bytes, size: int) -> bool:
        """Whether lines of ``size`` bytes would take a receiver more than
        ``DECODED_FACTOR * max_batch_bytes`` once decoded (counted only when
        they could: the fast path stays a length check)."""
        bound = DECODED_FACTOR * self.max_batch_bytes
        return size * MAX_DECODED_PER_BYTE > bound and decoded_size(data) > bound

    def idle(self) -> bool:
        """No fan-out running or scheduled."""
        return not self._running and not self._timers

    def stop(self) -> None:
        """No more fan-outs; pending ones are cancelled."""
        self._stopping = True
        for call in list(self._retries.values()) + list(self._timers.values()):
            if call.active():
                call.cancel()
        self._retries.clear()
        self._timers.clear()
