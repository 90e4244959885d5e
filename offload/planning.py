"""Deciding the memory plan (offload/plan.py has its types): `make_plan` places the target's
layers (resident, or streamed through slots from a host tier) within the budgets, beside the
device's fixed parts (offload/device_parts.py), or raises `PlanError` saying what would
fit; `plan_auto_context` finds the longest context that does.
Pure arithmetic on the sizes in a `PlanRequest` and a `MemoryBudget`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from offload.arena import arena_bytes
from offload.device_parts import fixed_parts, sequences_note
from offload.expert_plans import auto_experts, plan_experts
from offload.plan import (
    EXPERT_MODES,
    MAX_SLOTS,
    MIN_SLOTS,
    OFFLOAD_MODES,
    TIER_CHOICES,
    MemoryBudget,
    MemoryPlan,
    PlanError,
    PlanRequest,
    host_cache_bytes,
)
from offload.units import format_size

# `context auto` never plans fewer tokens than this (unless the model's maximum is smaller):
# a chat of a few turns with a system prompt already needs a few thousand.
MIN_AUTO_CONTEXT = 4096


def make_plan(request: PlanRequest, budget: MemoryBudget) -> MemoryPlan:
    """Decide resident/streamed layers and the host tier, or raise PlanError saying why not
    and what would fit."""
    r, t = request, request.target
    if r.offload not in OFFLOAD_MODES:
        raise PlanError(f"offload {r.offload!r} is not one of {', '.join(OFFLOAD_MODES)}")
    if r.host_tier not in TIER_CHOICES:
        raise PlanError(f"host tier {r.host_tier!r} is not one of {', '.join(TIER_CHOICES)}")
    if not MIN_SLOTS <= r.slots <= MAX_SLOTS:
        raise PlanError(
            f"--slots (offload.slots) must be from {MIN_SLOTS} to {MAX_SLOTS} (got {r.slots})"
        )
    n, layer = t.num_layers, t.layer_bytes
    if r.resident_layers is not None and not 0 <= r.resident_layers <= n:
        raise PlanError(
            f"--resident-layers (offload.resident_layers) {r.resident_layers} is outside 0..{n}"
        )
    fixed = fixed_parts(r, budget.device)
    host_cache = host_cache_bytes(r, budget)
    if host_cache > budget.ram_bytes:
        raise PlanError(
            f"the prefix cache ({format_size(host_cache)} of pinned RAM) is larger than the "
            f"RAM budget ({format_size(budget.ram_bytes)}): lower --prefix-cache "
            "(speculation.prefix_cache; 0 turns it off)"
        )
    fixed_bytes = sum(fixed.values())
    room = budget.device_bytes - fixed_bytes

    everything_fits = room >= n * layer
    if t.experts:
        if r.experts not in EXPERT_MODES:
            raise PlanError(f"experts {r.experts!r} is not one of {', '.join(EXPERT_MODES)}")
        mode = r.experts
        if mode == "auto":  # with their layers where everything fits; else per layer on a GPU
            if not everything_fits and budget.device == "cuda":
                return auto_experts(r, budget, fixed, host_cache)
            mode = "device"
        if mode != "device":
            return plan_experts(r, budget, fixed, host_cache, mode)
    all_resident = r.offload == "none" or (
        r.offload == "auto"
        and (r.resident_layers == n or (r.resident_layers is None and everything_fits))
    )
    if all_resident:
        if not everything_fits:
            raise PlanError(_no_fit_message(r, budget, fixed, streaming=False))
        dense = t.dense_layer_bytes
        keep_dense = layer < dense and room >= n * dense and not t.packed_kernels
        label = f"target layers ({n}, all resident{', dequantized' if keep_dense else ''})"
        parts = {**fixed, label: n * (dense if keep_dense else layer)}
        notes = sequences_note(r, budget, sum(parts.values()))
        if layer < dense and t.packed_kernels:
            notes.append(
                "packed layers computed where they lie (the CPU kernels read a layer's "
                f"{format_size(layer)} a token, not its {format_size(dense)} dequantized)"
            )
        if keep_dense:
            notes.append(
                f"packed layers kept dequantized ({format_size(dense)} each instead of "
                f"{format_size(layer)}): there is room, and no layer is rebuilt per pass"
            )
        plan = MemoryPlan(
            r, budget, parts, n, 0, 0, None, _why_resident(r), host_cache, 0, 0.0, notes
        )
        plan.dequantized_resident = keep_dense
        return plan

    # Streaming.
    if r.resident_layers is not None:
        resident = r.resident_layers
        if resident == n:
            raise PlanError(
                f"--resident-layers {n} with --offload stream leaves nothing to stream: "
                "use --offload none, or fewer resident layers"
            )
    else:
        fit = (room - r.slots * layer) // layer if layer else n
        resident = max(0, min(int(fit), n - 1))
    streamed = n - resident
    parts = dict(fixed)
    if resident:
        parts[f"resident target layers ({resident})"] = resident * layer
    parts[f"streaming slots ({r.slots} × layer)"] = r.slots * layer
    if sum(parts.values()) > budget.device_bytes:
        raise PlanError(_no_fit_message(r, budget, fixed, streaming=True, resident=resident))

    tier, reason, host_bytes = _host_tier(r, budget, streamed, sum(parts.values()))
    host_bytes += host_cache
    # With no more streamed layers than slots, every layer keeps its slot after the first
    # pass: nothing crosses the bus in steady state.
    per_pass = streamed * layer if streamed > r.slots else 0
    seconds = per_pass / budget.bandwidth if budget.bandwidth else None
    notes = sequences_note(r, budget, sum(parts.values()))
    if tier == "disk":
        notes.append(
            "disk tier: each pass also reads the streamed layers from the weight files; "
            "the expected time assumes the disk (or page cache) keeps up with the bus"
        )
    return MemoryPlan(
        r, budget, parts, resident, streamed, r.slots, tier, reason, host_bytes, per_pass,
        seconds, notes,
    )  # fmt: skip


def _why_resident(r: PlanRequest) -> str:
    if r.offload == "none":
        return "--offload none"
    if r.resident_layers is not None:
        return "--resident-layers: all"
    return "the whole target fits on the device"


def host_tier_bytes(layer_bytes: int, layers: int) -> int:
    """RAM a host tier allocates for `layers` flat layers (the streamed layers, or one staging
    buffer per slot): one page-aligned arena, page-locked in place on a GPU, so the figure is
    exact; no per-allocation rounding (see offload/arena.py)."""
    return arena_bytes(layer_bytes, layers)


def _host_tier(
    r: PlanRequest, budget: MemoryBudget, streamed: int, device_bytes: int
) -> tuple[str, str, int]:
    layer = r.target.layer_bytes
    ram = budget.ram_bytes - host_cache_bytes(r, budget)
    if budget.device == "cpu":
        ram -= device_bytes  # one pool: the "device" parts live in the same RAM
    in_ram = host_tier_bytes(layer, streamed)
    # (and one tensor's conversion at a time, on the reader thread: a GGUF's q/k rows)
    staging = host_tier_bytes(layer, r.slots) + r.target.disk_scratch_bytes
    if r.host_tier == "ram":
        if in_ram > ram:
            raise PlanError(
                f"host tier ram: the {streamed} streamed layers need {format_size(in_ram)} of "
                f"RAM but {format_size(max(ram, 0))} is available: use --host-tier disk "
                "(read from the weight files), or keep more layers resident"
            )
        return "ram", "asked for: --host-tier ram (offload.host_tier)", in_ram
    if r.host_tier == "auto" and in_ram <= ram:
        return "ram", "the streamed layers fit in RAM (pinned)", in_ram
    if staging > ram:
        raise PlanError(
            f"even the disk tier needs {format_size(staging)} of RAM for {r.slots} staging "
            f"buffers but {format_size(max(ram, 0))} is available: free RAM or use --slots 2"
        )
    if r.host_tier == "disk":
        return "disk", "asked for: --host-tier disk (offload.host_tier)", staging
    return (
        "disk",
        f"the streamed layers need {format_size(in_ram)} but RAM has {format_size(max(ram, 0))}",
        staging,
    )


def _no_fit_message(
    r: PlanRequest, budget: MemoryBudget, fixed: dict[str, int], streaming: bool, resident: int = 0
) -> str:
    t = r.target
    layer = t.layer_bytes
    if streaming:
        need = sum(fixed.values()) + (r.slots + resident) * layer
        how = f"with {resident} resident layers and {r.slots} streaming slots"
    else:
        need = sum(fixed.values()) + t.num_layers * layer
        how = "with every layer resident (--offload none)"
    biggest = ", ".join(f"{k} {format_size(v)}" for k, v in fixed.items())
    msg = (
        f"the models do not fit: {how} the {budget.device} needs {format_size(need)} but the "
        f"budget is {format_size(budget.device_bytes)} ({biggest}). "
    )
    options = _what_would_fit(r, budget)
    if not streaming:
        options.insert(0, "--offload stream or auto (stream layers from host memory)")
    if streaming and resident:
        options.insert(0, "fewer --resident-layers")
    if options:
        return msg + "What would fit: " + "; ".join(options) + "."
    return msg + (
        "Nothing smaller fits either: a device with at least "
        f"{format_size(_minimal_streamed(r, r.context, MIN_SLOTS, budget.device))} is needed."
    )


def _minimal_streamed(
    r: PlanRequest, context: int, slots: int, device: str, draft: bool = True
) -> int:
    """Device bytes of `r` at `context` with `slots` layers' worth of target buffers (and
    without the draft when `draft` is False)."""
    trial = replace(_with_context(r, context), slots=slots, draft=r.draft if draft else None)
    return sum(fixed_parts(trial, device).values()) + slots * r.target.layer_bytes


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest n in [lo, hi] with fits(n), for a `fits` that only turns false as n grows;
    None when not even lo fits."""
    if lo > hi or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def longest_context(r: PlanRequest, budget: MemoryBudget, layers: int, lo: int = 1) -> int | None:
    """The longest context, up to `r.context`, at which the parts that grow with it (KV
    caches, the attention mask) fit in the device budget beside the draft, the target's other
    fixed parts, the activations and `layers` target layers' worth of buffers (the
    streaming slots, or every layer when all stay resident); None when not even `lo` fits."""
    return largest_fitting(
        lambda context: _minimal_streamed(r, context, layers, budget.device) <= budget.device_bytes,
        lo,
        r.context,
    )


def _with_context(r: PlanRequest, context: int) -> PlanRequest:
    """`r` at another context: the largest pass shrinks with it; its logit rows (the largest
    tree + 1) stay, so a tree budget the device cannot hold is an error naming the budget
    rather than a context too short for the tree that was asked for."""
    return replace(r, context=context, pass_tokens=min(r.pass_tokens, context))


def plan_auto_context(request: PlanRequest, budget: MemoryBudget) -> MemoryPlan:
    """`context auto`: `request.context` is the model's maximum; plan the longest context up
    to it that fits, never below MIN_AUTO_CONTEXT (or the maximum, when that is smaller).

    When the whole target fits on the device with at least the floor, the context is the
    longest that keeps every layer resident: a resident pass costs milliseconds, a streamed
    one the whole target's transfer, so giving up long contexts no one asked for is the
    better default (the reason names the longer context streaming would allow). Otherwise
    the context takes what the draft, the streaming slots and the activations leave, and
    resident target layers take what the context leaves (each one saves only its share of
    the transfer). On a CPU device the budget is RAM and the rule is the same."""
    r, t = request, request.target
    floor = min(MIN_AUTO_CONTEXT, r.context)
    n = t.num_layers
    streamed_limit = longest_context(r, budget, r.slots + (r.resident_layers or 0), floor)
    if r.offload != "stream" and r.resident_layers in (None, n):
        resident = longest_context(r, budget, n, floor)
        if resident is not None:
            plan = make_plan(_with_context(r, resident), budget)
            if resident == r.context:
                plan.context_reason = "auto: the model's maximum; everything fits"
            else:
                plan.context_reason = (
                    f"auto: the longest with every target layer on the {budget.device}"
                    + (
                        f"; streaming would allow {streamed_limit}"
                        if r.offload == "auto"
                        and r.resident_layers is None
                        and streamed_limit
                        and streamed_limit > resident
                        else ""
                    )
                    + f"; the model allows {r.context}"
                )
            return plan
        if r.offload == "none" or r.resident_layers == n:
            raise _floor_error(r, budget, floor, streaming=False)
    if streamed_limit is None:
        raise _floor_error(r, budget, floor, streaming=True)
    plan = make_plan(_with_context(r, streamed_limit), budget)
    if streamed_limit == r.context:
        plan.context_reason = "auto: the model's maximum; it fits beside the streaming slots"
    else:
        plan.context_reason = (
            f"auto: the longest that fits beside the draft, {plan.slots} streaming slots and "
            f"the activations; the model allows {r.context}"
        )
    if r.resident_layers is None and streamed_limit > floor:
        # The trade the user may prefer: a shorter context, fewer layers over the bus.
        short = make_plan(_with_context(r, floor), budget)
        if short.resident_layers > plan.resident_layers:
            plan.context_reason += (
                f"; --context {floor} would keep {short.resident_layers} target layers resident "
                f"instead of {plan.resident_layers}"
            )
    return plan


def _floor_error(r: PlanRequest, budget: MemoryBudget, floor: int, streaming: bool) -> PlanError:
    """`context auto` when not even `floor` tokens fit: what would (a shorter --context
    among the options)."""
    at_floor = _with_context(r, floor)
    fixed = fixed_parts(at_floor, budget.device)
    detail = _no_fit_message(
        at_floor, budget, fixed, streaming=streaming, resident=r.resident_layers or 0
    )
    return PlanError(
        f"context auto plans at least {floor} tokens and even that does not fit: {detail}"
    )


def _what_would_fit(r: PlanRequest, budget: MemoryBudget) -> list[str]:
    cap, device = budget.device_bytes, budget.device
    options = []
    if r.resident_layers and _minimal_streamed(r, r.context, r.slots, device) <= cap:
        return [f"--resident-layers {_max_resident(r, budget)} or fewer"]
    if r.slots > MIN_SLOTS and _minimal_streamed(r, r.context, MIN_SLOTS, device) <= cap:
        options.append(f"--slots {MIN_SLOTS}")
    longest = longest_context(r, budget, MIN_SLOTS)
    if longest is not None and longest < r.context:
        options.append(f"--context {longest} (streamed, {MIN_SLOTS} slots)")
    if r.draft is not None:
        without = _minimal_streamed(r, r.context, MIN_SLOTS, device, draft=False)
        if without <= cap:
            room = cap - without
            need = _minimal_streamed(r, r.context, MIN_SLOTS, device) - without
            options.append(
                f"a smaller draft (at most {format_size(room)} of draft weights, KV cache and "
                f"activations; this one needs {format_size(need)}), or no draft"
            )
    return options


def _max_resident(r: PlanRequest, budget: MemoryBudget) -> int:
    spare = budget.device_bytes - _minimal_streamed(r, r.context, r.slots, budget.device)
    return max(0, spare // max(r.target.layer_bytes, 1))
