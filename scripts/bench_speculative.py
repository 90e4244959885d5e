"""Side-by-side speculative decoding benchmark on one model pair, in one run.

Strategies: autoregressive, linear K=1..8, tree with fixed budgets and `auto`, and
transformers' assisted generation (`assistant_model`, the outside reference), each greedy
and at temperature 1. Reports tokens per target pass, tokens/s and the ratio of tokens/s to
autoregressive decoding (absolute times drift on a shared machine; ratios from one run do
not). Writes a JSON file, prints a markdown table, and plots tokens per target pass
against the tree budget.

    .venv/bin/python scripts/bench_speculative.py            # ~1-5 minutes on 2 cores
    .venv/bin/python scripts/bench_speculative.py --prompts 2 --tokens 64   # quicker
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling.checkpoints.checkpoint import load  # noqa: E402
from speculative.drafting import ModelDrafter  # noqa: E402
from speculative.generation import Generation  # noqa: E402
from speculative.prefix_cache import PrefixCache  # noqa: E402
from speculative.rounds import Strategy  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402
from speculative.strategies.autoregressive import Autoregressive  # noqa: E402
from speculative.strategies.linear import Linear  # noqa: E402
from speculative.strategies.tree import TreeSpeculation  # noqa: E402

PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom",
    "One day, a big",
    "Tim had a red ball",
    "The sun was hot",
]
WARMUP_PROMPT = "There was a cat"
BUDGETS = (8, 16, 32, 64, 128, 256)


@dataclass
class Result:
    name: str
    mode: str  # greedy | t1
    budget: int | str | None
    tokens: int
    target_passes: int
    seconds: float
    chosen_budget: int | None = None

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / max(self.target_passes, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def run_strategy(
    name: str, strategy: Strategy, tok: Any, prompts: list[str], params: SamplingParams, n: int
) -> Result:
    session = strategy.new_session(512)
    warm = Generation(
        strategy, session, tok, tok.encode(WARMUP_PROMPT), params, 32, ignore_eos=True
    )
    warm.run()
    tokens = passes = 0
    seconds = 0.0
    chosen = None
    for i, prompt in enumerate(prompts):
        seeded = SamplingParams(**{**params.__dict__, "seed": i})
        gen = Generation(strategy, session, tok, tok.encode(prompt), seeded, n, ignore_eos=True)
        gen.run()
        st = gen.stats
        tokens += st.generated_tokens
        passes += st.decode_passes
        seconds += st.total_seconds - st.prefill_seconds
        chosen = st.budget
    mode = "greedy" if params.greedy else "t1"
    budget = getattr(strategy, "bench_budget", None)
    return Result(name, mode, budget, tokens, passes, seconds, chosen)


def run_assisted(
    target_dir: Path, draft_dir: Path, prompts: list[str], greedy: bool, n: int
) -> Result:
    """transformers' assisted generation with the same pair; target passes are counted with a
    forward hook; like the tree, it folds the prefill into the first verification."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    calls = [0]
    target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    tokens = passes = 0
    seconds = 0.0
    for i, prompt in enumerate([WARMUP_PROMPT, *prompts]):
        ids = tok(prompt, return_tensors="pt").input_ids
        torch.manual_seed(i)
        calls[0] = 0
        t0 = time.perf_counter()
        out = target.generate(
            ids,
            assistant_model=draft,
            do_sample=not greedy,
            temperature=None if greedy else 1.0,
            top_k=None if greedy else 0,
            top_p=None,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - t0
        if i == 0:
            continue  # warm-up
        tokens += out.shape[1] - ids.shape[1]
        passes += calls[0]  # the first pass also verifies (prefill folded in, as ours)
        seconds += elapsed
    return Result(
        "transformers assisted", "greedy" if greedy else "t1", None, tokens, passes, seconds
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--target", default=str(ROOT.parent / "shared/models/stories260k"))
    ap.add_argument("--draft", default=str(ROOT.parent / "shared/models/stories260k-draft"))
    ap.add_argument("--prompts", type=int, default=3, help=f"how many of {len(PROMPTS)} prompts")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--linear-max", type=int, default=8)
    ap.add_argument(
        "--out",
        default=str(ROOT / "bench-results"),
        help="the folder the JSON record is written in",
    )
    ap.add_argument("--no-assisted", action="store_true", help="skip transformers' reference")
    ap.add_argument("--threads", type=int, default=1, help="1: less waiting on a busy machine")
    ap.add_argument("--pairs", type=int, default=5, help="interleaved auto/autoregressive pairs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = PROMPTS[: args.prompts]
    target, tok, _ = load(args.target)
    draft, _, _ = load(args.draft)

    results: list[Result] = []
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
        plan: list[tuple[str, Strategy]] = [("autoregressive", Autoregressive(target))]
        for k in range(1, args.linear_max + 1):
            lin = Linear(target, ModelDrafter(draft), spec_length=k)
            lin.bench_budget = k  # type: ignore[attr-defined]
            plan.append((f"linear K={k}", lin))
        for budget in (*BUDGETS, "auto"):
            tree = TreeSpeculation(target, draft, budget=budget, prefix_cache=PrefixCache(0))
            tree.bench_budget = budget  # type: ignore[attr-defined]
            plan.append((f"tree {budget}", tree))
        for name, strategy in plan:
            res = run_strategy(name, strategy, tok, prompts, params, args.tokens)
            results.append(res)
            print(
                f"  {res.mode:6s} {name:16s} {res.tokens_per_pass:5.2f} tok/pass {res.tokens_per_second:7.0f} tok/s",
                flush=True,
            )
        if not args.no_assisted:
            res = run_assisted(
                Path(args.target), Path(args.draft), prompts, params.greedy, args.tokens
            )
            results.append(res)
            print(
                f"  {res.mode:6s} {res.name:16s} {res.tokens_per_pass:5.2f} tok/pass {res.tokens_per_second:7.0f} tok/s",
                flush=True,
            )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = report(results)
    interleaved = auto_against_autoregressive(target, draft, tok, prompts, args.tokens, args.pairs)
    meta = {
        "target": args.target,
        "draft": args.draft,
        "prompts": prompts,
        "tokens_per_prompt": args.tokens,
        "threads": args.threads,
        "torch": torch.__version__,
    }
    record = {"meta": meta, "results": rows, "auto_vs_autoregressive_interleaved": interleaved}
    (out / "speculative.json").write_text(json.dumps(record, indent=2))
    plot(rows, out / "speculative.png")
    print(f"\nwrote {out / 'speculative.json'} and {out / 'speculative.png'}")


def auto_against_autoregressive(
    target: Any, draft: Any, tok: Any, prompts: list[str], n: int, pairs: int
) -> dict[str, float]:
    """The `auto` goal (never more than 5% slower than plain decoding where speculation
    does not pay) is a ratio of two nearby numbers, so it is measured on its own: a fresh
    auto strategy (learning included) and autoregressive decoding alternate `pairs` times
    per mode, and the median ratio is reported."""
    ratios: dict[str, float] = {}
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
        mode = "greedy" if params.greedy else "t1"
        per_pair = []
        for i in range(pairs):
            runs = {}
            order = ("autoregressive", "auto") if i % 2 == 0 else ("auto", "autoregressive")
            for name in order:
                strategy: Strategy = (
                    Autoregressive(target)
                    if name == "autoregressive"
                    else TreeSpeculation(target, draft, budget="auto", prefix_cache=PrefixCache(0))
                )
                runs[name] = run_strategy(name, strategy, tok, prompts, params, n)
            per_pair.append(
                runs["auto"].tokens_per_second / runs["autoregressive"].tokens_per_second
            )
        ratios[mode] = statistics.median(per_pair)
        print(
            f"auto / autoregressive, {mode}, median of {pairs} interleaved pairs: {ratios[mode]:.3f}"
        )
    return ratios


def report(results: list[Result]) -> list[dict[str, Any]]:
    rows = []
    base = {r.mode: r.tokens_per_second for r in results if r.name == "autoregressive"}
    print(
        "\n| mode | strategy | tokens / target pass | tokens/s | vs autoregressive | budget chosen |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = r.tokens_per_second / base[r.mode]
        chosen = "" if r.chosen_budget is None or r.budget != "auto" else str(r.chosen_budget)
        print(
            f"| {r.mode} | {r.name} | {r.tokens_per_pass:.2f} | {r.tokens_per_second:.0f} "
            f"| {ratio:.2f}x | {chosen} |"
        )
        rows.append(
            {
                "mode": r.mode,
                "strategy": r.name,
                "budget": r.budget,
                "tokens": r.tokens,
                "target_passes": r.target_passes,
                "seconds": r.seconds,
                "tokens_per_target_pass": r.tokens_per_pass,
                "tokens_per_second": r.tokens_per_second,
                "speedup_vs_autoregressive": ratio,
                "auto_budget_last_chosen": r.chosen_budget if r.budget == "auto" else None,
            }
        )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, color in (("greedy", "tab:blue"), ("t1", "tab:orange")):
        tree = [
            r
            for r in rows
            if r["mode"] == mode and r["strategy"].startswith("tree ") and r["budget"] != "auto"
        ]
        ax.plot(
            [r["budget"] for r in tree],
            [r["tokens_per_target_pass"] for r in tree],
            "o-",
            color=color,
            label=f"tree ({mode})",
        )
        linear = [
            r["tokens_per_target_pass"]
            for r in rows
            if r["mode"] == mode and r["strategy"].startswith("linear")
        ]
        if linear:
            ax.axhline(max(linear), color=color, ls="--", lw=1, label=f"best linear K ({mode})")
        hf = [
            r["tokens_per_target_pass"]
            for r in rows
            if r["mode"] == mode and r["strategy"] == "transformers assisted"
        ]
        if hf:
            ax.axhline(hf[0], color=color, ls=":", lw=1, label=f"transformers assisted ({mode})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (nodes)")
    ax.set_ylabel("tokens per target pass")
    ax.set_title("stories260k + draft: tokens per target pass")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
