"""Log lines: the output, the three formats, and Twisted's own lines in our words."""
