"""The committed stubs (src/sluice_client/_proto) are what tools/generate.py makes from the
gateway's proto today: a proto change without regenerating fails here."""

import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_CLIENT = os.path.dirname(HERE)
GENERATE = os.path.join(PYTHON_CLIENT, "tools", "generate.py")
COMMITTED = os.path.join(PYTHON_CLIENT, "src", "sluice_client", "_proto")
FILES = ("gateway_pb2.py", "gateway_pb2.pyi", "gateway_pb2_grpc.py")


class GeneratedStubsTest(unittest.TestCase):
    def test_committed_stubs_match_the_proto(self):
        with tempfile.TemporaryDirectory() as out:
            subprocess.run([sys.executable, GENERATE, "--out", out], check=True)
            for name in FILES:
                with open(os.path.join(out, name)) as f:
                    fresh = f.read()
                with open(os.path.join(COMMITTED, name)) as f:
                    committed = f.read()
                self.assertEqual(
                    committed, fresh,
                    f"{name} is stale: run `python clients/python/tools/generate.py` and commit the result",
                )

    def test_the_installed_package_serves_the_gateway_service(self):
        from sluice_client import pb, pb_grpc

        service = pb.DESCRIPTOR.services_by_name["Gateway"]
        self.assertEqual(service.full_name, "sluice.v1.Gateway")
        self.assertEqual(sorted(m.name for m in service.methods), ["Run", "Stream"])
        self.assertTrue(hasattr(pb_grpc, "GatewayStub") and hasattr(pb_grpc, "CapabilityServiceServicer"))


if __name__ == "__main__":
    unittest.main()
