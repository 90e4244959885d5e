"""Server overhead: tokens/s and time to first token through the REST stream (SSE) versus
the same generation run in-process, on the same model, in one run.

    .venv/bin/python scripts/bench_server.py [--model M] [--draft D] [--strategy S]
        [--max-tokens 256] [--repeats 3] [--json bench_server.json]

The daemon runs as its own `specd serve` process, as users run it. Each repeat runs the in-process generation and the streamed request back to back (the
order alternates), greedy, ignoring EOS so both produce exactly --max-tokens tokens; the
medians are reported with their ratio (goal: REST ≥ 0.9 of in-process throughput).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from daemon.options import RuntimeOptions  # noqa: E402
from daemon.runtime import Runtime  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402

SHARED = ROOT.parent / "shared" / "models"


def in_process(runtime: Runtime, strategy: str, prompt_ids: list[int], n: int) -> dict:
    greedy = SamplingParams(temperature=0.0)
    gen = runtime.generation(prompt_ids, greedy, n, strategy=strategy, ignore_eos=True)
    t0 = time.perf_counter()
    first = None
    for chunk in gen:
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {"tokens": gen.completion_tokens, "ttft": first, "seconds": total, "text": gen.text}


def through_rest(port: int, strategy: str, prompt_ids: list[int], n: int) -> dict:
    body = {
        "prompt": prompt_ids,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "strategy": strategy,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, tokens, text = None, 0, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            if choice["text"]:
                if first is None:
                    first = time.perf_counter() - t0
                text.append(choice["text"])
    total = time.perf_counter() - t0
    conn.close()
    return {"tokens": tokens, "ttft": first, "seconds": total, "text": "".join(text)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_daemon(args: argparse.Namespace, port: int) -> subprocess.Popen:
    """`specd serve` in its own process, as users run it: the client here does not share
    the daemon's interpreter (or its GIL)."""
    cmd = [sys.executable, "-m", "daemon.cli", "serve", "--model", args.model,
           "--device", "cpu", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    if args.draft:
        cmd += ["--draft", args.draft]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "SPECD_LIMITS_CACHED_SESSIONS": "0"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"specd serve exited with status {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise TimeoutError("specd serve did not become healthy within 120 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default=str(SHARED / "stories260k"))
    ap.add_argument("--draft", default=None)
    ap.add_argument("--strategy", default="autoregressive")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: 1)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    runtime = Runtime(RuntimeOptions(model=args.model, draft=args.draft, device="cpu"))
    prompt_ids = runtime.tokenizer.encode(args.prompt)
    local, rest = [], []
    port = free_port()
    daemon = start_daemon(args, port)
    try:
        in_process(runtime, args.strategy, prompt_ids, 16)  # warm-up both paths
        through_rest(port, args.strategy, prompt_ids, 16)
        for i in range(args.repeats):
            pair = [
                lambda: local.append(
                    in_process(runtime, args.strategy, prompt_ids, args.max_tokens)
                ),
                lambda: rest.append(through_rest(port, args.strategy, prompt_ids, args.max_tokens)),
            ]
            for run in pair if i % 2 == 0 else pair[::-1]:
                run()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
    assert all(r["text"] == local[0]["text"] for r in local + rest), "outputs differ"

    def summary(runs: list[dict]) -> dict:
        return {
            "tokens": runs[0]["tokens"],
            "tokens_per_second": statistics.median(r["tokens"] / r["seconds"] for r in runs),
            "ttft_ms": statistics.median(r["ttft"] * 1000 for r in runs),
        }

    a, b = summary(local), summary(rest)
    ratio = b["tokens_per_second"] / a["tokens_per_second"]
    print(f"model {Path(args.model).name}, strategy {args.strategy}, {a['tokens']} tokens, "
          f"median of {args.repeats}")  # fmt: skip
    print(f"{'path':<12}{'tokens/s':>10}{'TTFT ms':>10}")
    print(f"{'in-process':<12}{a['tokens_per_second']:>10.1f}{a['ttft_ms']:>10.2f}")
    print(f"{'REST (SSE)':<12}{b['tokens_per_second']:>10.1f}{b['ttft_ms']:>10.2f}")
    print(f"REST / in-process throughput: {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"in_process": a, "rest": b, "ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
