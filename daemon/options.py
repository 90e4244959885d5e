"""What a runtime is built from (`RuntimeOptions`): the model pair, the strategy and the
memory options, as the command line, the configuration (`Settings.runtime_options`) or a
script gives them. A plain record that imports no torch, so that reading settings or
building the command line does not; daemon/runtime.py builds the runtime from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class RuntimeSetupError(RuntimeError):
    """A runtime that cannot be built as asked (a user error, reported in one line)."""


@dataclass
class RuntimeOptions:
    model: str
    draft: str | None = None  # a model folder / hub id, "ngram", "substitute", or None
    # --draft substitute: bits of its HQQ layers (2, 3, 4, 8) or auto (the most that fit),
    # and the folder built substitutes are kept in (None: built at every start).
    substitute_bits: int | str = "auto"
    substitute_cache: str | None = None
    # The folder what trees learned about a model pair is kept in between runs
    # (daemon/learned_store.py; None: every run starts from the prior).
    learned_cache: str | None = None
    # Told what loading is doing, in a few words, while it takes long (the engine shows
    # it in the status): building the substitute draft, layer by layer.
    on_progress: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    strategy: str | None = None  # None: tree with a draft, autoregressive without
    spec_length: int = 4  # linear: tokens drafted per round
    budget: int | str = "auto"  # tree: node budget, or "auto" (chosen from measured costs)
    max_depth: int | None = None  # tree: depth limit (None: chosen with the budget)
    tree_verification: str = "auto"  # tree: auto | walk | rejection (speculative.acceptance)
    # tree: bytes of cached target logits (0: off). speculative.prefix_cache.DEFAULT_MAX_BYTES,
    # restated so that this module imports no torch (tests/test_cli_startup.py: they agree).
    prefix_cache: int = 1 << 30
    # fp32 | bf16 | fp16, or auto: the checkpoint's dtype on CUDA; fp32 on a CPU when the
    # model fits in fp32 there (see modeling.checkpoints.checkpoint.dtype_candidates).
    dtype: str = "auto"
    quantize: str | None = None  # int8 | int4: the target's projections, quantized on load
    draft_quantize: str | None = None  # the same for the draft
    device: str = "auto"
    # KV cache length in tokens, or auto: the longest up to the model's maximum that fits
    # the budget, never below 4,096 (offload.planning.plan_auto_context).
    context: int | str = "auto"
    # Offload (see offload/): where the target's layers live and how they reach the device.
    offload: str = "auto"  # none | stream | auto
    resident_layers: int | str = "auto"
    slots: int = 2
    gpu_budget: str = "auto"  # a size ("24GB", "512MiB") or auto
    host_tier: str = "auto"  # ram | disk | auto
    # a mixture of experts' routed experts: auto | device | stream | cpu (offload/experts.py)
    experts: str = "auto"
    expert_slots: int | None = (
        None  # --experts stream: at most this many cached (None: all that fit)
    )
    ram_budget: str = "auto"  # a size or auto (available RAM minus a reserve)
    bandwidth: str | None = None  # host→device rate for the plan's estimate ("25GB/s")
    # The CPU's rate for experts computed there (`--experts auto`), None: measured on a GPU
    cpu_rate: str | None = None
    threads: int | str = "auto"  # CPU compute threads (torch intra-op), or auto
    # Compiled passes: auto | off | on (daemon/compiling.py). The configuration's default is
    # auto; a runtime built directly (tests, scripts) compiles only when asked.
    compile: str = "off"
    sequences: int = 1  # KV caches that may coexist (the daemon: active + kept conversations)
