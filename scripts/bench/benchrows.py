"""The rows every TCP benchmark sends (ours, the plain writer, Synapse's
server protocol): no imports, so both virtualenvs can load it."""

POOL = 10_000


def row(i):
    """Row ``i``: the shape of a Synapse ``caches`` row."""
    return ["get_user_by_id", [f"@user{i % POOL}:example.com"], 1490197670513 + i]
