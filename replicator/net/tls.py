"""TLS listeners that require client certificates.

Twisted's ``ssl:`` endpoint string covers a server's key and certificate but
not a CA for client certificates; :func:`server_endpoint` adds that: with
``client_ca`` every client must present a certificate signed by that CA, or
the TLS handshake fails before a single command is read.  Clients use the
``tls:`` endpoint string (hostname verification, ``trustRoots``, their own
``certificate`` and ``privateKey``).

:func:`certificate_names` tells which instance names a connected client's
certificate vouches for (its CN and DNS subject alternative names), so that
the replication server can bind a peer's ``NAME`` to its certificate.
"""

import re
from typing import TYPE_CHECKING, Any, Optional

from twisted.internet import endpoints, ssl
from twisted.internet.interfaces import IOpenSSLContextFactory, IStreamServerEndpoint
from twisted.python.filepath import FilePath
from zope.interface import implementer

from .endpoint_strings import parse

if TYPE_CHECKING:
    from OpenSSL import SSL

#: What :meth:`ReloadableTls.read` read: the client CA's path and the files' bytes.
Source = tuple[str | None, list[bytes]]


def load_ca_certificates(path: str) -> list[ssl.Certificate]:
    """Every PEM certificate in ``path``."""
    text = FilePath(path).getContent().decode("ascii", "replace")
    pems = re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", text, re.S)
    if not pems:
        raise ValueError(f"{path} holds no PEM certificate")
    return [ssl.Certificate.loadPEM(p.encode()) for p in pems]


def check_pem_directory(path: str) -> None:
    """What a ``tls:`` listener needs from its directory: ``*.pem`` files
    holding a private key and a certificate (Twisted's listener reads the
    directory when a client connects, and without them every handshake
    fails).  ValueError saying what is missing."""
    directory = FilePath(path)
    if not directory.isdir():
        raise ValueError(f"{path} is not a directory (a tls: listener reads its *.pem files)")
    text = "".join(child.getContent().decode("ascii", "replace")
                   for child in directory.children()
                   if child.basename().endswith(".pem") and child.isfile())
    if not re.search(r"-----BEGIN [A-Z ]*PRIVATE KEY-----", text):
        raise ValueError(f"no private key in the *.pem files of {path}")
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise ValueError(f"no certificate in the *.pem files of {path}")


def check_client_files(options: dict[str, str]) -> None:
    """What Twisted lets a ``tls:`` client endpoint string through with but
    every handshake would then fail on, from its keyword ``options``:
    ``trustRoots`` that is not a directory of ``*.pem`` certificates (Twisted
    reads only those, and trusts nothing else), ``privateKey`` without
    ``certificate`` (Twisted drops the key: no client certificate is sent),
    ``certificate`` alone in a file without its key.  ValueError saying
    which; the files' contents are Twisted's to judge after this."""
    trust = options.get("trustRoots")
    if trust is not None:
        directory = FilePath(trust)
        if not directory.isdir():
            raise ValueError(f"trustRoots {trust} is not a directory (it holds the CA "
                             "certificates as *.pem files)")
        if not any(child.basename().lower().endswith(".pem") and child.isfile()
                   and b"-----BEGIN CERTIFICATE-----" in child.getContent()
                   for child in directory.children()):
            raise ValueError(f"trustRoots {trust} holds no *.pem certificate")
    certificate = options.get("certificate")
    if certificate is None:
        if options.get("privateKey") is not None:
            raise ValueError("privateKey= without certificate= (the client certificate)")
        return
    if options.get("privateKey") is None and not re.search(
            rb"-----BEGIN [A-Z ]*PRIVATE KEY-----", FilePath(certificate).getContent()):
        raise ValueError(f"certificate {certificate} holds no private key: give privateKey=")


#: The ``ssl:`` listener options :func:`server_endpoint` reads itself (a
#: listener with another option is Twisted's, and its files are read once).
SSL_OPTIONS = frozenset({"port", "interface", "backlog", "privateKey", "certKey",
                         "extraCertChain"})


def server_endpoint(reactor: Any, endpoint: str,
                    client_ca: str | None = None) -> IStreamServerEndpoint:
    """A server endpoint from its string; ``ssl:`` with ``client_ca``
    requires client certificates signed by that CA."""
    return listener(reactor, endpoint, client_ca)[0]


def listener(reactor: Any, endpoint: str, client_ca: str | None = None,
             ) -> tuple[IStreamServerEndpoint, Optional["ReloadableTls"]]:
    """``(endpoint, tls)``: the server endpoint of ``endpoint`` and, for an
    ``ssl:`` listener, its :class:`ReloadableTls` (else None)."""
    if client_ca is not None and not endpoint.startswith("ssl:"):
        raise ValueError("client_ca needs an ssl: listener")
    if not endpoint.startswith("ssl:"):
        return endpoints.serverFromString(reactor, endpoint), None
    _, args, kw = parse(endpoint)
    if not set(kw) <= SSL_OPTIONS:
        if client_ca is not None:
            raise ValueError(f"unsupported ssl: option {sorted(set(kw) - SSL_OPTIONS)[0]!r} "
                             "with client_ca")
        return endpoints.serverFromString(reactor, endpoint), None
    port = int(kw.pop("port", args[0] if args else 0))
    interface = kw.pop("interface", "")
    backlog = int(kw.pop("backlog", 50))
    tls = ReloadableTls(kw, client_ca)
    return endpoints.SSL4ServerEndpoint(reactor, port, tls, backlog=backlog,
                                        interface=interface), tls


@implementer(IOpenSSLContextFactory)
class ReloadableTls:
    """The key, certificate (and chain) and client CA of an ``ssl:``
    listener, which a reload reads again: every new connection takes the
    context of the files read last, open connections keep theirs."""

    def __init__(self, options: dict[str, str], client_ca: str | None) -> None:
        private_key = options.get("privateKey", "server.pem")
        self._files = (private_key, options.get("certKey", private_key),
                       options.get("extraCertChain"))
        self.options, self._read = self.read(client_ca)
        self.client_ca = client_ca

    def read(self, client_ca: str | None) -> tuple[ssl.CertificateOptions, Source]:
        """``(CertificateOptions, the bytes read)`` from the files now
        (blocking: a reload calls it in a thread)."""
        private_key, cert_key, chain = self._files
        key_bytes, cert_bytes = (FilePath(private_key).getContent(),
                                 FilePath(cert_key).getContent())
        cert = ssl.PrivateCertificate.loadPEM(cert_bytes + b"\n" + key_bytes)
        read = [key_bytes, cert_bytes]
        extra = None
        if chain:
            read.append(FilePath(chain).getContent())
            extra = [c.original for c in load_ca_certificates(chain)]
        verify: dict[str, Any] = {}
        if client_ca is not None:
            read.append(FilePath(client_ca).getContent())
            verify = dict(verify=True, requireCertificate=True,
                          caCerts=[c.original for c in load_ca_certificates(client_ca)])
        options = ssl.CertificateOptions(privateKey=cert.privateKey.original,
                                         certificate=cert.original, extraCertChain=extra,
                                         **verify)
        return options, (client_ca, read)

    def take(self, read: tuple[ssl.CertificateOptions, Source]) -> bool:
        """Use what :meth:`read` returned from now on; whether it differs
        from what was in use (reactor thread)."""
        options, source = read
        changed: bool = source != self._read
        self.options, self._read, self.client_ca = options, source, source[0]
        return changed

    def getContext(self) -> "SSL.Context":
        context: SSL.Context = self.options.getContext()
        return context


def certificate_names(transport: object) -> frozenset[str] | None:
    """The names the peer's verified TLS certificate carries: its subject's
    common names and its DNS subject alternative names.

    None when the transport is not TLS or the peer presented no certificate
    (with ``client_ca`` the handshake already refused such a peer).
    """
    get = getattr(transport, "getPeerCertificate", None)
    if get is None:
        return None
    try:
        peer = get()
    except Exception:  # not (yet) a TLS connection
        return None
    if peer is None:
        return None
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = peer.to_cryptography() if hasattr(peer, "to_cryptography") else peer
    names = {a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
             if isinstance(a.value, str)}
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (x509.ExtensionNotFound, ValueError):  # none, or one we cannot read
        pass
    else:
        names.update(san.value.get_values_for_type(x509.DNSName))
    return frozenset(names)
