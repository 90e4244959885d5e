"""BPE merges derived from a sentencepiece vocabulary's scores (`merges_from_scores`): a
`llama` GGUF stores no merges, only each piece's score, and transformers builds its BPE from
every split of a piece into two pieces, ranked by the piece's score.

The derivation is a hostile file's cost: a piece is cut at every length some token has, so
its work grows with the vocabulary's text, and the merges it yields are bounded by limits
the caller gives (modeling/text/gguf_tokenizer.py's, with the file's other bounds). It stands
apart as pure work over strings and scores: no metadata keys, no `tokenizers` pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence


class TooManyMergesError(ValueError):
    """The vocabulary gives more merges, or more characters of them, than the limits allow."""


def merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], *, max_merges: int, max_text: int
) -> list[tuple[str, str]]:
    """BPE merges for a sentencepiece vocabulary: every split of a piece into two pieces,
    ranked by the whole piece's score, best first. Applying them lowest rank first is
    sentencepiece's (and llama.cpp's) rule: merge the adjacent pair whose union scores best.
    Equal scores: longer left part, then longer right part, then vocabulary order, as
    transformers' `generate_merges` orders them. More than `max_merges`, or `max_text`
    characters of them (both sides), is a TooManyMergesError, raised as soon as it is."""
    index = {token: i for i, token in enumerate(tokens)}
    # Only cuts where both parts have the length of some token can be merges: a real
    # vocabulary has a few dozen lengths, so most cuts of a long piece are never sliced.
    lengths = sorted({len(token) for token in tokens})
    present = set(lengths)
    ranked: list[tuple[float, int, int, str, str]] = []
    text = 0
    for piece, score in zip(tokens, scores, strict=True):
        found = len(ranked)
        for cut in lengths:
            if cut >= len(piece):
                break
            if len(piece) - cut not in present:
                continue
            left, right = index.get(piece[:cut]), index.get(piece[cut:])
            if left is not None and right is not None:  # the vocabulary's own strings
                ranked.append((-score, -cut, cut - len(piece), tokens[left], tokens[right]))
        text += (len(ranked) - found) * len(piece)
        if len(ranked) > max_merges or text > max_text:
            raise TooManyMergesError(f"over {max_merges:,} merges or {max_text:,} characters")
    ranked.sort(key=lambda merge: merge[:3])  # stable: vocabulary order within a tie
    return [(left, right) for *_, left, right in ranked]
