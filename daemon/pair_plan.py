"""The memory plan of a run's model pair, target and draft: `plan_pair` makes it from a run's
`RuntimeOptions`, the one plan both loading the target and `specd plan` make.
`plan_with_draft` plans the draft beside the target: a draft model or prompt lookup as
`choose_plan` (daemon/memory_plan.py) plans them, or the target's substitute, whose bits
are the most that fit and whose copies are of exactly the layers the plan streams."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.memory_plan import OffloadOptions, choose_plan, plan_dtype
from daemon.options import RuntimeOptions
from modeling.checkpoints.checkpoint import DTYPES, Checkpoint
from modeling.config import ModelConfig
from modeling.substitute import (
    SUBSTITUTE,
    build_peak_bytes,
    shares_packed,
    substitute_bits_for,
    substitute_config,
)
from offload.plan import MemoryBudget, MemoryPlan
from offload.planning import PlanError
from offload.units import format_size


def offload_options(options: RuntimeOptions) -> OffloadOptions:
    """The plan's offload options for a run. Without a draft only autoregressive decoding
    runs: no tree strategy, so no prefix cache to reserve."""
    return OffloadOptions(
        offload=options.offload,
        resident_layers=options.resident_layers,
        slots=options.slots,
        host_tier=options.host_tier,
        experts=options.experts,
        expert_slots=options.expert_slots,
        sequences=options.sequences,
        prefix_cache_bytes=options.prefix_cache if options.draft else 0,
        # `auto` does not compile on CUDA yet (daemon/compiling.py): only `on` captures.
        cuda_graphs=options.compile == "on",
    )


def planned_tree_budget(options: RuntimeOptions) -> int | str:
    """The tree the plan's largest pass must hold: none without a draft (`ngram` drafts)."""
    return options.budget if options.draft else 0


@dataclass(frozen=True)
class DraftPlan:
    """What a run drafts with, as planned: the draft's config (None: none, or prompt
    lookup), whether it is the target's substitute, and the substitute's bits."""

    config: ModelConfig | None
    substitute_bits: int | None = None
    # the substitute's layers that are low-bit copies (the streamed ones); the rest are
    # the target's own resident layers, drafting at the target's cost
    substitute_layers: int | None = None

    @property
    def substitute(self) -> bool:
        return self.substitute_bits is not None


def _substitute_plan(
    target: ModelConfig,
    bits: int,
    name: str,
    dtype: str,
    context: int | str,
    device_type: str,
    options: OffloadOptions,
    budget: MemoryBudget,
    tree_budget: int | str,
) -> MemoryPlan:
    """The plan with a `bits` substitute of exactly the layers it streams. Which layers
    stream depends on the substitute's size and the other way round: counting the copies
    of s layers, the plan streams s' >= s of them (more copies leave fewer resident), so
    starting from none and counting what the last plan streamed climbs to the least
    consistent count (a few plans; at most one per layer)."""
    config = substitute_config(target, bits)
    label = (
        f"substitute (the target's own {bits}-bit layers)"
        if shares_packed(target, bits)
        else f"substitute ({bits}-bit HQQ of the target)"
    )
    counted = 0
    while True:
        plan = choose_plan(
            target, config, name, dtype, context, device_type, options, budget, tree_budget,
            label, draft_shares_target=True, substitute_layers=counted,
        )  # fmt: skip
        if plan.streamed_layers <= counted:
            break
        counted = plan.streamed_layers
    if plan.expert_mode != "device":
        # Routed experts in RAM: the substitute copies every layer's experts (resident, so
        # a draft pass moves none). Counting them leaves the device less room, so the
        # experts stay in RAM (`auto` keeps them with their layers only where all fits).
        plan = choose_plan(
            target, config, name, dtype, context, device_type, options, budget, tree_budget,
            label, draft_shares_target=True, substitute_experts=True,
        )  # fmt: skip
        assert plan.expert_mode != "device", "counting the copies left more room"
    if plan.streamed_layers and not shares_packed(target, bits):
        _check_build(plan, target)
    return plan


# Device parts allocated only once serving starts: the room a substitute's build (at load,
# before any pass) may use besides what the plan leaves free.
LATER_PARTS = ("target KV cache", "activations", "draft trees'", "draft rows", "dequantization")


def _check_build(plan: MemoryPlan, target: ModelConfig) -> None:
    """Building the substitute's layers at load holds one projection's weight and its
    quantization temporaries at a time (`build_peak_bytes`): they must fit in what is not
    yet allocated then. Noted in the plan, or a PlanError when they would not fit."""
    itemsize = 4 if target.quantization is not None else DTYPES[plan_dtype(plan)].itemsize
    build = build_peak_bytes(target, itemsize)
    later = sum(v for k, v in plan.device_parts.items() if k.startswith(LATER_PARTS))
    room = later + plan.budget.device_bytes - plan.device_bytes
    if build > room:
        raise PlanError(
            f"building the substitute at load needs {format_size(build)} at once on the "
            f"{plan.budget.device} (one projection and its quantization), but only "
            f"{format_size(room)} is free before serving starts: give more --gpu-budget or "
            "a shorter --context"
        )
    plan.notes.append(
        f"building the substitute at load holds {format_size(build)} more at once (one "
        f"projection's weight and one block of its quantization), within the "
        f"{format_size(room)} that serving takes later"
    )


def plan_with_draft(
    target: ModelConfig,
    draft: str | None,
    draft_config: ModelConfig | None,
    substitute_bits: int | str,
    name: str,
    dtype: str,
    context: int | str,
    device_type: str,
    options: OffloadOptions,
    budget: MemoryBudget,
    tree_budget: int | str = "auto",
) -> tuple[MemoryPlan, DraftPlan]:
    """`choose_plan` for a run's draft: a model (`draft_config`), prompt lookup, none, or
    the target's substitute (`draft` "substitute"), whose bits `auto` chooses as the most
    (8, 4, 3, 2) that fit beside the target's resident part, KV cache and passes."""
    if draft != SUBSTITUTE:
        plan = choose_plan(
            target, draft_config, name, dtype, context, device_type, options, budget,
            tree_budget, str(draft),
        )  # fmt: skip
        return plan, DraftPlan(draft_config)
    choices = substitute_bits_for(target) if substitute_bits == "auto" else (int(substitute_bits),)
    failure: PlanError | None = None
    for bits in choices:
        try:
            plan = _substitute_plan(
                target, bits, name, dtype, context, device_type, options, budget, tree_budget
            )
            substitute_needs_ram(plan)
        except PlanError as exc:
            failure = exc
            continue
        copies = (
            "device copies of its packed layers as stored (the same bits: nothing is "
            "quantized again)"
            if shares_packed(target, bits)
            else f"{bits}-bit copies"
        )
        if plan.expert_mode != "device":
            plan.notes.append(
                f"the substitute draft: {bits}-bit copies of the routed experts of all "
                f"{target.num_layers} layers, resident (a draft pass moves no expert); the "
                "rest of each layer (attention, norms, router) is the target's own, and it "
                "shares the target's embedding, norm, head and KV cache"
            )
            return plan, DraftPlan(substitute_config(target, bits), bits, target.num_layers)
        plan.notes.append(
            f"the substitute draft: {plan.streamed_layers} of {target.num_layers} layers are "
            f"{copies}; it shares the target's embedding, norm, head and KV cache, and the "
            f"{plan.resident_layers} resident layers are their own substitutes"
        )
        if not plan.streamed_layers:
            plan.notes.append(
                "nothing streams: the substitute is the target itself, so a draft pass "
                "costs a target pass (`auto` budgets decide whether drafting pays; a small "
                "draft model of the family is cheaper)"
            )
        return plan, DraftPlan(substitute_config(target, bits), bits, plan.streamed_layers)
    tried = ", ".join(f"{b}-bit" for b in choices)
    raise PlanError(
        f"the substitute draft does not fit at {tried} ({choices[-1]}-bit: {failure}); draft "
        "with a small model of the family (--draft MODEL) or prompt lookup (--draft ngram), "
        "or give more --gpu-budget"
    ) from None


def substitute_needs_ram(plan: MemoryPlan) -> None:
    """PlanError where the plan streams the target's layers from disk: the substitute is
    built from their copies in RAM (refused here, where `specd plan` and `--draft auto` see
    it, as loading refuses it: `auto` chose it for a GGUF larger than RAM, and the daemon
    then could not start)."""
    if plan.streamed_layers and plan.host_tier == "disk":
        raise PlanError(
            "--draft substitute is built from the target's streamed layers in RAM, but the "
            f"plan streams them from disk ({plan.host_tier_reason}): give more --ram-budget "
            "(or --host-tier ram), or draft with a model"
        )


def plan_pair(
    options: RuntimeOptions,
    target: Checkpoint,
    draft: ModelConfig | None,
    budget: MemoryBudget,
    device_type: str,
    name: str,
) -> tuple[MemoryPlan, DraftPlan]:
    """The memory plan of the model pair `options` ask for, on `budget`: the one plan both
    loading the target (daemon/target_loading.py) and `specd plan` make. `target`: its
    checkpoint, opened (config.json is enough); `draft`: the draft model's config, None
    when there is no draft model (none, prompt lookup, the substitute); `device_type`:
    where the models compute; `name`: what the plan calls the target. Raises PlanError."""
    plan, drafting = plan_with_draft(
        target.config, options.draft, draft, options.substitute_bits, name, options.dtype,
        options.context, device_type, offload_options(options), budget,
        planned_tree_budget(options),
    )  # fmt: skip
    return plan, drafting
