"""A small PNG of facts per minute per stream, for people who would rather look.

Drawn from the committed minute aggregates (all writers summed), over the
last ``hours`` hours before the newest bucket of any stream.  Uses
matplotlib's non-interactive Agg backend; the file is written to a temporary
name and renamed, so a reader never sees half a PNG.
"""

import datetime
import os
from typing import Dict, List, Optional, Tuple


def facts_per_minute(spark, minute_path: str, hours: float) -> Dict[str, List[Tuple[int, int]]]:
    """``{stream: [(minute_ms, facts), ...]}`` over the plotted window, every
    minute from the stream's first to its last one present (0 where none)."""
    from pyspark.sql import functions as F

    if not os.path.isdir(minute_path) or not any(
            e.startswith("stream=") for e in os.listdir(minute_path)):
        return {}
    df = (spark.read.option("basePath", minute_path)
          .option("recursiveFileLookup", "false").parquet(minute_path))
    newest = df.agg(F.max("bucket_start")).first()[0]
    if newest is None:
        return {}
    cutoff = F.lit(newest) - F.expr(f"INTERVAL {int(hours * 60)} MINUTES")
    rows = (df.where(F.col("bucket_start") > cutoff)
            .groupBy("stream", F.unix_millis("bucket_start").alias("ms"))
            .agg(F.sum("facts").alias("facts")).collect())
    counts: Dict[str, Dict[int, int]] = {}
    for r in rows:
        counts.setdefault(str(r["stream"]), {})[int(r["ms"])] = int(r["facts"])
    series = {}
    for stream, by_minute in counts.items():
        first, last = min(by_minute), max(by_minute)
        series[stream] = [(ms, by_minute.get(ms, 0)) for ms in range(first, last + 1, 60_000)]
    return series


def render(series: Dict[str, List[Tuple[int, int]]], path: str, hours: float) -> str:
    """Draw ``series`` to ``path`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    try:
        for stream, points in sorted(series.items()):
            xs = [datetime.datetime.fromtimestamp(p[0] / 1000, datetime.timezone.utc)
                  .replace(tzinfo=None) for p in points]
            ys = [p[1] for p in points]
            ax.plot(xs, ys, marker="." if len(xs) < 60 else None, linewidth=1.2, label=stream)
        ax.set_title(f"Facts per minute (last {hours:g} h of exported data, UTC)")
        ax.set_xlabel("minute (UTC)")
        ax.set_ylabel("facts")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        locator = mdates.AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
        if series:
            ax.legend(loc="upper left", fontsize="small")
        fig.tight_layout()
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
    return path


def plot_facts_per_minute(spark, minute_path: str, path: str, hours: float = 24.0
                          ) -> Optional[str]:
    """Plot the committed minute aggregates; None when there is nothing to draw."""
    series = facts_per_minute(spark, minute_path, hours)
    if not series:
        return None
    return render(series, path, hours)
