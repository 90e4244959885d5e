"""The composition root: load the target (and draft), place them, and build strategies.

Both the `specd generate` command and the daemon's engine go through `Runtime`, so a
model pair behaves the same in a script and behind the REST endpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psutil
import torch

from daemon.compiling import SMALL_LAYER_PARAMETERS, Compilation
from daemon.draft_choice import NGRAM
from daemon.draft_loading import load_draft_model, settle_draft
from daemon.learned_store import LearnedStore, pair_key
from daemon.memory_plan import plan_dtype
from daemon.options import RuntimeOptions, RuntimeSetupError
from daemon.target_loading import expert_source, load_placed_target
from modeling.checkpoints.checkpoint import DTYPE_CHOICES, Checkpoint, NotCachedError
from modeling.decoder import Transformer
from modeling.models import layer_parameter_count
from modeling.substitute import SUBSTITUTE
from modeling.text.tokenizer import Tokenizer
from modeling.weights import cpu_kernels
from modeling.weights.packed import PackedLinear
from offload.expert_plans import expected_experts
from offload.experts import ExpertStats
from offload.plan import MemoryPlan
from offload.stream import LayerStreamer
from speculative.acceptance import AcceptanceModel
from speculative.auto_budget import AutoBudget
from speculative.budget import max_tree_budget
from speculative.drafting import Drafter, ModelDrafter
from speculative.generation import Generation
from speculative.ngram import NgramDrafter
from speculative.prefill import ALONE_PREFILL
from speculative.prefix_cache import PrefixCache
from speculative.rounds import Strategy
from speculative.sampling import SamplingParams
from speculative.session import Session
from speculative.strategies.autoregressive import Autoregressive
from speculative.strategies.linear import Linear
from speculative.strategies.tree import TreeSpeculation

log = logging.getLogger("specd.runtime")


def cpu_threads(requested: int | str, layer_parameters: int) -> int:
    """The torch intra-op thread count for CPU compute."""
    if requested != "auto":
        return int(requested)
    if layer_parameters < SMALL_LAYER_PARAMETERS:
        return 1
    return max(1, psutil.cpu_count(logical=False) or torch.get_num_threads())


def computes_in_place(model: Transformer) -> bool:
    """Whether every packed projection of `model` is multiplied from its blocks (the CPU
    kernels) and at least one is."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    return bool(packed) and all(m.computed_in_place(model.dtype, model.device) for m in packed)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeSetupError(
            "device cuda was asked for (--device, or models.device in the configuration: a "
            "GPU profile sets it) but no CUDA device is available: use auto or cpu"
        )
    return torch.device(device)


def linear_drafter(rt: Runtime) -> Drafter:
    """The draft model when one is loaded, else prompt lookup (--draft ngram)."""
    if rt.draft is not None:
        return ModelDrafter(rt.draft, shared_cache=rt.draft_kind == SUBSTITUTE)
    return NgramDrafter(rt.target.config.vocab_size)


# name → builder of a strategy with a tree budget and verification (only the tree
# strategy reads them).
StrategyBuilder = Callable[["Runtime", "int | str", str], Strategy]
STRATEGY_BUILDERS: dict[str, StrategyBuilder] = {
    "autoregressive": lambda rt, budget, verification: Autoregressive(rt.target),
    "linear": lambda rt, budget, verification: Linear(
        rt.target, linear_drafter(rt), rt.options.spec_length
    ),
    # Build once and reuse: with --budget auto it learns costs across requests; what
    # verification accepts is learned in the runtime's one model (`acceptance`).
    "tree": lambda rt, budget, verification: rt.learned_planner(
        TreeSpeculation(
            rt.target,
            rt.draft,
            budget=budget,
            max_depth=rt.options.max_depth,
            prefix_cache=rt.prefix_cache,
            verification=verification,
            acceptance=rt.acceptance,
            shared_cache=rt.draft_kind == SUBSTITUTE,
        )
    ),
}


def _alone_on_a_cpu() -> tuple[float, int]:
    return ALONE_PREFILL


class Runtime:
    def __init__(self, options: RuntimeOptions) -> None:
        self.options: RuntimeOptions = options
        self.device = pick_device(options.device)
        if options.dtype not in DTYPE_CHOICES:
            raise RuntimeSetupError(
                f"dtype {options.dtype!r} is not one of {', '.join(DTYPE_CHOICES)}"
            )
        if options.context != "auto" and not isinstance(options.context, int):
            raise RuntimeSetupError(
                f"context must be a token count or 'auto', got {options.context!r}"
            )
        if self.device.type == "cpu" and cpu_kernels.will_build():
            # (before the models load, whose layers would build them unannounced)
            note = "building the CPU kernels for this machine (once: a few seconds)"
            log.info(note)
            if options.on_progress is not None:
                options.on_progress(note)
            cpu_kernels.available()
        try:
            asked = settle_draft(options, self.device)
            options = self.options = asked.options
            placed = load_placed_target(options, self.device, asked.checkpoint)
        except NotCachedError as exc:  # (the draft is opened first)
            raise exc.naming_also([options.model, options.draft]) from None
        self.draft_reason: str | None = asked.reason  # why `--draft auto` chose what it did
        draft_ckpt = asked.checkpoint
        target, tokenizer, ckpt = placed.model, placed.tokenizer, placed.checkpoint
        self.plan: MemoryPlan = placed.plan
        self.streamer: LayerStreamer | None = placed.streamer
        # What `auto` settled on (or what was asked for): the plan holds both.
        self.dtype: str = plan_dtype(self.plan)
        self.context: int = self.plan.request.context
        # The largest tree a request may ask for: what the plan's largest pass holds.
        self.max_tree_budget: int = max_tree_budget(options.budget)
        # The largest pass the plan holds, which a batched pass of many generations may
        # not exceed either: its tokens, and its rows of logits.
        self.max_pass_tokens: int = self.plan.request.pass_tokens
        self.max_pass_rows: int = self.plan.request.logit_rows
        self.target: Transformer = target
        target.max_pass_tokens = self.max_pass_tokens  # its caches' window rings hold it
        self.tokenizer: Tokenizer = tokenizer
        # One cache of verified target logits for every tree strategy built here (keys are
        # token sequences, whatever the budget). Rows live in host RAM, pinned for a GPU.
        self.prefix_cache: PrefixCache = PrefixCache(
            options.prefix_cache, dtype=target.dtype, pin=self.device.type == "cuda"
        )
        # What tree verification accepted at the nodes it visited, per verification and
        # temperature regime: shared by every tree strategy built here, so that a request's
        # own budget or verification, or strategies rebuilt once compiled, start informed.
        self.acceptance: AcceptanceModel = AcceptanceModel()
        # CPU compute (a CPU device, or the host side of a streamed GPU run is not compute):
        # pick the thread count once the model's size is known.
        self.threads = cpu_threads(options.threads, layer_parameter_count(ckpt.config))
        # Where the CPU kernels compute the projections from their blocks, they take the
        # threads (they split each product's rows) and PyTorch's own operators keep one:
        # both pools spinning at once made decode 4x slower on 2 cores (SmolLM2 Q4_1: 35.7
        # tok/s kernels on 2 and torch on 1; 30.7 both on 1; 7.5 both on 2).
        self.kernel_threads = 1
        self._experts_seen = ExpertStats()  # routing's counts at the last offload_stats()
        if self.device.type == "cpu":
            if computes_in_place(target):
                self.kernel_threads = cpu_kernels.set_threads(self.threads)
                torch.set_num_threads(1)
            else:
                torch.set_num_threads(self.threads)
            if not cpu_kernels.available():
                # (the norms and attention of every model, and packed layers' products: a
                # warning where installing a compiler would bring them)
                level = logging.WARNING if cpu_kernels.fixable() else logging.INFO
                log.log(level, "the CPU kernels are unavailable: %s", cpu_kernels.status())
        self.checkpoint: Checkpoint = ckpt

        self.draft: Transformer | None = None
        self.draft_checkpoint: Checkpoint | None = None
        self.draft_kind: str | None = None  # "model", "substitute", "ngram" or None
        self.substitute_bits: int | None = placed.draft.substitute_bits
        # how many of the substitute's layers are low-bit copies (the rest are the target's)
        self.substitute_layers: int | None = placed.draft.substitute_layers
        if options.draft == NGRAM:
            self.draft_kind = NGRAM
        elif placed.substitute is not None:
            self.draft, self.draft_kind = placed.substitute, SUBSTITUTE
            if self.substitute_layers == 0:  # (the stats said substitute_bits, nothing more)
                log.warning(
                    "--draft substitute: every layer of the target is resident, so each is its "
                    "own substitute and no %s-bit copy is made: the target drafts for itself, "
                    "a draft pass at a target pass's cost (--offload stream streams layers; "
                    "--draft ngram costs nothing)",
                    self.substitute_bits,
                )
        elif draft_ckpt is not None:
            self.draft, self.draft_checkpoint = load_draft_model(
                asked, target, ckpt, tokenizer, self.dtype, self.device
            )
            self.draft_kind = "model"
        default = "tree" if self.draft_kind else "autoregressive"
        self.default_strategy = options.strategy or default
        self.check_strategy(self.default_strategy)
        self.compilation: Compilation | None = None
        # What trees learned about this pair in earlier runs (daemon/learned_store.py), and
        # the `--budget auto` planners built since, whose measurements are kept with it.
        self.learned: LearnedStore | None = None
        self._planners: list[weakref.ref[AutoBudget]] = []
        if options.learned_cache and self.draft_kind:
            key = pair_key(
                ckpt, options.quantize, self.dtype, self.draft_kind, self.draft_checkpoint,
                options.draft_quantize, self.substitute_bits,
            )  # fmt: skip
            placement = (
                f"{self.device.type}/{self.plan.resident_layers} resident"
                f"/{self.plan.streamed_layers} streamed"
            )
            self.learned = LearnedStore(Path(options.learned_cache), key, placement)
            self.learned.load(self.acceptance)

    def learned_planner(self, strategy: TreeSpeculation) -> TreeSpeculation:
        """A new tree strategy's `--budget auto` planner starts from what this placement
        measured before, and is kept (weakly) for `save_learned`."""
        planner = strategy.planner
        if isinstance(planner, AutoBudget):
            planner.price_passes_by(self.pass_feature())
            if self.learned is not None:
                self.learned.restore(planner)
            self._planners = [r for r in self._planners if r() is not None]
            self._planners.append(weakref.ref(planner))
        return strategy

    def pass_feature(self) -> Callable[[float], float] | None:
        """What a target pass's cost grows with, for `--budget auto` (speculative/pass_costs.py):
        a mixture of experts whose routed experts live off the device (`--experts stream`
        or `cpu`) pays per distinct expert a pass wakes, so its cost is priced by the
        expected experts n tokens wake a layer (uniform routing: E (1 - (1 - k/E)^n); the
        fitted line's slope takes up how skewed real routing is); None (its tokens) else."""
        moe = self.target.config.moe
        if moe is None or self.plan.expert_mode not in ("stream", "cpu", "mixed"):
            return None
        return partial(expected_experts, moe.experts, moe.top_k)

    def save_learned(self, force: bool = True) -> None:
        """Keep what trees have learned (the acceptance tables, and the most experienced
        live `auto` planner's costs) for the next run; with `force` False at most every
        SAVE_EVERY_S (the daemon calls it as generations finish)."""
        if self.learned is None:
            return
        planners = [p for p in (r() for r in self._planners) if p is not None]
        planner = max(planners, key=lambda p: p.rounds_seen, default=None)
        self.learned.save(self.acceptance, planner, force=force)

    def cpu_kernels_status(self) -> dict[str, object]:
        """Whether the target's packed projections are multiplied from their blocks (the
        CPU kernels), why not where they are not, and the threads each side uses."""
        used = self.device.type == "cpu" and computes_in_place(self.target)
        return {
            "used": used,
            "status": cpu_kernels.status(),
            "kernel_threads": self.kernel_threads,
            "torch_threads": torch.get_num_threads() if self.device.type == "cpu" else None,
        }

    def compile(self, serving: bool) -> Compilation:
        """Decide which models run compiled passes (`options.compile`); the caller warms
        them (`warm()` in the foreground, `warm_in_background()` for the daemon)."""
        models = {"target": self.target}
        folders = {"target": self.checkpoint.path}
        if self.draft is not None and self.draft_checkpoint is not None:
            models["draft"] = self.draft
            folders["draft"] = self.draft_checkpoint.path
        elif self.draft is not None and self.options.compile == "on":
            # The substitute, made here: no folder for `auto`'s child to precompile from,
            # and compiling in this process would hold requests for tens of seconds; so
            # it compiles when asked (its HQQ steps: modeling/compiled.py), never by auto.
            models["draft"] = self.draft
        self.compilation = Compilation(self.options.compile, models, serving, folders=folders)
        return self.compilation

    def check_strategy(self, name: str) -> None:
        """Refuse a strategy this runtime cannot build: an unknown name, or speculation
        without a draft."""
        if name not in STRATEGY_BUILDERS:
            raise RuntimeSetupError(
                f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_BUILDERS)}"
            )
        if name != "autoregressive" and self.draft_kind is None:
            raise RuntimeSetupError(
                f"strategy {name!r} needs a draft: pass --draft MODEL or --draft ngram"
            )

    def strategy(
        self,
        name: str | None = None,
        budget: int | str | None = None,
        verification: str | None = None,
    ) -> Strategy:
        """A new strategy `name` (default: the configured one); `budget` and
        `verification` replace the configured tree budget and verification (a request's
        own), None keeps them."""
        name = name or self.default_strategy
        # A request's strategy was admitted (daemon/admission.py); this guards the callers
        # that build one directly (tests, scripts) from a KeyError or a draftless tree.
        self.check_strategy(name)
        return STRATEGY_BUILDERS[name](
            self,
            self.options.budget if budget is None else budget,
            verification or self.options.tree_verification,
        )

    def new_session(self, strategy: Strategy) -> Session:
        session = strategy.new_session(self.context)
        if self.device.type == "cpu":  # (a pass costs its compute: see `chunk_now`)
            session.pass_bound = _alone_on_a_cpu
        return session

    def generation(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        strategy: str | None = None,
        ignore_eos: bool = False,
    ) -> Generation:
        """One generation on a new session of a new strategy `strategy` (default: the
        configured one), not yet run: iterate it, or `.run()` it."""
        built = self.strategy(strategy)
        return Generation(
            built,
            self.new_session(built),
            self.tokenizer,
            prompt_ids,
            params,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
        )

    def draft_stats(self) -> dict[str, int | str | None]:
        """What this runtime drafts with (for GenerationStats.extra and the status): the
        kind, and for the substitute its bits and how many of its layers are copies at
        those bits (with every layer resident, none: the target drafts for itself)."""
        return {
            "draft_kind": self.draft_kind,
            "substitute_bits": self.substitute_bits,
            "substitute_layers": self.substitute_layers,
            "draft_reason": self.draft_reason,
        }

    def offload_stats(self) -> dict[str, float | int | str]:
        """The streamer's figures since the last call (for GenerationStats.extra), and a
        mixture of experts' routing since then (the distinct experts a layer pass woke, the
        bytes of experts copied to the device and the cache's hit rate); {} when nothing
        streams and no expert moves."""
        stats: dict[str, float | int | str] = {}
        if self.streamer is not None:
            stats.update(self.streamer.stats())
            self.streamer.reset_counters()
        source = expert_source(self.target)
        if source is not None:
            now = dataclasses.replace(source.stats)
            last, self._experts_seen = self._experts_seen, now
            passes = now.layer_passes - last.layer_passes
            asked = now.asked - last.asked
            stats["experts_woken_per_layer_pass"] = (
                (now.woken - last.woken) / passes if passes else 0.0
            )
            stats["expert_bytes_copied"] = now.bytes_copied - last.bytes_copied
            stats["expert_hit_rate"] = (now.hits - last.hits) / asked if asked else 0.0
        return stats

    def expert_status(self) -> dict[str, object] | None:
        """Where a mixture of experts' routed experts live and what routing has cost so far
        (None for a dense model)."""
        if self.target.config.moe is None:
            return None
        source = expert_source(self.target)
        return {
            "mode": self.plan.expert_mode,
            "slots": self.plan.expert_slots,
            "layers": self.plan.expert_layer_counts(),
            "experts": self.target.config.moe.experts * self.target.config.num_layers,
            **(source.stats.to_dict() if source is not None else {}),
        }
