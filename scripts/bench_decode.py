"""Autoregressive decode speed: specd's runtime against transformers' `generate`.

Same checkpoint, prompt, dtype, token count and thread count; greedy; repeats interleaved
(ours, theirs, ours, ...) so that drift on a shared machine hits both alike. Prints a table
with the ratio and writes JSON. transformers is a bench/test-only dependency.

    .venv/bin/python scripts/bench_decode.py [--model DIR] [--max-tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling.checkpoints.checkpoint import DTYPES, load  # noqa: E402
from speculative.generation import Generation  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402
from speculative.strategies.autoregressive import Autoregressive  # noqa: E402

DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "stories260k"


@dataclass
class Result:
    implementation: str
    seconds: list[float]  # one per repeat: the whole call, prompt prefill included
    tokens: int

    @property
    def median_tokens_per_second(self) -> float:
        return self.tokens / statistics.median(self.seconds)

    def row(self) -> dict:
        return {
            **asdict(self),
            "median_tokens_per_second": self.median_tokens_per_second,
            "median_ms_per_token": 1000 * statistics.median(self.seconds) / self.tokens,
            "best_tokens_per_second": self.tokens / min(self.seconds),
        }


def run_ours(model, tokenizer, prompt_ids: list[int], n: int) -> tuple[float, list[int]]:  # type: ignore[no-untyped-def]
    strategy = Autoregressive(model)
    session = strategy.new_session(len(prompt_ids) + n)
    t0 = time.perf_counter()
    gen = Generation(
        strategy,
        session,
        tokenizer,
        prompt_ids,
        SamplingParams(temperature=0.0),
        max_tokens=n,
        ignore_eos=True,
    ).run()
    return time.perf_counter() - t0, gen.token_ids


def run_transformers(model, prompt_ids: list[int], n: int) -> tuple[float, list[int]]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return time.perf_counter() - t0, out[0, len(prompt_ids) :].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads for both (1: steadiest on a busy box)"
    )
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "decode.json"))
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM  # bench-only reference

    torch.set_num_threads(args.threads)
    ours_model, tokenizer, _ = load(args.model, args.dtype)
    ref_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.dtype]).eval()
    prompt_ids = tokenizer.encode(args.prompt)
    n = args.max_tokens

    # Warm-up (first calls allocate and pick kernels), and the tokens both must agree on.
    _, ours_ids = run_ours(ours_model, tokenizer, prompt_ids, n)
    _, ref_ids = run_transformers(ref_model, prompt_ids, n)
    ours = Result("specd autoregressive", [], n)
    ref = Result("transformers generate", [], n)
    for i in range(args.repeats):
        order = [(ours, True), (ref, False)] if i % 2 == 0 else [(ref, False), (ours, True)]
        for result, is_ours in order:
            if is_ours:
                seconds, _ = run_ours(ours_model, tokenizer, prompt_ids, n)
            else:
                seconds, _ = run_transformers(ref_model, prompt_ids, n)
            result.seconds.append(seconds)

    ratio = ours.median_tokens_per_second / ref.median_tokens_per_second
    print(
        f"model {args.model}  dtype {args.dtype}  prompt {len(prompt_ids)} tokens  "
        f"new {n} tokens  threads {args.threads}  repeats {args.repeats} (interleaved)"
    )
    print(f"{'implementation':<24}{'tokens/s (median)':>19}{'ms/token':>10}{'best tok/s':>12}")
    for r in (ours, ref):
        row = r.row()
        print(
            f"{r.implementation:<24}{row['median_tokens_per_second']:>19.1f}"
            f"{row['median_ms_per_token']:>10.3f}{row['best_tokens_per_second']:>12.1f}"
        )
    same = ours_ids == ref_ids
    print(f"ratio specd / transformers: {ratio:.2f}   identical greedy tokens: {same}")

    record = {
        "model": args.model,
        "dtype": args.dtype,
        "prompt": args.prompt,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": n,
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "results": [ours.row(), ref.row()],
        "ratio": ratio,
        "identical_tokens": same,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
