"""Regenerates the committed gRPC stubs in src/sluice_client/_proto/ from the gateway's proto
(gateway/proto/sluice/v1/gateway.proto), with grpcio-tools (pinned in pyproject's `test` extra).

    python clients/python/tools/generate.py            # rewrite the committed stubs
    python clients/python/tools/generate.py --out DIR  # write them elsewhere (the drift test does)

protoc names imports after the proto's path (`from sluice.v1 import gateway_pb2`); the stubs live
inside the sluice_client package instead, so that import is rewritten to a relative one."""

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.normpath(os.path.join(HERE, "..", "src", "sluice_client", "_proto"))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "..", "gateway", "proto"))
PROTO = "sluice/v1/gateway.proto"
FILES = ("gateway_pb2.py", "gateway_pb2.pyi", "gateway_pb2_grpc.py")
ABSOLUTE_IMPORT = "from sluice.v1 import gateway_pb2 as"
RELATIVE_IMPORT = "from . import gateway_pb2 as"


def generate(out):
    """Writes FILES into `out` (a directory that exists)."""
    if importlib.util.find_spec("grpc_tools") is None:
        sys.exit("grpcio-tools is not installed: pip install './clients/python[test]'")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", "-I", PROTO_ROOT,
             f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", PROTO],
            check=True,
        )
        generated = os.path.join(tmp, "sluice", "v1")
        for name in FILES:
            with open(os.path.join(generated, name), encoding="utf-8") as f:
                text = f.read()
            if name.endswith("_grpc.py"):
                if ABSOLUTE_IMPORT not in text:
                    sys.exit(f"{name}: protoc no longer writes {ABSOLUTE_IMPORT!r}; update generate.py")
                text = text.replace(ABSOLUTE_IMPORT, RELATIVE_IMPORT)
            with open(os.path.join(out, name), "w", encoding="utf-8") as f:
                f.write(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory to write into (default: the package's _proto/)")
    args = parser.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        generate(args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp)
        for name in FILES:
            shutil.copyfile(os.path.join(tmp, name), os.path.join(PACKAGE, name))


if __name__ == "__main__":
    main()
