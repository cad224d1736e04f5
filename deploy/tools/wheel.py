#!/usr/bin/env python3
"""Builds the wheel hook authors install with pip: `pip install sluice-<version>-py3-none-<platform>.whl`
puts `sluice`, the local gateway, the supervisor and the cell runtime the hooks run in on the
environment's PATH, side by side as `sluice` expects them, the way ruff and uv ship Rust binaries
through PyPI.

A plain wheel (PEP 427), written here with the standard library: no build backend, nothing fetched.
The binaries come from an install tree (`make install PREFIX=...`); the wheel is reproducible (fixed
timestamps, sorted entries). Its platform tag is `manylinux_<glibc>_<arch>` of the machine that built
the binaries: they need that glibc or newer, and nothing else of the system.

Usage: wheel.py --bin DIR --version X.Y.Z --readme FILE --out DIR
"""

import argparse
import base64
import hashlib
import os
import platform
import sys
import zipfile

# What the wheel carries, from the install tree's bin/: executables, then data read beside them.
EXECUTABLES = ("sluice", "sluice-gateway", "sluice-supervisor")
DATA = ("sluice-cell.cwasm", "sluice-cell.cwasm.sha256")

# 1980-01-01, the earliest a zip entry can say: the same bytes in, the same wheel out.
EPOCH = (1980, 1, 1, 0, 0, 0)


def platform_tag():
    """`manylinux_2_36_x86_64` on a Debian 12 x86-64 machine (PEP 600)."""
    libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    name, _, version = libc.partition(" ")
    if name != "glibc":
        sys.exit(f"wheel.py: the binaries need glibc; this system reports {libc!r}")
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{platform.machine()}"


def record_hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", required=True, help="the install tree's bin directory")
    p.add_argument("--version", required=True)
    p.add_argument("--readme", required=True, help="the project description (Markdown)")
    p.add_argument("--out", required=True, help="directory the wheel is written to")
    a = p.parse_args()

    tag = f"py3-none-{platform_tag()}"
    data_dir = f"sluice-{a.version}.data/scripts"
    info_dir = f"sluice-{a.version}.dist-info"
    entries = []  # (path in the wheel, bytes, executable)
    for name in sorted(EXECUTABLES + DATA):
        path = os.path.join(a.bin, name)
        if not os.path.isfile(path):
            sys.exit(f"wheel.py: {path} is missing (build it with `make install PREFIX=...`)")
        with open(path, "rb") as f:
            entries.append((f"{data_dir}/{name}", f.read(), name in EXECUTABLES))
    with open(a.readme, encoding="utf-8") as f:
        readme = f.read()
    metadata = (
        "Metadata-Version: 2.1\n"
        "Name: sluice\n"
        f"Version: {a.version}\n"
        "Summary: Write, check and test Sluice hooks: the sluice command, with the local gateway and "
        "the sandboxed Python cells hooks run in\n"
        "License: Apache-2.0\n"
        "Requires-Python: >=3.8\n"
        "Description-Content-Type: text/markdown\n"
        "\n"
        f"{readme}"
    )
    wheel = (
        "Wheel-Version: 1.0\n"
        "Generator: sluice deploy/tools/wheel.py\n"
        "Root-Is-Purelib: false\n"
        f"Tag: {tag}\n"
    )
    entries.append((f"{info_dir}/METADATA", metadata.encode(), False))
    entries.append((f"{info_dir}/WHEEL", wheel.encode(), False))
    record = "".join(f"{path},{record_hash(data)},{len(data)}\n" for path, data, _ in entries)
    record += f"{info_dir}/RECORD,,\n"
    entries.append((f"{info_dir}/RECORD", record.encode(), False))

    os.makedirs(a.out, exist_ok=True)
    out = os.path.join(a.out, f"sluice-{a.version}-{tag}.whl")
    # The files sorted, then the dist-info with RECORD last, as PEP 427 recommends.
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for path, data, executable in entries:
            info = zipfile.ZipInfo(path, date_time=EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = ((0o100755 if executable else 0o100644) & 0xFFFF) << 16
            z.writestr(info, data)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
