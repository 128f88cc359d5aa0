"""A listener as a service of the instance: the endpoint is built from its
string with the instance's reactor when the service starts."""

from typing import Any

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.logger import Logger
from twisted.python.failure import Failure

from ..net.tls import ReloadableTls, listener
from .startup import StartupError, os_reason


class ListeningService(Service):
    """Listens on an endpoint string while running; ``listening`` fires
    with the port once bound, or fails with :class:`StartupError` naming
    ``key`` (e.g. address in use)."""

    def __init__(self, reactor: Any, endpoint: str, factory: IProtocolFactory, what: str,
                 client_ca: str | None = None, key: str = "listen") -> None:
        self._reactor = reactor
        self.key = key
        self.endpoint = endpoint
        self.client_ca = client_ca
        self.factory = factory
        self.what = what
        self.port: IListeningPort | None = None
        self.tls: ReloadableTls | None = None  # an ssl: listener's, once started
        self.listening: defer.Deferred[IListeningPort] | None = None
        #: Lines say ``replication: listening on 127.0.0.1:9092``.
        self.log = Logger(namespace=f"replicator.{what.lower()}")

    def startService(self) -> None:
        super().startService()
        endpoint, self.tls = listener(self._reactor, self.endpoint, self.client_ca)
        d = endpoint.listen(self.factory)

        def bound(port: IListeningPort) -> IListeningPort:
            self.port = port
            self.log.info("listening on {address}", address=self.address)
            return port

        def failed(f: Failure) -> Failure:
            error = f.value
            if isinstance(error, CannotListenError):
                error = error.socketError
            elif not isinstance(error, OSError):
                return f
            raise StartupError(self.key, f"cannot listen on {self.endpoint}: "
                                         f"{os_reason(error)}")

        self.listening = d.addCallbacks(bound, failed)

    def stopService(self) -> "defer.Deferred[object] | None":
        super().stopService()
        if self.port is not None:
            address = self.address
            port, self.port = self.port, None

            def stopped(result: object) -> object:
                self.log.info("stopped listening on {address}", address=address)
                return result

            return defer.maybeDeferred(port.stopListening).addBoth(stopped)
        return None

    @property
    def address(self) -> str:
        """Where the listener is bound: ``host:port`` (``[v6]:port``), or the
        socket's path."""
        assert self.port is not None, "not listening"
        host = self.port.getHost()
        name, port = getattr(host, "host", None), getattr(host, "port", None)
        if name is None or port is None:
            path = getattr(host, "name", None) or "?"
            return path.decode("utf-8", "replace") if isinstance(path, bytes) else str(path)
        return f"[{name}]:{port}" if ":" in name else f"{name}:{port}"

    @property
    def bound_port(self) -> int | None:
        return getattr(self.port.getHost(), "port", None) if self.port is not None else None
