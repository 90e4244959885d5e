"""Experts offloaded by routing, measured on routing traces: what a pass moves plain and per
tree size, the expert cache's hit rate, and the tree `--budget auto` would choose per bus.

Routing traces: a random-weight Qwen3-MoE with Qwen3-30B-A3B's routing (128 experts, 8 a
token; hidden 128, experts of 64, 6 layers: the router's shape, not the expert widths, sets
which experts are woken) and SmolLM2's vocabulary, run over MT-Bench's first turns and
HumanEval's prompts (plain text through SmolLM2's tokenizer; fetched by package name, as
scripts/bench_realtext.py does). No small MoE with trained routing is published, so the
traces are a random model's: its routing follows the tokens (a repeated token routes alike)
but not a trained router's specialisation, which makes real hit rates higher than these.

Passes of n tokens take the text's next n tokens (a tree's n nodes stand in for them); per
layer pass the distinct experts woken, and through `offload/experts.py`'s ExpertCache,
with the share of the experts in slots that the plan's room for Qwen3-30B-A3B's experts
holds on a 12 and a 24 GB card (bf16 experts: 15% and 37%; Q4_K experts, 3.6x smaller: 54%
and all of them, which then need no cache), the copies it makes. Bytes are those copies
times a real expert's (3 x 2048 x 768 weights: bf16 9.4 MB, Q4_K 2.65 MB) times 48
layers.

The chosen tree: a pass costs an assumed resident part (`--resident-ms`, attention and
router on the card) plus the bytes it copies at the bus rate; a draft pass is
`--draft-ms` (assumed: no GPU was lent); the tokens a tree of each shape yields are the
stories pair's measured table (scripts/step_timing.py). For each bus rate the shape with
the best tokens/s, against plain decoding.

    .venv/bin/python scripts/bench_moe.py                 # docs/measurements.md's table
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling.checkpoints.checkpoint import load, load_tokenizer, open_checkpoint  # noqa: E402
from modeling.layers.moe import SparseMoE  # noqa: E402
from offload.experts import ExpertCache  # noqa: E402
from scripts.real_forms import SMOLLM2_GGUF  # noqa: E402
from scripts.realtext_data import human_eval, mt_bench  # noqa: E402
from scripts.step_timing import STORIES_TOKENS_PER_ROUND  # noqa: E402
from scripts.tiny_models import make_checkpoint  # noqa: E402

EXPERTS, PER_TOKEN, LAYERS, REAL_LAYERS = 128, 8, 6, 48
EXPERT_WEIGHTS = 3 * 2048 * 768  # one Qwen3-30B-A3B expert: gate, up, down
EXPERT_BYTES = {"bf16": EXPERT_WEIGHTS * 2, "Q4_K": EXPERT_WEIGHTS * 144 // 256}
# The plan's room for experts (docs/offload.md: 928 and 2,293 bf16 experts of 6,144), bytes
CACHE_ROOM = {"12 GB": 928 * EXPERT_BYTES["bf16"], "24 GB": 2293 * EXPERT_BYTES["bf16"]}
PASS_SIZES = (
    1,
    2,
    3,
    5,
    9,
    17,
    33,
    65,
    129,
)  # (4 and 16 nodes: 5 and 17)  # a plain step, then 1 + each tree budget
BUSES = {"PCIe 3.0 x16": 12e9, "PCIe 4.0 x16": 25e9, "PCIe 5.0 x16": 50e9}


def traces(texts: list[str]) -> list[list[list[list[int]]]]:
    """Per text, per layer, per token: the experts it routes to (a random Qwen3-MoE over the
    text's SmolLM2 ids, one causal pass, so each token's routing is what decoding gives)."""
    tokenizer = load_tokenizer(open_checkpoint(SMOLLM2_GGUF))
    vocab = 49152
    with tempfile.TemporaryDirectory() as scratch:
        folder = make_checkpoint(
            scratch, "qwen3_moe", vocab_size=vocab, tokenizer_size=512, hidden_size=128,
            num_layers=LAYERS, num_heads=4, num_kv_heads=2, max_position_embeddings=4096,
            num_experts=EXPERTS, num_experts_per_tok=PER_TOKEN, moe_intermediate_size=64,
        )  # fmt: skip
        model = load(folder, "fp32")[0]
    seen: list[torch.Tensor] = []
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for block in blocks:
        route = block.route

        def recorded(x: torch.Tensor, route: Any = route) -> tuple[torch.Tensor, torch.Tensor]:
            chosen, weights = route(x)
            seen.append(chosen)
            return chosen, weights

        block.route = recorded  # type: ignore[method-assign]
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer.encode(text)[:2048]
            seen.clear()
            cache = model.new_cache(len(ids))
            model(torch.tensor(ids), torch.arange(len(ids)), cache, last_only=True)
            out.append([layer.tolist() for layer in seen])  # (layers, tokens, k)
    return out


def simulate(runs: list[list[list[list[int]]]], n: int, share: float) -> dict[str, float]:
    """Passes of `n` tokens over every text: distinct experts a layer pass wakes, and what an
    ExpertCache with `share` of the experts in slots copies (one cache across the texts,
    as a daemon's serves one request after another)."""
    tiny = [[nn.Linear(1, 1, bias=False) for _ in range(EXPERTS)] for _ in range(LAYERS)]
    cache = ExpertCache(tiny, "cpu", slots=max(2, round(share * LAYERS * EXPERTS)))
    passes = woken = 0
    for layers in runs:
        tokens = len(layers[0])
        for start in range(0, tokens - n + 1, n):
            passes += 1
            for layer, chosen in enumerate(layers):
                wanted = sorted({e for row in chosen[start : start + n] for e in row})
                woken += len(wanted)
                cache.prepare(layer, wanted)
                for e in wanted:
                    cache.expert(layer, e)
    stats = cache.stats
    return {
        "passes": passes,
        "woken_per_layer_pass": woken / (passes * LAYERS),
        "hit_rate": stats.hits / max(stats.asked, 1),
        "copies_per_layer_pass": stats.copies / (passes * LAYERS),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--resident-ms", type=float, default=10.0,
                    help="a pass's resident part on the card (assumed)")  # fmt: skip
    ap.add_argument("--draft-ms", type=float, default=8.0,
                    help="a draft pass, e.g. Qwen3-0.6B's on the card (assumed)")  # fmt: skip
    ap.add_argument("--json", type=Path, default=ROOT / "bench-results" / "moe.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    texts = [q["turns"][0] for q in mt_bench()] + [p["prompt"] for p in human_eval()[:40]]
    runs = traces(texts)
    total = sum(len(r[0]) for r in runs)
    print(f"routing traces: {len(texts)} texts, {total} tokens, {LAYERS} layers of {EXPERTS} "
          f"experts, {PER_TOKEN} a token (random weights)\n")  # fmt: skip
    rows: list[dict[str, Any]] = []
    print("| card | experts | cached | pass tokens | experts woken / layer | hit rate "
          "| copied / layer pass | moved per pass | per token |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for card, room in CACHE_ROOM.items():
        for kind, size in EXPERT_BYTES.items():
            share = room / (size * REAL_LAYERS * EXPERTS)
            if share >= 1:
                print(f"| {card} | {kind} | all | | | | | nothing: every expert fits | |")
                continue
            for n in PASS_SIZES:
                got = simulate(runs, n, share)
                moved = got["copies_per_layer_pass"] * REAL_LAYERS * size
                rows.append({"card": card, "experts": kind, "share": share, "tokens": n, **got,
                             "moved": moved})  # fmt: skip
                print(f"| {card} | {kind} | {share:.0%} | {n} | {got['woken_per_layer_pass']:.1f} "
                      f"| {got['hit_rate']:.2f} | {got['copies_per_layer_pass']:.1f} "
                      f"| {moved / 2**30:.2f} GiB | {moved / n / 2**20:.0f} MiB |", flush=True)  # fmt: skip
    print(f"\nchosen tree (resident part {args.resident_ms:g} ms, draft pass {args.draft_ms:g} ms, "
          "tokens per shape: the stories pair's measured table)\n"
          "| card | experts | bus | plain tok/s | tree | tok/round | tok/s | x plain "
          "| a 4-node tree pays from | a 16-node tree from |\n"
          "|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    choices = []
    for card, kind in sorted({(r["card"], r["experts"]) for r in rows}):
        by_size = {
            r["tokens"]: r["moved"] for r in rows if (r["card"], r["experts"]) == (card, kind)
        }
        for bus, rate in BUSES.items():

            def seconds(n: int, rate: float = rate, moved: dict = by_size) -> float:
                return args.resident_ms / 1e3 + moved[n] / rate

            plain = 1 / seconds(1)
            best = ("plain", 1.0, plain)
            for shape, tokens in STORIES_TOKENS_PER_ROUND.items():
                if 1 + shape.budget not in by_size:
                    continue
                speed = tokens / (seconds(1 + shape.budget) + shape.depth * args.draft_ms / 1e3)
                if speed > best[2]:
                    best = (f"{shape.budget} nodes, depth {shape.depth}", tokens, speed)
            # The tokens a round must yield for a tree to match plain decoding's rate.
            even = [
                (seconds(1 + b) + d * args.draft_ms / 1e3) * plain for b, d in ((4, 4), (16, 6))
            ]
            choices.append({"card": card, "experts": kind, "bus": bus, "plain": plain,
                            "tree": best[0], "tokens": best[1], "rate": best[2],
                            "break_even": even})  # fmt: skip
            print(f"| {card} | {kind} | {bus} | {plain:.1f} | {best[0]} | {best[1]:.1f} "
                  f"| {best[2]:.1f} | {best[2] / plain:.2f} | {even[0]:.1f} tokens "
                  f"| {even[1]:.1f} |")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                     "rows": rows, "choices": choices}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
