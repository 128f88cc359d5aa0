"""``replicator verify``: a ``jsonl`` consumer's output (its rotated files
too, oldest first) compared with the stream tables: every fact exactly once,
in ascending token order per (stream, writer), whole (all its rows).

Beside a running daemon, both sides are taken at one moment: the files
are opened and their sizes taken (:mod:`.jsonl_held`: lines appended
later are not read, and are counted as bytes "written after verify
began"), then the tables are read in one snapshot (PostgreSQL's
REPEATABLE READ, SQLite's read transaction) taken after that.  The daemon
writes a fact to the file only once it is committed, so the snapshot holds
every fact the lines read speak of; what it holds beyond a key's last line
is "not yet delivered".

The files are read twice, in order, line by line: first for the rewind
lines only, then to compare, each table a page of facts at a time from
where the file's lines for that key begin (:class:`.PageQuery`, keyset
pages).  Memory holds one page per (stream, writer), the rewind points,
the first examples of each difference, and the tokens found missing so far
(to tell a fact that comes late, out of order, from one that never comes):
it grows with the differences, not with the files.

Where a key's checking begins: after its first line's position (a
consumer begins a file with a position line per key it starts from, and
rotation keeps them; a rewind line too).  A key whose first line is a
fact starts at that fact, and if the table still holds facts before it
(a consumer of an older version that began after them, or the rotated
files with its start deleted since), that is a difference, *no start
line*: nothing says those facts were never this file's.  Where it
ends: at its last line; facts of the table after it are "not yet
delivered", not a difference (the consumer may be behind or stopped).
A rewind line (``replicator rewind``) starts the key again after its token:
what follows is delivered again by design, not duplicated, and it
supersedes what came before it above that token.  The file is judged as a
reader that applies the rewind lines reads it: a line of a fact (or a
position) above the lowest rewind point of its key still to come is
superseded, counted as "handed on again after rewinds" and not compared
(a position is taken as that point); the copy after the last rewind that
covers a fact is the one compared.  A skip line (``replicator rewind
--skip-to``, a position line with ``skip``) moves the key past facts on
purpose: the table's facts it passes are *skipped*, not missing, and the
summary says how many facts each skip skipped (as the line records them:
those still in the table when it was made), when, and up to where
retention had trimmed (a skip line a rewind to come supersedes is a plain
position at that rewind's point).

A fact with no rows has no row in the table: one in the file is fine, and
one missing from it cannot be seen.

A stream with retention: the table is read from its trim boundary on
(:mod:`..streams.trimmed`; read when a stream's table is first read, and
again if a trim moves it while verify runs, which the snapshot keeps
from happening), and the file's facts at or below it are counted as
*trimmed from the table*: not compared, and not a difference (the table
no longer says what they were).
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..config.model import InstanceConfig, StreamConfig
from ..keys import Key
from ..storage.database import Cursor, Database
from ..streams.pages import FactPage, PageQuery
from ..streams.trimmed import FactsTrimmed, TrimCheck, boundary_key
from .base import Row
from .jsonl_held import Held, hold
from .jsonl_lines import parse_line

END = (1 << 63) - 1
PAGE_ROWS = 1000
#: Examples kept (and printed) per kind of difference per key.
EXAMPLES = 10
KINDS = ("missing", "duplicate", "out of order", "partial", "different rows", "extra",
         "no start line")


@dataclass
class KeyCheck:
    """One (stream, writer): the table's facts in order, against the file's."""

    stream: StreamConfig | None
    writer: str
    begin: int | None = None  # checked from the first token above this
    last: int = 0  # the largest token or position of the file so far
    facts: int = 0  # fact lines
    matched: int = 0
    missing: set[int] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    examples: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KINDS})
    behind: int = 0
    trimmed: int = 0  # fact lines at or below the trim boundary (not compared)
    superseded: int = 0  # fact lines a later rewind line hands on again (not compared)
    #: The rewind points still to come in the file, each the lowest from
    #: there on (the first: the lowest of all to come).
    covers: list[int] = field(default_factory=list)
    #: The skip lines: (from, to, facts skipped then, trim boundary then, when).
    skips: list[tuple[int, int, int, int, str]] = field(default_factory=list)
    passed: int = 0  # facts of the table a skip line passed (not missing)
    _table: Iterator[tuple[int, list[Row]]] | None = None
    _next: tuple[int, list[Row]] | None = None

    def note(self, kind: str, example: str, n: int = 1) -> None:
        self.counts[kind] += n
        if len(self.examples[kind]) < EXAMPLES:
            self.examples[kind].append(example)


class _Gone(Exception):
    """The fact asked for is at or below the trim boundary (a trim moved it
    while verify ran)."""


@dataclass
class FileProblem:
    path: str
    offset: int
    text: str


@dataclass
class Result:
    files: list[str]
    keys: dict[Key, KeyCheck]
    problems: list[FileProblem]
    lines: dict[str, int]
    grown: int = 0  # bytes written to the current file after the files were held

    @property
    def differences(self) -> dict[str, int]:
        totals = {k: sum(c.counts[k] for c in self.keys.values()) for k in KINDS}
        totals["missing"] += sum(len(c.missing) for c in self.keys.values())
        totals["file problems"] = len(self.problems)
        return {k: n for k, n in totals.items() if n}


def _lines(held: Held, problems: list[FileProblem]) -> Iterator[tuple[str, int, bytes]]:
    """``(path, offset, line)`` of every complete line, oldest file first; a
    last line without its newline (a write cut short) is a problem."""
    for path, offset, line in held.lines():
        if not line.endswith(b"\n"):
            problems.append(FileProblem(path, offset, f"a truncated last line "
                                                      f"({len(line)} bytes)"))
            continue
        yield path, offset, line


def _rewinds(held: Held) -> dict[Key, list[int]]:
    """Per key, the rewind points in file order."""
    points: dict[Key, list[int]] = {}
    for _, _, line in held.lines():
        if b'"rewind"' not in line or not line.endswith(b"\n"):
            continue
        try:
            key, token, obj = parse_line(line)
        except ValueError:
            continue  # (a problem the comparison reports)
        if key is not None and obj is not None and "rows" not in obj and "rewind" in obj:
            points.setdefault(key, []).append(token)  # type: ignore[arg-type]
    return points


def _lowest_to_come(points: list[int]) -> list[int]:
    """``[min(points[i:]) for each i]``."""
    out = list(points)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def snapshot(txn: Cursor, is_postgres: bool) -> None:
    """Begin the transaction's snapshot of the tables now: every statement
    after reads the database as it was at this moment."""
    if is_postgres:
        txn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        txn.execute("SELECT 1")
    else:
        txn.execute("BEGIN")
        txn.execute("SELECT COUNT(*) FROM sqlite_master")


class Verifier:
    """Runs in one database transaction (a pool thread): the files are held
    (:func:`.jsonl_held.hold`), then the transaction's snapshot taken, then
    ``txn`` reads the tables while the held files are read."""

    def __init__(self, config: InstanceConfig, path: str, db: Database) -> None:
        self.path = path
        self.is_postgres = db.is_postgres
        self.by_name = {s.name: s for s in config.streams}
        self.queries = {name: PageQuery(s, db) for name, s in self.by_name.items()}
        self.trims = {name: TrimCheck(name, boundary_key(s), db.is_postgres, db.sql)
                      for name, s in self.by_name.items() if s.preset is None}
        self.boundaries: dict[str, int] = {}  # per stream, as last read

    def run(self, txn: Cursor) -> Result:
        held = hold(self.path)
        try:
            snapshot(txn, self.is_postgres)
            return self._run(txn, held)
        finally:
            held.close()

    def _run(self, txn: Cursor, held: Held) -> Result:
        rewinds = _rewinds(held)
        problems: list[FileProblem] = []
        keys: dict[Key, KeyCheck] = {}
        lines = {"facts": 0, "positions": 0, "rewinds": 0, "skips": 0}
        for path, offset, line in _lines(held, problems):
            try:
                key, token, obj = parse_line(line)
            except ValueError as e:
                problems.append(FileProblem(path, offset, f"not a fact or position: {e}"))
                continue
            if key is None:
                continue
            assert token is not None and obj is not None  # a keyed line has both
            check = keys.get(key)
            if check is None:
                check = keys[key] = KeyCheck(self.by_name.get(key[0]), key[1],
                                             covers=_lowest_to_come(rewinds.get(key, [])))
            cover = check.covers[0] if check.covers else None
            if "rows" in obj:
                lines["facts"] += 1
                if cover is not None and token > cover:
                    check.facts += 1
                    check.superseded += 1  # handed on again after a rewind to come
                else:
                    self._fact(txn, check, token, obj["rows"])
            elif "rewind" in obj:
                lines["rewinds"] += 1
                del check.covers[:1]
                self._restart(txn, check, token)
            else:
                lines["positions"] += 1
                skip = skip_of(obj, token)
                if skip is not None:
                    lines["skips"] += 1
                if cover is not None and token > cover:
                    token, skip = cover, None  # (what a rewind to come hands on again)
                if skip is not None:
                    check.skips.append(skip)
                self._position(txn, check, token, skip is not None)
        for check in keys.values():
            while check._next is not None:
                check.behind += 1
                self._advance(txn, check)
        return Result(held.paths, keys, problems, lines, held.grown())

    # -------------------------------------------------------------- table
    def _restart(self, txn: Cursor, check: KeyCheck, after: int) -> None:
        """Check ``check`` again from the first fact after ``after``."""
        check.begin = after if check.begin is None else min(check.begin, after)
        check.last = after
        check.missing = {t for t in check.missing if t <= after}
        check._table = None
        check._next = None
        if check.stream is not None:
            check._table = self._table(txn, check, after)
            check._next = next(check._table, None)

    def _boundary(self, txn: Cursor, stream: StreamConfig) -> int:
        """The stream's trim boundary (0: nothing trimmed), read once."""
        boundary = self.boundaries.get(stream.name)
        if boundary is None:
            trim = self.trims.get(stream.name)
            boundary = self.boundaries[stream.name] = trim.boundary(txn) if trim else 0
        return boundary

    def _read(self, txn: Cursor, stream: StreamConfig, writer: str, after: int,
              to: int) -> FactPage:
        """A page of the table after ``after`` (or after the trim boundary,
        if higher); a trim that moved the boundary meanwhile is followed."""
        while True:
            since = max(after, self._boundary(txn, stream))
            try:
                return self.queries[stream.name].read_facts(txn, writer, since, to, PAGE_ROWS)
            except FactsTrimmed as e:
                self.boundaries[stream.name] = e.boundary

    def _table(self, txn: Cursor, check: KeyCheck, after: int) -> Iterator[tuple[int, list[Row]]]:
        assert check.stream is not None  # only a configured stream's table is read
        while True:
            facts, upto, limited = self._read(txn, check.stream, check.writer, after, END)
            yield from facts
            if not limited:
                return
            after = upto

    def _advance(self, txn: Cursor, check: KeyCheck) -> None:
        check._next = next(check._table, None) if check._table is not None else None

    def _in_table(self, txn: Cursor, check: KeyCheck, token: int) -> list[Row] | None:
        """The rows of fact ``token`` in the table, or None; :class:`_Gone`
        if a trim took it meanwhile."""
        if check.stream is None:
            return None
        facts, _, _ = self._read(txn, check.stream, check.writer, token - 1, token)
        if token <= self._boundary(txn, check.stream):
            raise _Gone()
        return facts[0][1] if facts else None

    def _trimmed(self, check: KeyCheck, token: int) -> None:
        check.trimmed += 1
        check.last = max(check.last, token)

    def _first_before(self, txn: Cursor, check: KeyCheck, token: int) -> int | None:
        """The first fact of the table (still kept) below ``token``, or None."""
        if check.stream is None:
            return None
        query = self.queries[check.stream.name]
        since = 0
        while since < token - 1:
            try:
                facts, _, _ = query.read_facts(txn, check.writer, since, token - 1, 1)
            except FactsTrimmed as e:  # from what retention keeps
                since = e.boundary
                continue
            return facts[0][0] if facts else None
        return None

    # -------------------------------------------------------------- lines
    def _position(self, txn: Cursor, check: KeyCheck, token: int, skip: bool = False) -> None:
        if check.begin is None:
            self._restart(txn, check, token)
            return
        if token <= check.last:
            return  # a new file's heading, or a repeat: nothing new
        self._skip_to(txn, check, token + 1, skip)
        check.last = token

    def _skip_to(self, txn: Cursor, check: KeyCheck, token: int, skip: bool = False) -> None:
        """Facts of the table below ``token`` not seen by now are missing
        (or, past a skip line, skipped on purpose)."""
        while check._next is not None and check._next[0] < token:
            if skip:
                check.passed += 1
            else:
                check.missing.add(check._next[0])
            self._advance(txn, check)

    def _fact(self, txn: Cursor, check: KeyCheck, token: int, rows: list[Row]) -> None:
        check.facts += 1
        if check.begin is None:
            earlier = self._first_before(txn, check, token)
            if earlier is not None:
                check.note("no start line", f"{token} (the key's first line; fact {earlier} "
                                            f"and maybe more before it are in the table)")
            self._restart(txn, check, token - 1)
        if check.stream is None:
            check.note("extra", f"{token} (its stream is not in the config)")
            return
        if token <= self._boundary(txn, check.stream):
            self._trimmed(check, token)
            return
        if token <= check.last:
            try:
                table_rows = self._in_table(txn, check, token)
            except _Gone:
                self._trimmed(check, token)
                return
            if token in check.missing:
                check.missing.discard(token)
                check.note("out of order", f"{token} (after {check.last})")
                self._compare(check, token, rows, table_rows)
            elif table_rows is not None or not rows:
                check.note("duplicate", str(token))
            else:
                check.note("extra", f"{token} (not in the table)")
            return
        self._skip_to(txn, check, token)
        if check._next is not None and check._next[0] == token:
            self._compare(check, token, rows, check._next[1])
            self._advance(txn, check)
        elif rows:
            check.note("extra", f"{token} (not in the table)")
        else:
            check.matched += 1  # a fact with no rows: no row in the table
        check.last = token

    def _compare(self, check: KeyCheck, token: int, rows: list[Row],
                 table_rows: list[Row] | None) -> None:
        if table_rows is None:
            if rows:
                check.note("extra", f"{token} (not in the table)")
            else:
                check.matched += 1
            return
        if rows == table_rows:
            check.matched += 1
        elif len(rows) < len(table_rows) and all(r in table_rows for r in rows):
            check.note("partial", f"{token} ({len(rows)} of {len(table_rows)} rows)")
        else:
            check.note("different rows", f"{token} ({len(rows)} rows in the file, "
                                         f"{len(table_rows)} in the table)")


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def skip_of(obj: dict[str, Any], token: int) -> tuple[int, int, int, int, str] | None:
    """``(from, to, facts, trimmed_through, at)`` of a skip line (a position
    line with a well-formed ``skip``), else None (a plain position)."""
    skip = obj.get("skip")
    if not isinstance(skip, dict):
        return None
    start, facts, boundary = (_integer(skip.get(k)) for k in ("from", "facts", "trimmed_through"))
    if start is None or facts is None or boundary is None:
        return None
    at = skip.get("at")
    return start, token, facts, boundary, at if isinstance(at, str) else "?"


def skipped_text(skips: list[tuple[int, int, int, int, str]]) -> str:
    """What the skips of a file skipped, for verify's last line."""
    facts = sum(n for _, _, n, _, _ in skips)
    return (f"{facts} fact{'' if facts == 1 else 's'} skipped by rewind --skip-to at "
            f"{', '.join(at for *_, at in skips)}")


def summary(result: Result, out: Callable[[str], None]) -> bool:
    """Print the readable summary with ``out``; True when equal."""
    rotated = len(result.files) - 1 if result.files else 0
    skip_lines = result.lines.get("skips", 0)
    out(f"verify: {result.files[-1] if result.files else '(no file)'}"
        f"{f' and {rotated} rotated files' if rotated > 0 else ''}: "
        f"{result.lines['facts']} fact lines, {result.lines['positions']} position lines, "
        f"{result.lines['rewinds']} rewind lines"
        f"{f', {skip_lines} skip lines' if skip_lines else ''}")
    for (stream, writer), check in sorted(result.keys.items()):
        counts = dict(check.counts)
        counts["missing"] += len(check.missing)
        found = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) or "no differences"
        begin = (f"from token {check.begin} of writer {writer}" if check.begin is not None
                 else "-")
        out(f"  {stream}/{writer}: {check.facts} facts, checked {begin} to {check.last}: "
            f"{check.matched} matched; {found}"
            f"{f'; {check.trimmed} trimmed from the table (not compared)' if check.trimmed else ''}"
            f"{f'; {check.superseded} handed on again after rewinds' if check.superseded else ''}"
            f"{f'; {check.behind} not yet delivered' if check.behind else ''}")
        for start, to, n, boundary, at in check.skips:
            out(f"    skipped by rewind --skip-to at {at}: facts {start + 1} to {to}, {n} of "
                f"them in the table then (facts up to {boundary} were trimmed by retention)")
        if check.missing:
            listed = sorted(check.missing)
            extra = f" (+{len(listed) - EXAMPLES} more)" if len(listed) > EXAMPLES else ""
            out(f"    missing: {', '.join(map(str, listed[:EXAMPLES]))}{extra}")
        for kind in KINDS[1:]:
            if check.examples[kind]:
                more = check.counts[kind] - len(check.examples[kind])
                out(f"    {kind}: {', '.join(check.examples[kind])}"
                    f"{f' (+{more} more)' if more else ''}")
    for problem in result.problems:
        out(f"  {problem.path} offset {problem.offset}: {problem.text}")
    if result.grown > 0:
        out(f"  {result.files[-1]}: {result.grown} bytes written after verify began (not "
            f"compared)")
    differences = result.differences
    if differences:
        out("verify: DIFFERENT: " + ", ".join(f"{n} {kind}" for kind, n in differences.items()))
        return False
    facts = sum(c.matched for c in result.keys.values())
    notes = []
    trimmed = sum(c.trimmed for c in result.keys.values())
    if trimmed:
        notes.append(f"{trimmed} trimmed from the table, not compared")
    superseded = sum(c.superseded for c in result.keys.values())
    if superseded:
        notes.append(f"{superseded} facts handed on again after rewinds")
    skips = [skip for c in result.keys.values() for skip in c.skips]
    if skips:
        notes.append(skipped_text(skips))
    noted = f" ({'; '.join(notes)})" if notes else ""
    out(f"verify: EQUAL: {facts} facts, each exactly once, in order, whole{noted}")
    return True
