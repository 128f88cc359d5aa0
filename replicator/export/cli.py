"""``replicator-export``: export stream aggregates to Parquet with Spark.

Runs as a console script (local Spark, ``--master`` default ``local[*]``) or
under ``spark-submit`` (``spark-submit --jars /usr/share/java/postgresql.jar
replicator/export/cli.py -c CONF -o OUT`` with the package installed; the
master then comes from ``spark-submit``).  The output path must be
a filesystem every executor and the driver share (the atomic commit is a
POSIX rename).

Progress goes to stderr, the summary table to stdout.  Exit status: 0 done
(also when there was nothing new), 1 the export failed (the previous export
stays current; also a run refused because retention trimmed facts it needs,
one line naming the range and ``--accept-trimmed``), 2 a configuration or
usage mistake, 130 interrupted.
"""

import argparse
import datetime
import logging
import re
import sys
from collections.abc import Callable

from replicator.config import ConfigError, load_yaml, parse_database, parse_streams

log = logging.getLogger("replicator.export")

#: The one line printed (exit 1) when PySpark is not installed.
SPARK_MISSING = ("replicator-export: PySpark is not installed: install the spark extra "
                 "(pip install -e '.[spark]' in the checkout, e.g. .venv/bin/pip install -e "
                 "'.[spark]'; make test-deps does it) and Java 17 (apt-get install "
                 "default-jre-headless)")


def parse_time(text: str) -> int:
    """``--since``/``--until``: ISO 8601 (UTC unless it says otherwise) or
    integer milliseconds since the epoch -> milliseconds."""
    text = text.strip()
    if re.fullmatch(r"-?\d{10,}", text):
        return int(text)
    try:
        value = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO 8601 date/time (e.g. 2024-05-01 or "
            "2024-05-01T12:00:00Z) nor epoch milliseconds") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    return int(value.timestamp() * 1000)


def _at_least(minimum: int, message: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, else ``message``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(message)
        return value
    return parse


_positive = _at_least(1, "must be at least 1")
_non_negative = _at_least(0, "must be 0 or more")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="replicator-export",
        description="Export per-stream aggregates (minute/hour buckets) of the streams' "
                    "backing tables to Parquet, incrementally and atomically, with Spark.",
    )
    p.add_argument("-c", "--config", required=True, help="the instance's YAML configuration")
    p.add_argument("-o", "--output", default="var/export",
                   help="output directory (default: var/export); read OUTPUT/current/minute "
                        "and OUTPUT/current/hour")
    p.add_argument("--master", default=None,
                   help="Spark master (default: local[*]; under spark-submit, its master)")
    p.add_argument("--partitions", type=_positive, default=4,
                   help="JDBC read partitions per stream, over the ID column (default: 4)")
    p.add_argument("--shuffle-partitions", type=_positive, default=8,
                   help="spark.sql.shuffle.partitions (default: 8)")
    p.add_argument("--streams", action="append", default=None, metavar="NAME[,NAME...]",
                   help="export only these streams (default: all configured)")
    p.add_argument("--since", type=parse_time, default=None, metavar="TIME",
                   help="on a stream's first export, start at its first fact timed at or "
                        "after TIME (ISO 8601, UTC by default, or epoch ms)")
    p.add_argument("--until", type=parse_time, default=None, metavar="TIME",
                   help="export only up to (excluding) the first fact timed at or after TIME")
    p.add_argument("--full", action="store_true",
                   help="forget the selected streams' previous export and rebuild it")
    p.add_argument("--accept-trimmed", action="store_true",
                   help="where retention trimmed facts this run needs before it read them, "
                        "export what the table keeps and record the range in state.json and "
                        "the summary (without it such a run is refused, exit 1)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw facts per minute per stream to this PNG file")
    p.add_argument("--plot-hours", type=float, default=24.0,
                   help="hours of data the plot shows (default: 24)")
    p.add_argument("--jdbc-jar", default=None,
                   help="JDBC driver jar (default: Debian's, from /usr/share/java)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Spark configuration, e.g. --conf spark.driver.memory=4g")
    p.add_argument("--keep", type=_non_negative, default=1, metavar="N",
                   help="previous generations kept beside the current one, for readers "
                        "still in them (default: 1; older ones are removed after a commit)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format="%(asctime)s replicator-export: %(message)s", datefmt="%H:%M:%S",
    )
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        doc = load_yaml(args.config)
        if not isinstance(doc, dict):
            raise ConfigError("file", f"{args.config} is not a mapping")
        db = parse_database(doc.get("database"))
        streams = parse_streams(doc.get("streams"))
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    names = None
    if args.streams:
        names = [n for item in args.streams for n in item.split(",") if n]
        known = {s.name for s in streams}
        unknown = [n for n in names if n not in known]
        if unknown:
            print(f"replicator-export: --streams: unknown stream(s) {', '.join(unknown)} "
                  f"(configured: {', '.join(sorted(known)) or 'none'})", file=sys.stderr)
            return 2
    if not streams:
        print("config: streams: no stream is configured", file=sys.stderr)
        return 2
    if args.since is not None and args.until is not None and args.since >= args.until:
        print("replicator-export: --since must be before --until", file=sys.stderr)
        return 2

    spark_conf = {}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            print(f"replicator-export: --conf {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        spark_conf[key.strip()] = value

    try:
        import pyspark.sql  # noqa: F401
    except ImportError:
        print(SPARK_MISSING, file=sys.stderr)
        return 1

    from replicator.export.job import format_summary, run_export
    from replicator.export.options import ExportOptions
    from replicator.export.source import SourceError
    from replicator.export.state import StateError

    options = ExportOptions(
        output=args.output, master=args.master, partitions=args.partitions,
        shuffle_partitions=args.shuffle_partitions, streams=names, since_ms=args.since,
        until_ms=args.until, full=args.full, jdbc_jar=args.jdbc_jar, plot=args.plot,
        plot_hours=args.plot_hours, progress_interval=0 if args.quiet else 2.0,
        spark_conf=spark_conf, keep_previous=args.keep, accept_trimmed=args.accept_trimmed,
    )
    try:
        result = run_export(db, streams, options)
    except (SourceError, StateError) as e:
        print(f"replicator-export: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("replicator-export: interrupted; the previous export is unchanged",
              file=sys.stderr)
        return 130
    except Exception as e:  # Spark/JDBC failures: one line, the rest in the log
        log.debug("export failed", exc_info=True)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"replicator-export: export failed ({type(e).__name__}): {first}; "
              "the previous export is unchanged", file=sys.stderr)
        return 1
    print(format_summary(result))
    return 0


if __name__ == "__main__":  # spark-submit replicator/export/cli.py ...
    sys.exit(main())
