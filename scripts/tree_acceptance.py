"""How many tokens a SpecExec tree round can yield, measured three ways on one model pair.

The walk samples from the target at the root and moves to a child whenever the sampled
token is one, so the expected tokens of a round over a given tree are exactly

    E = 1 + sum over nodes v of P(walk reaches v)
      = 1 + sum_v prod_{edges on v's path} p_target(child token | parent prefix)

This script runs the real tree strategy and reports, per budget:

- analytic: E from the target's verified distributions of each round's actual tree;
- empirical: tokens the walk actually emitted per round (must match analytic within noise);
- oracle: E for the best tree of the same budget chosen knowing p_target (best-first by
  target path probability, which is optimal because path probabilities shrink along a
  path), evaluated at the same round-start contexts: the ceiling for any draft;
- variants (--variants): E of trees built with other builder settings on the same
  contexts, so ideas are compared without sampling noise.

    .venv/bin/python scripts/tree_acceptance.py --budgets 64 --temperature 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench_speculative import PROMPTS  # noqa: E402
from speculative.checkpoint import load  # noqa: E402
from speculative.generation import alone  # noqa: E402
from speculative.model import Transformer  # noqa: E402
from speculative.passes import Steps  # noqa: E402
from speculative.prefix_cache import PrefixCache  # noqa: E402
from speculative.sampling import SamplingParams, make_generator, probabilities  # noqa: E402
from speculative.strategies.tree import TreeSpeculation  # noqa: E402
from speculative.tree import DraftTree, default_depth, grow_tree, verification_mask  # noqa: E402


def expected_tokens(tree: DraftTree, probs: torch.Tensor) -> float:
    """1 + sum over nodes of the probability that the walk reaches them; `probs` (N, V) is
    the target's final sampling distribution at every node of `tree`."""
    n = tree.size
    if n == 1:
        return 1.0
    parents, tokens = tree.parents[1:n], tree.tokens[1:n]  # (N-1,)
    edge = probs[parents, tokens].double()  # (N-1,) p_target(node token | parent prefix)
    reach = torch.ones(n, dtype=torch.float64)
    for i in range(1, n):  # parents precede children
        reach[i] = reach[int(parents[i - 1])] * edge[i - 1]
    return float(reach.sum())


@dataclass
class RoundLog:
    context: list[int]  # x_1..x_L at the round's start (x_L is the root)
    tokens: int  # tokens the walk emitted
    analytic: float  # E over the round's actual tree


class Recorder(TreeSpeculation):
    """The real strategy, keeping each round's tree and verified target logits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.captured: list[tuple[DraftTree, torch.Tensor]] = []

    def _draft(self, *args: Any, **kwargs: Any) -> Steps[DraftTree]:
        self._tree = yield from super()._draft(*args, **kwargs)
        return self._tree

    def _remember(
        self,
        logits: torch.Tensor,
        root_key: int,
        path: list[int],
        tokens: list[int],
        parents: list[int],
    ) -> int:
        self.captured.append((self._tree, logits.clone()))  # this round's tree (`_draft`)
        return super()._remember(logits, root_key, path, tokens, parents)


def record_rounds(
    target: Transformer,
    draft: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    budget: int,
    n: int,
    seed: int,
) -> list[RoundLog]:
    strategy = Recorder(target, draft, budget=budget, prefix_cache=PrefixCache(0))
    logs: list[RoundLog] = []
    for i, ids in enumerate(prompts):
        session = strategy.new_session(len(ids) + n + budget + 8)
        seq = list(ids)
        gen = make_generator(seed + i)
        for rnd in alone(strategy.steps(session, ids, params, n, gen)):
            if not rnd.tokens:
                continue  # a prefill step: no tree was verified
            if strategy.captured:
                tree, logits = strategy.captured.pop()
                analytic = expected_tokens(tree, probabilities(logits, params))
            else:  # a plain step (one token left to emit): no tree, exactly one token
                analytic = 1.0
            logs.append(RoundLog(list(seq), len(rnd.tokens), analytic))
            seq.extend(rnd.tokens)
    return logs


def draft_tree(
    target: Transformer,
    draft: Transformer,
    context: list[int],
    params: SamplingParams,
    budget: int,
    **builder: Any,
) -> float:
    """E for the tree `grow_tree` builds at `context` with the given builder settings."""
    depth = builder.pop("max_depth", None) or default_depth(budget)
    n = len(context)
    dcache = draft.new_cache(n + budget + 1)
    draft(torch.tensor(context[:-1]), torch.arange(n - 1), dcache)
    root_logits = draft(torch.tensor(context[-1:]), torch.tensor([n - 1]), dcache)[0]  # (V,)
    tree = DraftTree(context[-1], budget + 1)
    grow_tree(draft, dcache, tree, root_logits, n - 1, budget, depth, **builder)
    return target_expectation(target, context, tree, params)


def target_expectation(
    target: Transformer, context: list[int], tree: DraftTree, params: SamplingParams
) -> float:
    n = len(context)
    cache = target.new_cache(n + tree.size)
    tokens = torch.cat((torch.tensor(context[:-1]), tree.tokens[: tree.size]))  # (P + N,)
    positions = torch.cat((torch.arange(n - 1), n - 1 + tree.depths[: tree.size]))
    mask = verification_mask(tree.mask, n - 1)
    logits = target(tokens, positions, cache, mask=mask, logits_from=n - 1)  # (N, V)
    return expected_tokens(tree, probabilities(logits, params))


def oracle(target: Transformer, context: list[int], temperature: float, budget: int) -> float:
    """E of the best tree of `budget` nodes, chosen knowing the target: pure best-first
    (one node per step, no depth limit, every child eligible) on the target's own
    distribution at `temperature` (plain temperature sampling, no top-k/p)."""
    n = len(context)
    cache = target.new_cache(n + budget + 1)
    target(torch.tensor(context[:-1]), torch.arange(n - 1), cache)
    root_logits = target(torch.tensor(context[-1:]), torch.tensor([n - 1]), cache)[0]  # (V,)
    tree = DraftTree(context[-1], budget + 1)
    grow_tree(
        target,
        cache,
        tree,
        root_logits,
        n - 1,
        budget,
        budget,
        batch=1,
        score_temperature=temperature,
        max_branch=budget,
    )
    return 1.0 + float(tree.logprobs[1 : tree.size].double().exp().sum())


def parse_variant(text: str) -> dict[str, Any]:
    """'score_temperature=0.8,max_depth=10' → builder keyword arguments."""
    out: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        key, value = part.split("=")
        out[key] = int(value) if value.isdigit() else float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--target", default=str(ROOT.parent / "shared/models/stories260k"))
    ap.add_argument("--draft", default=str(ROOT.parent / "shared/models/stories260k-draft"))
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--seeds", type=int, default=1, help="repeat the real run with more seeds")
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument(
        "--variants",
        nargs="*",
        default=[],
        help="builder settings to compare on the same contexts, e.g. score_temperature=0.8",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    target, tok, _ = load(args.target)
    draft, _, _ = load(args.draft)
    params = SamplingParams(temperature=args.temperature)
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    for budget in args.budgets:
        logs: list[RoundLog] = []
        for s in range(args.seeds):
            logs += record_rounds(target, draft, prompts, params, budget, args.tokens, 1000 * s)
        emp = [r.tokens for r in logs]
        ana = [r.analytic for r in logs]
        # The walk's tokens have variance; the standard error says what "equal" means.
        se = statistics.pstdev(emp) / math.sqrt(len(emp))
        line = (
            f"budget {budget:4d} T={args.temperature}: rounds {len(logs)}  "
            f"empirical {statistics.fmean(emp):.3f} ± {se:.3f}  "
            f"analytic {statistics.fmean(ana):.3f}"
        )
        if not args.no_oracle and not params.greedy:
            orc = [oracle(target, r.context, args.temperature, budget) for r in logs]
            line += f"  oracle {statistics.fmean(orc):.3f}"
        print(line, flush=True)
        for text in args.variants:
            kwargs = parse_variant(text)
            values = [
                draft_tree(target, draft, r.context, params, budget, **dict(kwargs)) for r in logs
            ]
            print(f"    variant {text or 'default'}: analytic {statistics.fmean(values):.3f}")


if __name__ == "__main__":
    main()
