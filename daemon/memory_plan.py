"""A memory plan with its dtype and context settled, before any weight is loaded:
`plan_request` turns the models' footprints (daemon/footprint.py, from config.json alone)
and a run's `OffloadOptions` into a `PlanRequest`, and `choose_plan` settles `auto` dtype and
context against the machine's budget (offload.planning does the arithmetic). This is where
the daemon joins `speculative` (which knows the model) to `offload` (which knows memory);
daemon/pair_plan.py plans a run's draft beside its target with it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from daemon.footprint import footprint
from modeling.checkpoints.checkpoint import (
    DTYPES,
    dtype_candidates,
    dtype_key,
)
from modeling.compiled import MAX_TOKENS
from modeling.config import ModelConfig
from modeling.graphs import (
    ALLOCATOR_ROUNDING_BYTES,
    CUBLAS_WORKSPACE_BYTES,
    GRAPH_ATTENTION_BYTES,
    MAX_GRAPHS,
)
from modeling.kv_cache import INITIAL_SLOTS
from offload.plan import (
    GraphRequest,
    MemoryBudget,
    MemoryPlan,
    ModelFootprint,
    PlanRequest,
)
from offload.planning import PlanError, largest_fitting, make_plan, plan_auto_context
from speculative.budget import max_tree_budget
from speculative.prefill import PREFILL_CHUNK


@dataclass(frozen=True)
class OffloadOptions:
    """The offload options of a run (RuntimeOptions / CLI flags / config keys)."""

    offload: str = "auto"
    resident_layers: int | str = "auto"
    slots: int = 2
    host_tier: str = "auto"
    sequences: int = 1  # KV caches that may coexist (see PlanRequest)
    prefix_cache_bytes: int = 0  # the tree strategy's cache of target logits (0: off)
    cuda_graphs: bool = False  # steps captured as CUDA graphs (`--compile on` on CUDA)
    experts: str = "auto"  # a mixture of experts' routed experts (offload.EXPERT_MODES)
    expert_slots: int | None = None  # the expert cache's most experts (None: all that fit)


# What CUDA graphs hold, as modeling/graphs.py and compiled.py capture them.
GRAPHS = GraphRequest(
    tokens=MAX_TOKENS,
    chunk_bytes=GRAPH_ATTENTION_BYTES,
    count=MAX_GRAPHS,
    workspace_bytes=CUBLAS_WORKSPACE_BYTES + ALLOCATOR_ROUNDING_BYTES,
    warm_slots=INITIAL_SLOTS,
)


def plan_request(
    target: ModelFootprint,
    draft: ModelFootprint | None,
    context: int,
    options: OffloadOptions,
    tree_budget: int | str = "auto",
) -> PlanRequest:
    # The largest pass is a prefill chunk, or a tree when the budget asks for more nodes (the
    # tree strategy folds pending prompt tokens into verification only while they fit this);
    # a prefill chunk returns one logit row, a tree pass one per node (root included). The
    # tree budget is a pass's node budget: a pass batched over several generations holds
    # the budget's nodes, shared by their trees (speculative/batching.py), and a row per
    # generation (its root, or its one token).
    nodes = max_tree_budget(tree_budget) + 1
    tokens = min(max(PREFILL_CHUNK, nodes), context)
    rows = nodes - 1 + options.sequences
    resident = options.resident_layers
    return PlanRequest(
        target=target,
        draft=draft,
        context=context,
        pass_tokens=tokens,
        logit_rows=min(rows, tokens),
        offload=options.offload,
        resident_layers=None if resident == "auto" else int(resident),
        slots=options.slots,
        host_tier=options.host_tier,
        sequences=options.sequences,
        prefix_cache_bytes=options.prefix_cache_bytes,
        graphs=GRAPHS if options.cuda_graphs else None,
        experts=options.experts,
        expert_slots=options.expert_slots,
    )


def choose_plan(
    target: ModelConfig,
    draft: ModelConfig | None,
    name: str,
    dtype: str,
    context: int | str,
    device_type: str,
    options: OffloadOptions,
    budget: MemoryBudget,
    tree_budget: int | str = "auto",
    draft_name: str = "draft",
    draft_shares_target: bool = False,
    substitute_layers: int | None = None,
    substitute_experts: bool = False,
) -> MemoryPlan:
    """The memory plan with `dtype` and `context` settled: given values are checked, `auto`
    ones chosen, and the plan says which and why (`dtype_reason`, `context_reason`).

    `device_type` is where the models will compute ("cuda" when planning for another
    machine's GPU), which decides what dtype `auto` means. `draft_shares_target`: the
    draft is the target's substitute, sharing its embedding, head and KV cache, with
    quantized copies of `substitute_layers` layers only (the streamed ones: a resident
    target layer is its own substitute). `substitute_experts`: the target is a mixture
    whose routed experts live in RAM, and the substitute holds low-bit copies of every
    layer's routed experts alone (the rest of each layer is the target's, resident).
    Raises PlanError."""
    limit = target.max_context
    if context != "auto" and int(context) > limit:
        raise PlanError(f"context {context} is longer than {name} supports ({limit})")
    candidates = dtype_candidates(dtype, target, device_type)
    length = limit if context == "auto" else int(context)
    for i, (key, reason) in enumerate(candidates):
        last = i == len(candidates) - 1
        target_fp = footprint(target, DTYPES[key], name, device_type=device_type)
        draft_fp = (
            footprint(draft, DTYPES[key], draft_name, target.vocab_size, device_type)
            if draft
            else None
        )
        if draft_fp is not None and draft_shares_target:
            layers = draft_fp.num_layers if substitute_layers is None else substitute_layers
            draft_fp = replace(
                draft_fp,
                resident_bytes=0,
                kv_bytes_per_token=0,
                window_kv_bytes_per_slot=0,
                num_layers=layers,
            )
            if substitute_experts:
                draft_fp = replace(
                    draft_fp,
                    layer_bytes=draft_fp.experts * draft_fp.expert_bytes,
                    num_layers=target.num_layers,
                )

        def attempt(
            nodes: int | str,
            target_fp: ModelFootprint = target_fp,
            draft_fp: ModelFootprint | None = draft_fp,
        ) -> MemoryPlan:
            request = plan_request(target_fp, draft_fp, length, options, nodes)
            if context == "auto":
                return plan_auto_context(request, budget)
            return make_plan(request, budget)

        try:
            plan = attempt(tree_budget)
        except PlanError as exc:
            if not last:
                continue
            raise _with_tree_budget_hint(exc, attempt, tree_budget) from None
        # An earlier candidate (fp32 on a CPU) only when the model fits without streaming.
        if plan.streamed_layers and options.offload != "stream" and not last:
            continue
        plan.dtype_reason = reason
        return plan
    raise AssertionError("dtype_candidates returned no candidate")


def _with_tree_budget_hint(
    error: PlanError, attempt: Callable[[int], MemoryPlan], tree_budget: int | str
) -> PlanError:
    """A fixed tree budget whose pass is what does not fit: say so, and the largest that
    does, rather than only the context and draft options the plan knows about."""
    if not isinstance(tree_budget, int) or tree_budget <= 1:
        return error

    def fits(nodes: int) -> bool:
        try:
            attempt(nodes)
        except PlanError:
            return False
        return True

    best = largest_fitting(fits, 1, tree_budget - 1)
    if best is None:
        return error
    return PlanError(
        f"--budget {tree_budget} (speculation.budget) does not fit: the plan holds a target "
        f"pass of the root and {tree_budget} tree nodes, each with its logits. The largest tree "
        f"budget that fits is {best}: use --budget {best} or less, or auto. ({error})"
    )


def plan_dtype(plan: MemoryPlan) -> str:
    """The DTYPES key the plan was made for."""
    key = dtype_key(plan.request.target.dtype)
    assert key is not None, plan.request.target.dtype  # footprints are only made in DTYPES
    return key
