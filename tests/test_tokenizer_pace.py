"""The pace check on tokenizer.json (modeling/text/tokenizer_file.py): every pre-tokenizer
regex real models ship passes it with SmolLM2's real byte-level vocabulary and merges, and
a file is paced once a process. The hostile regexes it refuses are in
tests/test_hostile_folders.py."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from modeling.checkpoints.folder_files import CheckpointError
from modeling.checkpoints.gguf_file import read_gguf
from modeling.text import gguf_pretokenizers, tokenizer_file, tokenizer_pace
from modeling.text.gguf_pretokenizers import GROUPS, PRE_TOKENIZERS
from modeling.text.gguf_tokenizer import tokenizer_from_gguf
from tests.conftest import SHARED_MODELS

SMOLLM2 = SHARED_MODELS / "smollm2-135m-instruct" / "smollm2-135m-instruct-q4_1.gguf"
REAL = [
    "GPT2", "LLAMA3", "QWEN2", "QWEN35", "TEKKEN", "GPT4O", "KIMI_K2", "DEEPSEEK3", "SPARK",
    "BLOOM", "JAIS2", "YOUTU", "YOUTU_WORDS",
]  # fmt: skip


@pytest.fixture(scope="module")
def byte_level() -> dict[str, Any]:
    """SmolLM2's tokenizer (49,152 tokens, its merges) as a tokenizer.json."""
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} is not here")
    tokenizer = tokenizer_from_gguf(read_gguf(SMOLLM2).metadata, str(SMOLLM2))
    return json.loads(tokenizer.backend.to_str())


def _with_regex(spec: dict[str, Any], regex: str, folder: Path) -> Path:
    file = folder / "tokenizer.json"
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    byte_level["use_regex"] = False
    pre = {"type": "Sequence", "pretokenizers": [split, byte_level]}
    file.write_text(json.dumps({**spec, "pre_tokenizer": pre}))
    return file


@pytest.mark.parametrize("name", REAL)
def test_every_real_pre_tokenizer_regex_is_paced_and_passes(
    name: str, byte_level: dict[str, Any], tmp_path: Path
) -> None:
    file = _with_regex(byte_level, getattr(gguf_pretokenizers, name), tmp_path)
    backend = tokenizer_file.read_backend(file)
    assert backend.encode("Hello world").tokens == ["Hello", "Ġworld"]


def test_a_file_is_paced_once_a_process(
    byte_level: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = _with_regex(byte_level, gguf_pretokenizers.LLAMA3 + "|zz", tmp_path)
    timed: list[str] = []
    real = tokenizer_pace._timed

    def spy(backend: Any, probe: str, file: Path, tries: int = 1) -> float:
        timed.append(probe)
        return real(backend, probe, file, tries)

    monkeypatch.setattr(tokenizer_pace, "_timed", spy)
    tokenizer_file.read_backend(file)
    probes = len(tokenizer_pace._probes(64))
    assert len(timed) >= probes * len(tokenizer_pace.RUNGS)
    again = len(timed)
    tokenizer_file.read_backend(file)
    assert len(timed) == again  # the same text: not paced again
    file.write_text(file.read_text().replace("|zz", "|zy"))
    tokenizer_file.read_backend(file)
    assert len(timed) > again  # another text is


def test_the_same_text_read_twice_is_built_once(byte_level: dict[str, Any], tmp_path: Path) -> None:
    """A start reads the target's tokenizer.json twice (`--draft auto`, then the load): the
    second read of the same text returns what the first built; another text is built."""
    file = _with_regex(byte_level, gguf_pretokenizers.GPT2, tmp_path)
    first = tokenizer_file.read_backend(file)
    assert tokenizer_file.read_backend(file) is first
    file.write_text(file.read_text().replace('"use_regex": false', '"use_regex": true'))
    assert tokenizer_file.read_backend(file) is not first


def test_a_model_that_refuses_unknown_words_is_paced_and_loads(tmp_path: Path) -> None:
    """A WordLevel vocabulary without its unknown token refuses the probes' words (a plain
    Exception from the library): as before the pace check, the file loads and only a text
    holding such a word fails. The normalizer and pre-tokenizer that ran are timed."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    words = ["the", "quick", "brown", "fox", "jumped", "over", "lazy", "dogs"]
    built = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    built.pre_tokenizer = pre_tokenizers.Whitespace()
    file = tmp_path / "tokenizer.json"
    file.write_text(built.to_str())
    assert tokenizer_file.read_backend(file).encode("the lazy fox").ids == [0, 6, 3]


def _cuts_as_the_gguf_pre_tokenizer(
    spec: dict[str, Any], splits: list[tuple[str, str]], name: str, folder: Path
) -> None:
    """A tokenizer.json of `spec` whose pre-tokenizer is `splits` (regex, behavior) then
    ByteLevel loads, and cuts digits as the GGUF pre-tokenizer `name` does."""
    steps: list[dict[str, Any]] = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": b, "invert": False}
        for r, b in splits
    ]
    steps.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True})
    steps[-1]["use_regex"] = False
    file = folder / "tokenizer.json"
    file.write_text(
        json.dumps({**spec, "pre_tokenizer": {"type": "Sequence", "pretokenizers": steps}})
    )
    backend = tokenizer_file.read_backend(file)
    text = "In 1234567 ways, 89 x" + "7" * 20
    ours = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    assert ours == [p for p, _ in PRE_TOKENIZERS[name].pre_tokenizer().pre_tokenize_str(text)]


@pytest.mark.parametrize(
    ("name", "group"),
    [("afmoe", "afmoe"), ("superbpe", "superbpe"), ("tiny_aya", "digit groups, then gpt-4o")],
)
def test_a_digit_grouping_regex_in_a_tokenizer_json_runs_linear(
    name: str, group: str, byte_level: dict[str, Any], tmp_path: Path
) -> None:
    """llama.cpp's quadratic digit groupings written in a tokenizer.json (as the models'
    own files have them) run in their linear forms: the pace check passes them (superbpe's
    projected 52 s as written), and they cut as the GGUF pre-tokenizer does."""
    splits = [(r, "Isolated") for r in GROUPS[group][0]]
    _cuts_as_the_gguf_pre_tokenizer(byte_level, splits, name, tmp_path)


def test_a_file_of_too_many_values_is_refused_before_it_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python's JSON parser takes some 60 bytes a value: 64 MB of "[]," took 2 GB before the
    library refused the file. Values are counted by commas and brackets first."""
    file = tmp_path / "tokenizer.json"
    file.write_text("[" + "[]," * 1_000 + "[]]")
    monkeypatch.setattr(tokenizer_file, "MAX_JSON_VALUES", 1_500)
    parsed: list[str] = []
    monkeypatch.setattr(tokenizer_file.json, "loads", parsed.append)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: holds about 2,002 values; specd"):
        tokenizer_file.read_backend(file)
    assert not parsed


def test_a_wordpiece_model_splits_words_of_at_most_256_characters(tmp_path: Path) -> None:
    """WordPiece's greedy longest match costs a word's length cubed (8,192 characters of
    one word took 11 s); real files split words of up to 100 and call longer ones unknown."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    for longest, refused in ((100, False), (256, False), (10**9, True)):
        vocab = {"[UNK]": 0, "b": 1, "##b": 2}
        built = HFTokenizer(models.WordPiece(vocab, max_input_chars_per_word=longest))
        built.pre_tokenizer = pre_tokenizers.Whitespace()
        file = tmp_path / f"{longest}" / "tokenizer.json"
        file.parent.mkdir()
        file.write_text(built.to_str())
        if refused:
            with pytest.raises(CheckpointError, match="max_input_chars_per_word is 1,000,000,000"):
                tokenizer_file.read_backend(file)
        else:
            assert tokenizer_file.read_backend(file).encode("bbb").ids == [1, 2, 2]


@pytest.mark.parametrize("behavior", ["Isolated", "MergedWithPrevious", "Removed"])
def test_superbpes_zero_width_split_runs_linear_whatever_its_behavior(
    behavior: str, byte_level: dict[str, Any], tmp_path: Path
) -> None:
    """A regex that matches only a place to cut cuts the same pieces whatever the split's
    behavior: superbpe's in any of them runs in its linear form (it was refused)."""
    first, cut = GROUPS["superbpe"][0]
    splits = [(first, "Isolated"), (cut, behavior)]
    _cuts_as_the_gguf_pre_tokenizer(byte_level, splits, "superbpe", tmp_path)


@pytest.mark.parametrize(
    ("regex", "units"),
    [
        (gguf_pretokenizers.GPT2, ["'", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]),
        ("[<|]+[^<|]", ["<", "|"]),
        (r"\<\|+", ["<", "|", "<|"]),
        (r"\x3c+|\x{7e}+|\074+\o{76}", ["<", "~", ">"]),
        ("[!-$]+a", ["!", "-", "$"]),  # (a range's ends: a run of either is in its class)
        (r"(?:<\|)+>|(?:ab)+c|a{2,3}=", ["<", "|", "<|", ">", "ab", "="]),
        ("＜+＞", ["＜", "＞"]),
        (r"\p{Sm}+[^\p{Sm}]", list(string.punctuation)),
    ],
)
def test_what_a_regex_names_is_probed(regex: str, units: list[str]) -> None:
    assert tokenizer_pace.regex_units(_split_only(regex)) == set(units)
    probes = [what for what, _, _ in tokenizer_pace._probes(64, set(units))]
    assert {f"a run of {u!r}" for u in units} <= set(probes)


def _split_only(regex: str, **more: Any) -> HFTokenizer:
    """A tokenizer whose pre-tokenizer is one `Split` by `regex` (`more`: keys of its own)."""
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated"}
    spec = {
        "version": "1.0",
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{**split, "invert": False}]},
        "model": {"type": "WordLevel", "vocab": {"x": 0}, "unk_token": "x"},
    }
    spec["pre_tokenizer"].update(more)
    return HFTokenizer.from_str(json.dumps(spec))


def test_units_are_read_from_the_steps_the_library_built() -> None:
    """Regexes under keys the library ignores are not read (64 of them pushed the slow
    regex's marks past what was read), a surrogate escape names no unit (its run cannot
    be encoded: a traceback at load), and regexes naming more than can be timed are
    refused, not cut."""
    decoys = [{"pattern": {"Regex": f"q{i}"}} for i in range(200)]
    assert tokenizer_pace.regex_units(_split_only("[<|]+[^<|]", decoy=decoys)) == {"<", "|"}
    assert tokenizer_pace.regex_units(_split_only(r"(?#\uD800\x{DC00})<")) == {"#", "<"}
    many = "|".join(f"q{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(130))
    with pytest.raises(tokenizer_pace.UnitsTooMany, match="name 130 marks and runs"):
        tokenizer_pace.regex_units(_split_only(many))


def test_a_regex_too_long_to_read_is_refused(byte_level: dict[str, Any], tmp_path: Path) -> None:
    """A unit past the part of a regex read would not be probed: a regex longer than that
    (real ones are under 200 characters) is refused."""
    file = _with_regex(byte_level, "a{0}" * 20_000 + "<+>", tmp_path)
    with pytest.raises(CheckpointError, match="is 80,003 characters long; specd reads at most"):
        tokenizer_file.read_backend(file)
