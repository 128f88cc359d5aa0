"""The HTTP API of one instance (twisted.web).

* :mod:`.api`: :class:`HttpApi`, the routes and their dispatch; the status
  page and ``/metrics``.
* :mod:`.streams`: writing facts, reading positions.
* :mod:`.bookkeeping_pages`: the master's USER_SYNC / FEDERATION_ACK / USER_IP
  tables, paged off the reactor.
* :mod:`.probe`: ``/health`` (database probe, replication problems).
* :mod:`.site`: the site: body limits, the access log, redaction.
* :mod:`.channel`: one connection: deadlines, the connection cap, a JSON
  answer to every request twisted.web refuses.
"""

from .answers import HttpError
from .api import HttpApi

__all__ = ["HttpApi", "HttpError"]
