"""TLS, mutual TLS and bearer tokens, against gRPC servers run here in Python with certificates
made by certs.py (the gateway's own TLS is not on this branch): what the server sees of the
token and the client certificate, and how refusals reach the application."""

import asyncio
import os
import tempfile
import unittest
from concurrent import futures

import grpc

from sluice_client import (
    Action,
    Client,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    pb,
    pb_grpc,
)
from sluice_client.aio import AsyncClient

from .certs import Certs

TOKEN = "s3cr3t-token"


class Recorder(pb_grpc.GatewayServicer):
    """Answers every call with PASS and, in `message`, the authorization header and the client
    certificate's common name it saw; refuses a missing token (UNAUTHENTICATED) and another token
    (PERMISSION_DENIED), as the gateway does."""

    def _check(self, context):
        auth = dict(context.invocation_metadata()).get("authorization")
        if auth is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no bearer token")
        if auth != f"Bearer {TOKEN}":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "this caller may not use namespace default")
        cn = context.auth_context().get("x509_common_name", [b""])[0].decode()
        return f"{auth}|{cn}"

    def Run(self, request, context):
        return pb.RunResponse(action=pb.PASS, text=request.text, message=self._check(context), run_id="r1")

    def Stream(self, request_iterator, context):
        seen = self._check(context)
        text = "".join(r.chunk for r in request_iterator if r.WhichOneof("msg") == "chunk")
        yield pb.StreamResponse(commit=text)
        yield pb.StreamResponse(final=pb.RunResponse(action=pb.PASS, text=text, message=seen))


def serve(credentials=None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GatewayServicer_to_server(Recorder(), server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, f"127.0.0.1:{port}"


class TlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.certs = c = Certs()
        cls.tls, cls.tls_addr = serve(grpc.ssl_server_credentials([(c.server.key, c.server.cert)]))
        cls.mtls, cls.mtls_addr = serve(
            grpc.ssl_server_credentials([(c.server.key, c.server.cert)], root_certificates=c.ca, require_client_auth=True)
        )
        cls.plain, cls.plain_addr = serve()

    @classmethod
    def tearDownClass(cls):
        for s in (cls.tls, cls.mtls, cls.plain):
            s.stop(None)

    def test_tls_with_a_root_ca_sends_the_token_as_bearer(self):
        with Client(self.tls_addr, root_certificates=self.certs.ca, token=TOKEN, timeout=10) as c:
            r = c.run("bot", "input", "hi")
            self.assertIs(r.action, Action.PASS)
            self.assertEqual(r.message, f"Bearer {TOKEN}|")
            s = c.stream("bot", ["a", "b"])
            self.assertEqual(s.result().message, f"Bearer {TOKEN}|")
            self.assertEqual(s.committed, "ab")

    def test_root_ca_from_a_file_and_a_server_name_override(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "ca.pem")
            with open(path, "wb") as f:
                f.write(self.certs.ca)
            with Client(f"https://{self.tls_addr}", root_certificates=path, server_name="gateway.sluice.test",
                        token=TOKEN, timeout=10) as c:
                self.assertEqual(c.run("bot", "input", "hi").text, "hi")

    def test_an_untrusted_server_is_unavailable(self):
        with Client(self.tls_addr, root_certificates=self.certs.other_ca, token=TOKEN, timeout=10) as c:
            with self.assertRaises(Unavailable):
                c.run("bot", "input", "hi")

    def test_missing_or_wrong_token_is_refused_with_its_own_exception(self):
        with Client(self.tls_addr, root_certificates=self.certs.ca, timeout=10) as c:
            with self.assertRaises(Unauthenticated) as cm:
                c.run("bot", "input", "hi")
            self.assertEqual(cm.exception.details, "no bearer token")
        with Client(self.tls_addr, root_certificates=self.certs.ca, token="other", timeout=10) as c:
            with self.assertRaises(PermissionDenied) as cm:
                c.run("bot", "input", "hi")
            self.assertIn("namespace default", str(cm.exception))
            with self.assertRaises(PermissionDenied):
                c.stream("bot", ["x"]).result()

    def test_mutual_tls_presents_the_client_certificate(self):
        with Client(self.mtls_addr, root_certificates=self.certs.ca, client_certificate=self.certs.client.cert,
                    client_key=self.certs.client.key, token=TOKEN, timeout=10) as c:
            self.assertEqual(c.run("bot", "input", "hi").message, f"Bearer {TOKEN}|support-app")
        with Client(self.mtls_addr, root_certificates=self.certs.ca, token=TOKEN, timeout=10) as c:
            with self.assertRaises(Unavailable):
                c.run("bot", "input", "hi")

    def test_a_token_over_plaintext_goes_only_to_loopback(self):
        with Client(self.plain_addr, token=TOKEN, timeout=10) as c:
            self.assertEqual(c.run("bot", "input", "hi").message, f"Bearer {TOKEN}|")
        with self.assertRaises(ValueError) as cm:
            Client("gateway.example.com:50051", token=TOKEN)
        self.assertIn("only over TLS", str(cm.exception))

    def test_inconsistent_options_are_refused_at_construction(self):
        for kwargs, needle in [
            ({"client_certificate": self.certs.client.cert}, "both client_certificate and client_key"),
            ({"root_certificates": b"not a cert"}, "not PEM"),
            ({"root_certificates": "/nonexistent/ca.pem"}, "cannot read"),
            ({"tls": False, "root_certificates": self.certs.ca}, "tls=False"),
            ({"token": " padded "}, "whitespace"),
        ]:
            with self.subTest(kwargs=kwargs), self.assertRaises(ValueError) as cm:
                Client("127.0.0.1:1", **kwargs)
            self.assertIn(needle, str(cm.exception))
        with self.assertRaises(ValueError):
            Client("http://127.0.0.1:1", tls=True)

    def test_async_client_over_tls_with_a_token(self):
        async def go():
            async with AsyncClient(self.mtls_addr, root_certificates=self.certs.ca,
                                   client_certificate=self.certs.client.cert, client_key=self.certs.client.key,
                                   token=TOKEN, timeout=10) as c:
                r = await c.run("bot", "input", "hi")
                self.assertEqual(r.message, f"Bearer {TOKEN}|support-app")
            async with AsyncClient(self.tls_addr, root_certificates=self.certs.ca, timeout=10) as c:
                with self.assertRaises(Unauthenticated):
                    await c.run("bot", "input", "hi")

        asyncio.run(go())


if __name__ == "__main__":
    unittest.main()
