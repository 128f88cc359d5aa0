"""``replicator run | check | migrate | reopen | tail | write | positions | rewind | verify``.

``run`` stops cleanly on SIGTERM/SIGINT, re-reads its config on SIGHUP
(:mod:`replicator.daemon.reload`: what applies live, what needs a restart)
and reopens its output files on SIGUSR1 (after a rotation: nothing else
changes); ``reopen`` sends that SIGUSR1 to the daemon its ``pid_file`` names.

Exit codes: 0 fine, 1 a runtime failure (database unreachable, port in use,
HTTP error), 2 a usage or configuration mistake (one line naming the key).
"""

import argparse
import json
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request
import uuid
from typing import NoReturn

from twisted.internet import defer, task
from twisted.logger import Logger

from . import __version__, files
from .config import ConfigError, load_config, validate
from .logs.output import start_logging
from .logs.printable import printable
from .net.endpoint_strings import http_url

log = Logger()


def _fail(message: str, code: int) -> NoReturn:
    print(f"replicator: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _out(text: str) -> None:
    """One line to standard output, flushed; a reader that went away
    (``| head``) ends the command quietly with exit 0."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _reader_gone()
        sys.exit(0)


def _reader_gone() -> None:
    """Standard output's reader closed the pipe: whatever is still
    buffered, and every later write, goes to /dev/null, so that neither
    the next line nor Python's flush at exit raises again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _load(path: str):
    """The config at ``path``, parsed and validated (its files read) with
    the process's reactor; a mistake is one line and exit 2."""
    from twisted.internet import reactor

    try:
        return validate(load_config(path), reactor)
    except ConfigError as e:
        _fail(str(e), 2)


# ------------------------------------------------------------------ run
def cmd_run(args) -> None:
    # Whatever the daemon creates (database, output, directories) is
    # private to its user and group: data 0640, directories 0750.
    files.restrict_umask()
    config = _load(args.config)
    start_logging(config.log_level, config.log_format)
    from twisted.internet import reactor

    from .daemon.service import Instance
    from .daemon.startup import StartupError

    try:
        instance = Instance(config, reactor)
    except ConfigError as e:
        _fail(str(e), 2)
    except StartupError as e:
        _fail(str(e), e.code)

    config_path = os.path.abspath(args.config)
    instance.handler.gaps.config_path = config_path  # (named in a gap's command)
    held = None
    if config.pid_file is not None:
        from .daemon.pidfile import PidFileError, hold

        try:
            held = hold(config.pid_file)
        except PidFileError as e:
            _fail(str(e), 1)

    async def main(reactor):
        reload_on_hup(reactor, instance, config_path)
        reopen_on_usr1(reactor, instance)
        try:
            await instance.start()
        except (ConfigError, StartupError) as e:
            # An expected failure: one line on stderr (which is the log's
            # destination too, under systemd), no traceback.
            code = 2 if isinstance(e, ConfigError) else e.code
            print(f"replicator: {e}", file=sys.stderr, flush=True)
            await instance.stop()
            raise SystemExit(code) from None
        except Exception as e:
            log.failure("startup failed")
            text = " ".join(str(e).split())[:500] or type(e).__name__
            print(f"replicator: startup failed: {text}", file=sys.stderr, flush=True)
            await instance.stop()
            raise SystemExit(1) from None
        # SIGTERM/SIGINT stop the reactor once; the orderly stop runs first.
        reactor.addSystemEventTrigger(
            "before", "shutdown", lambda: defer.ensureDeferred(instance.stop()))
        stop_once(reactor)
        await defer.Deferred()  # until the reactor stops

    try:
        task.react(lambda reactor: defer.ensureDeferred(main(reactor)), [])
    finally:
        if held is not None:
            held.release()


def stop_once(reactor) -> None:
    """Make SIGTERM and SIGINT stop the reactor once; repeats are logged."""
    state = {"stopping": False}

    def stop():
        if state["stopping"]:
            log.info("already shutting down")
            return
        state["stopping"] = True
        reactor.stop()

    def on_signal(signum, frame):
        log.info("received {sig}; shutting down", sig=signal.Signals(signum).name)
        reactor.callFromThread(stop)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def reload_on_hup(reactor, instance, path: str) -> None:
    """Make SIGHUP re-read ``path`` and apply it (:meth:`.Instance.reload`)
    instead of ending the process."""
    def reload():
        d = defer.ensureDeferred(instance.reload(path))
        d.addErrback(lambda f: log.failure("reload failed", f))

    def on_signal(signum, frame):
        log.info("received SIGHUP; reloading {path}", path=path)
        reactor.callFromThread(reload)

    signal.signal(signal.SIGHUP, on_signal)


def reopen_on_usr1(reactor, instance) -> None:
    """Make SIGUSR1 reopen the output files (:meth:`.Instance.reopen`), the
    config file left unread, instead of ending the process."""
    def reopen():
        d = defer.ensureDeferred(instance.reopen())
        d.addErrback(lambda f: log.failure("reopen failed", f))

    def on_signal(signum, frame):
        log.info("received SIGUSR1; reopening the output files")
        reactor.callFromThread(reopen)

    signal.signal(signal.SIGUSR1, on_signal)


# --------------------------------------------------------------- reopen
def cmd_reopen(args) -> None:
    """SIGUSR1 to the daemon of ``-c FILE`` (found by its ``pid_file``):
    it reopens its output files, as after a rotation, and reads no config.
    Exit 0 once sent, 1 if no daemon holds the PID file, 2 if the config
    does not parse or names no ``pid_file``."""
    from .daemon.pidfile import PidFileError, running

    try:
        config = load_config(args.config)
    except ConfigError as e:
        _fail(str(e), 2)
    if config.pid_file is None:
        _fail("config: pid_file: not set (reopen finds the daemon by it; under systemd "
              "`systemctl kill -s USR1 --kill-whom=main UNIT` does the same)", 2)
    try:
        pid = running(config.pid_file)
        os.kill(pid, signal.SIGUSR1)
    except PidFileError as e:
        _fail(str(e), 1)
    except OSError as e:
        _fail(f"pid_file: cannot signal PID {pid} ({config.pid_file}): {e.strerror}", 1)
    _out(f"replicator: sent SIGUSR1 to PID {pid} ({config.instance_name}): it reopens its "
         f"output files")


# ----------------------------------------------------------------- tail
def cmd_tail(args) -> None:
    from twisted.internet import endpoints

    from .replication.transport.base_handler import BaseHandler
    from .replication.transport.tcp import upstream_service

    #: Fires when standard output's reader goes: tail then ends, exit 0.
    reader_gone: defer.Deferred[None] = defer.Deferred()

    class Printer(BaseHandler):
        """Prints what the server sends, one command per line."""

        def _print(self, cmd) -> None:
            stream = getattr(cmd, "stream_name", None)
            if reader_gone.called or (args.stream and stream is not None
                                      and stream != args.stream):
                return
            if args.json:
                text = json.dumps({"command": cmd.NAME, **cmd.fields()})
            else:
                # Peer text to a terminal: control characters escaped.
                text = printable(cmd.to_line().rstrip(" "), limit=None)
            try:
                print(text, flush=True)
            except BrokenPipeError:
                _reader_gone()
                reader_gone.callback(None)

        def __getattr__(self, name):
            if name.startswith("on_"):
                return lambda conn, cmd: self._print(cmd)
            raise AttributeError(name)

        def lost_connection(self, conn, reason):
            say(f"# connection closed ({reason})")

    printer = Printer(args.name)

    async def main(reactor):
        try:
            endpoints.clientFromString(reactor, args.endpoint)
        except Exception as e:
            plain = _host_port(args.endpoint)
            if plain is None:
                _fail(f"tail: cannot parse endpoint {args.endpoint!r}: {e} (write HOST:PORT, "
                      "e.g. 127.0.0.1:9092, or an endpoint string, e.g. "
                      "tcp:host=127.0.0.1:port=9092)", 2)  # react exits with 2
            args.endpoint = plain
        talking = []

        def wrap(endpoint):
            talking.append(_TalkingEndpoint(endpoint, args.endpoint, say))
            return talking[0]

        service = upstream_service(reactor, args.endpoint, printer, args.name,
                                   args.server_name, max_delay=10.0, wrap_endpoint=wrap,
                                   on_retry=lambda attempt, delay: talking[0].retry_in(
                                       attempt, delay))
        service.startService()
        reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
        stop_once(reactor)
        await reader_gone  # or until interrupted

    task.react(lambda reactor: defer.ensureDeferred(main(reactor)), [])


def _host_port(text: str) -> str | None:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as a ``tcp:`` client endpoint
    string, or None if ``text`` is not of that form."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([A-Za-z0-9.-]+):(\d{1,5})", text)
    if m is None:
        return None
    host = m.group(1) or m.group(3)
    port = m.group(2) or m.group(4)
    if host in ("tcp", "tcp6", "tls", "ssl", "unix") or not 0 < int(port) < 65536:
        return None
    return "tcp:host={}:port={}".format(host.replace(":", "\\:"), port)


def say(text: str) -> None:
    """One progress line (``tail``, ``write``'s retries) on stderr (stdout
    carries commands and IDs)."""
    print(text, file=sys.stderr, flush=True)


class _TalkingEndpoint:
    """A client endpoint that says on stderr when it connects and why a
    connection attempt failed, and which retry is next."""

    def __init__(self, endpoint, description: str, out):
        self._endpoint = endpoint
        self._description = description
        self._out = out
        self._attempts = 0
        self._failure = None

    def connect(self, factory):
        suffix = f" (retry {self._attempts})" if self._attempts else ""
        self._out(f"# connecting to {self._description}{suffix}")
        self._attempts += 1
        d = self._endpoint.connect(factory)

        def failed(f):
            self._failure = f.getErrorMessage().strip().splitlines()[0] if \
                f.getErrorMessage().strip() else f.type.__name__
            return f

        def connected(protocol):
            self._attempts = 0
            self._failure = None
            return protocol

        d.addCallbacks(connected, failed)
        return d

    def retry_in(self, attempt: int, delay: float) -> None:
        what = f"cannot connect to {self._description}: {self._failure}" if self._failure \
            else f"connection to {self._description} lost"
        self._attempts = attempt
        self._out(f"# {what}; retry {attempt} in {delay:.1f}s")


# ------------------------------------------------------- HTTP commands
def _http_base(config) -> str:
    endpoint = config.http.listen
    if not endpoint:
        _fail("config: http.listen: missing (this command talks to the daemon's HTTP API)", 2)
    try:
        return http_url(endpoint)
    except ValueError as e:
        _fail(f"config: http.listen: {e}", 2)



def _error_of(e: "urllib.error.HTTPError") -> str:
    """The ``error`` of a JSON error answer, else its reason phrase."""
    try:
        return str(json.loads(e.read()).get("error", e.reason))
    except ValueError:
        return str(e.reason)

def _request(url: str, method: str = "GET", body: bytes | None = None,
             secret: str | None = None) -> dict:
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Content-Type", "application/json")
    if secret:
        request.add_header("Authorization", f"Bearer {secret}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        _fail(f"{method} {url}: {e.code} {_error_of(e)}", 1)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        _fail(f"cannot reach the daemon at {url}: {reason}", 1)


def cmd_write(args) -> None:
    config = _load(args.config)
    names = [stream.name for stream in config.streams]
    if args.stream not in names:
        _fail(f"write: unknown stream {args.stream!r} (this config has: {', '.join(names)})", 2)
    if not args.rows and not args.empty:
        _fail("write: no rows given (one JSON array per row; a fact with no rows still "
              "takes a stream ID: pass --empty to write one)", 2)
    rows = []
    for i, text in enumerate(args.rows):
        try:
            rows.append(json.loads(text))
        except ValueError as e:
            _fail(f"row {i} is not JSON: {e}", 2)
    key = args.idempotency_key if args.idempotency_key is not None else str(uuid.uuid4())
    if not 0 < len(key) <= 255 or any(not "!" <= c <= "~" for c in key):
        _fail("write: --idempotency-key: 1 to 255 printable ASCII characters without "
              "space (e.g. a UUID)", 2)
    base = _http_base(config)
    answer = _post_fact(f"{base}/_replicator/v1/streams/{args.stream}/facts",
                        json.dumps({"rows": rows}).encode(), config.http.secret, key,
                        args.timeout, args.retries)
    _out(str(answer["stream_id"]))


#: ``write``'s waits between attempts: doubling from the first, at most the last.
WRITE_RETRY_FIRST, WRITE_RETRY_MAX = 0.5, 8.0


def _post_fact(url: str, body: bytes, secret: str | None, key: str, timeout: float,
               retries: int) -> dict:
    """POST one fact with ``Idempotency-Key: key``, retried with the same
    key after a timeout, a connection failure, a 5xx or a 409 with
    ``Retry-After`` (the first attempt still in flight): a retry of a write
    that was committed answers its ID and writes nothing.  Any other
    answer is final."""
    request = urllib.request.Request(url, data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Idempotency-Key", key)
    if secret:
        request.add_header("Authorization", f"Bearer {secret}")
    attempt = 0
    while True:
        wait = min(WRITE_RETRY_MAX, WRITE_RETRY_FIRST * 2 ** attempt)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as e:
            problem = f"POST {url}: {e.code} {_error_of(e)}"
            retry_after = e.headers.get("Retry-After", "") if e.headers else ""
            if e.code == 409 and retry_after.isdigit():
                wait = max(wait, min(float(retry_after), WRITE_RETRY_MAX))
            elif e.code < 500:
                _fail(problem, 1)
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                reason = f"no answer within {timeout:g} s"
            problem = f"cannot reach the daemon at {url}: {reason}"
        if attempt >= retries:
            _fail(problem + (f" (after {retries} retries with Idempotency-Key {key})"
                             if retries else ""), 1)
        attempt += 1
        say(f"replicator: {problem}; retry {attempt} of {retries} in {wait:g} s "
             f"(Idempotency-Key {key})")
        time.sleep(wait)


def cmd_positions(args) -> None:
    config = _load(args.config)
    answer = _request(f"{_http_base(config)}/_replicator/v1/positions",
                      secret=config.http.secret)
    if args.json:
        _out(json.dumps(answer, indent=2))
        return
    _out(f"{'stream':<20} {'writer':<16} {'position':>10} {'in_flight':>9} {'lag':>6}  link")
    for stream, info in sorted(answer.get("streams", {}).items()):
        for writer, w in sorted(info.get("writers", {}).items()):
            in_flight = w.get("in_flight", "-") if w.get("local") else "-"
            lag = w.get("lag", "-") if not w.get("local") else "-"
            link = "(local)" if w.get("local") else w.get("link", "-")
            _out(f"{stream:<20} {writer:<16} {w.get('position', '-')!s:>10} "
                 f"{in_flight!s:>9} {lag!s:>6}  {link}")
        holder = info.get("linear_holder")
        held = f"  {holder['text']}" if holder else ""
        _out(f"{stream:<20} {'(linear)':<16} {info.get('linear', '-')!s:>10}{held}")


# ---------------------------------------------------------------- check
def cmd_check(args) -> None:
    """Exit 0 with one "config ok" line, or 2 with one line naming the key
    of the first problem: every check a start makes, nothing changed."""
    config = _load(args.config)
    from .daemon.checking import check_instance, unbound_writers
    from .daemon.startup import StartupError

    for line in unbound_writers(config):
        print(f"replicator: warning: {line}", file=sys.stderr, flush=True)

    async def main(reactor):
        try:
            summary = await check_instance(config)
        except (ConfigError, StartupError) as e:
            print(f"replicator: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        _out(f"replicator: {summary}")

    task.react(lambda reactor: defer.ensureDeferred(main(reactor)), [])


# -------------------------------------------------------------- migrate
def cmd_migrate(args) -> None:
    """The schema made current, one line per step (:mod:`.migrating`);
    exit 0, 1 if a step failed (rolled back), 2 if the schema is too new."""
    config = _load(args.config)
    from .daemon.migrating import migrate_instance
    from .daemon.startup import StartupError

    async def main(reactor):
        try:
            await migrate_instance(config, args.dry_run, _out, reactor)
        except StartupError as e:
            print(f"replicator: {e}", file=sys.stderr, flush=True)
            raise SystemExit(e.code) from None

    task.react(lambda reactor: defer.ensureDeferred(main(reactor)), [])


# ------------------------------------------------------ rewind, verify
def cmd_rewind(args) -> None:
    from .consumers.jsonl_commands import cmd_rewind as rewind
    rewind(_load(args.config), args)


def cmd_verify(args) -> None:
    from .consumers.jsonl_commands import cmd_verify as verify
    verify(_load(args.config), args)


# ----------------------------------------------------------------- main
def _seconds(text: str) -> float:
    """``--timeout``: a number of seconds from 0.1 to 3600."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds from 0.1 to 3600, got {text!r}")
    return value


def _retries(text: str) -> int:
    """``--retries``: an integer from 0 to 100."""
    if not text.isdigit() or int(text) > 100:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 100, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replicator",
                                description="Synapse-style stream replication daemon")
    p.add_argument("--version", action="version", version=f"replicator {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one instance in the foreground")
    run.add_argument("-c", "--config", required=True, help="instance YAML file")
    run.set_defaults(fn=cmd_run)
    check = sub.add_parser("check", help="check a config as a start would, changing nothing "
                           "(exit 0, or 2 and one line naming the key)")
    check.add_argument("-c", "--config", required=True, help="instance YAML file")
    check.set_defaults(fn=cmd_check)
    migrate = sub.add_parser("migrate", help="bring the database's schema to this version's "
                             "(what a start does unless database.auto_migrate is false)")
    migrate.add_argument("-c", "--config", required=True, help="instance YAML file")
    migrate.add_argument("--dry-run", action="store_true",
                         help="list the steps due, change nothing")
    migrate.set_defaults(fn=cmd_migrate)
    reopen = sub.add_parser("reopen", help="make the running daemon reopen its output files "
                            "(after a rotation; SIGUSR1 to the PID in its pid_file)")
    reopen.add_argument("-c", "--config", required=True, help="instance YAML file")
    reopen.set_defaults(fn=cmd_reopen)
    tail = sub.add_parser("tail", help="connect like a worker and print every command")
    tail.add_argument("endpoint", help="HOST:PORT, or an endpoint string such as "
                      "tcp:host=127.0.0.1:port=9092 or tls:...")
    tail.add_argument("--name", default="replicator-tail", help="NAME to send")
    tail.add_argument("--server-name", default=None,
                      help="expected SERVER name (default: accept any)")
    tail.add_argument("--stream", help="only RDATA/POSITION of this stream")
    tail.add_argument("--json", action="store_true", help="one JSON object per line")
    tail.set_defaults(fn=cmd_tail)
    write = sub.add_parser("write", help="write one fact through the HTTP API")
    write.add_argument("-c", "--config", required=True)
    write.add_argument("stream")
    write.add_argument("rows", nargs="*", metavar="ROW_JSON", help="one JSON array per row")
    write.add_argument("--empty", action="store_true",
                       help="write a fact with no rows (it still takes a stream ID)")
    write.add_argument("--idempotency-key", metavar="KEY",
                       help="the write's Idempotency-Key (default: a new UUID each "
                            "invocation); a retry with the same key within "
                            "http.idempotency_window answers the first write's ID and "
                            "writes nothing")
    write.add_argument("--timeout", type=_seconds, default=30.0, metavar="S",
                       help="seconds to wait for each attempt's answer (default 30)")
    write.add_argument("--retries", type=_retries, default=5, metavar="N",
                       help="attempts after the first, with the same key, after a timeout, "
                            "a connection failure, a 5xx or a write still in flight "
                            "(default 5)")
    write.set_defaults(fn=cmd_write)
    positions = sub.add_parser("positions", help="print every (stream, writer) position")
    positions.add_argument("-c", "--config", required=True)
    positions.add_argument("--json", action="store_true")
    positions.set_defaults(fn=cmd_positions)
    rewind = sub.add_parser("rewind", help="deliver a jsonl consumer's facts again from a "
                            "token or a time, or skip them up to a token (the daemon stopped)")
    rewind.add_argument("-c", "--config", required=True)
    rewind.add_argument("consumer", help="the consumer: its index (0, 1, ...) or its path")
    point = rewind.add_mutually_exclusive_group(required=True)
    point.add_argument("--to", metavar="TOKEN|TIME",
                       help="a token, or a time (ISO 8601, e.g. 2026-11-25T10:00:00Z)")
    point.add_argument("--skip-to", metavar="TOKEN|boundary", dest="skip_to",
                       help="skip the facts up to this token, or up to the stream's trim "
                            "boundary as it is then (a retention gap: accept the loss)")
    rewind.add_argument("--stream", help="only this stream (needed with a token when the "
                        "consumer reads several)")
    rewind.set_defaults(fn=cmd_rewind)
    verify = sub.add_parser("verify", help="compare a jsonl consumer's output with the "
                            "stream tables (exit 0 equal, 1 different)")
    verify.add_argument("-c", "--config", required=True)
    verify.add_argument("consumer", help="the consumer: its index (0, 1, ...) or its path")
    verify.set_defaults(fn=cmd_verify)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
