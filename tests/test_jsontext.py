"""The one JSON encoder (:mod:`replicator.jsontext`): what its bytes cost to
keep.  The JSON-lines consumer keeps every encoded line until its flush, a
whole catch-up page of them: a line must hold about its own length.  And
the decoder of client JSON: a key given twice is refused."""

import json
import tracemalloc

import orjson
from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from replicator.jsontext import (
    DuplicateKeyError,
    decode_json_strict,
    encode_json,
    encode_json_line,
    unique_object,
)

FACT = {"stream": "caches", "writer": "master", "token": 123456,
        "rows": [["get_user", ["@alice:example.org", None], 1700000000000]]}


def held_per_object(make, n: int = 2000) -> float:
    """Bytes of memory held per object while ``n`` results of ``make()`` are kept."""
    tracemalloc.start()
    try:
        kept = [make() for _ in range(n)]
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(kept) == n
    return held / n


class HeldMemoryTests(SynchronousTestCase):
    def test_a_kept_line_holds_about_its_length(self):
        # orjson hands back its whole output buffer (about 4 KB, whatever the
        # length) when asked to append the newline itself: 1,000 lines of a
        # catch-up page then held ~4 MB instead of ~0.2 MB.
        line = encode_json_line(FACT)
        self.assertEqual(line, encode_json(FACT) + b"\n")
        self.assertLess(held_per_object(lambda: encode_json_line(FACT)), len(line) + 200)


def nested(depth: int, inner: bytes) -> bytes:
    return b"[" * depth + inner + b"]" * depth


class StrictDecodeTests(SynchronousTestCase):
    def refused_key(self, data: bytes) -> str:
        with self.assertRaises(DuplicateKeyError) as cm:
            decode_json_strict(data)
        return cm.exception.key

    def test_a_key_given_twice_is_named_at_any_depth(self):
        self.assertEqual(self.refused_key(b'{"rows":[1],"rows":[]}'), "rows")
        self.assertEqual(self.refused_key(b'[{"a":{"b":1,"c":2,"b":3}}]'), "b")
        # Colons in strings: the count of members is not fooled.
        self.assertEqual(self.refused_key(b'{"a:":"x:y","a:":"::"}'), "a:")
        self.assertEqual(self.refused_key(b'[{"u":"@a:x"},{"k":"@b:x","k":"@c:x"}]'), "k")
        # A colon spelled as an escape, and the same key spelled two ways.
        self.assertEqual(self.refused_key(b'{"a\\u003a":1,"a:":2}'), "a:")
        self.assertEqual(self.refused_key(b'{"a\\u003A":1,"a\\u003a":2}'), "a:")
        self.assertEqual(self.refused_key('{"\\u00e9":1,"\u00e9":2}'.encode()), "\u00e9")
        # Deeper than orjson encodes (254 levels).
        self.assertEqual(self.refused_key(nested(300, b'{"x":"a:b","x":1}')), "x")

    def test_without_a_repeated_key_the_value_is_orjsons(self):
        for data in (b'{"rows":[["a:b",{"k":"x:y","k:":{"k":1}},1]]}', b'{"a":1}', b"[]",
                     b'{"big":18446744073709551616,"n":[1.5,null,true]}',
                     b'{"a\\u003a":1,"a":2}', nested(300, b'{"x":"a:b","y":1}'),
                     nested(300, b'{"x":1}')):
            self.assertEqual(decode_json_strict(data), orjson.loads(data), data)

    def test_what_is_not_json_is_a_value_error(self):
        for data in (b"", b"{", b"[NaN]", b"\xff", b'{"a":1,}', nested(2000, b"1")):
            self.assertRaises(ValueError, decode_json_strict, data)
        # Too deep for the checking decoder: refused, never a RecursionError.
        self.assertRaises(ValueError, decode_json_strict, nested(1000, b'{"a":":","b":2}'))

    @given(st.recursive(
        st.none() | st.booleans() | st.integers(-10, 10) | st.sampled_from(["", ":", "a", "a:"]),
        lambda inner: st.lists(inner, max_size=3) | st.lists(
            st.tuples(st.sampled_from(["a", "b", ":", "a:"]), inner), max_size=3),
        max_leaves=12))
    def test_refused_exactly_when_a_key_repeats(self, value):
        def text(v) -> str:
            if isinstance(v, list) and v and all(isinstance(x, tuple) for x in v):
                return "{" + ",".join(json.dumps(k) + ":" + text(x) for k, x in v) + "}"
            if isinstance(v, list):
                return "[" + ",".join(map(text, v)) + "]"
            return json.dumps(v)

        data = text(value).encode()
        try:
            expected = orjson.loads(data)
            json.loads(data, object_pairs_hook=unique_object)
        except DuplicateKeyError as e:
            self.assertEqual(self.refused_key(data), e.key)
        else:
            self.assertEqual(decode_json_strict(data), expected)
