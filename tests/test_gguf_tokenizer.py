"""Tokenizers built from GGUF metadata (modeling/text/gguf_tokenizer.py) against the references
nobody here wrote: the ids stored beside llama.cpp's own GGUF files, the source folder's
tokenizer.json, transformers' GGUF tokenizer, and llama.cpp's SPM rule written out below."""

from __future__ import annotations

import heapq
import json
import random
import time
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from modeling.checkpoints.gguf_file import read_gguf
from modeling.text.gguf_merges import merges_from_scores
from modeling.text.gguf_tokenizer import (
    MAX_MERGES,
    MAX_MERGES_TEXT,
    GGUFTokenizerError,
    tokenizer_from_gguf,
)
from modeling.text.tokenizer import Tokenizer
from tests.conftest import SHARED_MODELS
from tests.test_model_stores import deadline

GGUF_DIR = SHARED_MODELS / "gguf"
GGUF_FILES = sorted(p.name for p in GGUF_DIR.glob("*.gguf"))

TEXTS = [
    "The little dog",
    "Once upon a time",
    "héllo wörld, naïve café 😀🎉 中文 ∑",
    " leading space",
    "trailing space ",
    "  two  spaces  and   three",
    "line\nbreak\n\n\nand\ttab",
    "digits 1234567 3.14159 2024-10-01",
    "it's what they'd've said, DON'T",
    "",
    " ",
]


def _spm(name: str) -> tuple[Tokenizer, dict[str, Any]]:
    fields = read_gguf(GGUF_DIR / name).metadata
    return tokenizer_from_gguf(fields, name), fields


def transformers_tokenizer(folder: Path, name: str) -> Any:
    """transformers' tokenizer for the GGUF file `folder / name`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def transformers_gguf() -> Any:
    return transformers_tokenizer


def test_metadata_equals_reader_contents() -> None:
    reader = gguf.GGUFReader(GGUF_DIR / "llama-rand-256-Q4_K_M.gguf")
    fields = read_gguf(GGUF_DIR / "llama-rand-256-Q4_K_M.gguf").metadata
    # (GGUFReader adds three keys of its own header, not metadata in the file.)
    own = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")
    assert fields == {n: f.contents() for n, f in reader.fields.items() if n not in own}
    assert (
        fields["tokenizer.ggml.tokens"][259] == "▁t" and fields["tokenizer.ggml.scores"][260] == -1
    )
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert len(GGUF_FILES) == 13  # the parametrized tests below see every shared file


@pytest.mark.parametrize("name", GGUF_FILES)
def test_spm_file_matches_reference_and_transformers(name: str, transformers_gguf: Any) -> None:
    ours, fields = _spm(name)
    reference = json.loads((GGUF_DIR / name.replace(".gguf", ".reference.json")).read_text())
    for item in reference["items"]:
        assert ours.encode(item["prompt"]) == item["prompt_ids"], item["prompt"]
    theirs = transformers_gguf(GGUF_DIR, name)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert (ours.bos_id, ours.add_bos, ours.eos_token_ids) == (1, True, (2,))
    assert ours.chat_template == fields.get("tokenizer.chat_template")
    assert ours.has_chat_template == name.startswith("llama-rand")


def test_spm_matches_the_source_folder_and_round_trips() -> None:
    ours, _ = _spm("stories260k-Q8_0.gguf")
    source = HFTokenizer.from_file(str(SHARED_MODELS / "stories260k" / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == source.encode(text).ids, text
        if not text.startswith(" "):  # the prepended ▁ and a leading space decode alike
            assert ours.decode(ids) == text
    assert ours.vocab_size == source.get_vocab_size() == 512


def _llama_cpp_spm(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's SPM tokenizer (llama-vocab.cpp, llm_tokenizer_spm_session) for text with no
    special tokens in it: a space prepended, spaces as ▁, then repeatedly merge the adjacent
    pair whose union is a piece with the best score, the leftmost on a tie; characters left
    without a piece become their bytes."""
    symbols: list[str | None] = list(("▁" + text).replace(" ", "▁"))
    queue: list[tuple[float, int, int, str]] = []

    def push(left: int, right: int) -> None:
        joined = f"{symbols[left]}{symbols[right]}" if 0 <= left < right < len(symbols) else ""
        if joined in vocab:
            heapq.heappush(queue, (-scores[vocab[joined]], left, right, joined))

    def neighbour(i: int, step: int) -> int:
        i += step
        while 0 <= i < len(symbols) and symbols[i] is None:
            i += step
        return i

    for i in range(1, len(symbols)):
        push(i - 1, i)
    while queue:
        _, left, right, joined = heapq.heappop(queue)
        if symbols[left] is None or symbols[right] is None:
            continue
        if f"{symbols[left]}{symbols[right]}" != joined:
            continue
        symbols[left], symbols[right] = joined, None
        push(neighbour(left, -1), left)
        push(left, neighbour(left, +1))
    ids: list[int] = []
    for piece in filter(None, symbols):
        if piece in vocab:
            ids.append(vocab[piece])
        else:
            ids += [vocab[f"<0x{byte:02X}>"] for byte in piece.encode()]
    return ids


def test_spm_agrees_with_llama_cpp_except_on_leading_space() -> None:
    """The docstring's claim: llama.cpp's rule gives our ids, "The little dog" included, on
    every text but those that start with a space, where it prepends one more ▁."""
    ours, fields = _spm("stories260k-F16.gguf")
    tokens = fields["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    for text in TEXTS:
        theirs = _llama_cpp_spm(text, vocab, fields["tokenizer.ggml.scores"])
        mine = ours.encode(text, add_special_tokens=False)
        if text.startswith(" "):
            assert theirs == [vocab["▁"], *mine], text
        elif text:
            assert theirs == mine, text
    assert ours.encode("The little dog") == [1, 291, 376, 400, 428]


def test_merge_ranks_break_score_ties_as_transformers_does() -> None:
    """The shared vocabulary's scores never tie; coarsened to tens they do, often."""
    from transformers.tokenization_utils_base import generate_merges

    _, fields = _spm("stories260k-F16.gguf")
    tokens = fields["tokenizer.ggml.tokens"]
    scores = [score // 10 for score in fields["tokenizer.ggml.scores"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    expected = generate_merges(vocab, dict(zip(tokens, scores, strict=True)))
    merges = merges_from_scores(tokens, scores, max_merges=MAX_MERGES, max_text=MAX_MERGES_TEXT)
    assert merges == expected


def test_spm_variants() -> None:
    """Special tokens inside text; no space prefix; EOS appended; a file without token types
    (older converters), whose BOS/EOS/UNK are still matched whole."""
    _, fields = _spm("stories260k-F16.gguf")
    default = tokenizer_from_gguf(fields, "a.gguf")
    # After a special token no ▁ is prepended (llama.cpp would: <s> ▁Hi).
    assert default.encode("Hi</s>there", add_special_tokens=False) == [320, 417, 2, 413, 260, 276]
    untyped = {k: v for k, v in fields.items() if k != "tokenizer.ggml.token_type"}
    untyped_ids = tokenizer_from_gguf(untyped, "u.gguf").encode("a</s>b<unk>c<s>")
    assert untyped_ids == default.encode("a</s>b<unk>c<s>") == [1, 261, 2, 430, 0, 429, 1]
    bare = tokenizer_from_gguf({**fields, "tokenizer.ggml.add_space_prefix": False}, "b.gguf")
    assert bare.encode(" Once upon") == default.encode("Once upon")
    assert bare.encode("Once") != default.encode("Once")
    assert bare.decode(bare.encode(" Once upon")) == " Once upon"
    with_eos = tokenizer_from_gguf({**fields, "tokenizer.ggml.add_eos_token": True}, "c.gguf")
    assert with_eos.encode("Once") == [*default.encode("Once"), 2]
    assert with_eos.encode("Once", add_special_tokens=False) == default.encode("Once")[1:]


CODE_AND_DIGITS = [
    "def f(x):\n    return [i**2 for i in range(x) if i % 2 == 0]  # squares\n\tprint(x)",
    "3.14159 2.71828 1,234,567 0x1F 1e-9 $12.50 2024-10-01T12:00:00Z",
    "a    b\n  c",
]


@pytest.mark.parametrize("architecture", ["gemma3", "phi3", "llama"])
def test_spm_shapes_by_architecture_match_transformers(
    architecture: str, tmp_path: Path, transformers_gguf: Any
) -> None:
    """The stories vocabulary written under each architecture whose SentencePiece shape
    differs (modeling/text/gguf_spm.py), with runs of spaces stored as spaces and the
    normal pieces' scores shuffled: Gemma ranks merges by position, not by those scores,
    and prefixes nothing; Phi-3 prefixes every stretch between special tokens."""
    _, fields = _spm("stories260k-F16.gguf")
    tokens = [*fields["tokenizer.ggml.tokens"], "  ", "   "]
    types = [*fields["tokenizer.ggml.token_type"], 4, 4]
    scores = [*fields["tokenizer.ggml.scores"], -1000.0, -1000.0]
    normal = [i for i, kind in enumerate(types) if kind == 1]
    shuffled = [scores[i] for i in normal]
    random.Random(0).shuffle(shuffled)
    for i, score in zip(normal, shuffled, strict=True):
        scores[i] = score
    path = tmp_path / f"{architecture}.gguf"
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(architecture != "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = tokenizer_from_gguf(read_gguf(path).metadata, path.name)
    theirs = transformers_gguf(tmp_path, path.name)
    by_score = tokenizer_from_gguf(
        {**read_gguf(path).metadata, "general.architecture": "llama"}, "l"
    )
    differs = False
    for text in [*TEXTS, *CODE_AND_DIGITS, "Hi</s>there<s> again"]:
        encoded = ours.encode(text)
        assert encoded == theirs.encode(text), text
        assert ours.decode(encoded) == theirs.decode(encoded, skip_special_tokens=True), text
        differs |= encoded != by_score.encode(text)
    assert differs == (architecture != "llama")  # each shape shows on these texts


# --- byte-level BPE (`gpt2`), written into GGUF files here -------------------------------

SPECIALS = {  # token -> GGUF token type: 3 control, 4 user-defined
    "<|begin_of_text|>": 3,
    "<|endoftext|>": 3,
    "<|eot_id|>": 3,
    "<|im_end|>": 3,
    "<｜end▁of▁sentence｜>": 3,  # not in the byte alphabet: written as text, matched whole
    "<think>": 4,
}
BPE_TEXTS = [
    *TEXTS,
    "Hello<|eot_id|>world<|im_end|>\n<think>hmm</think>",
    "a<｜end▁of▁sentence｜>b",
]


@pytest.fixture(scope="module")
def byte_level_vocab() -> tuple[list[str], list[str]]:
    return train_byte_level()


def train_byte_level() -> tuple[list[str], list[str]]:
    """A small byte-level BPE trained on the shared GGUF folder's README (text that does
    not change with our commits): tokens in id order, merges."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([(GGUF_DIR / "README.md").read_text()], trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].__getitem__)
    return tokens, [" ".join(merge) for merge in model["merges"]]


def _write_byte_level(
    path: Path,
    vocab: tuple[list[str], list[str]],
    pre: str,
    ids: dict[str, str] | None = None,
    add_bos: bool | None = None,
    extra_tokens: tuple[str, ...] = (),
) -> Path:
    """A GGUF with only tokenizer metadata; `ids` names special ids by token, as
    {"bos": "<|begin_of_text|>"} for tokenizer.ggml.bos_token_id."""
    tokens, merges = vocab
    tokens = [*tokens, *SPECIALS, *extra_tokens]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([SPECIALS.get(token, 1) for token in tokens])
    writer.add_token_merges(merges)
    for name, token in (ids or {}).items():
        getattr(writer, f"add_{name}_token_id")(tokens.index(token))
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _byte_level(path: Path) -> Tokenizer:
    return tokenizer_from_gguf(read_gguf(path).metadata, path.name)


L3_IDS = {"bos": "<|begin_of_text|>", "eos": "<|endoftext|>", "eot": "<|eot_id|>"}


@pytest.mark.parametrize(
    ("pre", "ids", "add_bos"),
    [
        ("llama-bpe", L3_IDS, True),
        ("qwen2", {"eos": "<|im_end|>", "pad": "<|endoftext|>"}, False),
        ("default", {"bos": "<|endoftext|>", "eos": "<|endoftext|>"}, None),
    ],
)
def test_byte_level_matches_transformers(
    pre: str,
    ids: dict[str, str],
    add_bos: bool | None,
    byte_level_vocab: Any,
    tmp_path: Path,
    transformers_gguf: Any,
) -> None:
    path = _write_byte_level(tmp_path / f"{pre}.gguf", byte_level_vocab, pre, ids, add_bos)
    ours = _byte_level(path)
    theirs = transformers_gguf(tmp_path, path.name)
    for text in BPE_TEXTS:
        if "｜" in text:
            continue  # transformers cuts that token into bytes (see the next test)
        encoded = ours.encode(text)
        assert encoded == theirs.encode(text), text
        assert ours.decode(encoded) == theirs.decode(encoded, skip_special_tokens=True), text
        assert ours.decode(encoded, skip_special_tokens=False) == theirs.decode(encoded), text
        if "<" not in text:
            assert ours.decode(encoded) == text
    assert ours.add_bos is bool(add_bos)
    assert ours.chat_template == "{{ messages[0]['content'] }}"


def test_byte_level_special_tokens_and_end_of_turn(byte_level_vocab: Any, tmp_path: Path) -> None:
    ids = {"bos": "<|begin_of_text|>", "eot": "<|eot_id|>"}
    ours = _byte_level(_write_byte_level(tmp_path / "l3.gguf", byte_level_vocab, "llama-bpe", ids))
    vocab = ours.vocabulary
    for token in SPECIALS:
        encoded = ours.encode(f"x{token}y", add_special_tokens=False)
        assert vocab[token] in encoded and len(encoded) == 3, token
        assert ours.decode(encoded, skip_special_tokens=False) == f"x{token}y"
    assert ours.decode(ours.encode("x<think>y")) == "x<think>y"  # user-defined: not special
    assert ours.decode(ours.encode("x<|eot_id|>y")) == "xy"
    # llama-bpe without add_bos_token: BOS, as llama.cpp does (transformers adds none); once.
    assert ours.encode("hi")[0] == vocab["<|begin_of_text|>"] == ours.bos_id
    assert ours.encode("<|begin_of_text|>hi") == ours.encode("hi")
    # No eos key: EOT, then the end-of-turn tokens llama.cpp knows by name.
    names = ["<|eot_id|>", "<|endoftext|>", "<|im_end|>"]
    assert ours.eos_token_ids == tuple(vocab[n] for n in names)
    assert ours.eos_token is None and ours.vocab_size == len(byte_level_vocab[0]) + len(SPECIALS)


def test_llama_bpe_takes_a_whole_word_its_merges_cannot_reach(
    byte_level_vocab: Any, tmp_path: Path
) -> None:
    """Meta's tokenizer.json and llama.cpp both set ignore_merges for Llama 3; Qwen2 does not."""
    for pre in ("llama-bpe", "qwen2"):
        path = tmp_path / f"{pre}.gguf"
        ours = _byte_level(
            _write_byte_level(path, byte_level_vocab, pre, extra_tokens=("Ġxyzzyq",))
        )
        encoded = ours.encode(" xyzzyq", add_special_tokens=False)
        assert (encoded == [ours.vocabulary["Ġxyzzyq"]]) is (pre == "llama-bpe"), pre
        assert ours.decode(encoded) == " xyzzyq"


# --- bad metadata ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.model": "rwkv"}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.scores": None}, "tokenizer.ggml.scores"),
        ({"tokenizer.ggml.scores": [0.0]}, "tokenizer.ggml.scores"),
        ({"tokenizer.ggml.token_type": [1, 2]}, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.bos_token_id": 512}, "tokenizer.ggml.bos_token_id"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gemma4"}, "tokenizer.ggml.pre"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}, "tokenizer.ggml.merges"),
    ],
)
def test_bad_metadata_names_the_key_and_the_file(change: dict[str, Any], key: str) -> None:
    _, fields = _spm("stories260k-F16.gguf")
    fields = {k: v for k, v in {**fields, **change}.items() if v is not None}
    with pytest.raises(GGUFTokenizerError, match=rf"^broken\.gguf: {key}") as raised:
        tokenizer_from_gguf(fields, "broken.gguf")
    assert isinstance(raised.value, ValueError)


def test_unknown_pre_in_a_written_file(byte_level_vocab: Any, tmp_path: Path) -> None:
    path = _write_byte_level(tmp_path / "odd.gguf", byte_level_vocab, "made-up-pre")
    with pytest.raises(ValueError, match=r"odd\.gguf: tokenizer\.ggml\.pre 'made-up-pre'"):
        _byte_level(path)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"tokenizer.ggml.tokens": [1, 2, 3]}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.tokens": [""] * 512}, "tokenizer.ggml.tokens"),  # (a text: 0 tokens)
        ({"tokenizer.ggml.scores": ["0.5"] * 512}, "tokenizer.ggml.scores"),
        ({"tokenizer.ggml.scores": "scores"}, "tokenizer.ggml.scores"),
        ({"tokenizer.ggml.token_type": ["1"] * 512}, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.token_type": [1.0] * 512}, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.bos_token_id": -1}, "tokenizer.ggml.bos_token_id"),
        ({"tokenizer.ggml.eos_token_id": "2"}, "tokenizer.ggml.eos_token_id"),
        ({"tokenizer.ggml.eos_token_id": True}, "tokenizer.ggml.eos_token_id"),
        ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token"),
        ({"tokenizer.chat_template": 5}, "tokenizer.chat_template"),
        ({"tokenizer.chat_template": ["{{ x }}"]}, "tokenizer.chat_template"),
        ({"tokenizer.ggml.model": ["llama"] * 10**6}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": ["x"]}, "tokenizer.ggml.pre"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_key_and_the_file(
    change: dict[str, Any], key: str
) -> None:
    """Issue 32: each was a traceback (or went on to fail later) before."""
    _, fields = _spm("stories260k-F16.gguf")
    with pytest.raises(GGUFTokenizerError, match=rf"^broken\.gguf: {key} ") as raised:
        tokenizer_from_gguf({**fields, **change}, "broken.gguf")
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 300


def test_a_huge_token_is_refused_before_the_merges_are_derived() -> None:
    """One 300,000-character piece made deriving the merges quadratic (no answer in 60 s).
    The bound is far above any real token, and a piece at the bound builds in no time."""
    from modeling.text import gguf_tokenizer

    _, fields = _spm("stories260k-F16.gguf")
    tokens = list(fields["tokenizer.ggml.tokens"])
    tokens[300] = "▁" + "a" * 299_999
    start = time.perf_counter()
    with deadline(10), pytest.raises(GGUFTokenizerError) as raised:
        tokenizer_from_gguf({**fields, "tokenizer.ggml.tokens": tokens}, "long.gguf")
    assert time.perf_counter() - start < 1
    assert str(raised.value).startswith(
        "long.gguf: tokenizer.ggml.tokens[300] is 300,000 characters long ('▁aaaa"
    )
    assert f"specd reads tokens of at most {gguf_tokenizer.MAX_PIECE_LENGTH:,}" in str(raised.value)
    tokens[300] = "▁" + "a" * (gguf_tokenizer.MAX_PIECE_LENGTH - 1)
    start = time.perf_counter()
    built = tokenizer_from_gguf({**fields, "tokenizer.ggml.tokens": tokens}, "ok.gguf")
    assert time.perf_counter() - start < 2
    assert built.decode(built.encode("Once upon a time")) == "Once upon a time"


def test_the_vocabulary_and_its_merges_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounds on a vocabulary's tokens, its text and its merges (derived from a `llama`
    file's scores, or a `gpt2` file's), each refused in one line naming the key."""
    from modeling.text import gguf_tokenizer, tokenizer_file

    _, fields = _spm("stories260k-F16.gguf")
    for module, bound, value, expected in [
        # (the vocabulary's own bounds are a tokenizer.json's too: tokenizer_file's)
        (tokenizer_file, "MAX_VOCABULARY", 511, "tokenizer.ggml.tokens has 512 tokens; specd re"),
        (tokenizer_file, "MAX_VOCABULARY_TEXT", 1000, "tokenizer.ggml.tokens holds 2,"),
        (gguf_tokenizer, "MAX_MERGES", 100, "tokenizer.ggml.tokens give over 100 merges"),
        (gguf_tokenizer, "MAX_MERGES_TEXT", 400, "tokenizer.ggml.tokens give over .* or 400 ch"),
        # its control tokens, matched whole in any text (<unk>, <s>, </s>: 10 bytes)
        (gguf_tokenizer, "MAX_ADDED_BYTES", 9, "tokenizer.ggml.token_type makes 3 tokens cont"),
    ]:
        with monkeypatch.context() as patch:
            patch.setattr(module, bound, value)
            with pytest.raises(GGUFTokenizerError, match=rf"^spm\.gguf: {expected}"):
                tokenizer_from_gguf(fields, "spm.gguf")
    byte_level = {
        **fields,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.merges": ["▁ t", "h e"] * 60,
    }
    monkeypatch.setattr(gguf_tokenizer, "MAX_MERGES", 100)
    with pytest.raises(GGUFTokenizerError, match=r"^bpe\.gguf: tokenizer\.ggml\.merges has 120"):
        tokenizer_from_gguf(byte_level, "bpe.gguf")


def test_a_template_that_does_not_compile_names_the_file_and_the_key() -> None:
    from modeling.text.model_template import ChatTemplateError

    _, fields = _spm("stories260k-F16.gguf")
    broken = {**fields, "tokenizer.chat_template": "{% if %}"}
    with pytest.raises(ChatTemplateError) as raised:
        tokenizer_from_gguf(broken, "tmpl.gguf")
    assert str(raised.value).startswith(
        "tmpl.gguf: tokenizer.chat_template, the model's chat template, does not compile: "
    )


def test_a_merge_longer_than_a_token_is_refused_in_a_short_line(
    byte_level_vocab: Any, tmp_path: Path
) -> None:
    """A merge whose halves make a token past the token bound (a megabyte's) was quoted
    whole by the `tokenizers` library's refusal: a one-line error of a megabyte."""
    path = _write_byte_level(tmp_path / "ok.gguf", byte_level_vocab, "qwen2")
    fields = read_gguf(path).metadata
    merges = ["a" * 1_000_000 + " b", *fields["tokenizer.ggml.merges"]]
    with pytest.raises(GGUFTokenizerError) as raised:
        tokenizer_from_gguf({**fields, "tokenizer.ggml.merges": merges}, "long-merge.gguf")
    said = str(raised.value)
    assert said.startswith("long-merge.gguf: tokenizer.ggml.merges has a merge of 1,000,001")
    assert len(said) < 300 and "\n" not in said


def test_merges_of_tokens_not_in_the_vocabulary_are_one_line(
    byte_level_vocab: Any, tmp_path: Path
) -> None:
    """The `tokenizers` library refuses them with a bare Exception: it is named as the
    file's fault, with what the library said."""
    path = _write_byte_level(tmp_path / "ok.gguf", byte_level_vocab, "qwen2")
    fields = read_gguf(path).metadata
    broken = {**fields, "tokenizer.ggml.merges": ["zzz qqq", *fields["tokenizer.ggml.merges"]]}
    with pytest.raises(GGUFTokenizerError) as raised:
        tokenizer_from_gguf(broken, "bad-merges.gguf")
    message = str(raised.value)
    assert message.startswith("bad-merges.gguf: the tokenizer.ggml.* keys do not make")
    assert "out of vocabulary" in message and "\n" not in message
