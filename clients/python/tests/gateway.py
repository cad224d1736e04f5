"""A real `sluice-gateway --local` for the client tests: the binary the workspace built
(target/debug/sluice-gateway, or $SLUICE_GATEWAY_BIN), real runsc sandboxes, the chains of
chains.py, a free loopback port and its own temporary state dir. One gateway serves every test of a
run (booting sandboxes is the expensive part); it is stopped with SIGTERM when the run ends.

Tests that need it skip, saying why, only when runsc is not installed; a missing gateway binary or
a gateway that does not start is a failure."""

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import unittest
from typing import Any, Dict, List, Optional, Sequence

from . import chains

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
RUNSC_MISSING = (
    "runsc (gVisor) is not installed, so no local gateway can run: these client tests need one "
    "(`make deps` installs runsc from bookworm-backports)"
)


def requires_runsc(cls):
    return unittest.skipUnless(shutil.which("runsc"), RUNSC_MISSING)(cls)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary() -> str:
    path = os.environ.get("SLUICE_GATEWAY_BIN") or os.path.join(REPO, "target", "debug", "sluice-gateway")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{path} is missing: build it with `cargo build -p sluice-gateway`")
    return path


class LocalGateway:
    """`files` are the chain files it serves (name -> YAML), `args` extra command-line options,
    `client` the options of the client that waits for it to be ready (TLS, token)."""

    def __init__(self, files: Optional[Dict[str, str]] = None, args: Sequence[str] = (),
                 client: Optional[Dict[str, Any]] = None, serve: Optional[str] = None) -> None:
        # `serve`: an existing directory to serve as it is (never removed) instead of `files`.
        self.own_dir = serve is None
        self.dir = serve or tempfile.mkdtemp(prefix="sluice-pyclient-chains")
        self.state = tempfile.mkdtemp(prefix="sluice-pyclient-state", dir="/tmp")
        if self.own_dir:
            for name, text in (chains.ALL if files is None else files).items():
                with open(os.path.join(self.dir, name), "w") as f:
                    f.write(text)
        self.address = f"127.0.0.1:{free_port()}"
        self.client = client or {}
        self.log: List[str] = []
        self.proc = subprocess.Popen(
            [binary(), "--local", self.dir, "--listen", self.address, "--state-dir", self.state,
             "--audit", os.path.join(self.state, "audit.jsonl"), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RUST_LOG": "info", "NO_COLOR": "1"},
        )
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.rstrip())

    def wait_ready(self, timeout: float = 120.0) -> None:
        from sluice_client import Client, Unavailable

        with Client(self.address, **self.client) as c:
            try:
                c.wait_ready(timeout)
            except Unavailable as e:
                tail = "\n".join(self.log[-20:])
                raise RuntimeError(f"the gateway never became ready: {e}\nits log:\n{tail}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._drainer.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        # A healthy run logs no warnings; when a test failed, these say what the gateway saw.
        troubles = [line for line in self.log if " WARN " in line or " ERROR " in line]
        if troubles:
            print("\nsluice-gateway warnings and errors during the client tests:", *troubles[-30:],
                  sep="\n  ", file=sys.stderr)
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.state, ignore_errors=True)


_gateway: Optional[LocalGateway] = None
_failed: Optional[str] = None


def shared() -> LocalGateway:
    """The run's gateway, started (and waited for) on first use; a start that failed fails every
    later caller at once with the same reason."""
    global _gateway, _failed
    if _failed is not None:
        raise RuntimeError(_failed)
    if _gateway is None:
        g = LocalGateway()
        try:
            g.wait_ready()
        except Exception as e:
            g.stop()
            _failed = str(e)
            raise
        atexit.register(g.stop)
        _gateway = g
    return _gateway
