"""Facts of other instances' writers handed to this instance's consumers.

:func:`make_reader` builds the :class:`.Reader` of one (stream, writer) read
here, wired to the consumers that take the stream: a fact, a catch-up page
and a reached position go to each of them in turn.

Invariants:

* Consumers are called in their configured order, and a consumer is called
  only once the one before it finished (awaited if it returned something
  to wait on): a fact reaches consumer ``i + 1`` only once consumer ``i``
  has it.
* Synchronous while every consumer is: a catch-up hands on many facts a
  page, so a coroutine is made only once a consumer returns something to
  wait on.
* A catch-up page goes to the consumers as one call only if every one of
  them takes pages (declares :class:`~replicator.consumers.base.IBatchConsumer`:
  ``on_facts_many``); such consumers skip facts they
  already have, so a page handed on again after a failure is no duplicate.
"""

from typing import Callable, List, Optional, Sequence, Tuple

from twisted.internet import defer

from ..background import Background
from ..consumers import Consumer
from ..consumers.base import IBatchConsumer
from ..streams.stream import Stream
from ..streams.trimmed import FactsTrimmed
from .reader import Reader, maybe_await

Fact = Tuple[int, List[list]]


def consumers_for(consumers: Sequence[Consumer], stream_name: str) -> List[Consumer]:
    """The consumers (of ``consumers``, in order) that take ``stream_name``."""
    return [c for c in consumers if c.streams is None or stream_name in c.streams]


def make_reader(stream: Stream, writer: str, position: Optional[int],
                consumers: Sequence[Consumer], *, clock, fetch_limit: int,
                retry_delay: float, background: Background,
                on_gap: Optional[Callable[[FactsTrimmed], None]] = None) -> Reader:
    """The reader of ``writer``'s facts on ``stream`` from ``position``,
    handing them to those of ``consumers`` that take the stream, and moving
    the stream's ID generator along for a writer that is not local."""
    name = stream.name
    takers = consumers_for(consumers, name)

    def deliver(token: int, rows: List[list]):
        for i, consumer in enumerate(takers):
            result = consumer.on_facts(name, writer, token, rows)
            if result is not None:
                return defer.ensureDeferred(
                    _facts_rest(result, takers[i + 1:], name, writer, token, rows))
        return None

    async def reached(token: int) -> None:
        for consumer in takers:
            await maybe_await(consumer.on_position(name, writer, token))

    def advanced(token: int) -> None:
        if writer not in stream.local_writers:
            stream.id_gen.advance(writer, token)

    def deliver_many(facts: List[Fact]):
        return _deliver_page(takers, name, writer, facts)

    pages = all(IBatchConsumer.providedBy(c) for c in takers)
    return Reader(name, writer, position, source=stream.facts_since, deliver=deliver,
                  deliver_many=deliver_many if pages else None, reached=reached, advanced=advanced, clock=clock,
                  fetch_limit=fetch_limit, retry_delay=retry_delay, background=background,
                  on_gap=on_gap)


def _deliver_page(consumers: Sequence[Consumer], name: str, writer: str, facts: List[Fact]):
    """A page of facts to every consumer in turn; a Deferred if one waits."""
    for i, consumer in enumerate(consumers):
        result = consumer.on_facts_many(name, writer, facts)
        if result is not None:
            return defer.ensureDeferred(
                _page_rest(result, consumers[i + 1:], name, writer, facts))
    return None


async def _page_rest(result, consumers, name, writer, facts) -> None:
    """Wait for a consumer's answer, then hand the page to the ones after it."""
    await maybe_await(result)
    for consumer in consumers:
        await maybe_await(consumer.on_facts_many(name, writer, facts))


async def _facts_rest(result, consumers, name, writer, token, rows) -> None:
    """Wait for a consumer's answer, then hand the fact to the ones after it."""
    await maybe_await(result)
    for consumer in consumers:
        await maybe_await(consumer.on_facts(name, writer, token, rows))

