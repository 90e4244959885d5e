"""A `specd serve` child process, for the scripts and tests that start one."""

from __future__ import annotations

import http.client
import subprocess
import time


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Return once the daemon on `port` answers /health with 200; RuntimeError (with its
    stderr, where it was piped) when it exits first or does not answer within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"the daemon exited ({proc.returncode}) {said}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)  # polling a child process's start-up
    raise RuntimeError(f"the daemon did not become ready in {timeout:.0f} s")
