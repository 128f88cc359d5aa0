"""The README's "Read from any language" examples, run as they are printed
against a real ``replicator run`` (its address and a reader's secret
substituted): every ``sh``, ``js`` and ``python`` block of that section.

* ``sh``: bash, with ``READER_SECRET`` in the environment (curl);
* ``js`` that reads ``process.env``: Node, as an ES module in ``.node/``
  (where ``make node-deps`` put the npm packages);
* other ``js``: headless Chromium, on a page of the daemon's origin with
  the ``replicator_reader`` cookie, ``console.log`` collected;
* ``python``: this interpreter.

A block prints a page (JSON), events, or ``stream_id rows-as-JSON`` lines;
the facts it printed must be the table's, in order.  Blocks that never end
(long-polls, event streams) are stopped once they printed every fact.

The ``js`` and ``python`` examples also run all at once while the daemon
goes away: killed (their connections cut, then refused), then a ``502`` on
its port (what a proxy in front answers meanwhile: an ``EventSource``
closes for good on it), then the daemon again; each must go on by itself
and print every fact of the table once, in order.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

from twisted.trial.unittest import SynchronousTestCase

from tests.cdp import Browser
from tests.read_api import READER_SECRET, ReadApiDaemon, as_table, parse_events
from tests.servers import unavailable, wait_for
from tests.web_clients import NODE_MODULES, BadGateway, node_binary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
SECTION = "## Read from any language"
#: The address the examples use (the one ``make run`` listens on).
EXAMPLE_BASE = "http://127.0.0.1:9093"
FACTS = 6
#: ``EventSource.CLOSED``: its ``readyState`` once it gave up.
EVENTSOURCE_CLOSED = 2
DEADLINE = 90.0


def examples() -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block of the section."""
    with open(README) as f:
        text = f.read()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else len(text)]
    return re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.S | re.M)


class Running:
    """A process whose output is collected on a thread until :meth:`stop`."""

    def __init__(self, args, env=None, cwd=None):
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True, env=env, cwd=cwd)
        self.out = ""
        self.err = ""
        self._threads = [threading.Thread(target=self._pump, args=(name,), daemon=True)
                         for name in ("stdout", "stderr")]
        for t in self._threads:
            t.start()

    def _pump(self, name):
        stream = getattr(self.proc, name)
        for chunk in iter(lambda: stream.read(1), ""):
            if name == "stdout":
                self.out += chunk
            else:
                self.err += chunk

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for t in self._threads:
            t.join(10)


def node_module(test, code: str) -> str:
    """``code`` saved as an ES module next to ``.node/node_modules`` (where
    its ``import`` finds the npm packages): its path."""
    if not os.path.isdir(os.path.join(NODE_MODULES, "eventsource")):
        unavailable("npm package eventsource not in .node/ (make node-deps)")
    here = tempfile.mkdtemp(prefix="example-", dir=os.path.dirname(NODE_MODULES))
    test.addCleanup(shutil.rmtree, here, True)
    path = os.path.join(here, "example.mjs")
    with open(path, "w") as f:
        f.write(code)
    return path


def same_origin_browser(test, daemon) -> Browser:
    """Chromium on a page of the daemon's origin, with the reader's cookie."""
    browser = Browser(test)
    browser.call("Network.enable", session=True)
    browser.call("Network.setCookie", session=True, name="replicator_reader",
                 value=READER_SECRET, url=daemon.base, httpOnly=True)
    browser.open(daemon.base + "/health")
    browser.wait("document.readyState === 'complete'", DEADLINE, "the page loaded")
    return browser


def run_in_browser(browser: Browser, code: str) -> None:
    """Run ``code`` on the page, ``console.log``'s arguments collected in
    ``window.lines`` and the ``readyState`` at every ``error`` event of
    every ``EventSource`` it makes in ``window.errors``."""
    browser.evaluate(
        "window.lines = []; console.log = (...args) => window.lines.push(args);"
        "window.errors = [];"
        "window.EventSource = class extends EventSource { constructor(...args) {"
        " super(...args);"
        " this.addEventListener('error', () => window.errors.push(this.readyState)); } };"
        "true")
    browser.evaluate(f"(() => {{ {code} }})(); true")


def printed_facts(text: str) -> list[tuple[int, list]]:
    """``stream_id rows-as-JSON`` lines, as :func:`as_table` shapes them."""
    facts = []
    for line in text.splitlines():
        token, _, rows = line.partition(" ")
        facts.append({"stream_id": int(token), "rows": json.loads(rows)})
    return as_table(facts)


def need_python_client(code: str) -> None:
    """Skip (fail with ``CI=true``) an example of the Durable Streams
    Python client without it (pyproject.toml, the test extra)."""
    if "durable_streams" in code:
        try:
            import durable_streams  # noqa: F401
        except ImportError:
            unavailable("the Python package durable-streams is not installed "
                        "(pyproject.toml, the test extra)")


class ReadmeExampleTests(SynchronousTestCase):
    def test_every_example_prints_the_tables_facts(self):
        blocks = [(lang, code) for lang, code in examples() if lang in ("sh", "js", "python")]
        self.assertEqual([lang for lang, _ in blocks],
                         ["js", "python", "sh", "sh", "js", "js", "js", "python"],
                         "the section's examples")
        daemon = ReadApiDaemon(self).start()
        daemon.write(FACTS)
        table = daemon.table()
        env = dict(os.environ, READER_SECRET=READER_SECRET)
        browser = None
        for lang, code in blocks:
            code = code.replace(EXAMPLE_BASE, daemon.base)
            try:
                browser = self._example(lang, code, env, table, daemon, browser)
            except AssertionError as e:
                raise AssertionError(f"README example {code[:70]!r}...: {e}") from None

    def _example(self, lang, code, env, table, daemon, browser):
        """Run one example; the browser, once one was needed."""
        if lang == "sh":
            if shutil.which("curl") is None:
                unavailable("curl not found")
            if "/events" in code:
                run = Running(["bash", "-c", code], env=env)
                self.addCleanup(run.stop)
                wait_for(lambda: sum(e.get("event") == "fact"
                                     for e in parse_events(run.out)) >= FACTS,
                         DEADLINE, "curl's events")
                run.stop()
                got = as_table(json.loads(e["data"]) for e in parse_events(run.out)
                               if e.get("event") == "fact")
                self.assertEqual(got, table)
            else:
                done = subprocess.run(["bash", "-c", code], env=env, text=True,
                                      capture_output=True, timeout=60)
                self.assertEqual(done.returncode, 0, done.stderr)
                page = json.loads(done.stdout)
                self.assertEqual(as_table(page["facts"]), table[:2])
        elif lang == "python":
            need_python_client(code)
            self._lines([sys.executable, "-c", code], env, table)
        elif "process.env" in code:
            self._lines([node_binary(), node_module(self, code)], env, table)
        else:
            if browser is None:
                browser = same_origin_browser(self, daemon)
            run_in_browser(browser, code)
            browser.wait(f"window.lines.length >= {FACTS}", DEADLINE,
                         "the browser's facts")
            lines = browser.evaluate("window.lines")
            got = as_table({"stream_id": token, "rows": rows} for token, rows in lines)
            self.assertEqual(got[:FACTS], table)
        return browser

    def _lines(self, args, env, table):
        """Run an example that prints ``stream_id rows`` lines until it
        printed every fact of ``table``."""
        run = Running(args, env=env)
        self.addCleanup(run.stop)
        try:
            wait_for(lambda: run.out.count("\n") >= len(table) or run.proc.poll() is not None,
                     DEADLINE, f"{args[0]}'s facts")
        finally:
            run.stop()
        lines = "\n".join(run.out.splitlines()[:len(table)])
        self.assertEqual(printed_facts(lines), table, run.err[-2000:])


    def test_examples_go_on_after_the_daemon_was_away(self):
        blocks = [(lang, code) for lang, code in examples() if lang in ("js", "python")]
        daemon = ReadApiDaemon(self).start()
        daemon.write(FACTS)
        env = dict(os.environ, READER_SECRET=READER_SECRET)
        clients = {}
        for lang, code in blocks:
            code = code.replace(EXAMPLE_BASE, daemon.base)
            if lang == "js" and "process.env" not in code:
                browser = same_origin_browser(self, daemon)
                run_in_browser(browser, code)
                clients["browser"] = InBrowser(browser)
                continue
            if lang == "python":
                need_python_client(code)
                name = "python ds" if "/ds/" in code else "python"
                args = [sys.executable, "-c", code]
            else:
                name = "node " + ("eventsource" if "/events" in code else
                                  "ds" if "/ds/" in code else "fetch")
                args = [node_binary(), node_module(self, code)]
            run = Running(args, env=env)
            self.addCleanup(run.stop)
            clients[name] = InProcess(run)
        self.assertEqual(sorted(clients),
                         ["browser", "node ds", "node eventsource", "node fetch", "python",
                          "python ds"])

        def each(predicate, what):
            def check():
                for name, client in clients.items():
                    client.check(name)
                return all(predicate(name) for name in clients)

            wait_for(check, DEADLINE, what)

        each(lambda name: len(clients[name].facts()) >= FACTS, "every example's facts")
        errors = {name: len(clients[name].errors()) for name in clients}
        daemon.kill()
        # Each saw its connection go and the next one refused.
        each(lambda name: len(clients[name].errors()) >= errors[name] + 2,
             "two errors in every example (cut, refused)")

        gateway = BadGateway(daemon.port)
        try:
            def asked(name):
                """How often ``name`` asked the proxy."""
                return sum(name == ("browser" if "Chrome" in agent else
                                    "python ds" if "python-httpx" in agent else
                                    "node ds" if "/ds/" in path else
                                    "python" if "Python" in agent else
                                    "node eventsource" if "/events" in path else
                                    "node fetch")
                           for path, agent, _ in gateway.requests)

            # An EventSource is closed for good by the first 502: the
            # example's own second try shows it opened another.
            each(lambda name: asked(name) >= (2 if name == "browser" else 1),
                 "every example asked the proxy's 502 (the browser twice)")
        finally:
            gateway.close()
        daemon.start()
        daemon.write(FACTS)
        table = daemon.table()
        self.assertEqual(len(table), 2 * FACTS)
        each(lambda name: len(clients[name].facts()) >= len(table),
             "every example's facts again")
        for name, client in clients.items():
            self.assertEqual(client.facts(), table, f"{name}: {client.errors()[-10:]}")
            # Each was told 502 (an EventSource closed on it), and went on.
            told = [e for e in client.errors() if e == EVENTSOURCE_CLOSED or "502" in str(e)]
            self.assertTrue(told, f"{name}: {client.errors()}")


class InProcess:
    """An example run as a process: the facts it printed on stdout, its
    stderr's lines (one per failure it went on after)."""

    def __init__(self, run: Running):
        self.run = run

    def facts(self):
        return printed_facts(self.run.out.rpartition("\n")[0])

    def errors(self) -> list[str]:
        return self.run.err.splitlines()

    def check(self, name: str) -> None:
        """An example that ended gave up: the test fails at once."""
        if self.run.proc.poll() is not None:
            raise AssertionError(f"{name} exited with {self.run.proc.returncode}: "
                                 f"{self.run.err[-2000:]}")


class InBrowser:
    """The browser's example (:func:`run_in_browser`): the facts it logged,
    the ``readyState`` at each ``error`` of its ``EventSource``\ s."""

    def __init__(self, browser: Browser):
        self.browser = browser

    def facts(self):
        return as_table({"stream_id": token, "rows": rows}
                        for token, rows in self.browser.evaluate("window.lines"))

    def errors(self) -> list:
        return self.browser.evaluate("window.errors")

    def check(self, name: str) -> None:
        pass
