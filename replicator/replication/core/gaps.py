"""Streams this instance stopped reading because retention trimmed facts
its readers (or consumers) still needed, or because what a reader handed on
is not what the table holds (:mod:`.audit`).

A reader that would have to read facts below a stream's trim boundary
(:mod:`replicator.streams.trimmed`) stops instead of skipping them; the
handler then stops every reader of that stream (:meth:`TrimGaps.report`
says which stream) and records the gap here.  A gap stays until a restart
(after an operator chose what to do: restore the facts, or accept the loss
with the ``replicator rewind --skip-to`` its text names): it is one
error line when found, a ``replicator_retention_gap`` gauge, and a health
finding (kind ``trimmed``) that fails ``/health`` and shows on the status
page, naming the consumers whose position is below the boundary.  A
mismatch is the same: one error line, the ``replicator_audit_mismatch``
gauge, a finding (kind ``audit``) naming the stream, writer and IDs, and
the ``replicator rewind --to`` that hands those facts on again.
"""

from collections.abc import Sequence

from twisted.logger import Logger

from ...consumers import Consumer
from ...keys import Key
from ...observe import metrics
from ...observe.health import Finding
from ...streams.trimmed import FactsTrimmed
from .audit import Mismatch

log = Logger(namespace="replicator.retention")
audit_log = Logger(namespace="replicator.audit")  # (a mismatch is the audit's finding)



def consumer_label(consumer: Consumer) -> str:
    """How a gap names a consumer: its file if it has one, else its class."""
    path = getattr(consumer, "path", None)
    return f"consumer {path}" if isinstance(path, str) else f"consumer {type(consumer).__name__}"


class TrimGaps:
    """The gaps found on this instance, by (stream, writer): each the
    :class:`FactsTrimmed` its reader met and the text health gives."""

    def __init__(self, config_path: str | None = None) -> None:
        self._gaps: dict[Key, tuple[FactsTrimmed, str]] = {}
        self._mismatches: dict[Key, tuple[Mismatch, str]] = {}
        #: The instance's config file, as the gap's command names it.
        self.config_path = config_path

    def report(self, gap: FactsTrimmed, consumers: Sequence[Consumer]) -> str:
        """Record ``gap`` (met by the reader of ``gap.writer``; ``consumers``
        take the stream); its health line, logged once."""
        key = (gap.stream, gap.writer)
        if key in self._gaps:
            return self._gaps[key][1]
        behind = []
        for consumer in consumers:
            try:
                position = consumer.positions().get(key)
            except Exception:  # a broken consumer still gets its gap reported
                position = None
            if position is not None and position < gap.boundary:
                behind.append((position, consumer_label(consumer), consumer))
        if behind:
            since = min(p for p, _, _ in behind)
            apart = len({p for p, _, _ in behind}) > 1  # then each says where it is
            who = ", ".join(f"{label} (at {p})" if apart else label for p, label, _ in behind)
            first = f"{who} {'needs' if len(behind) == 1 else 'need'} facts of writer " \
                    f"{gap.writer} after {since}"
            todo = self._todo(gap, [c for _, _, c in behind])
        else:
            since = gap.since
            first = f"the reader of writer {gap.writer} needs facts after {since}"
            todo = "restart this instance (no consumer is behind the boundary)"
        text = (f"stream {gap.stream}: {first} but facts up to {gap.boundary} were trimmed "
                f"by retention; the stream is stopped here: {todo}")
        self._gaps[key] = (gap, text)
        metrics.RETENTION_GAP.labels(gap.stream, gap.writer).set(1)
        log.error("{text}", text=text)
        return text

    def _todo(self, gap: FactsTrimmed, behind: Sequence[Consumer]) -> str:
        """What the operator does: restore the facts, or accept the loss
        (docs/operations.md, "Retention gaps"), with the exact command for
        each consumer that has a file."""
        config = self.config_path or "CONFIG"
        paths = [getattr(c, "path", None) for c in behind]
        commands = [f"`replicator rewind -c {config} {path} --stream {gap.stream} "
                    f"--skip-to boundary`" for path in paths if isinstance(path, str)]
        others = len(behind) - len(commands)
        run = f"run {' and '.join(commands)}" if commands else ""
        move = (f"{'and ' if commands else ''}move the other consumers past {gap.boundary}"
                if others else "")
        return (f"to accept the loss, stop this instance, {run}{' ' if run and move else ''}"
                f"{move}, then start it (or restore the facts: docs/operations.md, "
                f"\"Retention gaps\")")

    def report_mismatch(self, found: Mismatch, consumers: Sequence[Consumer]) -> str:
        """Record ``found`` (``consumers`` take the stream); its health
        line, logged once per (stream, writer)."""
        key = (found.stream, found.writer)
        if key in self._mismatches:
            return self._mismatches[key][1]
        config = self.config_path or "CONFIG"
        back = found.first - 1
        paths = [p for p in (getattr(c, "path", None) for c in consumers) if isinstance(p, str)]
        commands = [f"`replicator rewind -c {config} {path} --stream {found.stream} --to {back}`"
                    for path in paths]
        how = ("a fact arrived that a POSITION had said was not there"
               if found.how.startswith("late fact") else "the audit compared it with the table")
        if found.how.endswith("before a restart"):
            how += ", before this instance restarted"
        todo = (f"to hand them on again, stop this instance, run {' and '.join(commands)}, "
                f"then start it" if commands else
                "restart this instance to read them again from the table")
        text = (f"stream {found.stream}: what was delivered of writer {found.writer} in "
                f"({found.since}, {found.upto}] is not what the table holds ({how}): "
                f"{found.describe()}; the stream is stopped here: {todo}")
        self._mismatches[key] = (found, text)
        metrics.AUDIT_MISMATCH.labels(found.stream, found.writer).set(1)
        audit_log.error("{text}", text=text)
        return text

    def stopped(self, stream: str) -> bool:
        """Whether a gap or a mismatch stopped ``stream`` here."""
        return any(s == stream for s, _ in [*self._gaps, *self._mismatches])

    def mismatch(self, stream: str, writer: str) -> Mismatch | None:
        found = self._mismatches.get((stream, writer))
        return found[0] if found is not None else None

    def gap(self, stream: str, writer: str) -> FactsTrimmed | None:
        found = self._gaps.get((stream, writer))
        return found[0] if found is not None else None

    def findings(self) -> list[Finding]:
        """One finding per gap and per mismatch, failing ``/health``, in
        (stream, writer) order."""
        gaps = [Finding("trimmed", key[0], key[1], text,
                        f"stopped: facts up to {gap.boundary} trimmed, needed after {gap.since}")
                for key, (gap, text) in sorted(self._gaps.items())]
        return gaps + [Finding("audit", key[0], key[1], text,
                               f"stopped: delivered facts differ from the table in "
                               f"({found.since}, {found.upto}]")
                       for key, (found, text) in sorted(self._mismatches.items())]
