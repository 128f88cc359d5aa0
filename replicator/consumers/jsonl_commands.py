"""``replicator rewind`` and ``replicator verify``: the operator's tools for
a ``jsonl`` consumer's output (see docs/jsonl.md).

``CONSUMER`` names one consumer of the config: its index as config
messages write it (``0``, or ``consumers[0]``) or its ``path`` (as written
in the file, or the absolute path).

``rewind`` edits the consumer's persisted positions and so needs the daemon
stopped: the output's lock says whether a daemon holds it, and a held lock
is refused (exit 1) rather than changed under a running reader (which would
write its own positions over the edit).  The edit is one transaction (rewind
lines, then the state file: :meth:`.JsonlConsumer.rewind`); the next start
delivers the facts again from the point.

``--to`` is a token (an integer: facts from that token on are delivered
again, per stream, so with ``--stream`` when the consumer reads more than
one) or a time (ISO 8601, e.g. ``2026-11-25T10:00:00Z``; without a zone,
UTC): per stream, the first fact whose ``timestamp_column`` (milliseconds
since the epoch) is at or after it, so a stream without a
``timestamp_column`` cannot be rewound to a time.  A point retention has
trimmed (a token at or below the stream's trim boundary, a time before the
oldest fact left) is refused: the next start would stop at the gap again.

``--skip-to TOKEN`` goes the other way, for a retention gap
(docs/operations.md, "Retention gaps"): the consumer's positions in the
stream below ``TOKEN`` move up to it, so the facts up to it are never
delivered (the loss accepted).  ``--skip-to boundary`` (what a gap's error
names) is the stream's trim boundary, read in the same transaction that
counts the facts skipped: however fast retention trims, the command works
when pasted and skips only facts retention has already deleted (every fact
at or below the boundary is gone; none above it is skipped).  Its skip
line says ``"to": "boundary"``: the operator accepted the loss of whatever
retention has trimmed by the time the reader reads, so if the trimmer
passes the new position before the next start catches up, the daemon
skips to the boundary again by itself rather than stop at a new gap, for
as long as nothing was handed on since (:meth:`.JsonlConsumer.accepted_gap`,
:mod:`replicator.replication.core.accepted`).  The same
transaction as a rewind, with one *skip line* per key (a position line
that also says where from, when, how many facts of the table it skipped
and the boundary then, for ``replicator verify``).  Refused (exit 2): a
token not past any of the consumer's positions in the stream, below the
stream's trim boundary (the next start would stop again: the message names
``--skip-to boundary``; a number below the boundary is not taken as "to
the boundary", since the operator who chose it accepted a smaller loss
than retention has made since), or beyond the stream.  ``boundary`` with
nothing trimmed past the consumer's positions is nothing to do (exit 0).

Exit codes: 0 done (or verify: equal), 1 verify: different, or a runtime
failure (the daemon holds the output, the database unreachable), 2 a usage
mistake (one line).
"""

import argparse
import os
import sys
from datetime import UTC, datetime
from typing import Any, NoReturn

from twisted.internet import defer, task

from ..config.model import InstanceConfig, StreamConfig
from ..keys import Key
from ..storage import schema
from ..storage.database import Cursor, Database
from ..streams.trimmed import TrimCheck, boundary_key
from .jsonl_lines import BOUNDARY, iso_time


class Usage(Exception):
    """A usage mistake: one line, exit 2."""


def _fail(message: str, code: int) -> NoReturn:
    print(f"replicator: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def find_jsonl(config: InstanceConfig, name: str) -> tuple[str, str, tuple[str, ...]]:
    """``(where, absolute path, stream names)`` of the jsonl consumer ``name``."""
    index: int | None = None
    text = name[len("consumers["):-1] if name.startswith("consumers[") and name.endswith("]") \
        else name
    if text.isdigit():
        index = int(text)
        if index >= len(config.consumers):
            raise Usage(f"no consumers[{index}] (the config has {len(config.consumers)} "
                        f"consumers)")
    else:
        wanted = os.path.abspath(name)
        for i, consumer in enumerate(config.consumers):
            path = consumer.options.get("path")
            if consumer.type == "jsonl" and isinstance(path, str) and (
                    path == name or os.path.abspath(path) == wanted):
                index = i
        if index is None:
            raise Usage(f"no jsonl consumer with path {name!r} (give its path as in the "
                        f"config, or its index: 0, 1, ...)")
    consumer = config.consumers[index]
    where = f"consumers[{index}]"
    if consumer.type != "jsonl":
        raise Usage(f"{where} is a {consumer.type!r} consumer; only jsonl consumers keep "
                    f"an output and positions to rewind or verify")
    streams = consumer.streams if consumer.streams is not None else tuple(
        s.name for s in config.streams)
    # Relative paths are relative to the working directory, as for ``run``.
    return where, os.path.abspath(consumer.options["path"]), streams


def parse_point(text: str, flag: str = "--to") -> tuple[int | None, int | None]:
    """``(token, None)`` or ``(None, milliseconds since the epoch)``;
    ``flag`` other than ``--to`` takes a token only."""
    if text.lstrip("-").isdigit():
        token = int(text)
        if not 1 <= token < 1 << 63:
            raise Usage(f"rewind: {flag} {text}: a token is from 1 to 2^63-1")
        return token, None
    if flag != "--to":
        raise Usage(f"rewind: {flag} {text!r} is not a token (an integer) nor "
                    f"{BOUNDARY!r} (the stream's trim boundary)")
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise Usage(f"rewind: --to {text!r} is neither a token (an integer) nor a time "
                    f"(ISO 8601, e.g. 2026-11-25T10:00:00Z)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return None, int(when.timestamp() * 1000)


def _last_token(txn: Cursor, stream: StreamConfig, db: Database) -> int:
    """The stream's largest token: its table's, or a persisted position."""
    txn.execute(f"SELECT MAX({stream.id_column}) FROM {stream.table}")
    top = txn.fetchone()[0] or 0
    if schema.table_columns(txn, "stream_positions", db.is_postgres) is not None:
        txn.execute(db.sql("SELECT MAX(stream_id) FROM stream_positions WHERE stream_name = %s"),
                    (stream.positions_key,))
        top = max(top, txn.fetchone()[0] or 0)
    return top


def _boundary(txn: Cursor, stream: StreamConfig, db: Database) -> int:
    """The trim boundary of the stream's table (0: nothing trimmed)."""
    if stream.preset is not None:
        return 0  # Synapse's tables are never trimmed
    return TrimCheck(stream.name, boundary_key(stream), db.is_postgres, db.sql).boundary(txn)


def _check_kept(txn: Cursor, stream: StreamConfig, db: Database, text: str, token: int | None,
                ms: int | None) -> None:
    """Refuse a point before what the stream's table keeps (trimmed by
    retention): delivering again from there would stop at the gap."""
    boundary = _boundary(txn, stream, db)
    if not boundary:
        return
    if token is not None:
        if token <= boundary:
            raise Usage(f"rewind: --to {token}: stream {stream.name} keeps facts after "
                        f"{boundary} only (facts up to {boundary} were trimmed by retention); "
                        f"rewind to {boundary + 1} or above")
        return
    idc, ts = stream.id_column, stream.timestamp_column
    txn.execute(f"SELECT {idc}, MIN({ts}) FROM {stream.table} WHERE {idc} = "
                f"(SELECT MIN({idc}) FROM {stream.table}) GROUP BY {idc}")
    oldest = txn.fetchone()
    if oldest is not None and ms is not None and ms < oldest[1]:
        raise Usage(f"rewind: --to {text} is before what stream {stream.name} keeps: facts "
                    f"up to {boundary} were trimmed by retention (the oldest fact left, "
                    f"{oldest[0]}, is of {iso_time(oldest[1])}); rewind to that time or later")


def _first_at(txn: Cursor, stream: StreamConfig, db: Database, ms: int | None) -> int | None:
    txn.execute(db.sql(f"SELECT MIN({stream.id_column}) FROM {stream.table} "
                       f"WHERE {stream.timestamp_column} >= %s"), (ms,))
    first: int | None = txn.fetchone()[0]
    return first


def _points(txn: Cursor, db: Database, streams: list[StreamConfig], text: str, token: int | None,
            ms: int | None) -> dict[str, int | None]:
    """Per stream, the first token delivered again (None: nothing to)."""
    points: dict[str, int | None] = {}
    for stream in streams:
        _check_kept(txn, stream, db, text, token, ms)
        if token is not None:
            last = _last_token(txn, stream, db)
            if token > last:
                raise Usage(f"rewind: --to {token} is beyond stream {stream.name} (its last "
                            f"token is {last})")
            points[stream.name] = token
        else:
            points[stream.name] = _first_at(txn, stream, db, ms)
    return points


def _skip_plan(txn: Cursor, db: Database, stream: StreamConfig, token: int | None,
               current: dict[Key, int]) -> tuple[int, int, dict[Key, int]]:
    """One transaction: ``(target, boundary, facts of the table skipped per
    key)`` for the consumer's positions ``current`` in ``stream``; ``token``
    None is ``--skip-to boundary`` (the target is the boundary read here).
    Refuses a token beyond the stream or below the boundary."""
    boundary = _boundary(txn, stream, db)
    if token is None:
        target = boundary
    else:
        last = _last_token(txn, stream, db)
        if token > last:
            raise Usage(f"rewind: --skip-to {token} is beyond stream {stream.name} (its last "
                        f"token is {last})")
        target = token
    raised = {k: p for k, p in current.items() if p < target}
    if token is not None and raised and token < boundary:
        raise Usage(f"rewind: --skip-to {token} is below stream {stream.name}'s trim "
                    f"boundary {boundary}: the next start would stop at the gap again; skip "
                    f"to {boundary} or above, or give --skip-to {BOUNDARY} (the boundary "
                    f"when the skip is made, however far retention has trimmed by then)")
    counts = {key: _in_table(txn, db, stream, key[1], p, target) for key, p in raised.items()}
    return target, boundary, counts


def _in_table(txn: Cursor, db: Database, stream: StreamConfig, writer: str, after: int,
              upto: int) -> int:
    """How many facts of ``writer`` the table holds after ``after`` up to ``upto``."""
    where = f"{stream.writer_column} = %s AND " if stream.writer_column else ""
    txn.execute(db.sql(f"SELECT COUNT(DISTINCT {stream.id_column}) FROM {stream.table} "
                       f"WHERE {where}{stream.id_column} > %s AND {stream.id_column} <= %s"),
                ((writer,) if stream.writer_column else ()) + (after, upto))
    return int(txn.fetchone()[0])


def cmd_rewind(config: InstanceConfig, args: argparse.Namespace) -> None:
    from .file_thread import run_inline
    from .jsonl import JsonlConsumer, JsonlError

    skip = getattr(args, "skip_to", None) is not None
    flag, text = ("--skip-to", args.skip_to) if skip else ("--to", args.to)
    try:
        where, path, streams = find_jsonl(config, args.consumer)
        token, ms = (None, None) if skip and text == BOUNDARY else parse_point(text, flag)
        if args.stream is not None:
            if args.stream not in streams:
                raise Usage(f"rewind: {where} does not read stream {args.stream!r} (it reads "
                            f"{', '.join(streams)})")
            streams = (args.stream,)
        if (token is not None or skip) and len(streams) > 1:
            what = "TOKEN" if token is not None else text
            raise Usage(f"rewind: {flag} {what} needs --stream (tokens are per stream; {where} "
                        f"reads {', '.join(streams)})")
        by_name = {s.name: s for s in config.streams}
        chosen = [by_name[name] for name in streams]
        if ms is not None:
            untimed = [s.name for s in chosen if not s.timestamp_column]
            if untimed:
                raise Usage(f"rewind: --to TIME needs a timestamp_column; stream "
                            f"{', '.join(untimed)} has none (rewind it with --stream NAME "
                            f"--to TOKEN)")
    except Usage as e:
        _fail(str(e), 2)

    def open_output(reactor: Any) -> "JsonlConsumer":
        try:
            return JsonlConsumer(path, reactor, run_io=run_inline, streams=streams)
        except JsonlError as e:
            if "in use" in str(e):
                _fail(f"rewind: {path} is in use: stop the daemon first (a running reader "
                      f"holds its positions in memory and would write over the rewind)", 1)
            _fail(f"rewind: {e}", 1)

    async def skip_main(reactor: Any) -> None:
        stream = chosen[0]
        db = Database(config.database)
        try:
            consumer = open_output(reactor)
            try:
                current = {k: p for k, p in consumer.positions().items() if k[0] == stream.name}
                try:
                    target, boundary, counts = await db.runInteraction(
                        _skip_plan, db, stream, token, current)
                except Usage as e:
                    _fail(str(e), 2)
                except Exception as e:
                    _fail(f"rewind: cannot read the stream's table: {e}", 1)
                if not counts:
                    at = f" ({max(current.values())})" if current else " (it has none)"
                    if token is None:
                        print(f"rewind: nothing to skip: {where}'s position in stream "
                              f"{stream.name}{at} is not below its trim boundary "
                              f"{boundary}", flush=True)
                        return
                    _fail(f"rewind: --skip-to {token} is not past {where}'s position in stream "
                          f"{stream.name}{at}: nothing would be skipped (--to delivers facts "
                          f"again)", 2)
                at = iso_time(int(reactor.seconds() * 1000))
                notes = {key: {"from": current[key], "facts": n, "trimmed_through": boundary,
                               "at": at, **({"to": BOUNDARY} if token is None else {})}
                         for key, n in counts.items()}
                await consumer.skip({key: target for key in counts}, notes)
            finally:
                await consumer.close()
        finally:
            db.close()
        for (name, writer), n in sorted(counts.items()):
            before = current[(name, writer)]
            trimmed = (f"; facts up to {boundary} were trimmed by retention"
                       if boundary > before else "")
            print(f"rewind: {name}/{writer}: position {before} -> {target}: skipped facts "
                  f"{before + 1} to {target} ({n} of them in the table{trimmed})", flush=True)

    async def main(reactor: Any) -> None:
        db = Database(config.database)
        try:
            points = await db.runInteraction(_points, db, chosen, text, token, ms)
        except Usage as e:
            _fail(str(e), 2)
        except Exception as e:
            _fail(f"rewind: cannot read the streams' tables: {e}", 1)
        finally:
            db.close()
        consumer = open_output(reactor)
        try:
            current = consumer.positions()
            lowered = {}
            for (stream, writer), position in sorted(current.items()):
                first = points.get(stream)
                if first is not None and first - 1 < position:
                    lowered[(stream, writer)] = first - 1
            await consumer.rewind(lowered)
        finally:
            await consumer.close()
        for name in streams:
            if points[name] is None:
                print(f"rewind: {name}: no fact at or after {text}; nothing to deliver "
                      f"again", flush=True)
        for (stream, writer), position in sorted(lowered.items()):
            print(f"rewind: {stream}/{writer}: position {current[(stream, writer)]} -> "
                  f"{position} (the next start delivers from {position + 1} again)",
                  flush=True)
        if not lowered:
            print(f"rewind: nothing to do: {where} is not past {text}", flush=True)

    run = skip_main if skip else main
    task.react(lambda reactor: defer.ensureDeferred(run(reactor)), [])


def cmd_verify(config: InstanceConfig, args: argparse.Namespace) -> None:
    from .jsonl_verify import Verifier, summary

    try:
        _, path, _ = find_jsonl(config, args.consumer)
    except Usage as e:
        _fail(str(e), 2)

    async def main(reactor: Any) -> None:
        db = Database(config.database)
        try:
            result = await db.runInteraction(Verifier(config, path, db).run)
        except OSError as e:
            _fail(f"verify: cannot read {e.filename or path}: {e.strerror or e}", 1)
        finally:
            db.close()
        equal = summary(result, lambda text: print(text, flush=True))
        if not equal:
            raise SystemExit(1)

    task.react(lambda reactor: defer.ensureDeferred(main(reactor)), [])
