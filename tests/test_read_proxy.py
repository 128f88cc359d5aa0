"""The shipped nginx config (``contrib/nginx/replicator.conf``) in front of a
real ``replicator run`` on PostgreSQL, with a real headless Chromium:

* docs/read-api.md shows that file verbatim, so what the docs say to run
  is what is tested here;
* a page's plain ``EventSource`` (the browser's own reconnects, nothing of
  the page's) reads the stream through nginx while facts are written, the
  daemon is killed (SIGKILL) and started again: while it is down nginx
  answers ``200`` ``text/event-stream`` ``retry: 1000`` and nothing else,
  the browser comes back with the last event's id in ``Last-Event-ID``
  (nginx's access log shows it) instead of closing the stream for good (as
  it does on nginx's own ``502``), and it ends with every fact of the table
  once, in order;
* the fallback is for event streams only and never cached: a page asked
  while the daemon is down is a ``502`` and, once it is back, the daemon's
  page; a refusal of the daemon (``400``) passes through as it is.

With CI=true a missing nginx or chromium is a failure, never a skip.
"""

import json
import os
import re

from twisted.trial.unittest import SynchronousTestCase

from tests.cdp import Browser
from tests.read_api import READER_SECRET, ReadApiDaemon, as_table, get
from tests.servers import wait_for
from tests.web_clients import NGINX_SHIPPED, ROOT, NginxCache

DEADLINE = 90.0

#: A page's EventSource as a browser has it, with what happened to it.
PLAIN_EVENTSOURCE = r"""
(() => {
  window.got = []; window.opens = 0; window.errors = [];
  const source = new EventSource('/_replicator/v1/streams/caches/events');
  source.onopen = () => { window.opens += 1; };
  source.addEventListener('fact', (event) => {
    window.got.push([event.lastEventId, JSON.parse(event.data)]);
  });
  source.onerror = () => { window.errors.push(source.readyState); };
  window.source = source;
  return true;
})()
"""


class ShippedConfigDocTests(SynchronousTestCase):
    def test_the_docs_show_the_shipped_file_verbatim(self):
        with open(NGINX_SHIPPED) as f:
            shipped = f.read()
        with open(os.path.join(ROOT, "docs", "read-api.md")) as f:
            blocks = re.findall(r"^```nginx\n(.*?)^```$", f.read(), flags=re.S | re.M)
        self.assertEqual(blocks, [shipped])


class BrowserThroughNginxTests(SynchronousTestCase):
    def test_eventsource_through_nginx_survives_a_killed_daemon(self):
        daemon = ReadApiDaemon(self).start()
        nginx = NginxCache(daemon.port)
        self.addCleanup(nginx.stop)
        events_url = daemon.url(kind="events", base=nginx.base)
        facts_url = daemon.url(base=nginx.base)
        daemon.write(20)
        browser = Browser(self)
        browser.call("Network.enable", session=True)
        browser.call("Network.setCookie", session=True, name="replicator_reader",
                     value=READER_SECRET, url=nginx.base, httpOnly=True)
        browser.open(nginx.base + "/health")
        browser.wait("document.readyState === 'complete'", DEADLINE, "the page loaded")
        browser.evaluate(PLAIN_EVENTSOURCE)

        def received(n: int, what: str) -> None:
            browser.wait(f"window.got.length >= {n}", DEADLINE, what)

        received(20, "the first 20 facts (catch-up)")
        daemon.write(10)
        received(30, "10 live facts")
        last = browser.evaluate("window.got[window.got.length - 1][0]")

        def fallbacks():
            """nginx's answers for the daemon: an event stream while it was
            down (or refused for a moment) came from the named location."""
            return [line for line in nginx.access_lines()
                    if line[0].endswith("/events") and line[1] == "200"
                    and line[4].rstrip(",") in ("502", "503", "504")]

        def closed() -> bool:
            return browser.evaluate("window.source.readyState") == 2

        daemon.kill()
        # The browser comes back (after the fallback's retry: 1000) for as
        # long as the daemon is away; on nginx's own 502 it closes for good.
        wait_for(lambda: len(fallbacks()) >= 2 or closed(), DEADLINE,
                 "two fallback answers, or a closed EventSource")
        self.assertFalse(
            closed(), "the browser closed its EventSource for good (readyState 2); "
            f"its errors' readyStates: {browser.evaluate('window.errors')}; "
            f"nginx: {nginx.access_lines()}")
        # Every try carried the last event's id: nginx passes it on.
        self.assertEqual({line[5] for line in fallbacks()}, {last}, nginx.access_lines())

        # Asked directly while the daemon is down: the fallback, whole.
        status, headers, body = get(events_url)
        self.assertEqual((status, headers["content-type"], body),
                         (200, "text/event-stream", b"retry: 1000\n\n"))
        self.assertEqual(headers.get("cache-control"), "no-store")
        # Pages are not event streams: nginx's 502, for programs to retry.
        self.assertEqual(get(facts_url)[0], 502)

        daemon.start()
        daemon.write(10)
        received(40, "10 facts after the restart")
        table = daemon.table()
        self.assertEqual(len(table), 40)
        got = browser.evaluate("window.got")
        stats = browser.evaluate("[window.opens, window.errors, window.source.readyState]")
        # The try that reached the daemon again asked no `from`: only the
        # Last-Event-ID that nginx passed on resumes it with nothing twice.
        self.assertEqual(as_table(fact for _, fact in got), table, stats)
        self.assertEqual(len({token for token, _ in got}), 40, "one resume token per fact")
        self.assertNotIn(2, stats[1], f"opens, errors' readyStates, readyState: {stats}")
        self.assertEqual(stats[2], 1, stats)

        # Nothing of the outage was cached: the daemon's pages again, and
        # its refusals as they are.
        status, _, body = get(facts_url + "?limit=10")
        self.assertEqual(status, 200, body)
        self.assertEqual(as_table(json.loads(body)["facts"]), table[:10])
        status, _, body = get(events_url + "?from=not-a-token")
        self.assertEqual((status, json.loads(body)["parameter"]), (400, "from"), body)
