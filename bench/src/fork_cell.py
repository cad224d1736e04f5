"""The fork-cell baseline: the cell Sluice had before WebAssembly cells, reduced to its cost. A warm
Python process (the zygote: imports done) forks, per hook, a process that unshares the user, pid,
mount, ipc, net and uts namespaces, maps its user, forks the hook's process as pid 1 of the new pid
namespace, which mounts a private /tmp and its own /proc, loads the hook's code and runs it on the
payload; the answer comes back over a pipe. Run inside runsc by `sluice-bench cells`.

Protocol: prints `warm` after a few cells, waits for a line on stdin, runs N cells, prints `done`."""

import ctypes
import json
import os
import sys

HOOK = """
import re
P = re.compile(r'\\b\\d{3}-\\d{4}-\\d{4}\\b')
def execute(context, settings):
    t = P.sub('[phone]', context['outgoing'])
    return {'action': 'modify', 'outgoing': t} if t != context['outgoing'] else {'action': 'pass'}
"""
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
libc = ctypes.CDLL(None, use_errno=True)


def check(what, rc):
    if rc != 0:
        raise OSError(ctypes.get_errno(), what)


def cell(text):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            uid, gid = os.getuid(), os.getgid()
            check("unshare", libc.unshare(NEWUSER | NEWPID | NEWNS | NEWIPC | NEWNET | NEWUTS))
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"{uid} {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
            inner = os.fork()
            if inner == 0:
                check("mount /tmp", libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0x2 | 0x4, b"size=8388608"))
                check("mount /proc", libc.mount(b"proc", b"/proc", b"proc", 0x2 | 0x4 | 0x8, None))
                ns = {}
                exec(compile(HOOK, "<hook>", "exec"), ns)
                out = ns["execute"]({"outgoing": text, "state": None}, {})
                os.write(w, json.dumps(out).encode())
                os._exit(0)
            os.waitpid(inner, 0)
        finally:
            os._exit(0)
    os.close(w)
    answer = b""
    while chunk := os.read(r, 65536):
        answer += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(answer)


def main():
    n = int(sys.argv[1])
    text = ("The quick brown fox jumps over the lazy dog. " * 20) + "Call me at 010-1234-5678."
    for _ in range(5):
        assert cell(text)["action"] == "modify"
    print("warm", flush=True)
    sys.stdin.readline()
    for _ in range(n):
        cell(text)
    print("done", flush=True)


main()
