"""The composition root: load the target (and draft), place them, and build strategies.

Both the `specd generate` command and the daemon's engine go through `Runtime`, so a
model pair behaves the same in a script and behind the REST endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculative.checkpoint import DTYPES, Checkpoint, load
from speculative.generation import Session, Strategy
from speculative.model import Transformer
from speculative.strategies.autoregressive import Autoregressive
from speculative.tokenizer import Tokenizer

STRATEGIES = ("autoregressive",)


class RuntimeError_(RuntimeError):
    """A runtime that cannot be built as asked (a user error, reported in one line)."""


@dataclass
class RuntimeOptions:
    model: str
    draft: str | None = None
    strategy: str | None = None  # None: tree with a draft, autoregressive without
    dtype: str = "fp32"
    device: str = "auto"
    context: int | None = None  # None: the model's own maximum


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError_("--device cuda was asked for but no CUDA device is available")
    return torch.device(device)


class Runtime:
    def __init__(self, options: RuntimeOptions) -> None:
        self.options = options
        self.device = pick_device(options.device)
        if options.dtype not in DTYPES:
            raise RuntimeError_(f"dtype {options.dtype!r} is not one of {', '.join(DTYPES)}")
        target, tokenizer, ckpt = load(options.model, options.dtype, self.device)
        self.target: Transformer = target
        self.tokenizer: Tokenizer = tokenizer
        self.checkpoint: Checkpoint = ckpt
        self.draft: Transformer | None = None
        limit = ckpt.config.max_context
        if options.context is not None and options.context > limit:
            raise RuntimeError_(
                f"context {options.context} is longer than {options.model} supports ({limit})"
            )
        self.context = options.context or limit
        self.default_strategy = options.strategy or "autoregressive"
        if self.default_strategy not in STRATEGIES:
            raise RuntimeError_(
                f"unknown strategy {self.default_strategy!r}; choose one of {', '.join(STRATEGIES)}"
            )

    def strategy(self, name: str | None = None) -> Strategy:
        name = name or self.default_strategy
        if name == "autoregressive":
            return Autoregressive(self.target)
        raise RuntimeError_(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")

    def new_session(self, strategy: Strategy) -> Session:
        return strategy.new_session(self.context)
