"""Where a trigger point's time goes on the real exec path, hop by hop (e2e/cluster/README.md).

Run against the test cluster with Sluice installed (`make cluster-up cluster-install`, then
`. /var/lib/sluice-cluster/e2e.env`), as root:

    python3 e2e/cluster/exec_hops.py [--runs 20] [--sluice target/release/sluice]

It applies a 3-hook chain (the bench's, with the chart's default resources) in a namespace of its own,
captures every TCP segment with a payload on the hops a trigger point crosses (tcpdump, which does not
slow anything down), and makes paced runs with `sluice call` through one gateway pod. For each run it
takes, on each hop, the first segment of the request and the last segment of the answer, and prints
the medians:

    client → gateway (gRPC)  →  gateway → API server (exec websocket)  →  API server → kubelet
    →  kubelet → containerd (CRI stream server)  →  [containerd, runc shim, runsc, the supervisor's
    walk]  →  and back the same way.

The walk itself is what the supervisor reported for the hooks (`latency_us` of each hook); the rest of
the innermost span is containerd, the runc shim and gVisor's host pipes, and the supervisor's own
reading and writing. Nothing here is a test: it prints a table.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

NS = "sluice-hops"
CHAIN = "hops"
TEXT = ("Please call me at 010-1234-5678 or mail ann@example.com about the order. " * 14)[:1024]


def sh(*args, check=True, **kw):
    return subprocess.run(args, check=check, capture_output=True, text=True, **kw)


def kubectl(*args, **kw):
    return sh("kubectl", *args, **kw)


def chain_yaml():
    """The bench's 3-hook chain (bench/src/main.rs chain_yaml) with the chart's default resources."""
    hooks = [
        ("redact-phone", "modify",
         "import re\nPHONE = re.compile(r'\\d{3}-\\d{4}-\\d{4}')\n"
         "def execute(context, settings):\n"
         "    text = context['outgoing']\n"
         "    new = PHONE.sub('[phone]', text)\n"
         "    if new == text:\n        return {'action': 'pass'}\n"
         "    return {'action': 'modify', 'outgoing': new}\n"),
        ("block-injection", "block",
         "def execute(context, settings):\n"
         "    if 'ignore previous instructions' in context['outgoing'].lower():\n"
         "        return {'action': 'block', 'message': 'blocked'}\n"
         "    return {'action': 'pass'}\n"),
        ("count-emails", "detect",
         "import re\nEMAIL = re.compile(r'[\\w.]+@[\\w.]+')\n"
         "def execute(context, settings):\n"
         "    n = len(EMAIL.findall(context['outgoing']))\n"
         "    return {'action': 'detect', 'findings': {'emails': n}} if n else {'action': 'pass'}\n"),
    ]
    spec = {
        "apiVersion": "sluice.dev/v1alpha1", "kind": "HookChain",
        "metadata": {"name": CHAIN, "namespace": NS},
        "spec": {
            "target": CHAIN, "triggerPoint": "input",
            "pool": {"warm": 2, "max": 6, "reuse": "Recycle"},
            "hooks": [{"name": n, "action": a, "code": c} for n, a, c in hooks],
        },
    }
    return json.dumps(spec)


def gateway_endpoint():
    ns, name = os.environ["SLUICE_GATEWAY_SERVICE"].split("/")
    slices = json.loads(kubectl("get", "endpointslices", "-n", ns, "-l",
                                f"kubernetes.io/service-name={name}", "-o", "json").stdout)
    for s in slices["items"]:
        port = next(p["port"] for p in s["ports"] if p.get("name") == "grpc")
        for e in s.get("endpoints") or []:
            if (e.get("conditions") or {}).get("ready"):
                return e["addresses"][0], port, f"{name}.{ns}.svc"
    sys.exit("exec_hops: no ready gateway endpoint")


def stream_port():
    """containerd's CRI stream server: the port containerd listens on besides its sockets."""
    out = sh("ss", "-ltnpH").stdout
    for line in out.splitlines():
        if '"containerd"' in line:
            local = line.split()[3]
            return int(local.rsplit(":", 1)[1])
    sys.exit("exec_hops: containerd's stream server port not found (ss -ltnp)")


SEGMENT = re.compile(
    r"^(?P<t>\d+\.\d+) .*?IP (?P<src>[\d.]+)\.(?P<sport>\d+) > (?P<dst>[\d.]+)\.(?P<dport>\d+): tcp (?P<len>\d+)")


def segments(path):
    for line in open(path):
        m = SEGMENT.match(line)
        if m and int(m["len"]) > 0:
            yield (float(m["t"]), m["src"], int(m["sport"]), m["dst"], int(m["dport"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--sluice", default="target/release/sluice")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between runs")
    ap.add_argument("--keep", action="store_true", help="leave the chain and its pods for a look")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("exec_hops: run as root (tcpdump)")
    gw_ip, gw_port, server_name = gateway_endpoint()
    cri = stream_port()
    # A namespace of our own, made afresh (a previous run's may still be terminating).
    kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true", "--timeout=180s")
    kubectl("create", "namespace", NS)
    kubectl("apply", "-f", "-", input=chain_yaml())
    kubectl("wait", "-n", NS, f"hc/{CHAIN}", "--for=condition=PoolReady", "--timeout=300s")
    call = [a.sluice, "call", "--addr", f"https://{gw_ip}:{gw_port}", "--namespace", NS,
            "--target", CHAIN, "--text", TEXT, "--ca", os.environ["SLUICE_CA"],
            "--tls-server-name", server_name]
    for _ in range(5):  # the gateway holds a pod, and its connection is open, before we count
        sh(*call, check=False)
        time.sleep(0.3)
    cap = tempfile.NamedTemporaryFile(prefix="exec-hops-", suffix=".txt", delete=False)
    dump = subprocess.Popen(
        ["tcpdump", "-i", "any", "-n", "-tt", "-l", "-q", "-B", "16384",
         f"tcp port {gw_port} or tcp port 6443 or tcp port 10250 or tcp port {cri}"],
        stdout=cap, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    windows, walks = [], []
    for _ in range(a.runs):
        time.sleep(a.gap)
        began = time.time()
        done = sh(*call, check=False)
        if done.returncode != 0:
            sys.exit(f"exec_hops: sluice call failed: {done.stderr.strip()}")
        out = done.stdout
        windows.append((began, time.time()))
        walks.append(sum(h.get("latency_us", 0) for h in json.loads(out).get("hooks", [])) / 1000)
    time.sleep(0.5)
    dump.send_signal(signal.SIGINT)
    dump.wait()
    if not a.keep:
        kubectl("delete", "namespace", NS, "--wait=false", check=False)
    segs = list(segments(cap.name))

    def hop(seg, to_port=None, from_port=None, src=None, dst=None):
        t, s, sp, d, dp = seg
        return ((to_port is None or dp == to_port) and (from_port is None or sp == from_port)
                and (src is None or s == src) and (dst is None or d == dst))

    hops = {  # name: (request segments, answer segments)
        "client → gateway": (dict(to_port=gw_port, dst=gw_ip), dict(from_port=gw_port, src=gw_ip)),
        "gateway → API server": (dict(to_port=6443, src=gw_ip), dict(from_port=6443, dst=gw_ip)),
        "API server → kubelet": (dict(to_port=10250), dict(from_port=10250)),
        "kubelet → containerd": (dict(to_port=cri), dict(from_port=cri)),
    }
    marks = {name: ([], []) for name in hops}
    for (began, ended) in windows:
        inside = [s for s in segs if began <= s[0] <= ended]
        for name, (req, ans) in hops.items():
            first = [s[0] for s in inside if hop(s, **req)]
            last = [s[0] for s in inside if hop(s, **ans)]
            if first and last:
                marks[name][0].append(first[0])
                marks[name][1].append(last[-1])
    n = min(len(v[0]) for v in marks.values())
    if n == 0:
        sys.exit(f"exec_hops: no run was seen on every hop (capture in {cap.name})")
    names = list(hops)
    ms = lambda pairs: statistics.median(pairs) * 1000
    inward, outward = [], []
    for outer, inner in zip(names, names[1:]):
        where = outer.split(" → ")[1]
        inward.append((f"{where}: request in → out to the next hop",
                       ms([i - o for o, i in zip(marks[outer][0], marks[inner][0])])))
        outward.append((f"{where}: answer in → out to the previous hop",
                        ms([o - i for o, i in zip(marks[outer][1], marks[inner][1])])))
    walk = statistics.median(walks)
    innermost = ms([a - r for r, a in zip(*marks[names[-1]])])
    rows = inward + [
        ("containerd → runc shim → runsc → supervisor and back, walk excluded", innermost - walk),
        ("the walk (the hooks' `latency_us`, as the supervisor reports them)", walk),
    ] + outward[::-1]
    total = ms([a - r for r, a in zip(*marks[names[0]])])
    print(f"exec path, hop by hop: median of {n} paced runs of a 3-hook chain (1 KiB), in ms")
    print("| span | ms |\n|---|---|")
    for what, value in rows:
        print(f"| {what} | {value:.2f} |")
    print(f"| the whole run, as seen on the gateway's gRPC port | {total:.2f} |")
    client = statistics.median((e - b) * 1000 for b, e in windows)
    print(f"(`sluice call` end to end, process start and TLS handshake included: {client:.1f} ms)")
    print(f"capture: {cap.name}")


if __name__ == "__main__":
    main()
