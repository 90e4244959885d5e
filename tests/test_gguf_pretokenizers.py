"""GGUF pre-tokenizer names (modeling/text/gguf_pretokenizers.py): every name llama.cpp
writes is known, each group splits as its regexes do and as the models' own tokenizers do,
and the real SmolLM2 file (`smollm`) gives its own tokenizer.json's ids. The tokenizer
builders and their other references: tests/test_gguf_tokenizer.py."""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from modeling.checkpoints.gguf_file import read_gguf
from modeling.text.gguf_pretokenizers import GROUPS, LINEAR_FORMS, NOT_BYTE_LEVEL, PRE_TOKENIZERS
from modeling.text.gguf_tokenizer import tokenizer_from_gguf
from tests.conftest import SHARED_MODELS
from tests.test_gguf_tokenizer import (
    BPE_TEXTS,
    TEXTS,
    _byte_level,
    _write_byte_level,
    train_byte_level,
    transformers_tokenizer,
)


@pytest.fixture(scope="module")
def transformers_gguf() -> Any:
    return transformers_tokenizer


@pytest.fixture(scope="module")
def byte_level_vocab() -> tuple[list[str], list[str]]:
    return train_byte_level()


SMOLLM2_DIR = SHARED_MODELS / "smollm2-135m-instruct"
SMOLLM2 = "smollm2-135m-instruct-q4_1.gguf"
# Multilingual, code and digit-heavy; the last two are where transformers' split parts from it.
SMOLLM2_TEXTS = [
    *TEXTS,
    "x = 1234567 + 89.01e-5; print(f'{x:,}')  # 2024-10-01\n\tdef f(a, b=3):\n\t\treturn a**2 // 7",
    "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n",
    "Grüße aus Köln — naïve café, 東京タワーは333メートル, Привет мир 42, 😀🎉 ok",
    "   100 000 000 $3.50 v1.2.3 0x1F 1/2 12:30pm 555-0100\r\n\r\n  end  ",
    "مرحبا ١٢٣ and ½ ² ③",
]


def test_smollm2_file_matches_its_own_tokenizer_and_transformers(transformers_gguf: Any) -> None:
    """SmolLM2's tokenizer.json cuts digits one by one (`Digits(individual_digits=True)`)
    before GPT-2's split, as llama.cpp's `smollm` does. transformers' GGUF path gives the name
    GPT-2's split alone: the vocabulary has no token of a space and a digit, so the two agree
    but where a digit follows two spaces or more (GPT-2's split leaves the last with the
    digit, the digits cut first leave it with the spaces) or a numeral outside ASCII (½, ١)
    follows a space (one token there, two here)."""
    ours = tokenizer_from_gguf(read_gguf(SMOLLM2_DIR / SMOLLM2).metadata, SMOLLM2)
    theirs = transformers_gguf(SMOLLM2_DIR, SMOLLM2)
    own = HFTokenizer.from_str(theirs.backend_tokenizer.to_str())
    own.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    for text in SMOLLM2_TEXTS:
        encoded = ours.encode(text)
        assert encoded == own.encode(text).ids, text
        assert (encoded == theirs.encode(text)) is (text not in SMOLLM2_TEXTS[-2:]), text
        if "<|" not in text:
            assert ours.decode(encoded) == text
    assert ours.encode("12") == [vocab := ours.vocabulary["1"], vocab + 1]  # no BOS: the file's
    assert (ours.bos_id, ours.eos_token_ids) == (
        1,
        (2, 0),
    )  # <|im_start|>; <|im_end|>, <|endoftext|>
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [2]


def test_every_name_llama_cpp_writes_is_known() -> None:
    """The 91 names of llama.cpp's llama-vocab.cpp (llama-cpp-python 0.3.36), and `gpt2`."""
    assert len(PRE_TOKENIZERS) + len(NOT_BYTE_LEVEL) == 92
    assert not set(PRE_TOKENIZERS) & set(NOT_BYTE_LEVEL)
    assert {split.group for split in PRE_TOKENIZERS.values()} == set(GROUPS)
    flagged = {name for name, split in PRE_TOKENIZERS.items() if split.ignore_merges}
    assert {"llama-bpe", "tekken", "glm4", "minicpm5"} <= flagged
    assert not flagged & {"qwen2", "smollm", "chatglm-bpe", "dbrx", "gpt-2"}
    with_bos = {name for name, split in PRE_TOKENIZERS.items() if split.add_bos}
    assert with_bos == {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"} | {
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "tekken",
        "chameleon",
    }


SPLIT_SAMPLE = (
    "x=1234567;  y = 3.14159\n\n\tif (a<=b) { return a+b; } // it's DON'T 2024-10-01  \r\n"
    "  héllo wörld!!! ...   中文テスト 한국어 Привет ١٢٣ ½ <sentinel:12> IMGIMGABZ 😀 end  "
)


def _isolated_splits(text: str, patterns: tuple[str, ...]) -> list[str]:
    """llama.cpp's rule, with the `regex` module: each pattern cuts every piece into its
    matches and the text between them; the pieces are then spelled as GPT-2's bytes."""
    import regex
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    pieces = [text]
    for pattern in patterns:
        compiled = regex.compile(pattern, regex.V1 if "&&" in pattern else 0)
        cut = []
        for piece in pieces:
            bounds = sorted(
                {0, len(piece)} | {i for m in compiled.finditer(piece) for i in m.span()}
            )
            cut += [piece[a:b] for a, b in itertools.pairwise(bounds) if b > a]
        pieces = cut
    spelling = bytes_to_unicode()
    return ["".join(spelling[b] for b in piece.encode()) for piece in pieces]


@pytest.mark.parametrize("group", GROUPS)
def test_each_group_splits_as_its_regexes(group: str) -> None:
    regexes, names = GROUPS[group]
    expected = _isolated_splits(SPLIT_SAMPLE, regexes)
    for name in names.split():
        split = PRE_TOKENIZERS[name].pre_tokenizer().pre_tokenize_str(SPLIT_SAMPLE)
        assert [piece for piece, _ in split] == expected, name


def _split(name: str, text: str) -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    pieces = PRE_TOKENIZERS[name].pre_tokenizer().pre_tokenize_str(text)
    return [bytes(byte_of[c] for c in piece).decode() for piece, _ in pieces]


def test_the_main_groups_split_as_their_models_do() -> None:
    """Written out by hand from each model's regex, for the digits and spaces they differ on."""
    text = "ab 12345 it's  x\n\n"
    assert _split("gpt-2", text) == ["ab", " 12345", " it", "'s", " ", " x", "\n\n"]
    assert _split("smollm", text) == ["ab", " ", *"12345", " it", "'s", " ", " x", "\n\n"]
    assert _split("llama-bpe", text) == ["ab", " ", "123", "45", " it", "'s", " ", " x", "\n\n"]
    assert _split("qwen2", text) == ["ab", " ", *"12345", " it", "'s", " ", " x", "\n\n"]
    assert _split("deepseek-v3", text) == ["ab", " ", "123", "45", " it", "'s", " ", " x", "\n\n"]
    assert _split("afmoe", "1234567 x") == ["1", "234", "567", " x"]
    assert _split("tiny_aya", "1234567 x") == ["1", "234", "567", " x"]
    assert _split("bloom", "ab, 12345 it's") == ["ab", ",", " 12345", " it's"]
    assert _split("kimi-k2", "ok中文ok") == ["ok", "中文", "ok"]


@pytest.mark.parametrize("pre", ["smollm", "deepseek-v3", "tekken", "bloom"])
def test_a_new_name_builds_and_round_trips(pre: str, byte_level_vocab: Any, tmp_path: Path) -> None:
    ids = {"bos": "<|begin_of_text|>"}
    ours = _byte_level(_write_byte_level(tmp_path / f"{pre}.gguf", byte_level_vocab, pre, ids))
    for text in BPE_TEXTS:
        if "<" not in text:
            assert ours.decode(ours.encode(text)) == text, text
    assert ours.add_bos is (pre == "tekken")


def test_a_name_that_is_not_byte_level_says_so(byte_level_vocab: Any, tmp_path: Path) -> None:
    path = _write_byte_level(tmp_path / "g4.gguf", byte_level_vocab, "gemma4")
    with pytest.raises(ValueError, match=r"g4\.gguf: tokenizer\.ggml\.pre 'gemma4' is .*raw UTF-8"):
        _byte_level(path)


@pytest.mark.parametrize("regex", list(LINEAR_FORMS))
def test_a_linear_form_cuts_as_its_regex(regex: str) -> None:
    """The splits run for a quadratic digit-grouping regex cut as it does: on 20,000 random
    texts of ASCII and other digits (Arabic-Indic, superscripts, fractions, numerals),
    letters, "_", spaces, CJK and punctuation, and after a first split of digit runs."""

    def pieces(splits: list[pre_tokenizers.PreTokenizer], text: str) -> list[str]:
        return [piece for piece, _ in pre_tokenizers.Sequence(splits).pre_tokenize_str(text)]

    original = [pre_tokenizers.Split(Regex(regex), "isolated")]
    linear = [pre_tokenizers.Split(Regex(r), b) for r, b in LINEAR_FORMS[regex]]  # type: ignore[arg-type]
    runs = [pre_tokenizers.Split(Regex(r"\p{N}+"), "isolated")]
    alphabet = [*"0123456789" * 4, *"٣٤½²Ⅻ", *"abcZ_ 東\n.,-"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 24)))
        assert pieces(linear, text) == pieces(original, text), text
        assert pieces(runs + linear, text) == pieces(runs + original, text), text


@pytest.mark.parametrize("name", ["afmoe", "tiny_aya", "superbpe"])
def test_a_long_digit_run_is_cut_in_linear_time(name: str) -> None:
    """131,072 digits (a 32k-token prompt's worth) took the quadratic regexes 18-120 s of a
    preparing thread; cut from the run's start they take a tenth of a second."""
    split = PRE_TOKENIZERS[name].pre_tokenizer()
    start = time.thread_time()
    pieces = split.pre_tokenize_str("7" * 131_072 + " x")
    assert time.thread_time() - start < 5  # (a bound: the quadratic form is past it)
    assert [p for p, _ in pieces[:3]] == ["77", "777", "777"]
