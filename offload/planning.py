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
from offload.device_parts import fixed_parts
from offload.plan import (
    EXPERT_MODES,
    MIN_SLOTS,
    OFFLOAD_MODES,
    TIER_CHOICES,
    MemoryBudget,
    MemoryPlan,
    PlanRequest,
    host_cache_bytes,
)
from offload.units import format_size

# `context auto` never plans fewer tokens than this (unless the model's maximum is smaller):
# a chat of a few turns with a system prompt already needs a few thousand.
MIN_AUTO_CONTEXT = 4096


class PlanError(ValueError):
    """The models cannot be placed within the budgets; the message says what would fit."""


def make_plan(request: PlanRequest, budget: MemoryBudget) -> MemoryPlan:
    """Decide resident/streamed layers and the host tier, or raise PlanError saying why not
    and what would fit."""
    r, t = request, request.target
    if r.offload not in OFFLOAD_MODES:
        raise PlanError(f"offload {r.offload!r} is not one of {', '.join(OFFLOAD_MODES)}")
    if r.host_tier not in TIER_CHOICES:
        raise PlanError(f"host tier {r.host_tier!r} is not one of {', '.join(TIER_CHOICES)}")
    if r.slots < MIN_SLOTS:
        raise PlanError(f"--slots must be at least {MIN_SLOTS} (got {r.slots})")
    n, layer = t.num_layers, t.layer_bytes
    if r.resident_layers is not None and not 0 <= r.resident_layers <= n:
        raise PlanError(f"--resident-layers {r.resident_layers} is outside 0..{n}")
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
                return _auto_experts(r, budget, fixed, host_cache)
            mode = "device"
        if mode != "device":
            return _plan_experts(r, budget, fixed, host_cache, mode)
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
        notes = _sequences_note(r, budget, sum(parts.values()))
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
    notes = _sequences_note(r, budget, sum(parts.values()))
    if tier == "disk":
        notes.append(
            "disk tier: each pass also reads the streamed layers from the weight files; "
            "the expected time assumes the disk (or page cache) keeps up with the bus"
        )
    return MemoryPlan(
        r, budget, parts, resident, streamed, r.slots, tier, reason, host_bytes, per_pass,
        seconds, notes,
    )  # fmt: skip


def expected_experts(experts: int, per_token: int, tokens: float) -> float:
    """The distinct experts `tokens` tokens wake in one layer, each routed to `per_token`
    of `experts` uniformly at random (the estimate before any routing is measured):
    E (1 - (1 - k/E)^n)."""
    return experts * (1 - (1 - per_token / experts) ** tokens)


def _plan_experts(
    r: PlanRequest, budget: MemoryBudget, fixed: dict[str, int], host_cache: int, mode: str
) -> MemoryPlan:
    """Every layer resident but its routed experts, which live in host RAM: copied as
    routed into a device cache of as many experts as the room left holds (`stream`), or
    computed on the CPU (`cpu`)."""
    t = r.target
    n, e, k = t.num_layers, t.experts, t.experts_per_token
    rest = t.layer_bytes - e * t.expert_bytes  # attention, norms, router
    total = n * e
    parts = {**fixed, f"target layers without their experts ({n}, resident)": n * rest}
    room = budget.device_bytes - sum(parts.values())
    if room < (t.expert_bytes if mode == "stream" else 0):
        raise PlanError(
            f"the target's layers without their experts ({format_size(n * rest)}) and the "
            f"fixed parts ({format_size(sum(fixed.values()))}) do not fit the "
            f"{format_size(budget.device_bytes)} device budget with room for an expert: "
            "lower --context or give more --gpu-budget"
        )
    slots = min(total, room // t.expert_bytes) if mode == "stream" else 0
    if r.expert_slots is not None and mode == "stream":
        if r.expert_slots < 1:
            raise PlanError("--expert-slots must be at least 1")
        slots = min(slots, r.expert_slots)
    if slots:
        parts[f"expert cache ({slots} of {total} experts)"] = slots * t.expert_bytes
    host = total * t.expert_bytes
    if host + host_cache > budget.ram_bytes:
        raise PlanError(
            f"the routed experts ({format_size(host)}) do not fit the RAM budget "
            f"({format_size(budget.ram_bytes)}): give more --ram-budget"
        )
    notes = _sequences_note(r, budget, sum(parts.values()))
    if mode == "stream":
        # Before routing is measured: each layer's experts cached alike, routing uniform.
        miss = 1 - slots / total

        def moved(tokens: int) -> int:
            return int(n * expected_experts(e, k, tokens) * miss * t.expert_bytes)

        per_pass = moved(1)
        seconds = per_pass / budget.bandwidth if budget.bandwidth else None
        reason = f"the routed experts in RAM ({format_size(host)}), copied to the cache as routed"
        trees = ", ".join(
            f"{format_size(moved(m))} for {m} ({expected_experts(e, k, m):.0f} of {e} woken)"
            for m in (16, 64)
        )
        notes.append(
            f"experts by routing: a token wakes {k} of {e} experts a layer; a pass moves "
            f"{format_size(per_pass)} for 1 token, {trees} (uniform routing, "
            f"{slots / total:.0%} of the experts cached; /v1/specd/status reports what routing "
            "moves)"
        )
    else:
        per_pass, seconds = 0, None
        reason = f"the routed experts in RAM ({format_size(host)}), computed on the CPU"
        notes.append(f"experts on the CPU: a token's {k} experts a layer run there")
    plan = MemoryPlan(
        r, budget, parts, n, 0, 0, "ram", reason, host + host_cache, per_pass, seconds, notes
    )
    plan.expert_mode, plan.expert_slots = mode, slots
    return plan


def _auto_experts(
    r: PlanRequest, budget: MemoryBudget, fixed: dict[str, int], host_cache: int
) -> MemoryPlan:
    """`--experts auto` where a mixture's experts do not all fit a GPU: every layer's
    attention, norms and router resident, then either (a) the experts of as many whole
    layers as fit kept on the device and the other layers' experts computed on the CPU
    (each of those layers' tokens reads its k experts there), or (b) every expert in RAM,
    copied to a device cache as routed (`stream`), whichever a one-token pass costs less
    at the measured rates: the CPU's for the experts' dtype (`MemoryBudget.cpu_rates`)
    against the bus's for the bytes (b) is expected to copy. Under uniform routing a slot
    saves the same bytes wherever it goes, so whole layers on the device lose nothing to
    (b)'s spread cache, and the comparison is one of rates. Without a measured CPU rate,
    (b)."""
    t = r.target
    n, e, k = t.num_layers, t.experts, t.experts_per_token
    stream = _plan_experts(r, budget, fixed, host_cache, "stream")
    kind = "packed" if t.quantization else t.dtype
    rate = budget.cpu_rate(kind)
    if rate is None or not budget.bandwidth:
        stream.notes.append(
            f"experts auto: streamed by routing (the CPU's rate for {kind} experts is not "
            "measured: --cpu-rate gives it, --experts cpu computes them there)"
        )
        return stream
    rest = t.layer_bytes - e * t.expert_bytes
    room = budget.device_bytes - sum(fixed.values()) - n * rest
    whole = min(n - 1, max(0, room) // (e * t.expert_bytes))
    on_cpu = n - whole
    cpu_seconds = on_cpu * k * t.expert_bytes / rate
    stream_seconds = stream.streamed_bytes_per_pass / budget.bandwidth
    versus = (
        f"a 1-token pass computes {k} experts in each of {on_cpu} layers on the CPU "
        f"({format_size(on_cpu * k * t.expert_bytes)} at {rate / 1e9:.3g} GB/s for {kind}: "
        f"{cpu_seconds * 1e3:.3g} ms) or copies {format_size(stream.streamed_bytes_per_pass)} "
        f"to the cache ({budget.bandwidth / 1e9:.3g} GB/s: {stream_seconds * 1e3:.3g} ms)"
    )
    if cpu_seconds >= stream_seconds:
        stream.notes.append(f"experts auto: streamed by routing: {versus}")
        return stream
    if not whole:
        plan = _plan_experts(r, budget, fixed, host_cache, "cpu")
        plan.notes.append(f"experts auto: on the CPU: {versus}")
        return plan
    parts = {
        **fixed,
        f"target layers without their experts ({n}, resident)": n * rest,
        f"routed experts of {_layers(0, whole)} (resident)": whole * e * t.expert_bytes,
    }
    host = on_cpu * e * t.expert_bytes
    if host + host_cache > budget.ram_bytes:
        raise PlanError(
            f"the routed experts of {on_cpu} layers ({format_size(host)}) do not fit the RAM "
            f"budget ({format_size(budget.ram_bytes)}): give more --ram-budget"
        )
    notes = _sequences_note(r, budget, sum(parts.values()))
    notes.append(
        f"experts auto, per layer: {_layers(0, whole)} keep their experts on the device, "
        f"{_layers(whole, n)} compute theirs on the CPU, since {versus}"
    )
    reason = f"the routed experts of {on_cpu} layers in RAM ({format_size(host)}), computed there"
    plan = MemoryPlan(r, budget, parts, n, 0, 0, "ram", reason, host + host_cache, 0, None, notes)
    plan.expert_mode = "mixed"
    plan.expert_layers = ("device",) * whole + ("cpu",) * on_cpu
    return plan


def _layers(first: int, end: int) -> str:
    return f"layer {first}" if end == first + 1 else f"layers {first}-{end - 1}"


def _sequences_note(r: PlanRequest, budget: MemoryBudget, planned: int) -> list[str]:
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
    staging = host_tier_bytes(layer, r.slots)
    if r.host_tier == "ram":
        if in_ram > ram:
            raise PlanError(
                f"host tier ram: the {streamed} streamed layers need {format_size(in_ram)} of "
                f"RAM but {format_size(max(ram, 0))} is available: use --host-tier disk "
                "(read from the weight files), or keep more layers resident"
            )
        return "ram", "--host-tier ram", in_ram
    if r.host_tier == "auto" and in_ram <= ram:
        return "ram", "the streamed layers fit in RAM (pinned)", in_ram
    if staging > ram:
        raise PlanError(
            f"even the disk tier needs {format_size(staging)} of RAM for {r.slots} staging "
            f"buffers but {format_size(max(ram, 0))} is available: free RAM or use --slots 2"
        )
    if r.host_tier == "disk":
        return "disk", "--host-tier disk", staging
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
