"""Synapse's side, for the tests that run beside it: its tables as its
schema creates them (:data:`SYNAPSE_CACHES_DDL`, :data:`SYNAPSE_EXPORT_DDL`),
a stream read from them (:data:`READER`) and one of our own on our channel
(:data:`OWN`), SQL on its database (:func:`_pg`), a raw Redis command
(:func:`redis_call`), a recorder of a Redis channel
(:class:`ChannelRecorder`) and the tokens a consumer was handed
(:func:`tokens`).  Test modules take them from here, never from one
another."""

import socket

import psycopg2

# Synapse's own cache invalidation table, as its schema creates it.
SYNAPSE_CACHES_DDL = [
    "CREATE SEQUENCE cache_invalidation_stream_seq",
    "CREATE TABLE cache_invalidation_stream_by_instance (stream_id BIGINT NOT NULL, "
    "instance_name TEXT NOT NULL, cache_func TEXT NOT NULL, keys TEXT[], "
    "invalidation_ts BIGINT)",
    "CREATE UNIQUE INDEX cache_invalidation_stream_by_instance_id "
    "ON cache_invalidation_stream_by_instance(stream_id)",
    "CREATE TABLE stream_positions (stream_name TEXT NOT NULL, instance_name TEXT NOT NULL, "
    "stream_id BIGINT NOT NULL)",
    "CREATE UNIQUE INDEX stream_positions_idx ON stream_positions(stream_name, instance_name)",
]


READER = {"name": "caches", "table": "cache_invalidation_stream_by_instance",
          "sequence": "cache_invalidation_stream_seq",
          "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint?"}],
          "writers": ["master"]}


def _pg(dsn, statements=(), query=None):
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        cur = conn.cursor()
        for s in statements:
            cur.execute(s)
        if query is not None:
            cur.execute(query)
            return cur.fetchall()
    finally:
        conn.close()


def redis_call(port, *args):
    """One command on a plain Redis connection; the raw reply."""
    def bulk(s):
        b = s.encode() if isinstance(s, str) else s
        return b"$%d\r\n%s\r\n" % (len(b), b)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"*%d\r\n" % len(args) + b"".join(bulk(a) for a in args))
        return s.recv(65536)


class ChannelRecorder:
    """A plain Redis subscriber on one channel, as Synapse subscribes: keeps
    every message published there."""

    def __init__(self, port, channels):
        self.sock = socket.create_connection(("127.0.0.1", port))
        parts = [b"SUBSCRIBE"] + [c.encode() for c in channels]
        self.sock.sendall(b"*%d\r\n" % len(parts)
                          + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
        self.buffer = b""
        self.sock.setblocking(False)

    def messages(self):
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                self.buffer += chunk
        except BlockingIOError:
            pass
        # Good enough for tests: messages are "$n\r\n<payload>\r\n" after
        # "message" and the channel name.
        out = []
        for part in self.buffer.split(b"$7\r\nmessage\r\n")[1:]:
            lines = part.split(b"\r\n")
            out.append((lines[1].decode(), lines[3].decode()))
        return out

    def close(self):
        self.sock.close()


OWN = {"name": "app_events", "table": "app_events", "columns": [{"body": "text"}],
       "writers": ["app1"]}


def tokens(consumer, stream, writer):
    return [t for s, w, t, _ in consumer.facts if (s, w) == (stream, writer)]


# ------------------------------------------------- export of a preset stream
#: Synapse's tables of four presets and its stream_positions, as its schema
#: has them; Synapse names its persisted positions after its ID generators
#: ("presence_stream", "push_rules_stream"), not always after the stream.
SYNAPSE_EXPORT_DDL = SYNAPSE_CACHES_DDL + [
    "CREATE SEQUENCE receipts_sequence",
    "CREATE TABLE receipts_linearized (stream_id BIGINT NOT NULL, room_id TEXT NOT NULL, "
    "receipt_type TEXT NOT NULL, user_id TEXT NOT NULL, event_id TEXT NOT NULL, "
    "thread_id TEXT, event_stream_ordering BIGINT, data TEXT NOT NULL, instance_name TEXT)",
    "CREATE SEQUENCE presence_stream_sequence",
    "CREATE TABLE presence_stream (stream_id BIGINT, user_id TEXT, state TEXT, "
    "last_active_ts BIGINT, last_federation_update_ts BIGINT, last_user_sync_ts BIGINT, "
    "status_msg TEXT, currently_active BOOLEAN, instance_name TEXT)",
    "CREATE SEQUENCE push_rules_stream_sequence",
    "CREATE TABLE push_rules_stream (stream_id BIGINT NOT NULL, event_stream_ordering "
    "BIGINT NOT NULL, user_id TEXT NOT NULL, rule_id TEXT NOT NULL, op TEXT NOT NULL, "
    "priority_class SMALLINT, priority INTEGER, conditions TEXT, actions TEXT, "
    "instance_name TEXT)",
]
