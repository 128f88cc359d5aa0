"""The read API (``GET .../streams/{stream}/facts`` and ``.../events``)
with real clients against a real ``replicator run`` on PostgreSQL:

* curl: pages to the end, their cache headers, a long-poll that answers
  with the next fact and one that answers empty at its deadline, an event
  stream (``curl -N``) from the beginning, its ``retry:`` and heartbeats,
  and resumed from ``Last-Event-ID``,
  errors as JSON naming the parameter;
* Node.js: its own ``fetch`` paging through the stream, and the npm
  ``eventsource`` client reading events (its credential as ``access_token``,
  which the daemon's log never shows);
* Debian's nginx with ``proxy_cache`` in front (the shipped
  ``contrib/nginx/replicator.conf``): an old page is served from
  nginx's cache (``X-Cache-Status: HIT``, no second request in either
  access log), the newest never is;
* headless Chromium: a page's ``EventSource`` (credential in the
  ``replicator_reader`` cookie) reads the stream while the daemon is killed
  and started again and while the network is cut and restored; it got
  every fact of the table once, in order.

Every comparison is against the table.  With CI=true a missing curl, node,
npm package, nginx or chromium is a failure, never a skip.
"""

import json
import shutil
import subprocess
import threading
import urllib.parse

from twisted.trial.unittest import SynchronousTestCase

from tests.cdp import Browser
from tests.daemon import SECRET
from tests.read_api import OTHER_SECRET, READER_SECRET, ReadApiDaemon, as_table, get, parse_events
from tests.servers import unavailable, wait_for
from tests.web_clients import DroppableProxy, NginxCache, node

#: Deadline for anything a client or the daemon must get to (seconds).
DEADLINE = 90.0


def curl(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    binary = shutil.which("curl")
    if binary is None:
        unavailable("curl not found (scripts/ensure-system-deps.sh installs it)")
    return subprocess.run([binary, "-sS", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def curl_json(url: str, secret: str = READER_SECRET):
    done = curl("-H", f"Authorization: Bearer {secret}", url)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def with_query(url: str, **params) -> str:
    params = {k: v for k, v in params.items() if v is not None}
    return url + ("?" + urllib.parse.urlencode(params) if params else "")


class StreamReader:
    """``curl -N`` on an event stream, its output collected on a thread."""

    def __init__(self, url: str, *headers: str):
        binary = shutil.which("curl")
        if binary is None:
            unavailable("curl not found (scripts/ensure-system-deps.sh installs it)")
        args = [binary, "-sS", "-N", "--max-time", str(int(DEADLINE))]
        for header in headers:
            args += ["-H", header]
        self.proc = subprocess.Popen(args + [url], stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True)
        self.text = ""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for chunk in iter(lambda: self.proc.stdout.read(1), ""):
            with self._lock:
                self.text += chunk

    def events(self) -> list[dict]:
        with self._lock:
            return parse_events(self.text)

    def facts(self) -> list[dict]:
        return [e for e in self.events() if e.get("event") == "fact"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._thread.join(10)


NODE_PAGES = r"""
// Every fact of the stream through Node's own fetch, page by page.
const [url, secret] = process.argv.slice(1);
(async () => {
  const facts = [];
  let from = null;
  for (;;) {
    const query = new URLSearchParams({limit: '25'});
    if (from !== null) query.set('from', from);
    const response = await fetch(`${url}?${query}`, {headers: {Authorization: `Bearer ${secret}`}});
    if (response.status !== 200) throw new Error(`${response.status} ${await response.text()}`);
    const page = await response.json();
    if (page.facts.length === 0) break;
    facts.push(...page.facts);
    from = page.next;
  }
  console.log(JSON.stringify(facts));
})().catch((e) => { console.error(e); process.exit(1); });
"""

NODE_EVENTSOURCE = r"""
// The npm eventsource client, its credential in the query: `count` facts.
const { EventSource } = require('eventsource');
const [url, secret, count] = process.argv.slice(1);
const source = new EventSource(`${url}?access_token=${encodeURIComponent(secret)}`);
const got = [];
source.addEventListener('fact', (event) => {
  got.push({id: event.lastEventId, fact: JSON.parse(event.data)});
  if (got.length === Number(count)) {
    source.close();
    console.log(JSON.stringify(got));
  }
});
source.onerror = (e) => console.error('eventsource error', e.message || e.type);
setTimeout(() => {
  console.error(`timed out with ${got.length}`);
  process.exit(2);
}, 60000).unref();
"""


class CurlAndNodeTests(SynchronousTestCase):
    def test_curl_and_node_read_every_fact_of_the_table(self):
        daemon = ReadApiDaemon(self).start()
        daemon.write(60)
        table = daemon.table()
        self.assertEqual(len(table), 60)
        facts_url = daemon.url()

        # curl: pages of 25 to the end, with their headers.
        got, pages, token = [], [], None
        while True:
            done = curl("-D", "-", "-H", f"Authorization: Bearer {READER_SECRET}",
                        with_query(facts_url, limit=25, **({"from": token} if token else {})))
            self.assertEqual(done.returncode, 0, done.stderr)
            head, _, body = done.stdout.replace("\r\n", "\n").partition("\n\n")
            headers = {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip()
                       for line in head.splitlines()[1:]}
            page = json.loads(body)
            self.assertEqual(head.splitlines()[0].split()[1], "200", done.stdout)
            self.assertEqual(page["stream"], "caches")
            pages.append((headers, page))
            if not page["facts"]:
                self.assertEqual(page["next"], token)  # nothing new: the same place
                break
            self.assertNotEqual(page["next"], token)
            self.assertEqual(page["next"], urllib.parse.quote(page["next"], safe="-_.~"),
                             "a token is URL-safe")
            got += page["facts"]
            token = page["next"]
        self.assertEqual(as_table(got), table)
        self.assertEqual({f["writer"] for f in got}, {"master"})
        # A full page below the persisted position never changes: cacheable
        # for good; the newest (here: the empty one at the end) is not.
        first = pages[0][0]
        self.assertIn("immutable", first["cache-control"], first)
        self.assertIn("public", first["cache-control"], first)
        self.assertTrue(first.get("etag"), first)
        last = pages[-1][0]
        self.assertNotIn("immutable", last.get("cache-control", ""), last)
        self.assertTrue({"no-store", "no-cache"} & set(
            v.strip() for v in last.get("cache-control", "").split(",")), last)

        # A long-poll at the end answers with the next fact...
        polled = {}

        def poll():
            polled["page"] = curl_json(with_query(facts_url, **{"from": token, "wait": 30}))

        poller = threading.Thread(target=poll)
        poller.start()
        daemon.write(1)
        poller.join(DEADLINE)
        self.assertEqual(as_table(polled["page"]["facts"]), daemon.table()[60:])
        token = polled["page"]["next"]
        # ... or empty, with the same token, at its deadline.
        empty = curl_json(with_query(facts_url, **{"from": token, "wait": 1}))
        self.assertEqual((empty["facts"], empty["next"]), ([], token))
        # from=now: the current position, nothing before it.
        now = curl_json(with_query(facts_url, **{"from": "now"}))
        self.assertEqual((now["facts"], now["next"]), ([], token))

        # Bad input: JSON 4xx naming the parameter.
        for query, code, parameter in (({"from": "not-a-token"}, 400, "from"),
                                       ({"limit": 0}, 400, "limit"),
                                       ({"limit": 1001}, 400, "limit"),
                                       ({"wait": 31}, 400, "wait")):
            status, _, body = get(with_query(facts_url, **query))
            self.assertEqual((status, json.loads(body)["parameter"]), (code, parameter),
                             (query, body))
        status, _, body = get(facts_url, secret=OTHER_SECRET)
        self.assertEqual(status, 403, body)
        self.assertIn("error", json.loads(body))
        # Which streams exist is no business of a reader scoped to others.
        self.assertEqual(get(daemon.url("nope"))[0], 403)
        self.assertEqual(get(daemon.url("nope"), secret=SECRET)[0], 404)
        self.assertEqual(get(facts_url, secret=None)[0], 401)

        # curl -N: the event stream from the beginning, then a live fact.
        events_url = daemon.url(kind="events")
        stream = StreamReader(events_url, f"Authorization: Bearer {READER_SECRET}")
        self.addCleanup(stream.stop)
        wait_for(lambda: len(stream.facts()) == 61, DEADLINE, "61 events")
        daemon.write(1)
        wait_for(lambda: len(stream.facts()) == 62, DEADLINE, "the live event")
        wait_for(lambda: {"comment": "ping"} in stream.events()[62:], DEADLINE,
                 "a heartbeat after the last event")
        events = stream.events()
        stream.stop()
        self.assertTrue(any("retry" in e for e in events), events[:3])
        facts = stream.facts()
        self.assertEqual(as_table(json.loads(e["data"]) for e in facts), daemon.table())
        self.assertEqual(len({e["id"] for e in facts}), 62, "one resume token per fact")
        self.assertEqual({e.get("event") for e in events} - {None}, {"fact"}, events[:3])
        # Resumed from the 40th event's id: the 41st on, nothing before.
        resumed = StreamReader(events_url, f"Authorization: Bearer {READER_SECRET}",
                               f"Last-Event-ID: {facts[39]['id']}")
        self.addCleanup(resumed.stop)
        wait_for(lambda: len(resumed.facts()) >= 22, DEADLINE, "22 resumed events")
        resumed.stop()
        self.assertEqual(as_table(json.loads(e["data"]) for e in resumed.facts()),
                         daemon.table()[40:])
        # The page API's token is the event stream's resume token too.
        self.assertEqual(
            as_table(curl_json(with_query(facts_url, **{"from": facts[39]["id"]}))["facts"]),
            daemon.table()[40:])

        # Node's own fetch, paging.
        done = node(NODE_PAGES, facts_url, READER_SECRET)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(as_table(json.loads(done.stdout)), daemon.table())

        # The npm eventsource client, its credential in the query string.
        done = node(NODE_EVENTSOURCE, events_url, READER_SECRET, "62", need=["eventsource"])
        self.assertEqual(done.returncode, 0, done.stderr)
        got = json.loads(done.stdout)
        self.assertEqual(as_table(e["fact"] for e in got), daemon.table())
        self.assertEqual([e["id"] for e in got], [e["id"] for e in facts])
        self.assertNotIn(READER_SECRET, daemon.log())
        self.assertIn("/_replicator/v1/streams/caches/events", daemon.log(),
                      "the access log is on")


class NginxCacheTests(SynchronousTestCase):
    def test_old_pages_come_from_the_cache_and_the_newest_never(self):
        daemon = ReadApiDaemon(self).start()
        nginx = NginxCache(daemon.port)
        self.addCleanup(nginx.stop)
        daemon.write(30)
        url = daemon.url(base=nginx.base)

        def requests_to_daemon() -> int:
            return daemon.log().count('"GET /_replicator/v1/streams/caches/facts"')

        first = get(with_query(url, limit=10))
        self.assertEqual(first[0], 200, first)
        self.assertEqual(first[1].get("x-cache-status"), "MISS", first[1])
        self.assertIn("immutable", first[1]["cache-control"])
        wait_for(lambda: requests_to_daemon() == 1, DEADLINE, "the daemon's access line")
        again = get(with_query(url, limit=10))
        self.assertEqual(again[1].get("x-cache-status"), "HIT", again[1])
        self.assertEqual(again[2], first[2])
        self.assertEqual(again[1]["etag"], first[1]["etag"])
        # The hit never reached the daemon: nginx logged no upstream for it.
        wait_for(lambda: len(nginx.access_lines()) == 2, DEADLINE, "nginx's access lines")
        self.assertEqual(nginx.access_lines()[1][2:4], ["HIT", "-"])
        self.assertEqual(requests_to_daemon(), 1)
        # Revalidation by the ETag, straight from the daemon: 304, no body.
        status, _, body = get(with_query(daemon.url(), limit=10),
                              headers={"If-None-Match": first[1]["etag"]})
        self.assertEqual((status, body), (304, b""))

        # The newest page, asked twice: the daemon answers both times, and
        # the second time with the fact written in between.
        token = json.loads(first[2])["next"]
        newest_url = with_query(url, **{"from": token})
        newest = get(newest_url)
        self.assertEqual(len(json.loads(newest[2])["facts"]), 20)
        self.assertNotEqual(newest[1].get("x-cache-status"), "HIT")
        daemon.write(1)
        newer = get(newest_url)
        self.assertNotEqual(newer[1].get("x-cache-status"), "HIT", newer[1])
        self.assertEqual(as_table(json.loads(newer[2])["facts"]), daemon.table()[10:])
        self.assertEqual(requests_to_daemon(), 4)
        # Another credential does not get the cached page.
        other = get(with_query(url, limit=10), secret=OTHER_SECRET)
        self.assertEqual(other[0], 403, other)


BROWSER_READER = r"""
(() => {
  window.got = []; window.opens = 0; window.errors = 0; window.recreated = 0;
  const url = '/_replicator/v1/streams/caches/events';
  const listen = (source) => {
    source.onopen = () => { window.opens += 1; };
    source.addEventListener('fact', (event) => {
      window.got.push([event.lastEventId, JSON.parse(event.data)]);
    });
    source.onerror = () => {
      window.errors += 1;
      // The browser reconnects by itself (with Last-Event-ID) unless the
      // answer was an HTTP error (e.g. a 503 while the daemon starts): then
      // the page goes on from the last id it has, and the test fails.
      if (source.readyState === EventSource.CLOSED) {
        window.recreated += 1;
        const last = window.got.length ? window.got[window.got.length - 1][0] : null;
        window.source = new EventSource(last ? `${url}?from=${encodeURIComponent(last)}` : url);
        listen(window.source);
      }
    };
  };
  window.source = new EventSource(url);
  listen(window.source);
  return true;
})()
"""


class BrowserEventSourceTests(SynchronousTestCase):
    def test_eventsource_survives_restart_and_network_cut(self):
        daemon = ReadApiDaemon(self).start()
        proxy = DroppableProxy(daemon.port)
        self.addCleanup(proxy.close)
        daemon.write(20)
        browser = Browser(self)
        origin = f"http://127.0.0.1:{proxy.port}"
        # EventSource cannot send headers: the credential is a cookie.
        browser.call("Network.enable", session=True)
        browser.call("Network.setCookie", session=True, name="replicator_reader",
                     value=READER_SECRET, url=origin, httpOnly=True)
        browser.open(origin + "/health")
        browser.wait("document.readyState === 'complete'", DEADLINE, "the page loaded")
        browser.evaluate(BROWSER_READER)

        def received(n: int, what: str) -> None:
            browser.wait(f"window.got.length >= {n}", DEADLINE, what)

        received(20, "the first 20 facts (catch-up)")
        daemon.write(10)
        received(30, "10 live facts")

        # The daemon is killed and started again on the same port and database.
        daemon.kill()
        daemon.start()
        daemon.write(10)
        received(40, "10 facts after the restart")

        # The network is cut; facts are written meanwhile; it comes back.
        proxy.drop()
        daemon.write(10)
        proxy.restore()
        received(50, "10 facts written while cut")
        daemon.write(5)
        received(55, "5 live facts after the cut")

        got = browser.evaluate("window.got")
        stats = browser.evaluate("[window.opens, window.errors, window.recreated]")
        table = daemon.table()
        self.assertEqual(len(table), 55)
        self.assertEqual(as_table(fact for _, fact in got), table, stats)
        self.assertEqual(len({token for token, _ in got}), 55, "one resume token per fact")
        # Three connections (start, after the restart, after the cut), each
        # resumed by the browser itself: never an HTTP error that closes it.
        self.assertGreaterEqual(stats[0], 3, f"opens, errors, recreated: {stats}")
        self.assertEqual(stats[2], 0, f"opens, errors, recreated: {stats}")
        self.assertGreaterEqual(proxy.connections, 3)
        self.assertNotIn(READER_SECRET, daemon.log())
