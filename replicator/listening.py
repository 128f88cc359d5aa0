"""A listener as a service of the instance: the endpoint is built from its
string with the instance's reactor when the service starts."""

from typing import Optional

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.error import CannotListenError
from twisted.logger import Logger

from .startup import StartupError, os_reason
from .tls import server_endpoint

log = Logger()


class ListeningService(Service):
    """Listens on an endpoint string while running; ``listening`` fires
    with the port once bound, or fails with :class:`StartupError` naming
    ``key`` (e.g. address in use)."""

    def __init__(self, reactor, endpoint: str, factory, what: str, client_ca: str = None,
                 key: str = "listen"):
        self._reactor = reactor
        self.key = key
        self.endpoint = endpoint
        self.client_ca = client_ca
        self.factory = factory
        self.what = what
        self.port = None
        self.listening: Optional[defer.Deferred] = None

    def startService(self):
        super().startService()
        d = server_endpoint(self._reactor, self.endpoint, self.client_ca).listen(self.factory)

        def bound(port):
            self.port = port
            host = port.getHost()
            log.info("{what} listening on {host}:{port}", what=self.what,
                     host=getattr(host, "host", host), port=getattr(host, "port", ""))
            return port

        def failed(f):
            error = f.value
            if f.check(CannotListenError):
                error = error.socketError
            elif not f.check(OSError):
                return f
            raise StartupError(self.key, f"cannot listen on {self.endpoint}: "
                                         f"{os_reason(error)}")

        self.listening = d.addCallbacks(bound, failed)

    def stopService(self):
        super().stopService()
        if self.port is not None:
            port, self.port = self.port, None
            return port.stopListening()
        return None

    @property
    def bound_port(self) -> Optional[int]:
        return self.port.getHost().port if self.port is not None else None
