"""The client against the real gateway over TLS: server certificate, mutual TLS with a SPIFFE
client certificate, and bearer tokens matched by the gateway's caller policy (`--tls-cert`,
`--tls-key`, `--client-ca`, `--callers`), each refusal as its own exception.

A gateway binary without those options (built before the gateway's TLS landed) cannot run these:
they say so and skip."""

import hashlib
import os
import shutil
import subprocess
import tempfile
import unittest

from sluice_client import Action, Client, PermissionDenied, Unauthenticated, Unavailable

from . import chains
from .certs import SPIFFE_APP, Certs
from .gateway import LocalGateway, binary, requires_runsc

TOKEN = "batch-s3cret-token"
ELSEWHERE_TOKEN = "elsewhere-token"


def sha256(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


CALLERS = f"""apiVersion: sluice.dev/v1alpha1
kind: CallerPolicy
callers:
  - name: support-app
    match: {{uriSAN: "{SPIFFE_APP}"}}
    namespaces: [default]
  - name: batch
    match: {{tokenSha256: "{sha256(TOKEN)}"}}
    namespaces: [default]
  - name: elsewhere
    match: {{tokenSha256: "{sha256(ELSEWHERE_TOKEN)}"}}
    namespaces: [elsewhere]
"""


@requires_runsc
class GatewayTlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        help_text = subprocess.run([binary(), "--help"], capture_output=True, text=True).stdout
        if "--tls-cert" not in help_text:
            raise unittest.SkipTest(f"{binary()} has no --tls-cert: this gateway was built without TLS")
        cls.certs = c = Certs()
        cls.files = tempfile.mkdtemp(prefix="sluice-pyclient-tls")
        paths = {}
        for name, data in [("server.pem", c.server.cert), ("server-key.pem", c.server.key), ("ca.pem", c.ca),
                           ("callers.yaml", CALLERS.encode())]:
            paths[name] = os.path.join(cls.files, name)
            with open(paths[name], "wb") as f:
                f.write(data)
        cls.gateway = LocalGateway(
            files={"input.yaml": chains.INPUT},
            args=["--tls-cert", paths["server.pem"], "--tls-key", paths["server-key.pem"],
                  "--client-ca", paths["ca.pem"], "--callers", paths["callers.yaml"]],
            client={"root_certificates": c.ca, "token": TOKEN},
        )
        try:
            cls.gateway.wait_ready()
        except Exception:
            cls.gateway.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.gateway.stop()
        shutil.rmtree(cls.files, ignore_errors=True)

    def client(self, **kwargs):
        return Client(self.gateway.address, root_certificates=self.certs.ca, timeout=60, **kwargs)

    def test_a_bearer_token_over_tls(self):
        with self.client(token=TOKEN) as c:
            r = c.run("support-bot", "input", "call me at 010-1234-5678")
            self.assertIs(r.action, Action.MODIFY)
            self.assertEqual(r.text, "call me at [phone]")

    def test_a_client_certificate_over_mutual_tls(self):
        with self.client(client_certificate=self.certs.client.cert, client_key=self.certs.client.key) as c:
            self.assertEqual(c.run("support-bot", "input", "hello").text, "hello")

    def test_refusals_are_their_own_exceptions(self):
        with self.client() as c, self.assertRaises(Unauthenticated):
            c.run("support-bot", "input", "hello")
        with self.client(token="not-the-token") as c, self.assertRaises(Unauthenticated):
            c.run("support-bot", "input", "hello")
        with self.client(token=ELSEWHERE_TOKEN) as c:
            with self.assertRaises(PermissionDenied):
                c.run("support-bot", "input", "hello")
            with self.assertRaises(PermissionDenied):
                c.stream("support-bot", ["hello"]).result()

    def test_an_untrusted_or_plaintext_connection_is_unavailable(self):
        with Client(self.gateway.address, root_certificates=self.certs.other_ca, token=TOKEN, timeout=20) as c:
            with self.assertRaises(Unavailable):
                c.run("support-bot", "input", "hello")
        with Client(self.gateway.address, timeout=20) as c, self.assertRaises(Unavailable):
            c.run("support-bot", "input", "hello")


if __name__ == "__main__":
    unittest.main()
