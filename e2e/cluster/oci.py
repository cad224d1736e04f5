#!/usr/bin/env python3
"""Writes an OCI image archive (an OCI layout in a tar) without a registry or a container engine.

The test cluster imports it with `ctr -n k8s.io images import`. Layers are uncompressed tars: an
existing one (--layer, e.g. a Debian root filesystem) and/or one made of single files (--file).

  oci.py --name registry.k8s.io/pause:3.6 --file build/pause:/pause:0755 --entrypoint /pause \
         --user 65535:65535 --out pause.tar
"""

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def parse_file(spec):
    """SRC:DEST[:MODE] -> (src, dest, mode)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].startswith("/"):
        raise argparse.ArgumentTypeError(f"--file wants SRC:/DEST[:MODE], got {spec!r}")
    mode = int(parts[2], 8) if len(parts) == 3 else 0o644
    if not os.path.isfile(parts[0]):
        raise argparse.ArgumentTypeError(f"--file {spec!r}: {parts[0]} is not a file")
    return parts[0], parts[1], mode


def files_layer(files, out):
    """A reproducible layer holding each file and its parent directories (root-owned, mtime 0)."""
    dirs = set()
    for _, dest, _ in files:
        parent = os.path.dirname(dest.strip("/"))
        while parent:
            dirs.add(parent)
            parent = os.path.dirname(parent)
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for src, dest, mode in sorted(files, key=lambda f: f[1]):
            info = tarfile.TarInfo(dest.strip("/"))
            info.size, info.mode = os.path.getsize(src), mode
            with open(src, "rb") as f:
                tar.addfile(info, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="image reference, e.g. ghcr.io/sluice-dev/sluice-gateway:dev")
    parser.add_argument("--out", required=True, help="the archive to write")
    parser.add_argument("--layer", action="append", default=[], help="an existing uncompressed layer tar (in order)")
    parser.add_argument("--file", action="append", default=[], type=parse_file, help="SRC:/DEST[:MODE], in a last layer")
    parser.add_argument("--entrypoint", action="append", default=[], help="one argument of the entrypoint (repeat)")
    parser.add_argument("--cmd", action="append", default=[], help="one argument of the command (repeat)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE")
    parser.add_argument("--user", default="")
    parser.add_argument("--workdir", default="")
    args = parser.parse_args()

    if ":" not in args.name.rsplit("/", 1)[-1]:
        parser.error(f"--name {args.name!r} has no tag")
    for layer in args.layer:
        if not os.path.isfile(layer):
            parser.error(f"--layer {layer}: no such file")
    if not args.layer and not args.file:
        parser.error("an image needs at least one --layer or --file")

    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.out))) as tmp:
        layers = list(args.layer)
        if args.file:
            layers.append(os.path.join(tmp, "files.tar"))
            files_layer(args.file, layers[-1])
        blobs = []  # (digest, size, path or bytes)
        layer_descs = []
        for path in layers:
            digest, size = sha256_file(path), os.path.getsize(path)
            blobs.append((digest, size, path))
            layer_descs.append({"mediaType": LAYER, "digest": digest, "size": size})

        config = {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] + args.env}
        if args.entrypoint:
            config["Entrypoint"] = args.entrypoint
        if args.cmd:
            config["Cmd"] = args.cmd
        if args.user:
            config["User"] = args.user
        if args.workdir:
            config["WorkingDir"] = args.workdir
        image_config = json.dumps({
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in layer_descs]},
        }, sort_keys=True).encode()
        config_digest = "sha256:" + hashlib.sha256(image_config).hexdigest()
        blobs.append((config_digest, len(image_config), image_config))

        manifest = json.dumps({
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {"mediaType": CONFIG, "digest": config_digest, "size": len(image_config)},
            "layers": layer_descs,
        }, sort_keys=True).encode()
        manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        blobs.append((manifest_digest, len(manifest), manifest))

        index = json.dumps({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest),
                "annotations": {
                    "io.containerd.image.name": args.name,
                    "org.opencontainers.image.ref.name": args.name.rsplit(":", 1)[1],
                },
            }],
        }, sort_keys=True).encode()

        partial = args.out + ".partial"
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            def add_bytes(name, data):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))

            add_bytes("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
            add_bytes("index.json", index)
            seen = set()
            for digest, size, content in blobs:
                if digest in seen:
                    continue
                seen.add(digest)
                name = "blobs/sha256/" + digest.split(":", 1)[1]
                if isinstance(content, bytes):
                    add_bytes(name, content)
                else:
                    info = tarfile.TarInfo(name)
                    info.size, info.mode = size, 0o644
                    with open(content, "rb") as f:
                        tar.addfile(info, f)
        os.replace(partial, args.out)
    print(args.out)


if __name__ == "__main__":
    sys.exit(main())
