"""Token masks: the engine's mask words (one bit per token, 32 a word) turned into what a
model's logits are masked with, and the log-probabilities of tokens a grammar forces.
speculative/grammar.py makes the words; the strategies apply them here."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from speculative.sampling import SamplingParams, TokenLogprob

# Bit i of mask word w is token 32 w + i; read as bytes (little-endian, as on every
# machine torch runs on), bit j of byte b is token 8 b + j.
_SHIFTS = torch.arange(8, dtype=torch.uint8)


def bit(i: int) -> torch.Tensor:
    """Bit i of an int32 mask word (bit 31 is the sign bit)."""
    return torch.tensor(1 << i if i < 31 else -(1 << 31), dtype=torch.int32)


def spellable(matcher: llguidance.LLMatcher, words: torch.Tensor, eos: Sequence[int]) -> bool:
    """Whether the mask `words` at the matcher's state allows a token the matcher takes.
    Where nothing can follow (the vocabulary has no piece for what the grammar requires
    next, and no byte fallback), llguidance allows token 0 alone rather than nothing: a
    single allowed token is tried (cheap: only a mask of one set bit is)."""
    nonzero = words.nonzero()
    if len(nonzero) != 1:
        return len(nonzero) > 0
    index = int(nonzero[0, 0])
    word = int(words[index]) & 0xFFFFFFFF
    if word & (word - 1):
        return True  # two or more bits in the one word
    token = 32 * index + word.bit_length() - 1
    return token in eos or matcher.validate_tokens([token]) == 1


def expand(words: torch.Tensor, width: int) -> torch.Tensor:
    """(..., W) int32 mask words → (..., width) bool, on the words' device; ids past the
    words' coverage are not allowed. Worked on as bytes: its temporaries take 2 bytes per
    vocabulary entry (the mask itself 1), not the 8 of int32 shifts."""
    shifts = _SHIFTS.to(words.device)
    data = words.contiguous().view(torch.uint8)  # (..., 4 W)
    bits = ((data[..., None] >> shifts) & 1).bool()  # (..., 4 W, 8)
    flat = bits.reshape(*words.shape[:-1], -1)  # (..., 32 W)
    if flat.shape[-1] >= width:
        return flat[..., :width]
    pad = torch.zeros(
        *flat.shape[:-1], width - flat.shape[-1], dtype=torch.bool, device=flat.device
    )
    return torch.cat((flat, pad), dim=-1)


def masked(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` (..., V) with what `words` (..., W) forbids at -inf."""
    allowed = expand(words.to(logits.device), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))


def mask_rows_(logits: torch.Tensor, words: torch.Tensor) -> None:
    """Mask (t, V) `logits` in place, one row at a time (no (t, V) temporary beside the
    pass's own logits: what the memory plan's draft pass holds)."""
    with torch.inference_mode():
        for i in range(logits.shape[0]):
            allowed = expand(words[i].to(logits.device), logits.shape[-1])
            logits[i].masked_fill_(~allowed, float("-inf"))


def forced_logprobs(tokens: Sequence[int], params: SamplingParams) -> list[TokenLogprob]:
    """Log-probabilities of forced tokens under the constrained distribution (one-hot:
    0, the token its own only alternative); none unless the request asked for them."""
    if params.logprobs is None:
        return []
    return [TokenLogprob(t, 0.0, [(t, 0.0)] if params.logprobs else []) for t in tokens]
