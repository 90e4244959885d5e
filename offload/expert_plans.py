"""Where a mixture of experts' routed experts go in a memory plan (`--experts`,
offload.experts): every layer resident but its routed experts, which live in host RAM and
are copied to a device cache as routed (`stream`) or computed on the CPU (`cpu`), or, under
`auto` on a GPU, per layer as the measured bus and CPU rates make cheaper (`mixed`).
`make_plan` (offload/planning.py) calls these once it knows the fixed parts."""

from __future__ import annotations

from offload.device_parts import sequences_note
from offload.plan import MemoryBudget, MemoryPlan, PlanError, PlanRequest
from offload.units import format_size


def expected_experts(experts: int, per_token: int, tokens: float) -> float:
    """The distinct experts `tokens` tokens wake in one layer, each routed to `per_token`
    of `experts` uniformly at random (the estimate before any routing is measured):
    E (1 - (1 - k/E)^n)."""
    return experts * (1 - (1 - per_token / experts) ** tokens)


def plan_experts(
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
    notes = sequences_note(r, budget, sum(parts.values()))
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


def auto_experts(
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
    stream = plan_experts(r, budget, fixed, host_cache, "stream")
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
        plan = plan_experts(r, budget, fixed, host_cache, "cpu")
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
    notes = sequences_note(r, budget, sum(parts.values()))
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
