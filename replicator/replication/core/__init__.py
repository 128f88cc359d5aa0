"""What replication does with lines, whatever carries them: the handler, fan-out, readers, relay,
delivery, admission and the master's bookkeeping."""
