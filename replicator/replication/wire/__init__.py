"""The replication protocol's lines: commands, their fields, and lines built as bytes."""
