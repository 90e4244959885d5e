"""`Session`: one sequence's KV caches and the tokens they hold, kept across a
conversation's requests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from modeling.kv_cache import KVCache
from modeling.protocol import Model


class Session:
    """One sequence's state on the models: each model's KV cache and the token ids whose
    entries it holds. A conversation keeps its session so the next request prefills only
    what is new."""

    def __init__(self, target: Model, capacity: int, draft: Model | None = None):
        self.capacity = capacity
        self.target_cache: KVCache = target.new_cache(capacity)
        self.target_tokens: list[int] = []
        self.draft_cache: KVCache | None = draft.new_cache(capacity) if draft is not None else None
        self.draft_tokens: list[int] = []
        # How long a prefill pass may take now, and its fewest tokens, asked as each is cut
        # (speculative/prefill.py, `chunk_now`): None, its chunk whatever it costs. On a
        # CPU the runtime bounds it, and the engine bounds it more while others wait on
        # its passes. And the prompt tokens a second its prefill passes fed, measured.
        self.pass_bound: Callable[[], tuple[float, int] | None] = _unbounded
        self.prefill_rate = 0.0

    def fork(self) -> Session:
        """An independent session holding the same entries (each cache copied, its tokens
        with it): another sequence that starts from what this one has fed."""
        copy = Session.__new__(Session)
        copy.__dict__.update(self.__dict__)
        copy.target_cache = self.target_cache.clone()
        copy.target_tokens = list(self.target_tokens)
        copy.draft_cache = self.draft_cache.clone() if self.draft_cache is not None else None
        copy.draft_tokens = list(self.draft_tokens)
        copy.prefill_rate = 0.0
        return copy

    def reuse_prefix(self, prompt_ids: Sequence[int]) -> int:
        """Roll both caches back to their longest common prefix with `prompt_ids`, keeping at
        least the last prompt token unfed (it is the first round's root). Returns how many
        prompt tokens the target cache still holds."""
        limit = max(len(prompt_ids) - 1, 0)
        kept = _rewind(self.target_cache, common_prefix_len(self.target_tokens, prompt_ids, limit))
        del self.target_tokens[kept:]
        if self.draft_cache is not None:
            d = _rewind(self.draft_cache, common_prefix_len(self.draft_tokens, prompt_ids, limit))
            del self.draft_tokens[d:]
        return kept


def _unbounded() -> tuple[float, int] | None:
    return None


def _rewind(cache: KVCache, n: int) -> int:
    """Truncate to `n` entries, or to none where a window layer's ring no longer holds the
    window behind `n` (a conversation that went back far past its window: prefilled anew)."""
    n = n if cache.can_truncate(n) else 0
    cache.truncate(n)
    return n


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens `a` and `b` share, at most `limit` (None: no limit)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if (limit is not None and n >= limit) or x != y:
            break
        n += 1
    return n
