"""The test cluster's runsc handler: containerd's runc shim (io.containerd.runc.v2) runs this with
runc's command line, and it runs Debian's runsc.

gVisor's own shim (containerd-shim-runsc-v1) is not served by the Go module proxy, so the runc shim
drives runsc directly. runsc would read the CRI annotations and start a pod's containers in one
sandbox, but then every container's pid is the sandbox's and the runc shim, which waits on that pid,
never sees a container exit. So on `create` this removes those annotations: each container of the pod
(the pause container too) becomes a gVisor sandbox of its own, with no network (sandbox pods have
none; the pod's network namespace is left to the pause container). What this costs in fidelity is
in README.md ("gVisor without its shim").
"""

import json
import os
import sys

CRI_ANNOTATIONS = (
    "io.kubernetes.cri.container-type",
    "io.kubernetes.cri.sandbox-id",
    "io.kubernetes.cri-o.ContainerType",
    "io.kubernetes.cri-o.SandboxID",
)
SUBCOMMANDS = {"create", "start", "exec", "kill", "delete", "state", "ps", "events", "pause", "resume",
               "update", "checkpoint", "restore", "features", "run", "list", "wait"}


def bundle_of(args):
    for i, arg in enumerate(args):
        if arg in ("--bundle", "-b") and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--bundle="):
            return arg.split("=", 1)[1]
    return os.getcwd()


def detach_from_pod_sandbox(bundle):
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        spec = json.load(f)
    annotations = spec.get("annotations") or {}
    for key in CRI_ANNOTATIONS:
        annotations.pop(key, None)
    spec["annotations"] = annotations
    # The pause container keeps the pod's network namespace; a sandbox without network needs none.
    linux = spec.get("linux") or {}
    linux["namespaces"] = [ns for ns in linux.get("namespaces", []) if ns.get("type") != "network"]
    spec["linux"] = linux
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(spec, f)
    os.replace(tmp, path)


def main():
    argv = sys.argv[1:]
    if "--" not in argv or argv[:1] != ["--runsc"]:
        sys.exit("usage: runsc-runtime.py --runsc PATH [--log-dir DIR] -- RUNC-ARGS...")
    split = argv.index("--")
    own, args = argv[:split], argv[split + 1:]
    runsc = own[1]
    flags = ["--network=none"]
    if "--log-dir" in own:
        log_dir = own[own.index("--log-dir") + 1]
        flags += [f"--debug-log={log_dir}/", "--debug-log-format=text"]
    platform = os.environ.get("SLUICE_RUNSC_PLATFORM")
    if platform:
        flags.append(f"--platform={platform}")
    command = next((a for a in args if a in SUBCOMMANDS), None)
    if command == "create":
        detach_from_pod_sandbox(bundle_of(args[args.index(command):]))
    if command == "kill":
        sys.exit(kill(runsc, flags + args))
    os.execv(runsc, [runsc] + flags + args)


def kill(runsc, args):
    """`runsc kill`, with runc's words for a container that has already exited. The runc shim kills
    a stopped container too and takes only runc's "container not running" for "already finished";
    runsc says "sandbox is not running", which the shim reports as a failure, so the kubelet's
    StopContainer failed forever and the pod stayed Terminating."""
    import subprocess

    done = subprocess.run([runsc] + args, capture_output=True)
    sys.stdout.buffer.write(done.stdout)
    sys.stderr.buffer.write(done.stderr)
    if done.returncode != 0 and b"is not running" in done.stdout + done.stderr:
        sys.stderr.write("container not running\n")
    return done.returncode


if __name__ == "__main__":
    main()
