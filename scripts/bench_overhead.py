"""Fixed costs around decoding, one section each; `main()` runs every section asked for.

    .venv/bin/python scripts/bench_overhead.py [--sections startup] [--runs 5]
        [--model M] [--draft D] [--json PATH]

startup: cold processes, as users start them. `specd generate` from the process's start to
the first byte of text on its stdout (a pipe), `specd serve` from its start to /health
answering 200 (polled every 5 ms), and how long a fresh interpreter takes to start, to
import torch, and to import what `generate` needs (daemon.runtime pulls in torch), from
its start to the import done (its exit not counted; the collector off, as `generate` has
it), with their share of the time to the first token. Runs are interleaved so that load from other jobs falls on every measure
alike; medians and minima are reported (the minimum is the least disturbed run).

A section is a function `(args) -> list[Row]`; add one to SECTIONS.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "models"


@dataclass
class Row:
    """One measure of a section: seconds per run, summarised by median and minimum."""

    section: str
    name: str
    seconds: list[float]
    notes: dict[str, float | str] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def minimum(self) -> float:
        return min(self.seconds)

    def to_dict(self) -> dict:
        return {**asdict(self), "median": self.median, "min": self.minimum}


# ---- startup ----


def _env() -> dict[str, str]:
    # The checkout's own code, whichever one this script belongs to; one torch thread as
    # `--threads auto` picks for these models, so other jobs' load does not stall it.
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _specd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "daemon.cli", *argv]


def generate_to_first_token(model: str, draft: str | None) -> tuple[float, float]:
    """(seconds to the first byte of text on stdout, seconds to exit) of one cold
    `specd generate`."""
    cmd = _specd("generate", "--model", model, "--prompt", "Once upon a time", "--max-tokens", "8")
    if draft:
        cmd += ["--draft", draft]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    t_first = time.monotonic() - t0
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise RuntimeError(f"specd generate failed (status {proc.returncode})")
    return t_first, time.monotonic() - t0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _health(port: int) -> int:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return 0


def serve_to_ready(model: str, draft: str | None, timeout: float = 120.0) -> float:
    """Seconds from starting `specd serve` to /health answering 200 (models loaded)."""
    port = _free_port()
    cmd = _specd("serve", "--model", model, "--device", "cpu", "--port", str(port))
    cmd += ["--log-level", "warning"] + (["--draft", draft] if draft else [])
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env())
    try:
        while time.monotonic() - t0 < timeout:
            if _health(port) == 200:
                return time.monotonic() - t0
            if proc.poll() is not None:
                raise RuntimeError(f"specd serve exited with status {proc.returncode}")
            time.sleep(0.005)
        raise TimeoutError(f"specd serve was not ready within {timeout:.0f} s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def import_seconds(statement: str) -> float:
    """Seconds from starting a fresh interpreter to its having run `statement`: the child
    reads the same system-wide monotonic clock, so its exit (tearing torch down takes a
    few hundred milliseconds) is not counted."""
    script = f"{statement}\nimport time\nprint(time.monotonic())"
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=_env(), check=True, capture_output=True
    )
    return float(done.stdout.split()[-1]) - t0


# What a process has done by the time its imports are over (start → after the statement),
# with the cyclic collector off as `specd generate` imports (daemon/startup.py).
IMPORTS = {
    "interpreter alone": "pass",
    "import torch": "import gc; gc.disable(); import torch",
    "imports of generate": (
        "import gc; gc.disable(); import daemon.cli, daemon.runtime, speculative.generation"
    ),
}


def startup(args: argparse.Namespace) -> list[Row]:
    first: list[float] = []
    exits: list[float] = []
    ready: list[float] = []
    imports: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _ in range(args.runs):
        t_first, t_exit = generate_to_first_token(args.model, args.draft)
        first.append(t_first)
        exits.append(t_exit)
        ready.append(serve_to_ready(args.model, args.draft))
        for name, statement in IMPORTS.items():
            imports[name].append(import_seconds(statement))
    rows = [
        Row("startup", "generate: start → first token", first),
        Row("startup", "generate: start → exit (8 tokens)", exits),
        Row("startup", "serve: start → /health ready", ready),
    ]
    ttft = statistics.median(first)
    for name, seconds in imports.items():
        share = statistics.median(seconds) / ttft
        rows.append(Row("startup", name, seconds, {"share of first token": round(share, 3)}))
    return rows


SECTIONS: dict[str, Callable[[argparse.Namespace], list[Row]]] = {"startup": startup}


def print_table(rows: list[Row]) -> None:
    print("| section | measure | median s | min s | runs | notes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        notes = ", ".join(f"{k} {v}" for k, v in r.notes.items())
        print(
            f"| {r.section} | {r.name} | {r.median:.3f} | {r.minimum:.3f} "
            f"| {len(r.seconds)} | {notes} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--sections", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--runs", type=int, default=5, help="cold processes per measure")
    ap.add_argument("--model", default=str(SHARED / "stories260k"))
    ap.add_argument("--draft", default=str(SHARED / "stories260k-draft"), help="'' for none")
    ap.add_argument("--json", type=Path, default=None, help="write every run here")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    rows = [row for name in args.sections for row in SECTIONS[name](args)]
    print_table(rows)
    if args.json is not None:
        report = {"argv": sys.argv[1:], "rows": [r.to_dict() for r in rows]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
