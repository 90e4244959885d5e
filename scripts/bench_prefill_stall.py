"""A short request's answer while a long prompt prefills, on a CPU (docs/measurements.md,
"A short request beside a long prefill").

Starts `specd serve` from the checkout given (so two builds compare side by side), sends
a prompt of about 6,300 tokens, and a second later a one-token request; prints how long the
short request took alone, beside the long prompt, and how long the long prompt took.

    .venv/bin/python scripts/bench_prefill_stall.py [--root CHECKOUT] [--port N]
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.daemon_process import wait_ready  # noqa: E402

MODEL = ROOT.parent / "shared/models/smollm2-135m-instruct/smollm2-135m-instruct-q4_1.gguf"


def ask(port: int, body: dict) -> float:
    """Seconds for one completion request, answered whole."""
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", "/v1/completions", json.dumps(body))
    conn.getresponse().read()
    return time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose daemon runs")
    ap.add_argument("--port", type=int, default=18780)
    ap.add_argument("--model", type=Path, default=MODEL)
    args = ap.parse_args()
    home = tempfile.mkdtemp(prefix="specd-bench-")
    env = {
        "XDG_STATE_HOME": home,
        "XDG_CACHE_HOME": home,
        "XDG_CONFIG_HOME": home,
        "PATH": "/usr/bin:/bin",
    }
    command = [sys.executable, "-m", "daemon.cli", "serve", "--model", str(args.model),
               "--port", str(args.port), "--draft", "none", "--compile", "off", "--threads", "1"]  # fmt: skip
    server = subprocess.Popen(
        command, cwd=args.root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_ready(args.port, server, timeout=120)
        alone = ask(args.port, {"prompt": "Lily", "max_tokens": 1, "temperature": 0})
        long_prompt = "the quick brown fox jumps over the lazy dog " * 700
        took: dict[str, float] = {}

        def long() -> None:
            took["long"] = ask(
                args.port, {"prompt": long_prompt, "max_tokens": 1, "temperature": 0}
            )

        thread = threading.Thread(target=long)
        thread.start()
        time.sleep(1.0)
        beside = ask(args.port, {"prompt": "Lily, once", "max_tokens": 1, "temperature": 0})
        thread.join()
        print(f"{args.root}: short alone {alone:.2f} s; beside a long prefill {beside:.2f} s; "
              f"the long prompt {took['long']:.1f} s")  # fmt: skip
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
