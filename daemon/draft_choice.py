"""`--draft auto` (`models.draft: auto`): what a run drafts with when the user leaves it to
specd, and why (`DraftChoice.reason`: the log, `specd plan`, `/v1/specd/status` and each
response's stats say it).

In this order:
1. a small model with the target's tokenizer, found on this machine (Ollama's and LM
   Studio's stores, the Hugging Face cache): at most a quarter of the target's parameters,
   the largest such (Qwen3-0.6B for Qwen3-8B, Llama-3.2-1B for Llama-3.1-8B, Gemma 3 270M
   for its 12B and 27B). The stores' configs are read first (no weights); tokenizers are
   opened only for the few whose size and vocabulary could match, largest first.
2. on a GPU, the substitute draft (the target's own low-bit layers), where the plan fits
   it and some layers stream: with every layer resident the substitute would be the
   target itself, drafting at its full cost, which cannot pay; nor for a mixture whose
   experts live in RAM, where the copies of every expert would take the expert cache's
   room (`--draft substitute` asks for it).
3. prompt lookup (`ngram`): nothing to load or build. On a CPU it is the choice after a
   found model: a substitute takes minutes per billion weights to build there, and with
   the target resident it is the target itself anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from daemon.options import RuntimeOptions
from modeling.checkpoints.checkpoint import Checkpoint, load_tokenizer, open_checkpoint
from modeling.models import parameter_count
from modeling.substitute import SUBSTITUTE
from modeling.text.tokenizer import Tokenizer
from offload.plan import MemoryBudget, MemoryPlan
from offload.planning import PlanError
from offload.units import format_size

log = logging.getLogger("specd.draft")

AUTO = "auto"
NGRAM = "ngram"
DRAFT_SHARE = 4  # a found draft holds at most 1/DRAFT_SHARE of the target's parameters
MAX_TOKENIZERS = 8  # candidates whose tokenizer is opened, at most (largest first)


@dataclass(frozen=True)
class DraftChoice:
    draft: str  # a model reference, "substitute" or "ngram"
    reason: str


def local_models() -> list[tuple[str, Path]]:
    """(name, path) of the models on this machine: the stores' GGUF files and the hub
    cache's snapshots (the newest revision of each)."""
    from modeling.checkpoints.hub_cache import hub_snapshots
    from modeling.checkpoints.model_stores import list_store_models

    found = [(e.name, e.path) for e in list_store_models() if e.note is None]
    return found + [(snap.repo_id, snap.path) for snap in hub_snapshots()]


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def find_draft_model(
    target: Checkpoint, tokenizer: Tokenizer, found: Iterable[tuple[str, Path]]
) -> tuple[str, Path, int] | None:
    """The largest model in `found` with at most a quarter of `target`'s parameters whose
    tokenizer is `tokenizer`'s and whose embedding covers it: (name, path, parameters)."""
    limit = parameter_count(target.config) // DRAFT_SHARE
    vocab = target.config.vocab_size
    sized: list[tuple[int, str, Path]] = []
    for name, path in found:
        if _same_path(path, target.path):
            continue
        try:
            config = open_checkpoint(
                path, config_only=True, verify=False, compare_head=False
            ).config
        except (ValueError, OSError):
            continue  # `specd models` says why; it is no draft
        params = parameter_count(config)
        # Embeddings of one tokenizer differ by padding rows only (Qwen2.5: 151,936 and
        # 152,064): a vocabulary much larger or smaller is another tokenizer.
        if params <= limit and abs(config.vocab_size - vocab) <= max(1024, vocab // 50):
            sized.append((params, name, path))
    for params, name, path in sorted(sized, key=lambda s: -s[0])[:MAX_TOKENIZERS]:
        try:
            ckpt = open_checkpoint(path, compare_head=False)  # (the one chosen: at its load)
            theirs = load_tokenizer(ckpt)
        except (ValueError, OSError):
            continue
        if (
            theirs.vocabulary == tokenizer.vocabulary
            and tokenizer.id_limit <= ckpt.config.vocab_size
        ):
            return name, path, params
    return None


def choose_draft(
    target: Checkpoint,
    tokenizer: Tokenizer | None,
    device_type: str,
    substitute_plan: Callable[[], MemoryPlan],
    found: Iterable[tuple[str, Path]] | None = None,
) -> DraftChoice:
    """What `auto` drafts with for `target` computing on `device_type` (the module's
    order). `substitute_plan`: the run's plan with the substitute draft (raises PlanError
    when it does not fit); `found`: the models on this machine (default: `local_models`).
    Without the target's tokenizer (`specd plan` of a folder holding config.json only) no
    model can be matched to it, and the choice is among the other two."""
    model = None
    if tokenizer is not None:
        model = find_draft_model(target, tokenizer, local_models() if found is None else found)
    if model is not None:
        name, path, params = model
        share = params / parameter_count(target.config)
        return DraftChoice(
            str(path),
            f"draft auto: {name} ({params / 1e6:,.0f}M parameters, {share:.0%} of the "
            "target's), a model with the target's tokenizer found on this machine",
        )
    if device_type != "cuda":
        return DraftChoice(
            NGRAM,
            "draft auto: prompt lookup (no model with the target's tokenizer on this "
            "machine; on a CPU the substitute takes minutes per billion weights to build, "
            "and with the target resident it is the target itself)",
        )
    try:
        plan = substitute_plan()
    except PlanError as err:
        return DraftChoice(
            NGRAM,
            f"draft auto: prompt lookup (no model with the target's tokenizer on this "
            f"machine; the substitute does not fit: {str(err).splitlines()[0]})",
        )
    if plan.expert_mode != "device":
        copies = plan.device_parts.get("draft weights", 0)
        return DraftChoice(
            NGRAM,
            "draft auto: prompt lookup (no model with the target's tokenizer on this "
            f"machine; the substitute's low-bit copies of every expert ({format_size(copies)}) "
            "would take that room from the expert cache, and a tree wakes many experts a "
            "pass: --draft substitute tries it, --budget auto then decides whether it pays)",
        )
    if not plan.streamed_layers:
        return DraftChoice(
            NGRAM,
            "draft auto: prompt lookup (no model with the target's tokenizer on this "
            "machine; every layer is resident, so a substitute would be the target "
            "itself, drafting at its full cost)",
        )
    return DraftChoice(
        SUBSTITUTE,
        f"draft auto: the substitute (the target's own layers at low bits; "
        f"{plan.streamed_layers} of {plan.resident_layers + plan.streamed_layers} layers "
        "stream, and no model with the target's tokenizer is on this machine)",
    )


def resolve_auto(
    options: RuntimeOptions,
    target: Checkpoint,
    budget: MemoryBudget,
    device_type: str,
    tokenizer: Tokenizer | None = None,
) -> DraftChoice:
    """`choose_draft` for a run's `options` (whose draft is auto) and its target, opened
    (and its `tokenizer` where the caller has built it); the substitute planned on `budget`
    as the run would plan it. Logged."""
    from daemon.pair_plan import plan_pair

    def substitute_plan() -> MemoryPlan:
        with_substitute = replace(options, draft=SUBSTITUTE)
        return plan_pair(with_substitute, target, None, budget, device_type, str(target.path))[0]

    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(target)
        except (ValueError, OSError):
            tokenizer = None  # (a run refuses it when it loads; a plan of a hub id plans without)
    choice = choose_draft(target, tokenizer, device_type, substitute_plan)
    log.info("%s", choice.reason)
    return choice
