"""Sluice attach: the command the gateway execs into a warm pod, and the pod's readiness probe.

A warm pod's main process is the supervisor itself (`supervisor.py --listen`): it imported and warmed
up everything and started its zygote (which forks every cell) before the pod turned Ready. This relay connects to it on
the abstract unix socket `@sluice-supervisor` and hands it the exec's own stdin, stdout and stderr
(SCM_RIGHTS), so the protocol runs straight over the exec's pipes: the relay copies no byte. It then
waits until the supervisor is done and exits with the status the supervisor reports, which ends the
exec. `--probe` asks instead whether the supervisor is up (exit 0): waiting for its one attach with
its zygote alive, or already attached to its gateway (a kubelet that restarts probes every pod again);
it attaches nothing. While the supervisor is still starting (nothing listens yet) it keeps trying for
up to PROBE_WAIT seconds, so the kubelet's first probe, run as the container starts, turns the pod
Ready as soon as the supervisor is, not one probe period later. A second attach is refused.

Started on every claim, so it imports nothing beyond what the interpreter has already loaded: run
it as `python3 -I -S attach.py`.
"""

import os
import sys
from _socket import AF_UNIX, SCM_RIGHTS, SOCK_STREAM, SOL_SOCKET, socket

ADDRESS = "@sluice-supervisor"
TIMEOUT = 10.0
# Below the pod's probe timeoutSeconds (5).
PROBE_WAIT = 4.0


def address():
    """The abstract socket name; SLUICE_ATTACH overrides it (tests running several pods on one host)."""
    name = os.environ.get("SLUICE_ATTACH") or ADDRESS
    return "\0" + name[1:] if name.startswith("@") else name


def fail(message, code=1):
    # On attach, stderr is the gateway's protocol stream: one plain line, which it reports verbatim.
    os.write(2, f"sluice attach: {message}\n".encode("utf-8", "replace"))
    return code


def connect(wait):
    """Connects to the supervisor, retrying for `wait` seconds while nobody listens yet."""
    from time import monotonic, sleep

    give_up = monotonic() + wait
    while True:
        s = socket(AF_UNIX, SOCK_STREAM)
        s.settimeout(TIMEOUT)
        try:
            s.connect(address())
            return s
        except OSError:
            s.close()
            if monotonic() >= give_up:
                raise
        sleep(0.02)


def main(argv):
    if argv not in ([], ["--probe"]):
        return fail(f"usage: attach.py [--probe], not {' '.join(argv)!r}", 2)
    probe = argv == ["--probe"]
    try:
        s = connect(PROBE_WAIT if probe else 0)
    except OSError as e:
        return fail(f"no supervisor is waiting in this sandbox ({e.strerror or e}): it is already attached, still starting, or gone")
    try:
        if probe:
            s.sendall(b"probe")
            answer = s.recv(256)
            if answer in (b"ready", b"attached"):
                return 0
            return fail(f"the supervisor is not ready: {answer.decode('utf-8', 'replace') or 'no answer'}")
        fds = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in (0, 1, 2))
        # Our pid, so that the supervisor's check between trigger points knows we are no leftover.
        s.sendmsg([b"attach %d" % os.getpid()], [(SOL_SOCKET, SCM_RIGHTS, fds)])
        s.settimeout(None)  # the session lasts as long as the trigger point
        status = s.recv(64)
    except OSError as e:
        return fail(f"lost the supervisor: {e.strerror or e}")
    if not status:
        return fail("the supervisor ended without reporting a status")
    if len(status) > 1:  # a refusal, in words; a status is one byte
        return fail(f"the supervisor refused the attach: {status.decode('utf-8', 'replace')}")
    return status[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
