"""Twisted's own log lines, in our words or not at all.

Twisted logs what it does in its own words, with object reprs: ``Site
starting on 9093``, ``(TCP Port 9092 Closed)``, ``Main loop terminated.``,
``Starting factory <...Factory object at 0x...>``, ``Scheduling retry 3 to
connect <...Endpoint object at 0x...> in 7.16... seconds.``  Each of those
events has a line of ours already (``replication: listening on
127.0.0.1:9092``, ``instance master stopped``, the retry line of
:mod:`replicator.net.reconnect`), so :func:`keep` drops them; every other event
(Twisted's warnings and errors above all) is kept, and the formatter
(:mod:`replicator.logs.formats`) cleans what reprs it still carries.
"""

import re

from twisted.logger import LogEvent

#: Informational messages of Twisted's that repeat one of ours.
_REPEATS = re.compile(
    r"^(?:.* starting on \S+"            # Port.startListening: "<Factory> starting on 9092"
    r"|\(.*Port \S+ Closed\)"             # Port.connectionLost: "(TCP Port 9092 Closed)"
    r"|Starting factory .*"               # Factory.doStart of a noisy factory
    r"|Stopping factory .*"
    r"|Main loop terminated\.?"           # reactor.run's end
    r"|Scheduling retry \S+ to connect .*"  # ClientService (ours is silenced at the source)
    r"|Log opened\.?)$", re.S)


def keep(event: LogEvent) -> bool:
    """Whether ``event`` should be logged (False: one of Twisted's
    informational lines that repeats one of ours)."""
    namespace = event.get("log_namespace") or ""
    text = event.get("log_text")
    if text is None:
        text = event.get("log_format") or ""
    text = str(text).strip()
    ours = not (namespace == "log_legacy" or namespace.startswith("twisted."))
    if ours and not text.startswith("Scheduling retry"):
        return True
    if event.get("log_failure") is not None or event.get("isError"):
        return True
    return not _REPEATS.match(text)
