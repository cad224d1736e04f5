"""Test certificates made with `cryptography`: a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate (with a SPIFFE URI SAN) for mutual TLS, and an unrelated CA that must not be trusted."""

import datetime
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Optional, Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


# The client certificate's URI SAN (a SPIFFE ID), as a gateway caller policy would match it.
SPIFFE_APP = "spiffe://example.org/ns/default/sa/app"


@dataclass(frozen=True)
class Pair:
    cert: bytes
    key: bytes


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(subject: str, key, issuer: Optional[Tuple[x509.Certificate, object]], *, ca: bool, sans=(), usage=None):
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = (issuer[0].subject, issuer[1]) if issuer else (name, key)
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


class Certs:
    def __init__(self) -> None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert("sluice test CA", ca_key, None, ca=True)
        self.ca = ca.public_bytes(serialization.Encoding.PEM)
        server_key = ec.generate_private_key(ec.SECP256R1())
        server = _cert(
            "sluice-gateway", server_key, (ca, ca_key), ca=False,
            sans=[x509.IPAddress(ip_address("127.0.0.1")), x509.DNSName("localhost"), x509.DNSName("gateway.sluice.test")],
            usage=ExtendedKeyUsageOID.SERVER_AUTH,
        )
        self.server = Pair(server.public_bytes(serialization.Encoding.PEM), _pem_key(server_key))
        client_key = ec.generate_private_key(ec.SECP256R1())
        client = _cert("support-app", client_key, (ca, ca_key), ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH,
                       sans=[x509.UniformResourceIdentifier(SPIFFE_APP)])
        self.client = Pair(client.public_bytes(serialization.Encoding.PEM), _pem_key(client_key))
        other_key = ec.generate_private_key(ec.SECP256R1())
        self.other_ca = _cert("someone else's CA", other_key, None, ca=True).public_bytes(serialization.Encoding.PEM)
