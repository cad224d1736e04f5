"""How a client reaches the gateway: plaintext, TLS with a root CA, mutual TLS with a client
certificate, and a bearer token sent as `authorization: Bearer <token>`, all the standard gRPC way
(channel credentials composed with call credentials).

gRPC sends call credentials only over a secure connection; a token over plaintext is therefore
allowed only to a loopback address or a unix socket (grpc's local credentials), where nobody can
read it off the wire."""

import ipaddress
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import grpc

# PEM bytes, or the path of a PEM file.
Pem = Union[bytes, str, "os.PathLike[str]"]

GATEWAY_SERVICE = "sluice.v1.Gateway"


@dataclass(frozen=True)
class Endpoint:
    """What `grpc.secure_channel` / `insecure_channel` need: the target and, unless plaintext,
    the channel credentials; options carry a TLS name override."""

    target: str
    credentials: Optional[grpc.ChannelCredentials]
    options: Tuple[Tuple[str, object], ...]


def _pem(what: str, value: Optional[Pem]) -> Optional[bytes]:
    if value is None:
        return None
    if isinstance(value, bytes):
        data = value
    else:
        try:
            with open(value, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ValueError(f"{what}: cannot read {os.fspath(value)!r}: {e.strerror}") from e
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what}: not PEM (no -----BEGIN line)")
    return data


def _split_scheme(address: str) -> Tuple[str, Optional[bool]]:
    """`http://h:p` means plaintext, `https://h:p` TLS, a bare `h:p` leaves it to the options."""
    for scheme, tls in (("http://", False), ("https://", True)):
        if address.startswith(scheme):
            return address[len(scheme):].rstrip("/"), tls
    return address, None


def _host(target: str) -> str:
    if target.startswith("["):  # [::1]:50051
        return target[1:].split("]", 1)[0]
    if target.count(":") == 1:
        return target.rsplit(":", 1)[0]
    return target


def _is_local(target: str) -> bool:
    if target.startswith("unix:") or target.startswith("unix-abstract:"):
        return True
    host = _host(target)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint(
    address: str,
    *,
    tls: Optional[bool] = None,
    root_certificates: Optional[Pem] = None,
    client_certificate: Optional[Pem] = None,
    client_key: Optional[Pem] = None,
    token: Optional[str] = None,
    server_name: Optional[str] = None,
    options: Sequence[Tuple[str, object]] = (),
) -> Endpoint:
    """Checks the options together and builds the credentials; ValueError says what does not fit."""
    target, scheme_tls = _split_scheme(address)
    if not target:
        raise ValueError("the gateway address is empty (expected host:port)")
    wants_tls = any(x is not None for x in (root_certificates, client_certificate, client_key, server_name))
    if tls is None:
        tls = scheme_tls if scheme_tls is not None else wants_tls
    elif scheme_tls is not None and scheme_tls != tls:
        raise ValueError(f"{address!r} says {'TLS' if scheme_tls else 'plaintext'} but tls={tls}")
    if not tls and wants_tls:
        raise ValueError("certificates or server_name were given with tls=False")
    if (client_certificate is None) != (client_key is None):
        raise ValueError("mutual TLS needs both client_certificate and client_key")
    if token is not None:
        if not token or token != token.strip() or any(c in token for c in "\r\n"):
            raise ValueError("the token is empty or has surrounding whitespace or line breaks")

    opts: List[Tuple[str, object]] = list(options)
    creds: Optional[grpc.ChannelCredentials] = None
    if tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_pem("root_certificates", root_certificates),
            private_key=_pem("client_key", client_key),
            certificate_chain=_pem("client_certificate", client_certificate),
        )
        if server_name:
            opts.append(("grpc.ssl_target_name_override", server_name))
    elif token is not None:
        if not _is_local(target):
            raise ValueError(
                f"a bearer token is sent only over TLS or to a loopback address, and {target!r} is "
                "neither: give root_certificates (or tls=True for the system's CAs)"
            )
        kind = grpc.LocalConnectionType.UDS if target.startswith("unix") else grpc.LocalConnectionType.LOCAL_TCP
        creds = grpc.local_channel_credentials(kind)
    if token is not None and creds is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return Endpoint(target=target, credentials=creds, options=tuple(opts))
