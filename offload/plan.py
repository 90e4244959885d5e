"""The memory plan and what it is made from: each model's `ModelFootprint`, the machine's
`MemoryBudget`, the `PlanRequest` (context, pass sizes, offload choices), and the `MemoryPlan`
that answers it (which target layers stay on the compute device, which stream, through how
many slots, from which host tier, what a target pass is expected to cost), with its
rendering for `specd plan`.

Everything is sizes known before any weight is loaded (a `ModelFootprint` per model,
computed from a meta-device model by the caller) and the machine's budgets, which may be
measured or given for another machine ("a 70B on a 24 GB card with 64 GB RAM"). How a plan
is decided is offload/planning.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from offload.activations import ActivationFootprint
from offload.units import format_size

OFFLOAD_MODES = ("none", "stream", "auto")
# Where a mixture of experts' routed experts live (`--experts`, offload.experts): with their
# layers (device), in host RAM copied to a device cache as routed (stream), in host RAM
# computed there (cpu), or auto: device where everything fits, else on a GPU per layer:
# the layers whose experts fit keep them, the others stream them or compute them on the
# CPU, whichever the measured rates make cheaper.
EXPERT_MODES = ("auto", "device", "stream", "cpu")
TIER_CHOICES = ("ram", "disk", "auto")
MIN_SLOTS = 2
# More slots than this only hold more layers in flight than a copy stream can fill (the
# ring waits on the bus either way): a bound on what a flag can make us allocate.
MAX_SLOTS = 16


class PlanError(ValueError):
    """The models cannot be placed within the budgets; the message says what would fit."""


@dataclass(frozen=True)
class ModelFootprint:
    """What one model needs, in bytes, independent of where it is placed."""

    name: str
    dtype: str
    resident_bytes: int  # everything but the decoder layers: embeddings, final norm, head
    layer_bytes: int  # one decoder layer (all layers share one shape)
    num_layers: int
    kv_bytes_per_token: int  # K and V of the full-attention layers for one cached token
    activations: ActivationFootprint  # what a pass allocates, by its shape
    # A layer read from the disk tier: what a read holds besides the staging buffer while it
    # converts one tensor (a GGUF's reordered q/k rows, its float tensors; 0: none)
    disk_scratch_bytes: int = 0
    # Packed weights (modeling/weights/packed.py): the format, one layer's bytes if it were
    # dequantized, and the most a projection's rebuild holds at once (the plan reserves it:
    # one projection is rebuilt at a time, for its matmul only).
    quantization: str = ""
    dense_layer_bytes: int = 0
    dequant_bytes: int = 0
    # Of those, what a compiled step rebuilds inside its graph (traceable packed
    # projections: the substitute's HQQ), held by a CUDA graph's pool (`graph_bytes`).
    traced_dequant_bytes: int = 0
    # A mixture of experts: each routed expert's bytes (as the streamer lays one out), the
    # experts of a layer and those a token routes to (0: a dense model)
    expert_bytes: int = 0
    experts: int = 0
    experts_per_token: int = 0
    # Its packed projections compute from their blocks where the model computes (the CPU
    # kernels, modeling/weights/cpu_kernels.py): a decode step then reads the packed bytes,
    # so the layers stay packed even where their dequantized copy would fit.
    packed_kernels: bool = False
    # Window layers (modeling/kv_cache.py): K and V per slot of their ring, its window,
    # and the room it keeps ahead of the window (kv_cache.WINDOW_ROOM)
    window_kv_bytes_per_slot: int = 0
    window: int = 0
    window_room: int = 0

    @property
    def weight_bytes(self) -> int:
        return self.resident_bytes + self.num_layers * self.layer_bytes

    def kv_bytes(self, context: int, pass_tokens: int = 0) -> int:
        """A full KV cache of `context` tokens for passes of up to `pass_tokens`."""
        ring = self.window_kv_bytes_per_slot
        # the ring's size as modeling/kv_cache.py's window_ring_size makes it (this package
        # imports no model code; tests/test_window_ring.py checks that the two agree)
        ahead = 2 * max(self.window_room, pass_tokens)
        slots = min(context, self.window + max(self.window, ahead))
        return self.kv_bytes_per_token * context + (ring * slots if ring else 0)

    def activation_bytes(self, tokens: int, logit_rows: int, context: int) -> int:
        """Peak of a pass of `tokens` tokens returning `logit_rows` logit rows, attending
        to `context` slots."""
        return self.activations.pass_bytes(tokens, logit_rows, context)


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (tied tensors once); meta modules work."""
    seen: set[int] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


@dataclass(frozen=True)
class MemoryBudget:
    """The memory a plan may take (measured, or given for another machine): the compute
    device's bytes and host RAM's, each with where its figure came from, and the
    host→device bandwidth. Not the tree budget, which is a node count (speculative/budget.py)."""

    device: str  # "cuda" or "cpu": where the models compute
    device_bytes: int
    device_source: str
    ram_bytes: int
    ram_source: str
    bandwidth: float | None  # host→device bytes/s
    bandwidth_source: str
    # The rate (bytes/s of weights read) at which this CPU multiplies a token by a matrix,
    # per dtype ("bfloat16", "float16", "float32"; "packed" only where configured): what a
    # mixture's experts computed on the CPU cost (`--experts auto`). Empty: not measured.
    cpu_rates: tuple[tuple[str, float], ...] = ()
    cpu_rate_source: str = "not measured"

    def cpu_rate(self, dtype: str) -> float | None:
        """The CPU's rate for weights in `dtype` (a dtype name, or "packed"), or None."""
        return dict(self.cpu_rates).get(dtype)


@dataclass(frozen=True)
class GraphRequest:
    """What a model's CUDA graphs hold for good (modeling/graphs.py): a pool with a
    step's working memory, each graph's output and fixed mask, the library workspace of
    their capture stream, and meanwhile the warm-up's scratch cache."""

    tokens: int  # the largest captured step
    chunk_bytes: int  # the bound on a captured step's attention scores
    count: int  # graphs kept per model
    workspace_bytes: int  # cuBLAS's workspaces on the capture stream, the allocator's rounding
    warm_slots: int  # the warm-up's scratch KV cache


@dataclass(frozen=True)
class PlanRequest:
    target: ModelFootprint
    draft: ModelFootprint | None
    context: int
    pass_tokens: int  # the largest pass: a prefill chunk or the largest tree
    # The most logit rows a pass returns: 1 for a prefill chunk (last row only), every node
    # of the largest tree for a verification pass.
    logit_rows: int = 1
    offload: str = "auto"  # none | stream | auto
    resident_layers: int | None = None  # None: as many as fit
    slots: int = MIN_SLOTS
    host_tier: str = "auto"  # ram | disk | auto
    # Sequences whose KV caches may coexist (a daemon's active plus kept conversations).
    # Caches grow with use, so the plan reserves one full-context sequence and warns when
    # all of them at full length would not fit.
    sequences: int = 1
    # Cached target logits (speculation.prefix_cache). Rows are copied off the device as
    # they are stored: on a GPU they take pinned host RAM, on a CPU the one pool.
    prefix_cache_bytes: int = 0
    # Steps captured as CUDA graphs (`--compile on` on a GPU), None: none.
    graphs: GraphRequest | None = None
    # Where a mixture of experts' routed experts live (EXPERT_MODES), and at most how many
    # the device cache holds under `stream` (None: as many as fit)
    experts: str = "auto"
    expert_slots: int | None = None


@dataclass
class MemoryPlan:
    request: PlanRequest
    budget: MemoryBudget
    device_parts: dict[str, int]  # part → bytes on the compute device
    resident_layers: int
    streamed_layers: int
    slots: int  # 0 when nothing streams
    host_tier: str | None  # None when nothing streams
    host_tier_reason: str
    host_bytes: int  # host RAM: the tier's (pinned layers or staging) + a GPU's prefix cache
    streamed_bytes_per_pass: int
    seconds_per_pass: float | None  # transfer-bound estimate at the budget's bandwidth
    notes: list[str] = field(default_factory=list)
    # Why this context and dtype: "as requested", or what `auto` weighed (set by the caller
    # that chose them: `plan_auto_context` here, the daemon for the dtype).
    context_reason: str = "as requested"
    dtype_reason: str = "as requested"
    # Packed target layers that all fit the device even dequantized are kept so (no
    # rebuild per pass); streamed plans keep them packed (the device is full by design).
    dequantized_resident: bool = False
    # A mixture of experts' routed experts: where they live ("device" with their layers,
    # "stream": host RAM and `expert_slots` device slots, "cpu": host RAM, computed there,
    # "mixed": per layer as `expert_layers` says, each "device" or "cpu")
    expert_mode: str = "device"
    expert_slots: int = 0
    expert_layers: tuple[str, ...] = ()

    def expert_layer_modes(self) -> tuple[str, ...]:
        """Where each layer's routed experts live (one mode per layer)."""
        if self.expert_layers:
            return self.expert_layers
        return (self.expert_mode,) * self.request.target.num_layers

    def expert_layer_counts(self) -> dict[str, int]:
        """How many layers keep their routed experts each way ({} for a dense model)."""
        if not self.request.target.experts:
            return {}
        modes = self.expert_layer_modes()
        return {mode: modes.count(mode) for mode in dict.fromkeys(modes)}

    @property
    def device_bytes(self) -> int:
        return sum(self.device_parts.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": asdict(self.request.target),
            "draft": asdict(self.request.draft) if self.request.draft else None,
            "context": self.request.context,
            "context_reason": self.context_reason,
            "dtype": self.request.target.dtype,
            "dtype_reason": self.dtype_reason,
            "pass_tokens": self.request.pass_tokens,
            "logit_rows": self.request.logit_rows,
            "offload": self.request.offload,
            "budget": asdict(self.budget),
            "device_parts": dict(self.device_parts),
            "device_bytes": self.device_bytes,
            "resident_layers": self.resident_layers,
            "streamed_layers": self.streamed_layers,
            "slots": self.slots,
            "host_tier": self.host_tier,
            "host_tier_reason": self.host_tier_reason,
            "host_bytes": self.host_bytes,
            "prefix_cache_bytes": self.request.prefix_cache_bytes,
            "streamed_bytes_per_pass": self.streamed_bytes_per_pass,
            "seconds_per_pass": self.seconds_per_pass,
            "notes": list(self.notes),
            "dequantized_resident": self.dequantized_resident,
            "experts": self.expert_mode,
            "expert_slots": self.expert_slots,
            "expert_layers": self.expert_layer_counts(),
        }

    def render(self) -> str:
        r, b, t = self.request, self.budget, self.request.target
        lines = [
            "specd memory plan",
            f"  target   {t.name}: {t.num_layers} layers × {format_size(t.layer_bytes)}, "
            f"{format_size(t.weight_bytes)} "
            + (f"as stored, computed in {t.dtype}" if t.quantization else f"in {t.dtype}"),
        ]
        if t.quantization:
            rebuild = f"one projection at a time, {format_size(t.dequant_bytes)} at most"
            how = (
                "kept dequantized: there is room (see the note)"
                if self.dequantized_resident
                else "products computed from the blocks by the CPU kernels; a pass longer than "
                f"theirs rebuilds {rebuild}"
                if t.packed_kernels
                else f"rebuilt for its matmul: {rebuild}"
            )
            lines.append(
                f"  packed   {t.quantization}: a layer is {format_size(t.layer_bytes)} "
                f"({format_size(t.dense_layer_bytes)} dequantized); {how}"
            )
        if r.draft:
            d = r.draft
            packed = f" ({d.quantization})" if d.quantization else ""
            lines.append(f"  draft    {d.name}: {format_size(d.weight_bytes)}{packed}")
        lines += [
            f"  dtype    {t.dtype} ({self.dtype_reason})",
            f"  context  {r.context} tokens ({self.context_reason})",
            f"  pass     largest {r.pass_tokens} tokens, {r.logit_rows} logit rows",
            f"  budget   {b.device} {format_size(b.device_bytes)} ({b.device_source}); "
            f"RAM {format_size(b.ram_bytes)} ({b.ram_source})",
            f"  host→device {_rate(b.bandwidth)} ({b.bandwidth_source})",
            *(
                [f"  CPU      {_cpu_rates(b)} ({b.cpu_rate_source})"]
                if t.experts and b.cpu_rates
                else []
            ),
            "",
            f"  on the {b.device}:",
        ]
        width = max(len(k) for k in self.device_parts)
        for part, n in self.device_parts.items():
            lines.append(f"    {part:<{width}}  {format_size(n):>10}")
        lines.append(
            f"    {'total':<{width}}  {format_size(self.device_bytes):>10}"
            f"  of {format_size(b.device_bytes)}"
        )
        lines.append("")
        lines.append(
            f"  layers   {self.resident_layers} resident, {self.streamed_layers} streamed"
            + (f" through {self.slots} slots" if self.streamed_layers else "")
        )
        pinned_cache = host_cache_bytes(r, b)
        if pinned_cache:
            lines.append(f"  host     prefix cache: {format_size(pinned_cache)} of pinned RAM")
        if self.host_tier:
            lines.append(
                f"  host     tier {self.host_tier}: "
                f"{format_size(self.host_bytes - pinned_cache)} of RAM ({self.host_tier_reason})"
            )
            per_pass = format_size(self.streamed_bytes_per_pass)
            on_cpu = self.expert_layer_modes().count("cpu") if t.experts else 0
            if on_cpu and not self.streamed_bytes_per_pass:
                lines.append(
                    f"  expected nothing streamed: the CPU computes the routed experts of "
                    f"{on_cpu} layers"
                )
            elif self.seconds_per_pass is None:
                lines.append(f"  expected {per_pass} streamed per target pass")
            else:
                lines.append(
                    f"  expected {self.seconds_per_pass:.3g} s per target pass "
                    f"({per_pass} at {_rate(b.bandwidth)})"
                )
        else:
            lines.append(f"  host     nothing streams ({self.host_tier_reason})")
        lines += [f"  note     {n}" for n in self.notes]
        return "\n".join(lines)


def _cpu_rates(b: MemoryBudget) -> str:
    return ", ".join(f"{dtype} {_rate(rate)}" for dtype, rate in b.cpu_rates)


def _rate(bandwidth: float | None) -> str:
    return "unknown" if bandwidth is None else f"{bandwidth / 1e9:.3g} GB/s"


def host_cache_bytes(r: PlanRequest, budget: MemoryBudget) -> int:
    """Host RAM the prefix cache takes besides the device parts: all of it with a GPU (its
    slots are pinned chunks of power-of-two sizes, which the allocator does not round up),
    none on a CPU (there it is a device part)."""
    return 0 if budget.device == "cpu" else r.prefix_cache_bytes
