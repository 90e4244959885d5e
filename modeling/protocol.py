"""What the decoding algorithms (speculative/) see of a model: a pass over tokens with
positions, a cache and a mask (`Segment`, `Model.forward_batch`), a new cache, the
vocabulary width it speaks, its device and dtype. Nothing here knows an architecture:
`modeling.decoder.Transformer` is the one implementation, built from an architecture module
(modeling/models/), and a streamed or compiled model is still one."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from modeling.kv_cache import KVCache


@dataclass
class Segment:
    """One sequence's share of a model pass: its new tokens, their RoPE positions, the
    sequence's own KV cache, and the mask over that cache (None: causal among the new
    tokens, seeing the whole cache; (T, T): among the new tokens only, each seeing the
    whole cache; (T, cache.length + T): over every slot, e.g. a draft tree growing in
    batches). Logits are returned for rows `logits_from`.. only (T - 1: the last)."""

    tokens: torch.Tensor  # (T,) token ids
    positions: torch.Tensor  # (T,)
    cache: KVCache
    mask: torch.Tensor | None = None
    logits_from: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.logits_from < max(self.length, 1):
            raise ValueError(
                f"logits_from {self.logits_from} is outside a segment of {self.length} tokens"
            )

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def logit_rows(self) -> int:
        return self.length - self.logits_from


class Model(Protocol):
    """A decoder as the algorithms drive it. `forward_batch` appends each segment's tokens
    to its own cache and returns its fp32 logits (T_i - logits_from_i, vocab_width);
    `forward` is the one-segment call; `prefetch` hints that a pass is coming (a streamed
    model starts copying its first layers)."""

    vocab_width: int

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor]: ...

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        last_only: bool = False,
        logits_from: int = 0,
    ) -> torch.Tensor: ...

    def new_cache(self, capacity: int) -> KVCache: ...

    def prefetch(self) -> None: ...


class HiddenStatesPass(Protocol):
    """What `Transformer.compiled` holds: another way to run a one-sequence pass up to the
    final hidden states (modeling/compiled.py's `CompiledPasses`, compiled graphs),
    leaving the cache's new entries uncommitted; None where it cannot run that pass, which
    then runs eager."""

    def hidden_states(self, segment: Segment) -> torch.Tensor | None: ...


class LayerSequence(Protocol):
    """What `Transformer.layers` may be replaced with (see `Transformer.set_layers`): an
    iterable over callable layers in order, with a length. The offload streamer is one."""

    def __iter__(self) -> Iterator[Callable[..., torch.Tensor]]: ...

    def __len__(self) -> int: ...
