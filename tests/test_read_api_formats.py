"""Page formats of the read API chosen by ``Accept``: the compact NDJSON
pages hold the same facts and tokens as the JSON ones, with the same
caching and read-ahead; any ``Accept`` gets a format or a 406, never a
crash.  In memory over a fake stream, and once through a real daemon."""

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer, task
from twisted.trial.unittest import SynchronousTestCase

from replicator.http.read import formats, tokens
from replicator.http.read.auth import ReaderAuth
from replicator.http.read.pages import read_page
from replicator.http.read.params import ParameterError
from replicator.http.read.routes import ReadRoutes
from tests.http_api import AUTH
from tests.read_api_cases import PAGES, ReadTestCase
from tests.read_api_fakes import FakeRequest, FakeStream, run

SECRET = b"s" * 16


def parse_ndjson(body):
    """``(head, facts)`` of an NDJSON page, each fact as the JSON page
    shows it (rows as objects keyed by the head's columns)."""
    lines = body.split(b"\n")
    assert lines[-1] == b"", body[-40:]
    head = orjson.loads(lines[0])
    facts = []
    for line in lines[1:-1]:
        stream_id, writer, rows = orjson.loads(line)
        facts.append({"stream_id": stream_id, "writer": writer,
                      "rows": [dict(zip(head["columns"], r)) for r in rows]})
    return head, facts


class NegotiateTests(SynchronousTestCase):
    def test_choices(self):
        json, nd = formats.JSON, formats.NDJSON
        for header, form in [
            (None, json),
            ([b"application/json"], json),
            ([b"application/x-ndjson"], nd),
            ([b"Application/X-NDJSON; charset=utf-8"], nd),
            ([b"*/*"], json),
            ([b"application/*"], json),
            ([b"application/x-ndjson, */*;q=0.8"], nd),
            ([b"application/x-ndjson;q=0.5, application/json"], json),
            ([b"application/json;q=0, */*"], nd),  # JSON refused by name
            ([b"text/html", b"application/x-ndjson"], nd),  # two headers: one list
            ([b"text/html,application/xhtml+xml,*/*;q=0.8"], json),  # a browser
            ([b""], json),
            ([b"\xff\x00;;;,,,"], json),  # nothing well-formed: the default
            ([b"application/x-ndjson;q=2"], json),  # a q out of range: that range ignored
            ([b"*/x-ndjson"], json),
        ]:
            self.assertIs(formats.negotiate(header), form, header)

    def test_refusal_is_406_naming_accept(self):
        for header in ([b"text/html"], [b"application/json;q=0, application/x-ndjson;q=0"],
                       [b"text/event-stream"], [b"*/*;q=0"]):
            with self.assertRaises(ParameterError, msg=header) as e:
                formats.negotiate(header)
            self.assertEqual((e.exception.code, e.exception.extra), (406, {"parameter": "Accept"}))
            self.assertIn("application/x-ndjson", e.exception.message)

    def test_only_the_first_ranges_are_read(self):
        many = b",".join([b"text/html"] * formats.MAX_RANGES + [b"application/json"])
        with self.assertRaises(ParameterError):
            formats.negotiate([many])

    @settings(max_examples=400, deadline=None)
    @given(st.lists(st.binary(max_size=80), max_size=3))
    def test_any_header_is_a_format_or_406(self, values):
        try:
            self.assertIn(formats.negotiate(values), formats.FORMATS)
        except ParameterError as e:
            self.assertEqual(e.code, 406)


def stream_of(n, rows=1):
    """A fake stream of writer ``a`` with facts 1..n, all final."""
    s = FakeStream(["a"])
    for i in range(1, n + 1):
        s.add("a", i, [[f"v{i}.{r}"] for r in range(rows)])
    s.id_gen.move("a", n)
    return s


class Registry:
    def __init__(self, stream):
        self.stream = stream

    def find(self, name):
        return self.stream if name == self.stream.name else None


class RouteTests(SynchronousTestCase):
    def setUp(self):
        self.clock = task.Clock()
        self.stream = stream_of(7)
        self.routes = ReadRoutes(registry=Registry(self.stream), auth=ReaderAuth(SECRET.decode()),
                                 clock=self.clock)
        # Every fact below 10 persisted (what PersistedLinear would read).
        self.routes.persisted._known["events"] = (0.0, 10)

    def get(self, query, accept=None, etag=None):
        request = FakeRequest()
        request.method = b"GET"
        request.args = {k.encode(): [v.encode()] for k, v in query.items()}
        request.requestHeaders.setRawHeaders(b"authorization", [b"Bearer " + SECRET])
        if accept is not None:
            request.requestHeaders.setRawHeaders(b"accept", accept)
        if etag is not None:
            request.requestHeaders.setRawHeaders(b"if-none-match", [etag])
        d = defer.ensureDeferred(self.routes.facts(request, "events"))
        return request, d

    def answer(self, query, accept=None):
        _, d = self.get(query, accept)
        return self.successResultOf(d)

    def test_same_facts_and_tokens_as_json(self):
        query = {"limit": "3"}
        walked = {}
        for name, accept in (("json", None), ("ndjson", [b"application/x-ndjson"])):
            pages, q = [], dict(query)
            while True:
                r = self.answer(q, accept)
                if name == "json":
                    doc = orjson.loads(r.body)
                    head = {"stream": doc["stream"], "next": doc["next"]}
                    facts = doc["facts"]
                else:
                    self.assertEqual(r.content_type, b"application/x-ndjson")
                    head, facts = parse_ndjson(r.body)
                    self.assertEqual(head["columns"], ["v"])
                    del head["columns"]
                pages.append((head, facts, r.headers.get(b"cache-control"),
                              r.headers.get(b"vary")))
                if not facts:
                    break
                q = {**query, "from": head["next"]}
            walked[name] = pages
        self.assertEqual(walked["ndjson"], walked["json"])
        self.assertEqual([[f["stream_id"] for f in p[1]] for p in walked["json"]],
                         [[1, 2, 3], [4, 5, 6], [7], []])
        self.assertEqual(walked["json"][0][1][0], {"stream_id": 1, "writer": "a",
                                                   "rows": [{"v": "v1.0"}]})
        self.assertEqual([p[2] for p in walked["json"]],
                         [formats_immutable(), formats_immutable(), b"no-store", b"no-store"])
        self.assertEqual({p[3] for p in walked["json"]}, {b"Accept"})

    def test_an_ndjson_page_byte_for_byte(self):
        r = self.answer({"limit": "2"}, [b"application/x-ndjson"])
        token = tokens.encode("events", {"a": 2})
        self.assertEqual(r.body, b'{"stream":"events","columns":["v"],"next":"%s"}\n'
                                 b'[1,"a",[["v1.0"]]]\n[2,"a",[["v2.0"]]]\n' % token.encode())

    def test_etag_per_format_and_304(self):
        json = self.answer({"limit": "3"})
        nd = self.answer({"limit": "3"}, [b"application/x-ndjson"])
        self.assertNotEqual(json.headers[b"etag"], nd.headers[b"etag"])
        request, d = self.get({"limit": "3"}, [b"application/x-ndjson"], nd.headers[b"etag"])
        self.assertIsNone(self.successResultOf(d))
        self.assertEqual(request.responseCode, 304)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"vary"), [b"Accept"])
        # The JSON page's tag does not match the NDJSON page.
        _, d = self.get({"limit": "3"}, [b"application/x-ndjson"], json.headers[b"etag"])
        self.assertEqual(self.successResultOf(d).body, nd.body)

    def test_hostile_accept(self):
        _, d = self.get({"limit": "3"}, [b"text/html"])
        error = self.failureResultOf(d, ParameterError).value
        self.assertEqual((error.code, error.extra), (406, {"parameter": "Accept"}))
        for garbage in ([b"\x00\xff" * 100], [b";q=;q=,/,*/"], [b"a" * 8000]):
            r = self.answer({"limit": "3"}, garbage)
            self.assertEqual(r.content_type, b"application/json")

    def test_read_ahead_per_format(self):
        ahead = self.routes.readahead
        nd = [b"application/x-ndjson"]
        first = self.answer({"limit": "2"}, nd)
        head, _ = parse_ndjson(first.body)
        second = self.answer({"limit": "2", "from": head["next"]}, nd)  # it walks
        head, _ = parse_ndjson(second.body)
        # Built ahead, one after the other: the NDJSON pages after it, up
        # to the first that is not full (5-6, then 7).
        self.assertEqual(sorted(k[1] for k in ahead._built), [(("a", 4),), (("a", 6),)])
        self.assertEqual({k[3] for k in ahead._built}, {"ndjson"})
        # A JSON request from the same token does not get the NDJSON page.
        json = self.answer({"limit": "2", "from": head["next"]})
        self.assertEqual(json.content_type, b"application/json")
        self.assertEqual(ahead.used, 0)
        third = self.answer({"limit": "2", "from": head["next"]}, nd)
        self.assertEqual(ahead.used, 1)
        self.assertEqual(parse_ndjson(third.body)[1][0]["stream_id"], 5)

    def test_page_bytes_count_the_format_answered(self):
        self.stream = stream_of(6, rows=3)
        one = run(read_page(self.stream, {"a": 0}, {"a": 6}, 100, columns=["v"],
                            max_bytes=1, form=formats.NDJSON))
        self.assertEqual([f[0] for f in one.facts], [1])
        self.assertEqual(one.facts[0][3], b'[1,"a",[["v1.0"],["v1.1"],["v1.2"]]]\n')
        line = len(one.facts[0][3])
        two = run(read_page(self.stream, {"a": 0}, {"a": 6}, 100, columns=["v"],
                            max_bytes=2 * line, form=formats.NDJSON))
        self.assertEqual([f[0] for f in two.facts], [1, 2])
        self.assertTrue(two.full)
        self.assertEqual(two.next, {"a": 2})


def formats_immutable():
    from replicator.http.read.routes import IMMUTABLE
    return IMMUTABLE


class DaemonTests(ReadTestCase):
    async def walk(self, accept):
        pages, query = [], "?limit=4"
        headers = {**AUTH, **({"Accept": accept} if accept else {})}
        while True:
            response, data = await self.call("GET", PAGES.format("events") + query,
                                             headers=headers)
            self.assertEqual(response.code, 200, data)
            kind = response.headers.getRawHeaders(b"content-type")[0]
            if kind == b"application/x-ndjson":
                head, facts = parse_ndjson(data)
            else:
                doc = orjson.loads(data)
                head, facts = doc, doc["facts"]
            pages.append(([f["stream_id"] for f in facts], facts, head["next"],
                          response.headers.getRawHeaders(b"cache-control")))
            if not facts:
                return pages
            query = f"?limit=4&from={head['next']}"

    async def test_ndjson_pages_of_a_daemon(self):
        from tests.read_api_cases import until_deferred

        await self.start_reading()
        ids = await self.write("events", 10)
        await until_deferred(lambda: self.db.runQuery(
            "SELECT stream_id FROM stream_positions WHERE stream_name = 'events'"),
            lambda r: r == [(ids[-1],)])
        nd = await self.walk("application/x-ndjson")
        json = await self.walk(None)
        self.assertEqual(nd, json)
        self.assertEqual([p[0] for p in nd], [ids[:4], ids[4:8], ids[8:], []])
        self.assertEqual(nd[0][1][0]["rows"], [{"event_id": "$e0.0"}])
        self.assertEqual(nd[0][3], [b"public, max-age=31536000, immutable"])
        response, data = await self.call("GET", PAGES.format("events"),
                                         headers={**AUTH, "Accept": "text/html"})
        self.assertEqual(response.code, 406)
        self.assertEqual(orjson.loads(data)["parameter"], "Accept")
