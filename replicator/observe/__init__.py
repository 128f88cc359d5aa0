"""What an operator sees of an instance: health findings, the status page and its data, metrics,
writers' links and roles."""
