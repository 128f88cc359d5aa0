"""A small PNG of facts per minute per stream, for people who would rather look.

Drawn from the committed minute aggregates (all writers summed), over the
last ``hours`` hours before the newest bucket of any stream, by event time:
streams without a ``timestamp_column`` (bucketed by the export run's time)
are left out and named under the plot, and the minute still running is not
drawn (its partial count would look like a drop).  Uses
matplotlib's non-interactive Agg backend; the file is written to a temporary
name and renamed, so a reader never sees half a PNG.
"""

import datetime
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # PySpark and matplotlib are the exporter's extra
    from matplotlib.figure import Figure
    from pyspark.sql import SparkSession


def facts_per_minute(spark: "SparkSession", minute_path: str,
                     hours: float) -> dict[str, list[tuple[int, int]]]:
    """``{stream: [(minute_ms, facts), ...]}`` over the plotted window, every
    minute from the stream's first to its last one present (0 where none)."""
    from pyspark.sql import functions as F

    if not os.path.isdir(minute_path) or not any(
            e.startswith("stream=") for e in os.listdir(minute_path)):
        return {}
    df = (spark.read.option("basePath", minute_path)
          .option("recursiveFileLookup", "false").parquet(minute_path))
    top = df.agg(F.max("bucket_start")).first()
    newest = None if top is None else top[0]
    if newest is None:
        return {}
    cutoff = F.lit(newest) - F.expr(f"INTERVAL {int(hours * 60)} MINUTES")
    rows = (df.where(F.col("bucket_start") > cutoff)
            .groupBy("stream", F.unix_millis("bucket_start").alias("ms"))
            .agg(F.sum("facts").alias("facts")).collect())
    counts: dict[str, dict[int, int]] = {}
    for r in rows:
        counts.setdefault(str(r["stream"]), {})[int(r["ms"])] = int(r["facts"])
    series = {}
    for stream, by_minute in counts.items():
        first, last = min(by_minute), max(by_minute)
        series[stream] = [(ms, by_minute.get(ms, 0)) for ms in range(first, last + 1, 60_000)]
    return series


#: The plot spans at least this much time, so that its ticks are minutes.
MIN_SPAN_MS = 10 * 60_000


def complete_minutes(series: dict[str, list[tuple[int, int]]], now_ms: int
                     ) -> dict[str, list[tuple[int, int]]]:
    """``series`` without the minute still running at ``now_ms`` (its count
    is partial: drawn, it looks like a drop in the rate)."""
    out = {}
    for stream, points in series.items():
        kept = [p for p in points if p[0] + 60_000 <= now_ms]
        if kept:
            out[stream] = kept
    return out


def figure(series: dict[str, list[tuple[int, int]]], hours: float,
           left_out: Sequence[str] = ()) -> "Figure":
    """The matplotlib figure of ``series`` (complete minutes only); the
    legend sits beside the axes, never over the data.  ``left_out`` names
    the streams not drawn because they have no event time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    def when(ms: int) -> float:
        """The x of a time: matplotlib's date number of its naive UTC datetime."""
        day: float = mdates.date2num(
            datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)
            .replace(tzinfo=None))
        return day

    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    first: int | None = None
    last: int | None = None
    for stream, points in sorted(series.items()):
        xs = [when(p[0]) for p in points]
        ys = [p[1] for p in points]
        ax.plot(xs, ys, marker="." if len(xs) < 60 else None, linewidth=1.2, label=stream)
        first = points[0][0] if first is None else min(first, points[0][0])
        last = points[-1][0] if last is None else max(last, points[-1][0])
    ax.set_title(f"Facts per minute by event time (last {hours:g} h of exported data)")
    ax.set_xlabel("event time (UTC), one point per complete minute")
    ax.set_ylabel("facts per minute")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if first is not None and last is not None:
        span = max(last - first, MIN_SPAN_MS)
        ax.set_xlim(when(last - span), when(last))
    locator = mdates.AutoDateLocator(minticks=3, maxticks=9)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(
        locator, formats=["%Y", "%b", "%d", "%H:%M", "%H:%M", "%H:%M:%S"]))
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                  fontsize="small")
    if left_out:
        fig.text(0.01, 0.01, "not plotted (no timestamp_column, so no event time): "
                 + ", ".join(sorted(left_out)), fontsize="small", color="#555555")
    fig.tight_layout(rect=(0, 0.04 if left_out else 0, 1, 1))
    return fig


def render(series: dict[str, list[tuple[int, int]]], path: str, hours: float,
           left_out: Sequence[str] = ()) -> str:
    """Draw ``series`` to ``path`` (PNG); returns the path."""
    import matplotlib.pyplot as plt

    fig = figure(series, hours, left_out)
    try:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
    return path


def plot_facts_per_minute(spark: "SparkSession", minute_path: str, path: str, hours: float = 24.0,
                          timed: Iterable[str] | None = None,
                          now_ms: int | None = None) -> str | None:
    """Plot the committed minute aggregates; None when there is nothing to draw.

    Only the streams in ``timed`` (those with a ``timestamp_column``; None:
    all) are drawn: the others are bucketed by the export run's time, which
    is not when their facts happened.  The minute running at ``now_ms`` is
    left out (its count is partial)."""
    series = facts_per_minute(spark, minute_path, hours)
    left_out: list[str] = []
    if timed is not None:
        timed = set(timed)
        left_out = [s for s in series if s not in timed]
        series = {s: p for s, p in series.items() if s in timed}
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    series = complete_minutes(series, now_ms)
    if not series:
        return None
    return render(series, path, hours, left_out)
