"""Prompt-lookup drafting: propose continuations by matching the last few tokens against
earlier context. No draft model, no weights: text that repeats itself (code, quotes, lists,
chat that echoes the question) is guessed for free.

All of n-gram drafting lives here: the lookup (`ngram_continuations`, `ngram_tree_prefixes`),
linear speculation's drafter (`NgramDrafter`) and tree speculation's tree (`ngram_tree`).

Losslessness does not depend on the guesses being good: a deterministic proposal is a
point mass q(t) = 1 for the proposed token, and rejection sampling against that q is exact.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from modeling.protocol import Model
from speculative.draft_tree import DraftTree, tree_from_continuations
from speculative.drafting import Proposal
from speculative.grammar import Constraint
from speculative.passes import Steps
from speculative.sampling import PenaltyContext, SamplingParams
from speculative.session import Session


def ngram_continuations(
    context: Sequence[int],
    *,
    max_ngram: int = 3,
    min_ngram: int = 1,
    max_len: int = 8,
    max_candidates: int = 8,
) -> list[list[int]]:
    """Continuations that followed earlier occurrences of the context's longest suffix
    n-gram (n from `max_ngram` down to `min_ngram`; the first n that occurs earlier wins).

    Returns up to `max_candidates` distinct continuations, each 1..`max_len` tokens, most
    frequent first (how many earlier occurrences were followed by exactly it), ties broken
    by recency (the latest occurrence first). Empty when nothing matches.
    """
    if max_len < 1 or max_candidates < 1 or min_ngram < 1 or max_ngram < min_ngram:
        return []
    ids = np.asarray(context, dtype=np.int64)  # (L,)
    n, starts = _longest_suffix_match(ids, max_ngram, min_ngram)
    if len(starts) == 0:
        return []
    counts: Counter[tuple[int, ...]] = Counter()
    latest: dict[tuple[int, ...], int] = {}
    for start in starts:  # most recent first
        begin = int(start) + n
        cont = tuple(ids[begin : begin + max_len].tolist())
        counts[cont] += 1
        latest.setdefault(cont, int(start))
    _merge_truncated(counts, latest, max_len)
    ranked = sorted(counts, key=lambda c: (-counts[c], -latest[c]))
    return [list(c) for c in ranked[:max_candidates]]


# Earlier occurrences an n-gram tree is built from: the most recent ones (a long context
# repeating a common n-gram has thousands; the recent ones predict best).
TREE_OCCURRENCES = 64


def ngram_tree_prefixes(
    context: Sequence[int], budget: int, *, max_ngram: int = 3, max_len: int = 8
) -> list[tuple[int, ...]]:
    """The `budget` best nodes of a prompt-lookup tree, as continuation prefixes in
    best-first order: a prefix's worth is how many of the earlier occurrences of the
    context's longest suffix n-gram were followed by it (its empirical probability), so
    the first levels follow what most often came next and deeper levels the continuation
    those agree on; ties go to the shorter, then the more recent. Parents come before
    their children (a child never occurs more often than its parent)."""
    if budget < 1 or max_len < 1:
        return []
    ids = np.asarray(context, dtype=np.int64)  # (L,)
    n, starts = _longest_suffix_match(ids, max_ngram, 1)
    if len(starts) == 0:
        return []
    counts: Counter[tuple[int, ...]] = Counter()
    latest: dict[tuple[int, ...], int] = {}
    for start in starts[:TREE_OCCURRENCES]:  # most recent first
        begin = int(start) + n
        cont = tuple(ids[begin : begin + max_len].tolist())
        for d in range(1, len(cont) + 1):
            counts[cont[:d]] += 1
            latest.setdefault(cont[:d], int(start))
    ranked = sorted(counts, key=lambda c: (-counts[c], len(c), -latest[c]))
    return ranked[:budget]


def ngram_tree(
    context: Sequence[int],
    budget: int,
    max_depth: int,
    *,
    max_ngram: int = 3,
    device: torch.device | str = "cpu",
) -> DraftTree:
    """Tree speculation's prompt-lookup tree: the root is the context's last token, and its
    nodes the `budget` best continuation prefixes (`ngram_tree_prefixes`), at most
    `max_depth` deep, as a trie."""
    found = ngram_tree_prefixes(context, budget, max_ngram=max_ngram, max_len=max_depth)
    return tree_from_continuations(context[-1], found, budget, max_depth, device)


def _longest_suffix_match(
    ids: np.ndarray, max_ngram: int, min_ngram: int
) -> tuple[int, np.ndarray]:
    """The length n of the longest suffix n-gram of `ids` (from `max_ngram` down to
    `min_ngram`) that occurs earlier, and where those earlier occurrences start, the most
    recent first; (0, no starts) when none does."""
    length = len(ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = ids[length - n :]  # (n,)
        # An occurrence starting at i must leave at least one token after it that is not
        # part of the suffix itself, so windows start in [0, L - n - 1].
        windows = sliding_window_view(ids[: length - 1], n)  # (L - n, n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts) > 0:
            return n, starts[::-1]
    return 0, np.empty(0, dtype=np.int64)


def _merge_truncated(
    counts: Counter[tuple[int, ...]], latest: dict[tuple[int, ...], int], max_len: int
) -> None:
    """Occurrences near the end of the context have continuations cut short by the end;
    in a repeating pattern those are prefixes of older, longer ones. Count them for the
    best longer continuation they begin, so a short cut-off guess does not outrank it."""
    for short in sorted((c for c in counts if len(c) < max_len), key=len):
        longer = [c for c in counts if len(c) > len(short) and c[: len(short)] == short]
        if longer:
            best = max(longer, key=lambda c: (counts[c], latest[c]))
            counts[best] += counts.pop(short)
            latest[best] = max(latest[best], latest.pop(short))


def ngram_proposal(context: Sequence[int], length: int, *, max_ngram: int = 3) -> list[int]:
    """One chain of up to `length` tokens for linear speculation: the best continuation."""
    found = ngram_continuations(context, max_ngram=max_ngram, max_len=length, max_candidates=1)
    return found[0] if found else []


class NgramDrafter:
    """Linear speculation's prompt lookup: the continuation that most often followed earlier
    occurrences of the sequence's suffix, the latest first among equals (`ngram_proposal`).
    Deterministic, so q is a point mass on each proposed token."""

    def __init__(self, vocab_size: int, max_ngram: int = 3) -> None:
        self.draft: Model | None = None
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram

    def new_session(self, target: Model, capacity: int) -> Session:
        return Session(target, capacity)

    def propose(
        self,
        session: Session,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        penalties: PenaltyContext,
        generator: torch.Generator,
        constraint: Constraint | None = None,
    ) -> Steps[Proposal]:
        t0 = time.perf_counter()
        tokens = ngram_proposal(sequence, k, max_ngram=self.max_ngram) if k > 0 else []
        if constraint is not None:  # a guess the grammar refuses could never be accepted
            tokens = tokens[: constraint.valid_prefix(tokens)]
        device = penalties.counts.device
        q = torch.nn.functional.one_hot(
            torch.tensor(tokens, dtype=torch.long, device=device), self.vocab_size
        ).float()  # (k, V)
        yield from ()  # step-wise like every drafter, though lookup requests no pass
        return Proposal(tokens, q, 0, time.perf_counter() - t0)

    def rollback(self, session: Session, committed: int) -> None:
        pass  # nothing is cached between rounds
