"""Phase 1: hostile protocol lines against the server and client protocols,
in-process (StringTransport + Clock) with a real :class:`ReplicationHandler`
over real streams on SQLite.

For every input a fresh connection (after a random valid prefix such as
``NAME worker1`` + ``REPLICATE``) is fed the bytes in random chunks, and:

* nothing raises out of ``dataReceived``;
* no event is logged at critical level (``log.failure``: an unhandled error);
* no logged text carries control characters a peer sent (issue 11 item 14);
* each complete line is either a valid command (parsed, dispatched, the
  connection stays up) or the connection closes with one ``ERROR`` line
  written last; a connection never closes without ``ERROR``;
* what is buffered of an unfinished line never exceeds the line limit;
* a bystander connection (a reader that sent REPLICATE) is never closed and
  only ever receives complete, valid lines within the limit;
* (client side) consumers only get rows that fit the stream, in increasing
  token order per writer.

At the end every connection is closed; the handler must become idle and
keep no per-connection state; its bookkeeping tables' sizes are reported.
"""

import os
import random
import re
import shutil
import tempfile

from twisted.internet import defer, reactor
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure

from replicator.config import parse_database, parse_streams
from replicator.consumers import Consumer
from replicator.replication.core.handler import ReplicationHandler
from replicator.replication.transport.protocol import (
    ClientReplicationProtocol,
    ServerReplicationProtocol,
)
from replicator.replication.wire.commands import (
    CLIENT_COMMANDS,
    CLIENT_WRITER_COMMANDS,
    SERVER_COMMANDS,
    parse_line,
)
from replicator.replication.wire.parsing import CommandParseError
from replicator.storage.database import Database
from replicator.streams.registry import StreamRegistry
from replicator.streams.rows import RowError, check_rows
from tests.support import create_sqlite_stream_tables

from . import inputs
from .results import PhaseResult, show

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")

SERVER_PREFIXES = [
    [], ["NAME worker1"], ["NAME worker1", "REPLICATE"], ["NAME reader-x", "REPLICATE"],
    ["REPLICATE"], ["NAME worker1", "PING 1"],
]
CLIENT_PREFIXES = [["SERVER hs.test"], ["SERVER hs.test", "PING 1"],
                   # Readers of these keys on this connection: RDATA is delivered.
                   ["SERVER hs.test", "POSITION caches master 0 0", "POSITION events master 0 0"]]


class LogCapture:
    """Collects logged events that an invariant forbids: anything at
    critical level or carrying a failure, and text with control characters."""

    def __init__(self):
        self.events: list[dict] = []

    def __call__(self, event):
        self.events.append(event)

    def start(self):
        globalLogPublisher.addObserver(self)
        return self

    def stop(self):
        globalLogPublisher.removeObserver(self)

    def take(self) -> list[dict]:
        events, self.events = self.events, []
        return events


class CheckingConsumer(Consumer):
    """A consumer that checks what the handler delivers: rows that fit the
    stream, tokens increasing per (stream, writer)."""

    streams = None

    def __init__(self, columns):
        self.columns = columns  # stream name -> columns
        self.last = {}
        self.problems: list[tuple] = []
        self.facts = 0

    def positions(self):
        return {}

    def on_facts(self, stream, writer, token, rows):
        self.facts += 1
        key = (stream, writer)
        if key in self.last and token <= self.last[key]:
            self.problems.append(("consumer_order", f"{key} token {token} after {self.last[key]}"))
        self.last[key] = token
        try:
            check_rows(self.columns[stream], rows)
        except RowError as e:
            self.problems.append(("bad_row_delivered", f"{stream}/{writer}: {e}"))

    def on_position(self, stream, writer, token):
        key = (stream, writer)
        self.last[key] = max(self.last.get(key, token), token)


def _complete_lines(data: bytes, buffered: bytes) -> list[bytes]:
    lines = (buffered + data).split(b"\n")
    lines.pop()
    return lines


def _judge_line(line: bytes, side: str) -> str | None:
    """None if the protocol must accept ``line`` (blank or a valid command
    the peer may send at all), else why it must be refused."""
    if line[-1:] == b"\r":
        line = line[:-1]
    if len(line) > inputs.MAX_LINE:
        return "too long"
    if not line or line.isspace():
        return None
    try:
        cmd = parse_line(line.decode("utf-8"))
    except (UnicodeDecodeError, CommandParseError) as e:
        return f"unparsable: {e}"
    except Exception as e:  # the parser itself failing is a finding elsewhere
        return f"parser raised {type(e).__name__}"
    allowed = CLIENT_COMMANDS | CLIENT_WRITER_COMMANDS if side == "server" else SERVER_COMMANDS
    if cmd.NAME not in allowed:
        return "not allowed"
    return None


class LinesFuzzer:
    """Drives one side (``"server"`` or ``"client"``) with ``count`` inputs."""

    def __init__(self, result: PhaseResult, seed: int, families=None):
        self.result = result
        self.rng = random.Random(seed)
        self.families = families or list(inputs.FAMILIES)
        self.capture = LogCapture()
        self.clock = Clock()
        self.clock.advance(1490197665.5)

    async def setup(self, directory: str):
        streams = parse_streams(inputs.STREAMS)
        self.columns = {s.name: s.columns for s in streams}
        self.registries = {}
        self.handlers = {}
        for name in ("master", "worker1"):
            path = os.path.join(directory, f"{name}.db")
            # The tables of the streams others write (a reader creates none).
            create_sqlite_stream_tables(path, streams)
            db = Database(parse_database({"sqlite": path}))
            registry = StreamRegistry(db, name, streams, reactor=reactor)
            await registry.start()
            self.registries[name] = (db, registry)
        self.consumer = CheckingConsumer(self.columns)
        self.handlers["server"] = ReplicationHandler(
            self.registries["master"][1], "master", inputs.SERVER_NAME, clock=self.clock)
        self.handlers["client"] = ReplicationHandler(
            self.registries["worker1"][1], "worker1", inputs.SERVER_NAME,
            consumers=[self.consumer], clock=self.clock)
        for h in self.handlers.values():
            h.start()
        # A master fact, so that readers have something to catch up on.
        await self.registries["master"][1].get("caches").write_fact([["f", None, 1]])
        #: IDs each side's streams handed out: (side, stream) -> largest.
        self.written = {("server", "caches"): 1}

    async def teardown(self):
        for db, registry in self.registries.values():
            await registry.stop()
            db.close()

    # -------------------------------------------------------------- connections
    def _connect(self, side: str):
        handler = self.handlers[side]
        if side == "server":
            proto = ServerReplicationProtocol(handler, inputs.SERVER_NAME, clock=self.clock)
        else:
            proto = ClientReplicationProtocol(handler, "worker1", inputs.SERVER_NAME,
                                              clock=self.clock)
        transport = StringTransport()
        proto.makeConnection(transport)
        return proto, transport

    def _lose(self, proto) -> None:
        if proto._connected:
            proto.connectionLost(Failure(ConnectionDone()))

    # -------------------------------------------------------------- checks
    def _check_logs(self, family: str, data: bytes) -> None:
        for event in self.capture.take():
            text = formatEvent(event)
            level = event.get("log_level")
            if event.get("log_failure") is None and text.startswith("Unhandled error in Deferred"):
                continue  # the failure itself comes as its own event
            if event.get("log_failure") is not None or level == LogLevel.critical:
                failure = event.get("log_failure")
                sig = (f"{failure.type.__name__}: {str(failure.value)[:300]}{_where(failure)}"
                       if failure is not None else text[:100])
                detail = text[:200]
                if failure is not None:
                    detail += " | " + failure.getTraceback().strip().splitlines()[-1][:200]
                self.result.found("unhandled_error_logged", sig, family, show(data), detail)
            elif _CONTROL.search(text):
                fmt = str(event.get("log_format", ""))[:60]
                self.result.found("log_control_chars", fmt, family, show(data), repr(text[:160]))

    def _check_bystander(self, proto, transport, seen: int, family: str, data: bytes) -> int:
        if proto._closing:
            self.result.found("bystander_closed", str(proto.close_reason), family, show(data),
                              show(transport.value()[-300:]))
            return -1
        value = transport.value()
        new = value[seen:]
        end = new.rfind(b"\n") + 1
        for line in new[:end].split(b"\n")[:-1]:
            why = _judge_line(line, "client")
            if why is not None:
                self.result.found("bad_line_to_bystander", why[:60], family, show(data),
                                  show(line))
        return seen + end

    def _feed(self, side, proto, transport, family, data) -> None:
        before = len(transport.value())
        buffered = proto._buffer
        for chunk in inputs.chunks(self.rng, data):
            if transport.disconnecting:
                break  # a closing TCP transport reads no more
            try:
                proto.dataReceived(chunk)
            except Exception as e:
                self.result.found("exception_escaped", f"{type(e).__name__}: {str(e)[:300]}",
                                  family, show(data))
                return
            if len(proto._buffer) > inputs.MAX_LINE + 1 and not transport.disconnecting:
                self.result.found("buffer_over_limit", "unfinished line kept", family, show(data))
        lines = _complete_lines(data, buffered)
        refusals = [why for why in (_judge_line(line, side) for line in lines) if why]
        written = transport.value()[before:]
        if proto._closing:
            last = written.rstrip(b"\n").rsplit(b"\n", 1)[-1]
            if not last.startswith(b"ERROR"):
                self.result.found("closed_without_error", str(proto.close_reason), family,
                                  show(data), show(written[-200:]))
            elif not transport.disconnecting:
                self.result.found("error_without_close", str(proto.close_reason), family,
                                  show(data))
        elif refusals:
            self.result.found("invalid_line_accepted", refusals[0][:70], family, show(data))

    # -------------------------------------------------------------- run
    async def run(self, side: str, count: int) -> None:
        self.capture.start()
        try:
            await self._run(side, count)
        finally:
            self.capture.stop()

    async def _run(self, side: str, count: int) -> None:
        rng = self.rng
        handler = self.handlers[side]
        bystander = None
        if side == "server":
            bystander, btr = self._connect("server")
            bystander.dataReceived(b"NAME reader\nREPLICATE\n")
            seen = len(btr.value())
        prefixes = SERVER_PREFIXES if side == "server" else CLIENT_PREFIXES
        for i in range(count):
            family = self.families[i % len(self.families)]
            data = inputs.FAMILIES[family](rng, side)
            self.result.tried(f"{side}.{family}")
            proto, transport = self._connect(side)
            prefix = rng.choice(prefixes)
            if prefix:
                proto.dataReceived(("\n".join(prefix) + "\n").encode())
            self._check_logs(family, data)
            self._feed(side, proto, transport, family, data)
            if rng.random() < 0.2:
                self.clock.advance(rng.choice([0.001, 0.01, 1.0, 6.0]))
            if bystander is not None and not bystander._closing:
                # An honest reader PINGs (one that never does is closed
                # after idle_timeout without a command).
                bystander.dataReceived(b"PING 1\n")
            self._check_logs(family, data)
            if bystander is not None and seen >= 0:
                seen = self._check_bystander(bystander, btr, seen, family, data)
                if seen >= 0 and bystander.queued == 0 and len(btr.value()) > 1 << 20:
                    btr.clear()
                    seen = 0
            self._lose(proto)
            self._check_logs(family, data)
            for kind, detail in self.consumer.problems:
                self.result.found(kind, detail[:80], family, show(data))
            self.consumer.problems.clear()
            if i % 50 == 49:
                await _turn()
        # Let reader work (catch-up on the database) finish.
        for _ in range(2000):
            self.clock.advance(0.5)
            if handler.idle():
                break
            await _turn()
        if not handler.idle():
            self.result.found("handler_not_idle", side, "-", "", "reader or fan-out work left")
        self._check_logs("end", b"")
        if bystander is not None:
            self._lose(bystander)
        left = [c for c in handler.connections]
        if left:
            self.result.found("connection_state_leaked", f"{len(left)} connections", "-", "")
        self.result.figure(f"{side}.user_ips", len(handler.user_ips))
        self.result.figure(f"{side}.user_syncs", sum(len(v) for v in handler.user_syncs.values()))
        self.result.figure(f"{side}.federation_acks", len(handler.federation_acks))
        if side == "client":
            self.result.figure("client.facts_delivered", self.consumer.facts)
        positions = {f"{s}/{w}": t for (s, w), t in handler.announced_positions().items()}
        self.result.figure(f"{side}.announced", positions)
        # Nothing a peer says may move a local writer past the IDs its
        # stream handed out (issue 11 item 1).
        for (stream, writer), token in handler.announced_positions().items():
            bound = self.written.get((side, stream), 0)
            if token > bound:
                self.result.found("position_poisoned", f"{side}: {stream}/{writer} announced "
                                  "past the stream's sequence", "-", "",
                                  f"announced {token}, sequence at {bound}")


def _where(failure) -> str:
    """ at file:function of the innermost replicator frame."""
    for name, filename, line, *_ in reversed(failure.frames):
        if "/replicator/" in filename:
            return f" at {filename.rsplit('/replicator/', 1)[1]}:{name}:{line}"
    return ""


def _turn():
    from twisted.internet import reactor

    d = defer.Deferred()
    reactor.callLater(0.001, d.callback, None)
    return d


async def run_phase(seed: int, count: int, families=None, sides=("server",
                                                                 "client")) -> PhaseResult:
    """Phase 1: ``count`` inputs per side."""
    result = PhaseResult("1-lines")
    directory = tempfile.mkdtemp(prefix="fuzz-lines-")
    fuzzer = LinesFuzzer(result, seed, families)
    try:
        await fuzzer.setup(directory)
        for side in sides:
            await fuzzer.run(side, count)
    finally:
        await fuzzer.teardown()
        shutil.rmtree(directory, ignore_errors=True)
    return result.done()
