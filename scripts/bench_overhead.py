"""Per-step and start-up overhead, one section each; `main()` runs every section asked for.

    .venv/bin/python scripts/bench_overhead.py [--sections startup decode draft profile]
        [--runs 5] [--repeats 5] [--model M] [--draft D] [--json PATH]

Ratios, not absolute times, are the result: the machine is shared. Sections:

- startup: cold processes, as users start them. `specd generate` from the process's start
  to the first byte of text on its stdout (a pipe), `specd serve` from its start to
  /health answering 200 (polled every 5 ms), and how long a fresh interpreter takes to
  start, to import torch, and to import what `generate` needs, from its start to the
  import done (its exit not counted; the collector off, as `generate` has it), with their
  share of the time to the first token. Runs are interleaved so that load from other jobs
  falls on every measure alike; medians and minima are reported.
- decode: tokens/s of greedy generation on the pair, compiled passes off against on
  (alternating repeats, best of each), for autoregressive, linear and tree speculation;
  the outputs must be identical.
- draft: one draft step per tree depth (1, 8, 32 nodes over a ~100-token cache), eager
  against compiled, median microseconds.
- profile: host time per decode step from torch.profiler, eager against compiled, with
  the profiler's top table for each.
- shaped: a random draft in a real model's shape (`--shaped llama-3.2-1b`: 16 layers,
  vocabulary 128,256), one draft step at 1-64 nodes over a 512-token cache, eager against
  compiled; on CUDA also against CUDA graphs of the eager and of the compiled step, with
  the graphs' capture count and time. A default section only where CUDA is; on a CPU ask
  for it, scaled down
  (`--sections shaped --hidden-scale 0.05`).
- budget: the tree shape the auto budget would choose for a streamed 8B and 70B target on a
  24 GB card, with the shaped section's draft step times (eager, and what `--compile on`
  runs) and a target pass at the plan's transfer bound (measured bandwidth); predicted
  tokens/s with the stories pair's acceptance. A default section only where CUDA is.

A section is a function `(args) -> rows` (printed by the section, written to the JSON under
its name); add one to SECTIONS.
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
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from modeling.checkpoints.checkpoint import load  # noqa: E402
from modeling.compiled import CompiledPasses  # noqa: E402
from modeling.text.tokenizer import Tokenizer  # noqa: E402
from scripts.step_timing import budget, print_steps, shaped, step_seconds  # noqa: E402
from speculative.drafting import ModelDrafter  # noqa: E402
from speculative.generation import Generation  # noqa: E402
from speculative.rounds import Strategy  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402
from speculative.strategies.autoregressive import Autoregressive  # noqa: E402
from speculative.strategies.linear import Linear  # noqa: E402
from speculative.strategies.tree import TreeSpeculation  # noqa: E402

SHARED = ROOT.parent / "shared" / "models"
PROMPT = "Once upon a time"


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


def _startup_rows(args: argparse.Namespace) -> list[Row]:
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


class Pair:
    """The shared target and draft, each with its compiled passes warmed; `compiled(on)`
    switches both."""

    def __init__(self, target_dir: Path, draft_dir: Path) -> None:
        self.target, self.tokenizer = load(str(target_dir))[:2]
        self.draft = load(str(draft_dir))[0]
        self.passes: dict[int, CompiledPasses] = {}
        self.warm_seconds = 0.0
        for model in (self.target, self.draft):
            passes = CompiledPasses(model)
            self.warm_seconds += passes.warm(lambda line: print(f"  {line}", flush=True))
            self.passes[id(model)] = passes

    def compiled(self, on: bool) -> None:
        for model in (self.target, self.draft):
            model.compiled = self.passes[id(model)] if on else None


def _generate(strategy: Strategy, tokenizer: Tokenizer, n: int) -> tuple[float, list[int]]:
    prompt = tokenizer.encode(PROMPT)
    session = strategy.new_session(len(prompt) + n + 64)
    gen = Generation(
        strategy, session, tokenizer, prompt, SamplingParams(temperature=0.0), n, ignore_eos=True
    )
    t0 = time.perf_counter()
    gen.run()
    return time.perf_counter() - t0, gen.token_ids


def _decode_rows(pair: Pair, tokens: int, repeats: int) -> list[dict[str, Any]]:
    strategies: dict[str, Callable[[], Strategy]] = {
        "autoregressive": lambda: Autoregressive(pair.target),
        "linear (k=4)": lambda: Linear(pair.target, ModelDrafter(pair.draft), 4),
        "tree (budget 8)": lambda: TreeSpeculation(pair.target, pair.draft, budget=8),
    }
    rows = []
    for name, build in strategies.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        outputs: dict[bool, list[int]] = {}
        for i in range(repeats + 1):  # the first round of each is a warm-up
            for on in (False, True) if i % 2 == 0 else (True, False):
                pair.compiled(on)
                seconds, ids = _generate(build(), pair.tokenizer, tokens)
                outputs[on] = ids
                if i:
                    times[on].append(seconds)
        pair.compiled(False)
        eager, compiled = min(times[False]), min(times[True])
        rows.append(
            {
                "strategy": name,
                "eager_tokens_per_s": tokens / eager,
                "compiled_tokens_per_s": tokens / compiled,
                "ratio": eager / compiled,
                "identical_output": outputs[False] == outputs[True],
            }
        )
    return rows


def _draft_rows(pair: Pair, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for nodes in (1, 8, 32):
        pair.compiled(False)
        eager = step_seconds(pair.draft, nodes, 100, repeats)
        pair.compiled(True)
        compiled = step_seconds(pair.draft, nodes, 100, repeats)
        pair.compiled(False)
        rows.append(
            {
                "nodes": nodes,
                "eager_us": 1e6 * eager,
                "compiled_us": 1e6 * compiled,
                "ratio": eager / compiled,
            }
        )
    return rows


def _profile(pair: Pair, steps: int) -> dict[str, Any]:
    """Host (CPU) time per decode step of the target as torch.profiler sees it."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    for on in (False, True):
        pair.compiled(on)
        _generate(Autoregressive(pair.target), pair.tokenizer, 8)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _generate(Autoregressive(pair.target), pair.tokenizer, steps)
        events = prof.key_averages()
        total_us = sum(e.self_cpu_time_total for e in events)
        label = "compiled" if on else "eager"
        out[label] = {
            "host_us_per_step": total_us / steps,
            "ops_per_step": sum(e.count for e in events) / steps,
            "table": events.table(sort_by="self_cpu_time_total", row_limit=8),
        }
    pair.compiled(False)
    out["ratio"] = out["eager"]["host_us_per_step"] / out["compiled"]["host_us_per_step"]
    return out


_PAIRS: dict[tuple[str, str], Pair] = {}


def _pair(args: argparse.Namespace) -> Pair:
    """The pair with warmed compiled passes, built once for every section that needs it."""
    key = (args.model, args.draft or args.model)
    if key not in _PAIRS:
        print("warming the compiled passes (loaded from the disk cache after the first run)")
        pair = Pair(Path(key[0]), Path(key[1]))
        print(f"  warm-up took {pair.warm_seconds:.1f} s")
        _PAIRS[key] = pair
    return _PAIRS[key]


def decode(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = _decode_rows(_pair(args), args.tokens, args.repeats)
    print(f"\ndecode, {args.tokens} greedy tokens, best of {args.repeats}")
    print(f"{'strategy':<18}{'eager tok/s':>13}{'compiled tok/s':>16}{'ratio':>8}  same")
    for r in rows:
        print(
            f"{r['strategy']:<18}{r['eager_tokens_per_s']:>13.0f}"
            f"{r['compiled_tokens_per_s']:>16.0f}{r['ratio']:>7.2f}x  {r['identical_output']}"
        )
    return rows


def draft(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = _draft_rows(_pair(args), max(args.repeats * 20, 21))
    print("\ndraft step (one tree depth) over a 100-token cache, median")
    print_steps(rows)
    return rows


def profile(args: argparse.Namespace) -> dict[str, Any]:
    prof = _profile(_pair(args), 50)
    for label in ("eager", "compiled"):
        p = prof[label]
        print(
            f"\nprofile, {label}: {p['host_us_per_step']:.0f} µs host time and "
            f"{p['ops_per_step']:.0f} profiled ops per decode step"
        )
        print(p["table"])
    print(f"host time per step, eager / compiled: {prof['ratio']:.2f}x")
    return prof


def startup(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = _startup_rows(args)
    print_table(rows)
    return [r.to_dict() for r in rows]


SECTIONS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "startup": startup,
    "decode": decode,
    "draft": draft,
    "profile": profile,
    "shaped": shaped,
    "budget": budget,
}


def print_table(rows: list[Row]) -> None:
    print("| section | measure | median s | min s | runs | notes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        notes = ", ".join(f"{k} {v}" for k, v in r.notes.items())
        print(
            f"| {r.section} | {r.name} | {r.median:.3f} | {r.minimum:.3f} "
            f"| {len(r.seconds)} | {notes} |"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    default = ["startup", "decode", "draft", "profile"]
    if torch.cuda.is_available():
        default += ["shaped", "budget"]
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=default)
    ap.add_argument("--runs", type=int, default=5, help="startup: cold processes per measure")
    ap.add_argument("--model", default=str(SHARED / "stories260k"))
    ap.add_argument("--draft", default=str(SHARED / "stories260k-draft"), help="'' for none")
    ap.add_argument("--tokens", type=int, default=200, help="decode: tokens per generation")
    ap.add_argument("--repeats", type=int, default=5, help="decode: runs of each, best kept")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shaped", default="llama-3.2-1b", help="shaped: real_shapes preset")
    ap.add_argument("--hidden-scale", type=float, default=1.0, help="shaped: width scale")
    ap.add_argument("--shaped-bits", type=int, choices=(2, 3, 4, 8), default=None,
                    help="shaped: the model's HQQ substitute at these bits instead")  # fmt: skip
    ap.add_argument("--shaped-layers", type=int, default=None, help="shaped: fewer layers")
    ap.add_argument("--shaped-repeats", type=int, default=50, help="shaped: steps timed")
    ap.add_argument("--json", type=Path, default=None, help="write every section here")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else argv,
                              "torch": torch.__version__, "threads": args.threads}  # fmt: skip
    for name in args.sections:
        report[name] = SECTIONS[name](args)
        if _PAIRS:
            report["warm_seconds"] = [pair.warm_seconds for pair in _PAIRS.values()]
        if args.json is not None:  # after each section: a run cut short keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
