"""What replicator knows of Synapse (pinned: 1.163.2): its stream names, and
presets for the streams that can be read from one of its tables.

Facts only (checked against that version's schema and stream definitions,
and exercised by ``make interop``); nothing here is Synapse's code.

* :data:`STREAM_NAMES` — every stream name Synapse has (or had): beside a
  Synapse, replicator never writes one of these.
* :data:`PRESETS` — ``synapse/<stream>``: the table, ID column, writer
  column, sequence and RDATA row layout of a stream Synapse writes into one
  table.  A preset stream is read-only here, and never created.
* :data:`REFUSED` — streams that cannot be caught up from one table, with
  the reason given to the operator.
"""

from collections.abc import Iterable
from typing import Any

#: Streams of Synapse 1.163.2 (synapse/replication/tcp/streams), plus names
#: earlier versions used: a stream of ours must never take one of them.
STREAM_NAMES = frozenset({
    "events", "backfill", "presence", "presence_federation", "typing", "receipts",
    "push_rules", "pushers", "caches", "device_lists", "to_device", "federation",
    "account_data", "un_partial_stated_room", "un_partial_stated_event",
    "thread_subscriptions", "profile_updates", "sticky_events", "quarantined_media",
    # Earlier versions (still refused: an older Synapse may share the Redis).
    "tag_account_data", "groups", "user_signature", "public_rooms", "cache_invalidation",
})

#: Synapse's main process: the writer of every stream unless its
#: ``stream_writers`` config moves one to a worker.
MAIN_PROCESS = "master"


def _preset(table: str, sequence: str, columns: Iterable[tuple[str, str]],
            writer_column: str | None = "instance_name", json_text: Iterable[str] = (),
            positions_name: str | None = None) -> dict[str, Any]:
    return {"table": table, "id_column": "stream_id", "writer_column": writer_column,
            "sequence": sequence, "columns": [dict([c]) for c in columns],
            "json_text": frozenset(json_text), "positions_name": positions_name}


#: ``synapse/<name>`` → the stream's layout.  ``columns`` are the fields of
#: Synapse's RDATA row for that stream, in wire order, as they are stored;
#: ``json_text`` names columns Synapse keeps as JSON in a TEXT column (sent
#: decoded on the wire).  ``positions_name`` is the ``stream_name`` under
#: which Synapse's ID generator persists its positions in ``stream_positions``
#: (its generator's name, not always the stream's; None: the stream's): the
#: exporter's bound.  ``presence`` and ``push_rules`` have an
#: ``instance_name`` column, but Synapse reads their facts without it (rows
#: from before it was added hold NULL): here too, with one writer.
PRESETS: dict[str, dict[str, Any]] = {
    "caches": _preset(
        "cache_invalidation_stream_by_instance", "cache_invalidation_stream_seq",
        [("cache_func", "text"), ("keys", "json?"), ("invalidation_ts", "bigint?")]),
    "presence": _preset(
        "presence_stream", "presence_stream_sequence",
        [("user_id", "text"), ("state", "text"), ("last_active_ts", "bigint"),
         ("last_federation_update_ts", "bigint"), ("last_user_sync_ts", "bigint"),
         ("status_msg", "text?"), ("currently_active", "boolean")],
        writer_column=None, positions_name="presence_stream"),
    "receipts": _preset(
        "receipts_linearized", "receipts_sequence",
        [("room_id", "text"), ("receipt_type", "text"), ("user_id", "text"),
         ("event_id", "text"), ("thread_id", "text?"), ("data", "json")],
        json_text=("data",)),
    "push_rules": _preset(
        "push_rules_stream", "push_rules_stream_sequence", [("user_id", "text")],
        writer_column=None, positions_name="push_rules_stream"),
    "un_partial_stated_room": _preset(
        "un_partial_stated_room_stream", "un_partial_stated_room_stream_sequence",
        [("room_id", "text")], positions_name="un_partial_stated_room_stream"),
    "un_partial_stated_event": _preset(
        "un_partial_stated_event_stream", "un_partial_stated_event_stream_sequence",
        [("event_id", "text"), ("rejection_status_changed", "boolean")],
        positions_name="un_partial_stated_event_stream"),
}

_MEMORY = ("is held in Synapse's memory, not in a table: it cannot be caught up after "
           "a gap, so replicator does not read it")
_TABLES = "is written to several tables (no single table holds every fact)"

#: Streams with no preset, and why.
REFUSED: dict[str, str] = {
    "typing": _MEMORY,
    "federation": _MEMORY,
    "presence_federation": _MEMORY,
    "events": _TABLES + " and its rows are built from the events themselves",
    "backfill": _TABLES + " and its IDs run backwards (negative)",
    "account_data": _TABLES + ": account_data, room_account_data and room_tags_revisions",
    "to_device": _TABLES + ": device_inbox and device_federation_outbox",
    "device_lists": _TABLES + ": device_lists_stream and device_lists_changes_in_room",
    "pushers": _TABLES + ": pushers and deleted_pushers",
    "thread_subscriptions": "keeps one row per subscription, updated in place (its IDs "
                            "move), so the table cannot replay the stream",
}
_NO_PRESET = "has no preset: its rows are not its table's columns as stored"
for _name in ("profile_updates", "sticky_events", "quarantined_media"):
    REFUSED[_name] = _NO_PRESET
