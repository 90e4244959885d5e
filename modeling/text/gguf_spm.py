"""A `llama` (SentencePiece) GGUF vocabulary as a `tokenizers` pipeline, in the three shapes
the files need (`sentencepiece`): BPE over the pieces, merge ranks from the pieces' order,
byte fallback (`<0xNN>`) for characters with no piece, spaces as `▁`, and a decoder that
undoes all three. Which shape is the file's `general.architecture`, as transformers picks
it (`integrations/gguf/gguf_tokenizer_mapping.py`, transformers 5.24), since nothing in
the tokenizer keys says:

- most files (Llama 2, Mistral, TinyLlama, the stories models): `Metaspace`, one `▁`
  prepended to a text that does not start with a space (unless `add_space_prefix` is
  false), merges ranked by each piece's score;
- `phi3`: the prefix from a normalizer, as Phi-3's own tokenizer.json has it, so every
  stretch of text between special tokens gets its `▁`, even one that starts with a space
  ("  hi" is ▁▁▁hi; llama.cpp prepends there too);
- `gemma`, `gemma2`, `gemma3`: no prefix at all, merges ranked by the pieces' position in
  the file (Gemma's scores tie in blocks and do not give its merge order), and the runs of
  spaces the converter stored as real spaces ("  ", user-defined tokens 138-167 of Gemma
  3's 262,144) spelled `▁▁` as the pieces are; those are then found by the BPE, not
  matched whole as user-defined tokens (transformers' choice, and what Gemma's
  tokenizer.json does).

Where llama.cpp tokenizes an SPM text differently we follow transformers, which the rest of
specd and its references are checked against. llama.cpp's SPM rule (merge the adjacent pair
whose union is the best-scoring piece, the leftmost on a tie) is this BPE, so most texts
agree, "The little dog" included (▁The ▁little ▁do g from both; tests/test_gguf_tokenizer.py
writes llama.cpp's rule out). They part on the prefix space of the first shape: llama.cpp
prepends one to every stretch of text that starts the prompt or follows a special token,
even a stretch that starts with a space, where Metaspace prepends only to a text that does
not start with one, and only at its start: " lead" is ▁▁lead there and ▁lead here, "<s>Hi"
is <s> ▁Hi there and <s> Hi here. On score ties between different pieces the merge rank
decides here, the position there.

Deriving the merges costs a piece's length squared (each cut of it is looked up;
modeling/text/gguf_merges.py); the caller has bounded the pieces and their text.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from modeling.text.gguf_merges import merges_from_scores

GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})
PREFIX_NORMALIZER_ARCHITECTURES = frozenset({"phi3"})


def spelled_pieces(tokens: Sequence[str], architecture: str | None) -> list[str]:
    """The pieces as the BPE looks them up: a Gemma file's whitespace-only tokens that hold
    a space respelled as that many `▁`; every other file's as stored."""
    if architecture not in GEMMA_ARCHITECTURES:
        return list(tokens)
    return ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]


def sentencepiece(
    pieces: Sequence[str],
    scores: Sequence[float],
    unknown: int | None,
    add_space_prefix: bool,
    architecture: str | None,
    max_merges: int,
    max_text: int,
) -> HFTokenizer:
    """The pipeline for `pieces` (`spelled_pieces`' spelling) and their `scores`; `unknown`
    the unknown piece's id. A TooManyMergesError for a vocabulary whose merges pass
    `max_merges` or `max_text` characters."""
    gemma = architecture in GEMMA_ARCHITECTURES
    # Gemma ranks by position: later pieces merge later, whatever their scores say.
    ranks = [-float(i) for i in range(len(pieces))] if gemma else scores
    merges = merges_from_scores(pieces, ranks, max_merges=max_merges, max_text=max_text)
    backend = HFTokenizer(
        models.BPE(
            vocab={piece: i for i, piece in enumerate(pieces)},
            merges=merges,
            unk_token=pieces[unknown] if unknown is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
        # (a split on spaces, as GemmaTokenizer has: none are left after the normalizer)
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(" "), "merged_with_previous")
    elif architecture in PREFIX_NORMALIZER_ARCHITECTURES:
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁")] * add_space_prefix + [normalizers.Replace(" ", "▁")]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
        )
    if add_space_prefix and not gemma:
        steps.append(decoders.Strip(" ", 1, 0))  # the space prepended
    backend.decoder = decoders.Sequence(steps)
    return backend
