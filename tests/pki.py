"""A test PKI: a CA and the certificates the TLS tests present (server,
client, a stranger's from another CA, ...), written as PEM files.  Test
modules take it from here, never from one another."""

import datetime
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject_cn, key, issuer_cert=None, issuer_key=None, ca=False, san=None):
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in san]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _write(path, *objs):
    with open(path, "wb") as f:
        for obj in objs:
            if isinstance(obj, x509.Certificate):
                f.write(obj.public_bytes(serialization.Encoding.PEM))
            else:
                f.write(obj.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))


def make_pki(directory):
    """A CA, a server certificate for localhost, a client certificate, and a
    stranger's certificate from another CA; returns their paths."""
    ca_key = _key()
    ca = _cert("replicator test CA", ca_key, ca=True)
    other_key = _key()
    other_ca = _cert("someone else's CA", other_key, ca=True)
    paths = {}
    for name, cn, issuer, issuer_key, san in (
        ("server", "localhost", ca, ca_key, ["localhost"]),
        ("client", "worker1", ca, ca_key, None),
        ("stranger", "worker9", other_ca, other_key, None),
        ("intruder", "worker9", ca, ca_key, None),
        ("alias", "host.example", ca, ca_key, ["worker2"]),
    ):
        key = _key()
        cert = _cert(cn, key, issuer, issuer_key, san=san)
        paths[f"{name}.key"] = os.path.join(directory, f"{name}.key")
        paths[f"{name}.crt"] = os.path.join(directory, f"{name}.crt")
        _write(paths[f"{name}.key"], key)
        _write(paths[f"{name}.crt"], cert)
    os.makedirs(os.path.join(directory, "trust"))
    paths["ca.crt"] = os.path.join(directory, "trust", "ca.pem")
    _write(paths["ca.crt"], ca)
    paths["trust"] = os.path.join(directory, "trust")
    return paths
