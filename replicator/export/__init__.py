"""Spark exporter: per-stream aggregates of the streams' backing tables.

``replicator-export`` (:mod:`replicator.export.cli`) reads every configured
stream's backing table through Spark's JDBC source and writes Parquet
aggregates (per stream x writer x minute/hour bucket) that an operator can
chart.  It only ever exports *final* facts: IDs at or below the stream's
linear persisted position (the minimum over its configured writers in
``stream_positions``), and it is incremental (per-stream state of the last
exported token) and atomic (a generation directory swapped in with one
symlink rename).

Modules:

* :mod:`.source`    -- JDBC driver discovery, positions and bounds queries,
  the partitioned JDBC read;
* :mod:`.state`     -- incremental state and the generation/commit protocol
  of the output directory;
* :mod:`.aggregate` -- the Spark aggregation;
* :mod:`.reference` -- the same aggregation in plain Python (tests, bench);
* :mod:`.plan`      -- planning one stream's run (range, dates, next state);
* :mod:`.spark`     -- the SparkSession and the settings a run needs;
* :mod:`.job`       -- running one export;
* :mod:`.plot`      -- the optional facts-per-minute PNG;
* :mod:`.cli`       -- the console script.

The definitions every implementation here shares are in :mod:`.reference`'s
docstring.
"""
