"""What one export run is asked for besides the database and the streams
(the command line's options, as one value the planner and the run share)."""

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class ExportOptions:
    """Everything a run takes besides the database and the streams."""

    output: str
    master: str | None = None
    partitions: int = 4
    shuffle_partitions: int = 8
    streams: Sequence[str] | None = None  # names; None = all configured
    since_ms: int | None = None
    until_ms: int | None = None
    full: bool = False
    jdbc_jar: str | None = None
    plot: str | None = None
    plot_hours: float = 24.0
    progress_interval: float = 2.0
    spark_conf: dict[str, str] = field(default_factory=dict)  # --conf KEY=VALUE
    now_ms: int | None = None  # the run's time (tests); default: the clock
    keep_previous: int = 1  # generations kept below the current one (--keep)
    #: --accept-trimmed: export what the table keeps over a range retention
    #: trimmed before the export read it, recording the range (else refused).
    accept_trimmed: bool = False
