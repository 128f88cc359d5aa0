"""The ``log`` consumer: one log line per fact; keeps nothing (always live)."""

from collections.abc import Sequence
from typing import Any

from twisted.logger import Logger, LogLevel

from ..config import ConfigError, ConsumerConfig, get_str, no_unknown
from ..jsontext import preview_json
from .base import STARTS, Consumer, Row

LOG_LEVELS = {
    "debug": LogLevel.debug, "info": LogLevel.info, "warn": LogLevel.warn,
    "error": LogLevel.error, "critical": LogLevel.critical,
}


def preview(rows: list[Row], limit: int = 200) -> str:
    """Compact JSON of ``rows``, cut to ``limit`` characters (ending in …).

    Only the first ``limit`` rows are encoded, whatever the size of the
    fact: each takes at least 3 characters, so the cut falls inside them."""
    text = preview_json(rows[:limit] if len(rows) > limit else rows)
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return text


class LogConsumer(Consumer):
    """Logs one line per fact: ``stream/writer token: N rows [preview]``.

    Keeps nothing, so :meth:`positions` is empty (always live).  ``logger``
    (tests) defaults to one in the ``replicator.consumers.log`` namespace.
    """

    def __init__(self, streams: Sequence[str] | None = None, level: str = "info",
                 logger: Logger | None = None, preview_chars: int = 200,
                 start: str = "now") -> None:
        if start not in STARTS:
            raise ValueError(f"start {start!r} is not one of {', '.join(STARTS)}")
        self.start = start
        if level not in LOG_LEVELS:
            raise ValueError(f"level {level!r} is not one of {', '.join(LOG_LEVELS)}")
        self.streams = tuple(streams) if streams is not None else None
        self.level = LOG_LEVELS[level]
        self.preview_chars = preview_chars
        self.log = logger if logger is not None else Logger(namespace="replicator.consumers.log")

    def on_facts(self, stream: str, writer: str, token: int, rows: list[Row]) -> None:
        self.log.emit(self.level, "{stream}/{writer} {token}: {count} {noun} {preview}",
                      stream=stream, writer=writer, token=token, count=len(rows),
                      noun="row" if len(rows) == 1 else "rows",
                      preview=preview(rows, self.preview_chars))


def options_of(config: ConsumerConfig, where: str) -> dict[str, str]:
    """The keyword arguments of a :class:`LogConsumer` (options ``level``;
    ``start``, default ``now``: it keeps no position, so with ``beginning``
    every start logs every fact still in the tables again)."""
    options = config.options
    no_unknown(options, ("level", "start"), where)
    level = get_str(options, "level", where, "info")
    if level not in LOG_LEVELS:
        raise ConfigError(f"{where}.level", f"{level!r} is not one of {', '.join(LOG_LEVELS)}")
    start = get_str(options, "start", where, "now")
    if start not in STARTS:
        raise ConfigError(f"{where}.start", f"{start!r} is not one of {', '.join(STARTS)}")
    return {"level": level, "start": start}


def build(config: ConsumerConfig, base_dir: str, where: str, reactor: Any) -> Consumer:
    """A :class:`LogConsumer` from its config (:func:`options_of`)."""
    options = options_of(config, where)
    return LogConsumer(streams=config.streams, level=options["level"], start=options["start"])
