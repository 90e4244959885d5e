"""What the compute device holds besides the target's layers, for a plan request: the
draft's weights, the target's embeddings, norm and head, the KV caches, one pass's
activations, the other generations' tree masks, the draft's rows kept for rejection
verification, the dequantization scratch, the CUDA graphs, and on a CPU the prefix cache
(`fixed_parts`, each labelled as `specd plan` prints it). offload/planning.py places the layers in what they leave; a new
allocation that lives as long as serving is counted here."""

from __future__ import annotations

from dataclasses import replace

from offload.plan import GraphRequest, MemoryBudget, ModelFootprint, PlanRequest
from offload.units import format_size


def graph_bytes(m: ModelFootprint, g: GraphRequest, context: int) -> int:
    """What one model's CUDA graphs hold. A step's working set (the head runs outside;
    scores within `chunk_bytes`) three times: the pool keeps it, twice because steps
    captured over the allocations a cache grows through may not reuse each other's blocks,
    and the warm-up runs one more beside a served pass (on its scratch cache). Each graph
    keeps its (tokens, hidden) output and its (tokens, slots) mask, whose rows times slots
    the score bound limits (one row of a single-token step spans the context). A streamed
    target is not captured; counted anyway, as the plan chooses streaming after this. A
    packed model whose projections the graph rebuilds (`traced_dequant_bytes`: the
    substitute's HQQ) holds the largest rebuilt weight in its step's working set too."""
    a = m.activations
    step = replace(a, chunk_bytes=g.chunk_bytes).pass_bytes(g.tokens, 0, context)
    step += m.traced_dequant_bytes
    mask = max(min(g.chunk_bytes // a.score_bytes_per_key, g.tokens * context), context)
    per_graph = g.tokens * a.hidden_bytes_per_token + mask
    return 3 * step + m.kv_bytes(g.warm_slots) + g.count * per_graph + g.workspace_bytes


def fixed_parts(r: PlanRequest, device: str) -> dict[str, int]:
    """What the device holds besides the target's layers. On a CPU the prefix cache is one
    of them (the device is RAM: one pool); with a GPU it is pinned host RAM."""
    t, d = r.target, r.draft
    parts: dict[str, int] = {}
    if d is not None:
        parts["draft weights"] = d.weight_bytes
    parts["target embeddings, norm, head"] = t.resident_bytes
    parts[f"target KV cache ({r.context} tokens)"] = t.kv_bytes(r.context, r.pass_tokens)
    if d is not None and d.kv_bytes_per_token:  # (a substitute draft shares the target's)
        parts[f"draft KV cache ({r.context} tokens)"] = d.kv_bytes(r.context, r.pass_tokens)
    act = t.activation_bytes(r.pass_tokens, r.logit_rows, r.context)
    if d is not None:
        act = max(act, d.activation_bytes(r.pass_tokens, r.logit_rows, r.context))
    parts[f"activations ({r.pass_tokens}-token pass, {r.logit_rows} logit rows)"] = act
    if d is not None and r.sequences > 1:
        # Every generation's draft tree holds its (budget + 1)² ancestor mask while the
        # pass is assembled (`DraftTree`); the pass's activation figure counts one.
        nodes = max(r.logit_rows - r.sequences + 1, 1)
        parts[f"draft trees' ancestor masks ({r.sequences - 1} more)"] = (
            r.sequences - 1
        ) * nodes**2
    if d is not None:
        # Rejection verification keeps the draft's fp16 log-probabilities after each
        # expanded node of a tree until the tree is verified: at most one per logit row of
        # the pass (speculative/children.py `DraftRows`).
        parts["draft rows for rejection verification"] = (
            r.logit_rows * d.activations.fp32_row_bytes // 2
        )
    rebuild = max(t.dequant_bytes, d.dequant_bytes if d is not None else 0)
    if rebuild:
        parts["dequantization (largest projection)"] = rebuild
    if device == "cpu" and r.prefix_cache_bytes:
        parts["prefix cache"] = r.prefix_cache_bytes
    if device == "cuda" and r.graphs is not None:
        g = r.graphs
        parts[f"CUDA graphs (steps of up to {g.tokens} tokens)"] = sum(
            graph_bytes(m, g, r.context) for m in (t, d) if m is not None
        )
    return parts


def sequences_note(r: PlanRequest, budget: MemoryBudget, planned: int) -> list[str]:
    """A warning when every possible conversation at full length would overflow the
    device; the plan itself holds one (caches are allocated as sequences grow)."""
    if r.sequences <= 1:
        return []
    per_sequence = r.target.kv_bytes(r.context, r.pass_tokens) + (
        r.draft.kv_bytes(r.context, r.pass_tokens) if r.draft else 0
    )
    worst = planned + (r.sequences - 1) * per_sequence
    if worst <= budget.device_bytes:
        return []
    fit = 1 + max(0, budget.device_bytes - planned) // max(per_sequence, 1)
    return [
        f"KV caches grow with use and this plan holds one {r.context}-token sequence; "
        f"{r.sequences} conversations (limits.max_concurrent + limits.cached_sessions) at "
        f"full length would need {format_size(worst)} of the {format_size(budget.device_bytes)} "
        f"budget (about {fit} fit): lower those limits or context.length if conversations "
        "run long"
    ]
