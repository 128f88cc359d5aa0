"""Incremental state and the atomic layout of the export's output directory.

Layout of ``OUTPUT`` (the ``--output`` path)::

    OUTPUT/
      current -> gen-00000007        symlink, swapped by one rename(2)
      gen-00000007/
        state.json                   ExportState of this generation
        minute/stream=S/date=D/*.parquet
        hour/stream=S/date=D/*.parquet
      gen-00000006/                  the previous generation, kept for
                                     readers that were in the middle of it
      .staging-*/                    a run in progress (or a dead one)
      .lock                          flock: one exporter at a time

Invariants:

* ``current`` always names a complete generation: a run builds the next one
  in a staging directory (new partitions written by Spark, unchanged ones
  hard-linked from the current generation -- files are never modified once
  written), fsyncs it, renames it to ``gen-N`` and only then swaps the
  symlink.  A run that fails or is killed at any point leaves ``current``
  and what it names untouched; its leftovers are removed by the next run.
* The state file lives *inside* the generation, so the tokens it records
  and the Parquet it describes become visible together: the state is never
  ahead of (nor behind) the output.
* Readers read ``OUTPUT/current/minute`` and ``OUTPUT/current/hour``
  (Spark/pyarrow partition discovery yields the ``stream`` and ``date``
  columns).
"""

import errno
import fcntl
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

STATE_FILE = "state.json"
#: 2: the columns ``delay_ms_p50/p95/p99`` are named ``gap_ms_p50/p95/p99``
#: (an incremental run on a version 1 export would mix both in one dataset).
STATE_VERSION = 2
DATASETS = ("minute", "hour")
GEN_RE = re.compile(r"^gen-(\d{8,})$")
# Characters Spark escapes in partition values (ExternalCatalogUtils).
_SPARK_ESCAPED = set('"#%\'*/:=?\\\x7f{[]^')


class StateError(RuntimeError):
    """The output directory cannot be used (locked, unreadable state): one line."""


@dataclass
class StreamState:
    """What one stream's export has covered so far.

    * ``token``: every ID at or below it is exported (or is a gap that will
      be counted with the next fact); the next run reads above it.
    * ``last_fact``: the largest exported fact ID (None before the first).
    * ``dates``: per UTC date with exported facts, ``[first, prev]``: the
      smallest fact ID of that date and the fact ID just below it (None for
      the stream's first fact).  Both are fixed once written: later facts
      have larger IDs.  They let a run re-aggregate a date from its first
      fact (a late fact can land on a date already exported).
    * ``observed``: ``[lo, hi, ms]``: a fact in ``(lo, hi]`` without a row
      time is timed ``ms`` (the run that exported it).
    * ``layout``: the table layout the export was made from; a change needs
      ``--full``.
    * ``facts``/``rows``/``rollbacks``: totals exported so far.
    * ``trimmed``: ``[lo, hi]`` per range ``(lo, hi]`` retention trimmed
      before the export read it, accepted with ``--accept-trimmed``: the
      facts there that are not in the export (or no longer in the buckets
      of a date rebuilt since) are unknown, and the rollbacks just above
      such a range are not counted.
    """

    token: int
    last_fact: int | None = None
    dates: dict[str, list[int | None]] = field(default_factory=dict)
    observed: list[list[int]] = field(default_factory=list)
    layout: dict[str, str | None] = field(default_factory=dict)
    facts: int = 0
    rows: int = 0
    rollbacks: int = 0
    updated_at: str | None = None
    trimmed: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "StreamState":
        return cls(
            token=int(doc["token"]),
            last_fact=None if doc.get("last_fact") is None else int(doc["last_fact"]),
            dates={d: [v[0], v[1]] for d, v in doc.get("dates", {}).items()},
            observed=[[int(a), int(b), int(c)] for a, b, c in doc.get("observed", [])],
            layout=dict(doc.get("layout", {})),
            facts=int(doc.get("facts", 0)),
            rows=int(doc.get("rows", 0)),
            rollbacks=int(doc.get("rollbacks", 0)),
            updated_at=doc.get("updated_at"),
            trimmed=[[int(a), int(b)] for a, b in doc.get("trimmed", [])],
        )


@dataclass
class ExportState:
    """The state of one generation: per stream, what is exported."""

    generation: int = 0
    streams: dict[str, StreamState] = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {
            "version": STATE_VERSION,
            "generation": self.generation,
            "streams": {name: asdict(s) for name, s in sorted(self.streams.items())},
        }
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "ExportState":
        doc = json.loads(text)
        version = doc.get("version")
        if version == 1:
            raise StateError("this export was made by replicator 0.2 or older, whose columns "
                             "delay_ms_p50/p95/p99 are now gap_ms_p50/p95/p99: move the output "
                             "directory away and export again")
        if version != STATE_VERSION:
            raise StateError(f"state file version {version!r} is not {STATE_VERSION}")
        return cls(
            generation=int(doc.get("generation", 0)),
            streams={n: StreamState.from_json(s) for n, s in doc.get("streams", {}).items()},
        )


def escape_partition_value(value: str) -> str:
    """A partition value as Spark writes it in a directory name (``%XX``)."""
    return "".join(
        f"%{ord(ch):02X}" if ch in _SPARK_ESCAPED or ord(ch) < 0x20 else ch for ch in value
    )


def _fsync_path(path: str, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (then ``root`` itself)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath, directory=True)


def link_tree(src: str, dst: str) -> int:
    """Recreate ``src`` at ``dst`` with hard links (copies across devices).

    Safe because exported files are never modified in place.  Returns the
    number of files linked.
    """
    count = 0
    for dirpath, _dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target_dir = os.path.normpath(os.path.join(dst, rel))
        os.makedirs(target_dir, exist_ok=True)
        for name in filenames:
            s, d = os.path.join(dirpath, name), os.path.join(target_dir, name)
            try:
                os.link(s, d)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
                shutil.copy2(s, d)
            count += 1
    return count


class Staging:
    """The next generation being built; nothing here is visible until commit."""

    def __init__(self, store: "OutputStore", path: str):
        self.store = store
        self.path = path

    def stream_dir(self, dataset: str, stream: str) -> str:
        """Where the stream's partitions of ``dataset`` go (``.../stream=S``)."""
        return os.path.join(self.path, dataset, f"stream={escape_partition_value(stream)}")

    def carry_stream(self, stream: str, keep_date: Callable[[str], bool] = lambda d: True
                     ) -> int:
        """Link the current generation's partitions of ``stream`` whose date
        ``keep_date`` accepts into this staging generation."""
        current = self.store.current_path()
        if current is None:
            return 0
        count = 0
        for dataset in DATASETS:
            src = os.path.join(current, dataset, f"stream={escape_partition_value(stream)}")
            if not os.path.isdir(src):
                continue
            for entry in sorted(os.listdir(src)):
                if not entry.startswith("date=") or not keep_date(entry[len("date="):]):
                    continue
                count += link_tree(os.path.join(src, entry),
                                   os.path.join(self.stream_dir(dataset, stream), entry))
        return count


class OutputStore:
    """The output directory: its lock, its current generation, its commits."""

    def __init__(self, path: str, keep_previous: int = 1):
        self.path = os.path.abspath(path)
        self.keep_previous = keep_previous
        self._lock_fd: int | None = None

    # -------------------------------------------------------------- lock
    def lock(self) -> None:
        """Take the exporter lock (non-blocking); StateError if held."""
        os.makedirs(self.path, exist_ok=True)
        fd = os.open(os.path.join(self.path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StateError(f"another export is running on {self.path}") from None
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------ reading
    def current_path(self) -> str | None:
        link = os.path.join(self.path, "current")
        if not os.path.islink(link):
            return None
        target = os.readlink(link)
        full = os.path.join(self.path, target)
        return full if os.path.isdir(full) else None

    def load_state(self) -> ExportState:
        current = self.current_path()
        if current is None:
            return ExportState()
        try:
            with open(os.path.join(current, STATE_FILE), encoding="utf-8") as f:
                return ExportState.from_json(f.read())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StateError(f"cannot read {current}/{STATE_FILE}: {e}") from None

    def _generations(self) -> list[int]:
        numbers = []
        for name in os.listdir(self.path):
            m = GEN_RE.match(name)
            if m:
                numbers.append(int(m.group(1)))
        return sorted(numbers)

    # ------------------------------------------------------------ writing
    def begin(self) -> Staging:
        """Remove what dead runs left and start a staging generation."""
        if self._lock_fd is None:
            raise StateError("begin() without the lock")
        self._cleanup(keep_previous=self.keep_previous)
        path = os.path.join(self.path, f".staging-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(path)
        return Staging(self, path)

    def abort(self, staging: Staging) -> None:
        shutil.rmtree(staging.path, ignore_errors=True)

    def commit(self, staging: Staging, state: ExportState) -> str:
        """Make ``staging`` the current generation, with ``state``.

        Returns the new generation's path.  Either the symlink swap happens
        (and everything it names is on disk) or ``current`` is unchanged.
        """
        number = max(self._generations() + [state.generation]) + 1
        state.generation = number
        for dataset in DATASETS:
            os.makedirs(os.path.join(staging.path, dataset), exist_ok=True)
        with open(os.path.join(staging.path, STATE_FILE), "w", encoding="utf-8") as f:
            f.write(state.to_json())
        fsync_tree(staging.path)
        name = f"gen-{number:08d}"
        final = os.path.join(self.path, name)
        os.rename(staging.path, final)
        tmp_link = os.path.join(self.path, f".current-{uuid.uuid4().hex[:8]}")
        os.symlink(name, tmp_link)
        os.replace(tmp_link, os.path.join(self.path, "current"))
        _fsync_path(self.path, directory=True)
        self._cleanup(keep_previous=self.keep_previous)
        return final

    def _cleanup(self, keep_previous: int) -> None:
        """Remove staging leftovers and generations older than the kept ones.

        Kept: the current generation and the ``keep_previous`` newest ones
        below it.  A generation *above* the current one is a run that died
        between its rename and its symlink swap: removed.
        """
        current = self.current_path()
        current_no = None
        if current is not None:
            m = GEN_RE.match(os.path.basename(current))
            current_no = int(m.group(1)) if m else None
        numbers = self._generations()
        older = [n for n in numbers if current_no is not None and n < current_no]
        keep = set(older[-keep_previous:]) if keep_previous else set()
        if current_no is not None:
            keep.add(current_no)
        for n in numbers:
            if n not in keep:
                shutil.rmtree(os.path.join(self.path, f"gen-{n:08d}"), ignore_errors=True)
        for name in os.listdir(self.path):
            if name.startswith(".staging-") or name.startswith(".current-"):
                full = os.path.join(self.path, name)
                if os.path.islink(full) or os.path.isfile(full):
                    os.unlink(full)
                else:
                    shutil.rmtree(full, ignore_errors=True)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
