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
* After a reload changed the consumers, a consumer gets no fact at or
  below the token it already had (:func:`delivery_for`'s ``floors``).
"""

from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime

from ...background import Background
from ...consumers import Consumer
from ...consumers.base import IBatchConsumer
from ...streams.stream import Stream
from ...streams.trimmed import FactsTrimmed
from .accepted import accepting
from .audit import Mismatch
from .reader import Reader, maybe_await

Fact = tuple[int, list[list[Any]]]
Deliver = Callable[[int, list[list[Any]]], defer.Deferred[None] | None]
DeliverMany = Callable[[list[Fact]], defer.Deferred[None] | None] | None
Reached = Callable[[int], Any]


def consumers_for(consumers: Sequence[Consumer], stream_name: str) -> list[Consumer]:
    """The consumers (of ``consumers``, in order) that take ``stream_name``."""
    return [c for c in consumers if c.streams is None or stream_name in c.streams]


def make_reader(stream: Stream, writer: str, position: int | None,
                consumers: Sequence[Consumer], *, clock: IReactorTime, fetch_limit: int,
                retry_delay: float, background: Background,
                on_gap: Callable[[FactsTrimmed], None] | None = None,
                on_mismatch: Callable[[Mismatch], None] | None = None,
                audit: bool = True,
                current: Callable[[], Sequence[Consumer]] | None = None) -> Reader:
    """The reader of ``writer``'s facts on ``stream`` from ``position``,
    handing them to those of ``consumers`` that take the stream, and moving
    the stream's ID generator along for a writer that is not local.  Its
    POSITIONs are checked against the table, and (``audit``) what it
    hands on is noted for the audit (:mod:`.audit`).  A retention gap that
    the consumers of the moment (``current()``, default ``consumers``)
    accepted in advance is skipped (:mod:`.accepted`)."""
    deliver, deliver_many, reached = delivery_for(stream.name, writer, consumers)
    now = current if current is not None else (lambda: consumers)

    def advanced(token: int) -> None:
        if writer not in stream.local_writers:
            stream.id_gen.advance(writer, token)

    source = accepting(stream.facts_since, stream.name, writer,
                       lambda: consumers_for(now(), stream.name))
    return Reader(stream.name, writer, position, source=source, deliver=deliver,
                  deliver_many=deliver_many, reached=reached, advanced=advanced, clock=clock,
                  fetch_limit=fetch_limit, retry_delay=retry_delay, background=background,
                  on_gap=on_gap, probe=stream.first_fact_in, known=stream.known_ids,
                  audit=audit, sample=stream.config.preset is None, on_mismatch=on_mismatch)


def delivery_for(name: str, writer: str, consumers: Sequence[Consumer],
                 floors: dict[int, int] | None = None) -> tuple[Deliver, DeliverMany, Reached]:
    """``(deliver, deliver_many, reached)`` of a :class:`.Reader` of ``writer``
    on stream ``name``, to those of ``consumers`` that take the stream
    (``deliver_many`` None unless every one of them takes pages).

    ``floors`` (a reload changed the consumers): the token each consumer,
    by its index in ``consumers``, already has; it gets nothing at or
    below it (the reader rewound for a consumer further back).  Once a
    fact is above every floor, everyone gets everything again.
    """
    takers = consumers_for(consumers, name)
    floor_of: dict[int, int] = {}  # id(consumer) -> token it has
    if floors:
        floor_of = {id(c): floors[i] for i, c in enumerate(consumers)
                    if i in floors and c in takers}
    top = max(floor_of.values(), default=None)

    def wanting(token: int) -> list[Consumer]:
        """The takers ``token`` is new to."""
        nonlocal top
        if top is None:
            return takers
        if token > top:
            floor_of.clear()
            top = None
            return takers
        return [c for c in takers if floor_of.get(id(c), token - 1) < token]

    def deliver(token: int, rows: list[list[Any]]) -> defer.Deferred[None] | None:
        targets = takers if top is None else wanting(token)
        for i, consumer in enumerate(targets):
            result = consumer.on_facts(name, writer, token, rows)
            if result is not None:
                return defer.ensureDeferred(
                    _facts_rest(result, targets[i + 1:], name, writer, token, rows))
        return None

    async def reached(token: int) -> None:
        for consumer in wanting(token):
            await maybe_await(consumer.on_position(name, writer, token))

    def deliver_many(facts: list[Fact]) -> defer.Deferred[None] | None:
        if facts and top is not None:
            wanting(facts[0][0])  # past every floor: they are dropped
        if top is None:
            return _deliver_page(takers, name, writer, facts)
        return _deliver_page_above(takers, floor_of, name, writer, facts)

    pages = all(IBatchConsumer.providedBy(c) for c in takers)
    return deliver, deliver_many if pages else None, reached


def _deliver_page_above(takers: Sequence[Any], floor_of: dict[int, int], name: str, writer: str,
                        facts: list[Fact]) -> defer.Deferred[None] | None:
    """A page to every taker in turn, each only the facts above its floor."""
    return defer.ensureDeferred(_page_above(takers, dict(floor_of), name, writer, facts))


async def _page_above(takers: Sequence[Any], floor_of: dict[int, int], name: str, writer: str,
                      facts: list[Fact]) -> None:
    for consumer in takers:
        floor = floor_of.get(id(consumer))
        mine = facts if floor is None else [f for f in facts if f[0] > floor]
        if mine:
            await maybe_await(consumer.on_facts_many(name, writer, mine))


def rewire(reader: Reader, consumers: Sequence[Consumer], started: Sequence[Consumer],
           beginning: int = 0, now: int | None = None) -> None:
    """A paused ``reader`` hands facts to ``consumers`` from now on (a start,
    or a reload changed them).  Each of ``started`` (new) gets what is above
    its own persisted position, the reader rewound for it if that is
    behind.  One with no position for this key starts where its ``start``
    says: ``"beginning"`` after ``beginning`` (the stream's trim boundary:
    every fact still in the table), ``"now"`` at the reader's position
    (``now`` if the reader has none yet and another one rewinds it; else
    it is live from the writer's next POSITION).  Such a consumer is told
    its start first (``on_position``), so what it writes says where it
    begins.  Every consumer that was there is live."""
    name, position = reader.stream_name, reader.position
    key = (name, reader.writer)
    fresh = {id(c) for c in started}
    floors: dict[int, int] = {}
    back: int | None = None
    heads: list[tuple[Consumer, int | None]] = []
    for i, consumer in enumerate(consumers):
        own = None
        if id(consumer) in fresh and (consumer.streams is None or name in consumer.streams):
            own = consumer.positions().get(key)
            if own is None:
                if getattr(consumer, "start", "now") != "beginning":
                    heads.append((consumer, None))
                    continue
                own = beginning
                heads.append((consumer, own))
        if own is None:
            if position is not None:
                floors[i] = position
            continue
        floors[i] = own
        if position is None or own < position:
            back = own if back is None else min(back, own)
    live = position if position is not None or back is None else now
    if live is not None:
        for i, consumer in enumerate(consumers):
            if any(c is consumer and token is None for c, token in heads):
                floors[i] = live
    reader.set_delivery(*delivery_for(name, reader.writer, consumers, floors))
    if back is not None:
        reader.rewind(back)
    for consumer, token in heads:
        start = live if token is None else token
        if start is not None:
            consumer.on_position(name, reader.writer, start)


def _deliver_page(consumers: Sequence[Any], name: str, writer: str,
                  facts: list[Fact]) -> defer.Deferred[None] | None:
    """A page of facts to every consumer in turn (each provides
    :class:`~replicator.consumers.IBatchConsumer`); a Deferred if one waits."""
    for i, consumer in enumerate(consumers):
        result = consumer.on_facts_many(name, writer, facts)
        if result is not None:
            return defer.ensureDeferred(
                _page_rest(result, consumers[i + 1:], name, writer, facts))
    return None


async def _page_rest(result: Any, consumers: Sequence[Any], name: str, writer: str,
                     facts: list[Fact]) -> None:
    """Wait for a consumer's answer, then hand the page to the ones after it."""
    await maybe_await(result)
    for consumer in consumers:
        await maybe_await(consumer.on_facts_many(name, writer, facts))


async def _facts_rest(result: Any, consumers: Sequence[Consumer], name: str, writer: str,
                      token: int, rows: list[list[Any]]) -> None:
    """Wait for a consumer's answer, then hand the fact to the ones after it."""
    await maybe_await(result)
    for consumer in consumers:
        await maybe_await(consumer.on_facts(name, writer, token, rows))

