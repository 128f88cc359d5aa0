"""Rows encoded once, at write time: the fan-out of a local writer's facts
only puts prefix and token in front of the JSON lines the write path kept.

The bytes on the wire must be exactly those of encoding the rows in the
fan-out (the path before, still taken when memory cannot answer): checked
for arbitrary rows and facts (batches, unicode, lone surrogates, integers
beyond 64 bits, nested JSON, rows too long for a line, facts too big for a
batch), at the encoder, the fan-out, and through a stream's write path.
"""

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from replicator.jsontext import encode_json_line
from replicator.replication.core.fanout import Fanout
from replicator.replication.wire.encoding import (
    encode_rdata_lines,
    encode_written,
    encode_written_fact,
    joined,
)
from replicator.streams.recent import EncodedPage, RecentFacts
from replicator.streams.rows import RowCodec, RowError
from tests.harness import Harness, lines
from tests.stream_sets import WRITTEN_STREAMS as STREAMS

_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**70), 2**70),  # beyond 64 bits: the standard library's encoding
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=2),
    st.sampled_from(["é", "\u2028", "\r\n", "\t\"\\", "😀", "\x7f"]),
)
_json = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=12)
_row = st.lists(_json, min_size=1, max_size=4)


@st.composite
def _facts(draw: Any, row: Any = _row) -> list[tuple[int, list[Any]]]:
    """Facts of one writer in token order: (token, rows), tokens ascending
    with gaps (other writers' IDs), every fact with at least one row."""
    token = draw(st.integers(1, 10**12))
    out = []
    for rows in draw(st.lists(st.lists(row, min_size=1, max_size=4), min_size=1, max_size=8)):
        out.append((token, rows))
        token += draw(st.integers(1, 10**6))
    return out


def _updates(facts: list[tuple[int, list[Any]]]) -> list[tuple[int, Any]]:
    return [(token, row) for token, rows in facts for row in rows]


def _page(facts: list[tuple[int, list[Any]]], upto: int) -> EncodedPage:
    tokens, kept = [], []
    for token, rows in facts:
        for row in rows:
            tokens.append(token)
            kept.append(encode_json_line(row))
    return EncodedPage(tokens, kept, len(facts), upto, False)


class _Capture:
    """The fan-out's ``broadcast``: what one connection would be written."""

    def __init__(self) -> None:
        self.data: list[bytes] = []

    def __call__(self, lines: Any, name: str) -> None:
        self.data.append(joined(lines))


def _fanout(capture: _Capture, max_line_length: int, max_batch_rows: int,
            max_batch_bytes: int) -> Fanout:
    return Fanout(capture, Clock(), max_line_length=max_line_length,
                  max_batch_rows=max_batch_rows, max_batch_bytes=max_batch_bytes)


class EncodeWrittenTests(SynchronousTestCase):
    """:func:`encode_written` against :func:`encode_rdata_lines`."""

    @given(_facts(), st.integers(20, 400))
    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def test_same_bytes_or_none_when_a_row_is_too_long(self, facts, max_line_length):
        updates = _updates(facts)
        page = _page(facts, facts[-1][0])
        old = encode_rdata_lines("caches", "master", updates, max_line_length)
        new = encode_written("caches", "master", page.tokens, page.lines, page.facts,
                             max_line_length)
        if new is None:
            # Only when the row-by-row encoder would drop a row, or the
            # quick bound could not show it would not (then the fan-out
            # goes fact by fact, exactly).
            fact_by_fact = [encode_written_fact("caches", "master", token,
                                                [encode_json_line(r) for r in rows],
                                                max_line_length) for token, rows in facts]
            if old.dropped == 0:
                self.assertNotIn(None, fact_by_fact)
                self.assertEqual(b"".join(b"".join(f) for f in fact_by_fact if f), joined(old))
            return
        self.assertEqual(old.dropped, 0)
        self.assertEqual(joined(new), joined(old))
        self.assertEqual(len(new), len(old))
        self.assertEqual(list(new), list(old))

    @given(_facts(), st.integers(20, 400))
    @settings(max_examples=150, deadline=None)
    def test_one_fact_is_dropped_exactly_when_the_row_encoder_drops_a_row(self, facts,
                                                                        max_line_length):
        for token, rows in facts:
            old = encode_rdata_lines("caches", "master", [(token, r) for r in rows],
                                     max_line_length)
            new = encode_written_fact("caches", "master", token,
                                      [encode_json_line(r) for r in rows], max_line_length)
            if old.dropped:
                self.assertIsNone(new)
            else:
                self.assertEqual(new, list(old))

    def test_no_rows(self):
        self.assertEqual(list(encode_written("caches", "master", [], [], 0)), [])


class FanoutWrittenTests(SynchronousTestCase):
    """:meth:`Fanout.send_written` writes what :meth:`Fanout.send_updates`
    writes for the same rows: lines, POSITIONs for facts too big for a line
    or a batch, the trailing POSITION, the token announced."""

    @given(_facts(), st.integers(20, 300), st.integers(1, 6), st.integers(30, 400),
           st.integers(0, 3))
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def test_same_bytes_as_encoding_in_the_fanout(self, facts, max_line_length, max_batch_rows,
                                                  max_batch_bytes, gap):
        upto = facts[-1][0] + gap
        prev = facts[0][0] - 1
        old, new = _Capture(), _Capture()
        before = _fanout(old, max_line_length, max_batch_rows, max_batch_bytes)
        after = _fanout(new, max_line_length, max_batch_rows, max_batch_bytes)
        before.send_updates("caches", "master", prev, _updates(facts), upto)
        after.send_written("caches", "master", prev, _page(facts, upto))
        self.assertEqual(b"".join(new.data), b"".join(old.data))
        self.assertEqual(after.announced, before.announced)

    def test_an_empty_page_is_a_position(self):
        new = _Capture()
        fanout = _fanout(new, 16384, 100, 10**6)
        fanout.send_written("caches", "master", 4, EncodedPage([], [], 0, 9, False))
        self.assertEqual(new.data, [b"POSITION caches master 4 9\n"])
        self.assertEqual(fanout.announced, {("caches", "master"): 9})


class WritePathTests(SynchronousTestCase):
    """The lines come from the write path (:class:`RowCodec`), and the
    fan-out of a stream's writer sends them."""

    @given(st.lists(st.lists(st.tuples(st.text(max_size=6), _json, st.integers(-(2**63),
                                                                                  2**63 - 1)),
                             max_size=3), min_size=1, max_size=4))
    @settings(max_examples=150, deadline=None)
    def test_the_codec_keeps_each_rows_json_line(self, facts):
        codec = RowCodec(STREAMS[0].columns)
        rows = [[list(r) for r in fact] for fact in facts]
        try:
            wire, _, kept = codec.prepare(rows)
        except RowError:
            return  # e.g. NUL in the text, NaN: refused, never on the wire
        except TypeError:
            return  # an integer beyond 64 bits in the JSON column (the statement's encoder)
        self.assertEqual(kept, [[encode_json_line(r) for r in fact] for fact in wire])

    def test_a_row_that_is_not_json_is_a_row_error(self):
        # Before, without a line limit (the library's writes), it went as
        # far as the statement's parameters, and failed there as a TypeError.
        codec = RowCodec(STREAMS[0].columns)
        with self.assertRaises(RowError) as e:
            codec.prepare([[["f", {"k": {1, 2}}, 1]]])
        self.assertEqual(str(e.exception), "row 0: not encodable as JSON")

    def test_nan_inside_a_tuple_in_a_json_column_is_refused(self):
        # JSON cannot carry NaN: before, one inside a tuple was not seen,
        # written (the table got null) and its fact announced by POSITION.
        codec = RowCodec(STREAMS[0].columns)
        with self.assertRaises(RowError) as e:
            codec.prepare([[["f", {"k": (1.0, float("nan"))}, 1]]])
        self.assertEqual(str(e.exception),
                         "row 0: column 'keys' holds NaN or Infinity, which JSON cannot carry")

    def harness(self, **handler_kwargs: Any) -> tuple[Harness, Any, Any]:
        h = Harness(STREAMS, self.addCleanup)
        node = h.instance("master", **handler_kwargs)
        _, transport = h.serve(node, name="reader", replicate=True)
        return h, node, transport

    @given(st.lists(st.lists(st.tuples(st.text(max_size=6), _json, st.integers(-(2**63),
                                                                                  2**63 - 1)),
                             max_size=3), min_size=1, max_size=5))
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def test_a_writers_facts_go_out_as_the_table_would_send_them(self, facts):
        # Lines of at most 120 bytes: some rows go out as POSITION.
        h, node, transport = self.harness(max_line_length=120)
        stream = node.stream("caches")
        rows = [[list(r) for r in fact] for fact in facts]
        try:
            stream.prepare(rows)
        except (RowError, TypeError):
            return
        from_memory = []
        send_written = node.handler.fanout.send_written
        node.handler.fanout.send_written = lambda *a: from_memory.append(send_written(*a))
        h.run(stream.write_facts(rows))
        self.assertEqual(len(from_memory), 1)
        sent = transport.value()
        # The fan-out before: the rows read back from the table, encoded.
        top = stream.id_gen.get_current_token("master")
        updates, upto, _ = h.run(stream.updates_since("master", 0, top))
        expected = _Capture()
        _fanout(expected, node.handler.fanout.max_line_length, node.handler.fanout.max_batch_rows,
                node.handler.fanout.max_batch_bytes).send_updates(
            "caches", "master", 0, updates, upto)
        self.assertEqual(sent, b"".join(expected.data))

    def test_a_row_changed_after_its_write_goes_out_as_written(self):
        """The caller's objects may change once the write has answered; the
        table has the row as written, and so does the wire (before, the
        fan-out encoded the caller's objects when it ran: a coalesced
        fan-out sent the changed value)."""
        h, node, transport = self.harness()
        stream = node.stream("caches")
        h.run(stream.write_fact([["first", None, 1]]))  # the next fan-out is coalesced
        keys = {"user": "@a:example.com"}
        h.run(stream.write_fact([["second", keys, 2]]), settle=False)
        keys["user"] = "@changed:example.com"
        h.settle()
        self.assertEqual(lines(transport)[-1],
                         'RDATA caches master 2 ["second",{"user":"@a:example.com"},2]')


class RecentLinesTests(SynchronousTestCase):
    """The lines kept for the fan-out live and go with their facts."""

    def test_lines_are_bounded_and_forgotten_with_their_facts(self):
        recent = RecentFacts(["master"], sole_writer=True)
        recent.MAX = 10
        recent.start({"master": 0})
        for i in range(1, 26):
            recent.remember("master", [i], [[["r", None, i]]], [[b'["r",null,%d]\n' % i]])
        self.assertLessEqual(len(recent.lines["master"]), 10)
        self.assertEqual(recent.lines["master"].keys(), recent.facts["master"].keys())
        low = min(recent.facts["master"])
        page = recent.encoded("master", low - 1, 25, 1000, 25)
        self.assertEqual(page.tokens, list(range(low, 26)))
        self.assertEqual(page.lines[-1], b'["r",null,25]\n')
        recent.forget("master", 25)
        self.assertEqual(recent.lines["master"], {})
        # Below the floor, or past what completed, memory does not answer.
        self.assertIsNone(recent.encoded("master", 0, 25, 1000, 25))
        self.assertIsNone(recent.encoded("master", 25, 26, 1000, 25))

    def test_a_page_stops_before_the_limit_and_says_where(self):
        recent = RecentFacts(["master"], sole_writer=True)
        recent.start({"master": 0})
        recent.remember("master", [1, 2, 3], [[["a"]], [["b"], ["c"]], [["d"]]],
                        [[b"a"], [b"b", b"c"], [b"d"]])
        self.assertEqual(recent.encoded("master", 0, 3, 2, 3),
                         EncodedPage([1], [b"a"], 1, 1, True))
        self.assertEqual(recent.encoded("master", 0, 3, 3, 3),
                         EncodedPage([1, 2, 2], [b"a", b"b", b"c"], 2, 2, True))
        self.assertEqual(recent.encoded("master", 1, 3, 1, 3),
                         EncodedPage([2, 2], [b"b", b"c"], 1, 2, True))
        self.assertEqual(recent.updates("master", 0, 3, 3, 3)[1:], (2, True))
