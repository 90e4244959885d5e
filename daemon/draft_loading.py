"""What a run drafts with, opened and loaded: `--draft auto` settled (daemon/draft_choice.py),
a draft model's checkpoint opened before the target is planned (the plan holds both), and
after the target loads, the draft model loaded and checked against it (one vocabulary;
that each embedding covers its tokenizer's ids is checked as each model loads). The substitute draft is built with the target
(daemon/target_loading.py); prompt lookup loads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from daemon.draft_choice import AUTO, NGRAM, resolve_auto
from daemon.options import RuntimeOptions, RuntimeSetupError
from modeling.checkpoints.checkpoint import Checkpoint, load, open_checkpoint
from modeling.decoder import Transformer
from modeling.substitute import SUBSTITUTE
from modeling.text.tokenizer import Tokenizer
from offload.machine import detect_budget


@dataclass(frozen=True)
class DraftAsked:
    """What the run drafts with before the target loads: the options with `auto` settled,
    why it was settled so (None where the user named the draft), and a draft model's
    checkpoint, opened (None for ngram, the substitute or no draft)."""

    options: RuntimeOptions
    reason: str | None
    checkpoint: Checkpoint | None


def settle_draft(options: RuntimeOptions, device: torch.device) -> DraftAsked:
    """`--draft auto` resolved against the target and this machine, and the draft model's
    checkpoint opened once: its config is planned for, then it loads."""
    reason = None
    if options.draft == AUTO:
        budget = detect_budget(
            device, options.gpu_budget, options.ram_budget, options.bandwidth, measure=False
        )
        # (loading checks what `verify` would, once)
        target_ckpt = open_checkpoint(options.model, options.quantize, verify=False)
        choice = resolve_auto(options, target_ckpt, budget, device.type)
        options, reason = replace(options, draft=choice.draft), choice.reason
    ckpt = (
        open_checkpoint(options.draft, options.draft_quantize, verify=False)  # (loaded)
        if options.draft and options.draft not in (NGRAM, SUBSTITUTE)
        else None
    )
    return DraftAsked(options, reason, ckpt)


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, draft_ref: str) -> None:
    """Speculation compares token ids, so both models must mean the same thing by each id."""
    if target.vocabulary != draft.vocabulary:
        raise RuntimeSetupError(
            f"draft {draft_ref!r} uses a different tokenizer/vocabulary than the target: "
            "speculation needs both models to share one vocabulary (pick a draft from the "
            "same model family)"
        )


def load_draft_model(
    asked: DraftAsked,
    target: Transformer,
    target_ckpt: Checkpoint,
    tokenizer: Tokenizer,
    dtype: str,
    device: torch.device,
) -> tuple[Transformer, Checkpoint]:
    """The draft model of `asked` (which has a checkpoint), loaded in the run's dtype on
    `device`, checked against the loaded target, its output widened to the target's and
    its passes bounded as the target's are."""
    assert asked.checkpoint is not None and asked.options.draft is not None
    ref = asked.options.draft
    # (each model's embedding covers its tokenizer's ids: checked as it loads)
    draft, draft_tok, draft_ckpt = load(asked.checkpoint, dtype, device)
    check_same_vocabulary(tokenizer, draft_tok, ref)
    draft.set_vocab_width(target.vocab_width)  # no-op when the sizes are equal
    draft.max_pass_tokens = target.max_pass_tokens
    return draft, draft_ckpt
