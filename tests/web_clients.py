"""Real HTTP clients and middleboxes of the read API, for integration tests.

* :class:`NginxCache`: Debian's nginx on a free loopback port, with the
  shipped ``contrib/nginx/replicator.conf`` (the one the docs show) in
  front of a daemon's HTTP listener: ``proxy_cache`` for pages, event
  streams unbuffered, and an answer an ``EventSource`` retries while the
  daemon is down.  Every answer carries ``X-Cache-Status`` (nginx's
  ``$upstream_cache_status``: ``MISS``, ``HIT``, ``BYPASS``..., empty when
  the cache was not consulted) and nginx's access log has one line per
  request with that status, the upstream's address and status (``-`` when
  nginx answered from its cache) and the request's ``Last-Event-ID``.
  The cache key includes the ``Authorization`` header: nginx does not check
  credentials on a hit, so entries are kept per credential (see the
  README's section on caching proxies).
* :func:`node`: runs a script with the machine's ``node`` (its own
  ``fetch``) and the npm packages ``make node-deps`` installed in
  ``.node/node_modules`` (``eventsource``).
* :class:`DroppableProxy`: a loopback TCP proxy (the chaos suite's) on a
  thread of its own, whose link can be dropped (connections reset, the
  port refusing) and restored on the same port: a network cut that a
  browser sees.
* :class:`BadGateway`: a proxy's ``502`` on the port of a daemon that is
  down.

A missing binary or package skips locally and fails with ``CI=true``.
"""

import asyncio
import http.server
import os
import shutil
import signal
import subprocess
import tempfile
import threading

from tests.chaos.proxy import Proxy
from tests.servers import free_port, unavailable, wait_for_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE_MODULES = os.path.join(ROOT, ".node", "node_modules")

#: The nginx config the docs show (docs/read-api.md includes it verbatim).
NGINX_SHIPPED = os.path.join(ROOT, "contrib", "nginx", "replicator.conf")

#: What a test changes in it: ``(text, replacement)``, each text found once.
NGINX_SUBSTITUTIONS = (
    ("server 127.0.0.1:9093;", "server 127.0.0.1:{upstream};"),
    ("listen 80;", "listen 127.0.0.1:{port};"),
    ("/var/cache/nginx/replicator", "{tmp}/cache"),
)

#: The rest of nginx's config around the shipped file, from a temp dir:
#: the access log has one line per request, ``$request_uri $status
#: $upstream_cache_status $upstream_addr $upstream_status
#: $http_last_event_id`` (``-`` for an empty one).
NGINX_CONF = """\
worker_processes 1;
daemon off;
master_process on;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    log_format cache '$request_uri $status $upstream_cache_status $upstream_addr '
                     '$upstream_status $http_last_event_id';
    access_log {tmp}/access.log cache;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    include {tmp}/replicator.conf;
}}
"""


def shipped_nginx_conf(path: str = NGINX_SHIPPED, **values) -> str:
    """The shipped config with the test's ports and directory (``upstream``,
    ``port``, ``tmp``); a substitution that finds nothing, or more than one
    place, is an error (the file changed under the test)."""
    with open(path) as f:
        text = f.read()
    for old, new in NGINX_SUBSTITUTIONS:
        count = text.count(old)
        if count != 1:
            raise AssertionError(f"{path}: {old!r} found {count} times, not once")
        text = text.replace(old, new.format(**values))
    return text


def nginx_binary() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK)
                                     else None)
    if path is None:
        unavailable("nginx not found (Debian package nginx; scripts/ensure-system-deps.sh "
                    "installs it)")
    return path


class NginxCache:
    """nginx with ``config`` (the shipped file) in front of
    ``127.0.0.1:upstream_port``, from a temp dir, on a free loopback port;
    :meth:`stop` ends it (by PID) and deletes its files."""

    def __init__(self, upstream_port: int, config: str = NGINX_SHIPPED):
        binary = nginx_binary()
        self.tmp = tempfile.mkdtemp(prefix="replicator-nginx-")
        # As root, nginx's workers run as nobody: they must reach their dirs.
        os.chmod(self.tmp, 0o755)
        self.port = free_port()
        self.conf = os.path.join(self.tmp, "nginx.conf")
        with open(os.path.join(self.tmp, "replicator.conf"), "w") as f:
            f.write(shipped_nginx_conf(config, upstream=upstream_port, port=self.port,
                                       tmp=self.tmp))
        with open(self.conf, "w") as f:
            f.write(NGINX_CONF.format(tmp=self.tmp))
        self._log = open(os.path.join(self.tmp, "stderr.log"), "wb")
        # -e: the error log before the config is read (else the packaged
        # /var/log/nginx/error.log, which needs root).
        self.proc = subprocess.Popen(
            [binary, "-p", self.tmp, "-c", self.conf, "-e", os.path.join(self.tmp, "error.log")],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_port(self.port)
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"nginx did not start: {self.errors()}") from None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def access_lines(self) -> list[list[str]]:
        """nginx's access log: ``[request_uri, status, cache status, upstream
        address, upstream status, Last-Event-ID]`` per request (nginx writes
        the line when the request ends)."""
        try:
            with open(os.path.join(self.tmp, "access.log")) as f:
                return [line.split() for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def errors(self) -> str:
        text = ""
        for name in ("stderr.log", "error.log"):
            try:
                with open(os.path.join(self.tmp, name), errors="replace") as f:
                    text += f.read()
            except FileNotFoundError:
                pass
        return text[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: workers too
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def node_binary() -> str:
    path = shutil.which("node")
    if path is None:
        unavailable("node not found (Debian package nodejs; scripts/ensure-system-deps.sh "
                    "installs it)")
    return path


def node(script: str, *args: str, timeout: float = 120.0,
         need: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` (JavaScript source, CommonJS) with ``node``, ``args``
    after it in ``process.argv``; ``need``: npm packages it requires, from
    ``.node/node_modules`` (``make node-deps``)."""
    binary = node_binary()
    for package in need or ():
        if not os.path.isdir(os.path.join(NODE_MODULES, package)):
            unavailable(f"npm package {package} not in .node/node_modules (make node-deps)")
    env = dict(os.environ, NODE_PATH=NODE_MODULES)
    return subprocess.run([binary, "-e", script, "--", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


class DroppableProxy:
    """The chaos suite's loopback proxy to ``target_port``, on an asyncio
    loop of its own thread (the tests block meanwhile)."""

    def __init__(self, target_port: int):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = Proxy("reader", target_port)
        self._call(self.proxy.start())
        self.port = self.proxy.port
        self.drops = 0

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def drop(self) -> None:
        """Reset every connection and stop listening: the network is cut."""
        self.drops += 1
        self._call(self.proxy.close())

    def restore(self) -> None:
        """Listen again on the same port."""
        self._call(self.proxy.start(self.port))

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        return self.proxy.connections

    def close(self) -> None:
        try:
            self._call(self.proxy.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


class BadGateway:
    """What a proxy in front answers while the daemon behind it is down:
    ``502`` (``text/html``, as nginx's) to every request, on
    ``127.0.0.1:port`` (the daemon's, once it is gone), on a thread of its
    own.  :attr:`requests` holds ``(path with query, User-Agent,
    Last-Event-ID)`` of each request; :meth:`close` frees the port."""

    def __init__(self, port: int):
        self.requests: list[tuple] = []
        seen = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append((self.path, self.headers.get("User-Agent", ""),
                             self.headers.get("Last-Event-ID")))
                body = b"<html><body><h1>502 Bad Gateway</h1></body></html>\n"
                self.send_response(502)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
