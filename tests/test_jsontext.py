"""The one JSON encoder (:mod:`replicator.jsontext`): what its bytes cost to
keep.  The JSON-lines consumer keeps every encoded line until its flush, a
whole catch-up page of them: a line must hold about its own length."""

import tracemalloc

from twisted.trial.unittest import SynchronousTestCase

from replicator.jsontext import encode_json, encode_json_line

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
