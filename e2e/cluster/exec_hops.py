"""Where a trigger point's time goes on the real exec path, hop by hop (e2e/cluster/README.md).

Run against the test cluster with Sluice installed (`make cluster-up cluster-install`, then
`. /var/lib/sluice-cluster/e2e.env`), as root, with the Python client installed
(`make test-clients` makes `.venv-clients`):

    python3 e2e/cluster/exec_hops.py [--runs 200] [--python .venv-clients/bin/python]

It applies a 3-hook chain (the bench's, with the chart's default resources) in a namespace of its own,
captures every TCP segment with a payload on the hops a trigger point crosses (tcpdump, which does not
slow anything down), and makes paced runs through one gateway pod over one kept gRPC connection (the
Python client, as an application calls; a process per run would put a TLS handshake and a
connection's teardown into the gateway's spans). For each run it takes, on each hop, the first segment
of the request and the last segment of the answer, and prints each span's median, its p99 and its
share of the slowest runs:

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


# Runs under the Python client's venv: paced runs over one connection, one JSON line per counted run
# (its window on this machine's clock and the walk the supervisor reported).
RUNNER = r"""
import json, os, sys, time
from sluice_client import Client
addr, server_name, ca, ns, chain, text, runs, gap = sys.argv[1:9]
gw = Client(addr, namespace=ns, root_certificates=ca, server_name=server_name,
            token=os.environ.get("SLUICE_TOKEN"))
for _ in range(5):  # the gateway holds a pod, and the connection is open, before we count
    gw.run(chain, "input", text)
    time.sleep(0.3)
for _ in range(int(runs)):
    time.sleep(float(gap))
    began = time.time()
    r = gw.run(chain, "input", text)
    ended = time.time()
    walk = sum(h.latency_us for h in r.hooks) / 1000
    print(json.dumps({"began": began, "ended": ended, "walk_ms": walk}), flush=True)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--python", default=".venv-clients/bin/python",
                    help="a Python with sluice-client installed (make test-clients makes it)")
    ap.add_argument("--gap", type=float, default=0.05, help="seconds between runs (the bench's pace)")
    ap.add_argument("--keep", action="store_true", help="leave the chain and its pods for a look")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("exec_hops: run as root (tcpdump)")
    if sh(a.python, "-c", "import sluice_client", check=False).returncode != 0:
        sys.exit(f"exec_hops: {a.python} has no sluice_client: make test-clients, or --python")
    gw_ip, gw_port, server_name = gateway_endpoint()
    cri = stream_port()
    # A namespace of our own, made afresh (a previous run's may still be terminating).
    kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true", "--timeout=180s")
    kubectl("create", "namespace", NS)
    kubectl("apply", "-f", "-", input=chain_yaml())
    kubectl("wait", "-n", NS, f"hc/{CHAIN}", "--for=condition=PoolReady", "--timeout=300s")
    cap = tempfile.NamedTemporaryFile(prefix="exec-hops-", suffix=".txt", delete=False)
    dump = subprocess.Popen(
        ["tcpdump", "-i", "any", "-n", "-tt", "-l", "-q", "-B", "16384",
         f"tcp port {gw_port} or tcp port 6443 or tcp port 10250 or tcp port {cri}"],
        stdout=cap, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    done = sh(a.python, "-c", RUNNER, f"{gw_ip}:{gw_port}", server_name, os.environ["SLUICE_CA"],
              NS, CHAIN, TEXT, str(a.runs), str(a.gap), check=False)
    time.sleep(0.5)
    dump.send_signal(signal.SIGINT)
    dump.wait()
    if not a.keep:
        kubectl("delete", "namespace", NS, "--wait=false", check=False)
    if done.returncode != 0:
        sys.exit(f"exec_hops: the runs failed: {done.stderr.strip()[-2000:]}")
    runs = [json.loads(line) for line in done.stdout.splitlines()]
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
    names = list(hops)
    # Per run: the first request segment and the last answer segment on each hop, then its spans.
    spans = []
    for run in runs:
        inside = [s for s in segs if run["began"] <= s[0] <= run["ended"]]
        # From the outermost hop inwards, each inner hop's segments bounded by the outer one's: the
        # `end` and next `init` the gateway sends after the answer, and their acks, are not the run.
        marks, lo, hi = {}, run["began"], run["ended"]
        for name, (req, ans) in hops.items():
            first = [s[0] for s in inside if hop(s, **req) and s[0] >= lo]
            last = [s[0] for s in inside if hop(s, **ans) and s[0] <= hi]
            if not (first and last):
                break
            marks[name] = lo, hi = first[0], last[-1]
        if len(marks) < len(names):
            continue
        row = {}
        for outer, inner in zip(names, names[1:]):
            where = outer.split(" → ")[1]
            row[f"{where}: request in → out to the next hop"] = marks[inner][0] - marks[outer][0]
        innermost = marks[names[-1]][1] - marks[names[-1]][0]
        row["containerd → runc shim → runsc → supervisor and back, walk excluded"] = (
            innermost - run["walk_ms"] / 1000)
        row["the walk (the hooks' `latency_us`, as the supervisor reports them)"] = run["walk_ms"] / 1000
        for outer, inner in reversed(list(zip(names, names[1:]))):
            where = outer.split(" → ")[1]
            row[f"{where}: answer in → out to the previous hop"] = marks[outer][1] - marks[inner][1]
        row["the whole run, as seen on the gateway's gRPC port"] = (
            marks[names[0]][1] - marks[names[0]][0])
        row["the client's own view (gRPC call, Python client)"] = run["ended"] - run["began"]
        spans.append(row)
    if not spans:
        sys.exit(f"exec_hops: no run was seen on every hop (capture in {cap.name})")
    n = len(spans)
    whole = "the whole run, as seen on the gateway's gRPC port"
    slowest = sorted(spans, key=lambda r: r[whole])[-max(1, n // 100):]

    def pct(values, p):
        values = sorted(values)
        return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]

    print(f"exec path, hop by hop: {n} paced runs ({a.gap * 1000:.0f} ms apart) of a 3-hook chain "
          f"(1 KiB) over one connection, in ms; the slowest 1 % = {len(slowest)} runs")
    print("| span | median | p99 | mean of the slowest 1 % |\n|---|---|---|---|")
    for what in spans[0]:
        values = [r[what] * 1000 for r in spans]
        tail = statistics.mean(r[what] * 1000 for r in slowest)
        print(f"| {what} | {statistics.median(values):.2f} | {pct(values, 99):.2f} | {tail:.2f} |")
    print(f"capture: {cap.name}")


if __name__ == "__main__":
    main()
