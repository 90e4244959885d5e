"""Logit parity with transformers (an implementation nobody here wrote) on tiny random
checkpoints of every supported family, and greedy generation parity on the real ones.

Each case runs the same three kinds of pass the strategies use: a prefill, several cached
single-token decode steps, and one multi-token step with a tree-shaped (non-causal) mask.
A masked row must equal transformers run on that row's own ancestor path."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from modeling.checkpoints.checkpoint import load
from modeling.kv_cache import CacheFullError, KVCache
from speculative.generation import Generation
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive

FAMILIES = [
    "llama",
    "llama3",
    "mistral",
    "ministral3",
    "qwen2",
    "qwen3",
    "gemma3",
    "phi3",
    "phi3-partial",
]
ATOL = 1e-4

# A small draft tree under the last decoded token: node i's parent (-1 = hangs off the
# committed prefix). Two branches of depth 3 and 2 plus a lone leaf: rows are not causal.
TREE_PARENTS = [-1, 0, 1, -1, 3, 0, -1]


def _ancestors(parents: list[int]) -> list[list[int]]:
    paths = []
    for i in range(len(parents)):
        path, node = [], i
        while node != -1:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def _tree_mask(parents: list[int]) -> torch.Tensor:
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)  # (T, T)
    for i, path in enumerate(_ancestors(parents)):
        mask[i, path] = True
    return mask


def _hf_model(path: Path, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_checkpoint, family: str, tie: bool) -> None:
    path = tiny_checkpoint(family, tie_word_embeddings=tie, vocab_size=96)
    assert load(path)[2].config.tie_word_embeddings is tie
    _check_parity(path, f"{family}-{tie}")


@pytest.mark.parametrize(
    "options",
    [
        {"attention_bias": True, "mlp_bias": True},  # Llama with every bias
        {"num_kv_heads": 4},  # plain multi-head attention (no grouping)
        {"num_kv_heads": 1, "num_heads": 8},  # multi-query attention
    ],
    ids=["llama-biases", "llama-mha", "llama-mqa"],
)
def test_logits_match_transformers_variants(tiny_checkpoint, options: dict) -> None:
    _check_parity(tiny_checkpoint("llama", vocab_size=96, **options), str(sorted(options)))


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("mistral", {"sliding_window": 8}),  # every layer slides; the prompt is 19 tokens
        # layer 0 full, layer 1 sliding (Qwen2's max_window_layers)
        ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
        (
            "qwen2",
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 8.0,
                    "original_max_position_embeddings": 8,
                    "beta_fast": 16,
                    "beta_slow": 2,
                    "attention_factor": 1.3,
                }
            },
        ),
    ],
    ids=["mistral-window", "qwen2-window-layers", "qwen3-window", "llama-yarn", "qwen2-yarn-set"],
)
def test_logits_match_transformers_windows_and_yarn(
    tiny_checkpoint, family: str, options: dict
) -> None:
    """Sliding windows by position (tree rows share positions, and each must equal its own
    path under transformers' window by index) and YaRN's frequencies and attention factor,
    past the window and the original context."""
    path = tiny_checkpoint(family, vocab_size=96, **options)
    config = load(path)[2].config
    assert config.sliding_window == options.get("sliding_window")
    _check_parity(path, f"{family}-{sorted(options)}")


def _check_parity(path: Path, seed_key: str, ref: torch.nn.Module | None = None) -> None:
    ours, _, _ = load(path)
    ref = ref if ref is not None else _hf_model(path)
    gen = torch.Generator().manual_seed(zlib.crc32(seed_key.encode()))
    prompt = torch.randint(3, 96, (19,), generator=gen)  # (P,)
    decode = torch.randint(3, 96, (4,), generator=gen)  # (D,)
    tree = torch.randint(3, 96, (len(TREE_PARENTS),), generator=gen)  # (N,)

    # 1. prefill
    cache = ours.new_cache(64)
    got = ours(prompt, torch.arange(len(prompt)), cache)  # (P, V)
    with torch.no_grad():
        out = ref(input_ids=prompt[None], use_cache=True)
    torch.testing.assert_close(got, out.logits[0].float(), atol=ATOL, rtol=0)
    past = out.past_key_values

    # 2. cached single-token decode steps
    fed = prompt.tolist()
    for tok in decode.tolist():
        got = ours(torch.tensor([tok]), torch.tensor([len(fed)]), cache)  # (1, V)
        with torch.no_grad():
            out = ref(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        torch.testing.assert_close(got, out.logits[0].float(), atol=ATOL, rtol=0)
        fed.append(tok)

    # 3. a tree step: positions are L + depth, the mask is each node's ancestor path
    paths = _ancestors(TREE_PARENTS)
    positions = torch.tensor([len(fed) + len(p) - 1 for p in paths])  # (N,)
    got = ours(tree, positions, cache, mask=_tree_mask(TREE_PARENTS))  # (N, V)
    assert cache.length == len(fed) + len(tree)
    for row, path in enumerate(paths):
        seq = torch.tensor(fed + tree[path].tolist())
        with torch.no_grad():
            want = ref(input_ids=seq[None]).logits[0, -1].float()
        torch.testing.assert_close(got[row], want, atol=ATOL, rtol=0, msg=f"tree row {row}")


def test_full_width_mask_matches_short_mask(tiny_checkpoint) -> None:
    """The (T, cache.length + T) mask form says the same as the (T, T) form when every
    row sees the whole prefix."""
    path = tiny_checkpoint("llama", vocab_size=96)
    model, _, _ = load(path)
    prompt = torch.arange(3, 15)
    tree = torch.arange(20, 20 + len(TREE_PARENTS))
    depth = torch.tensor([len(p) - 1 for p in _ancestors(TREE_PARENTS)])
    short = _tree_mask(TREE_PARENTS)
    wide = torch.cat((torch.ones(len(tree), len(prompt), dtype=torch.bool), short), dim=1)
    results = []
    for mask in (short, wide):
        cache = model.new_cache(32)
        model(prompt, torch.arange(len(prompt)), cache)
        results.append(model(tree, len(prompt) + depth, cache, mask=mask))
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="attention mask has shape"):
        model(tree, len(prompt) + depth, model.new_cache(32), mask=torch.ones(2, 3))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_smoke(stories_target, stories_reference, dtype: str) -> None:
    """Half precision runs end to end, keeps its dtype in the weights and the cache, and
    stays close to fp32 (same first greedy token on three reference prompts)."""
    half, _, _ = load(stories_target, dtype=dtype)
    full, _, _ = load(stories_target)
    assert half.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for item in stories_reference["items"][:3]:
        ids = torch.tensor(item["prompt_ids"])
        cache = half.new_cache(16)
        assert cache.k.dtype == half.dtype
        got = half(ids, torch.arange(len(ids)), cache, last_only=True)[0]  # (V,)
        want = full(ids, torch.arange(len(ids)), full.new_cache(16), last_only=True)[0]
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert (got - want).abs().max() < 0.5
        assert int(got.argmax()) == int(want.argmax())


def _checkpoints_with_weights(shared: Path) -> list[Path]:
    return sorted(p for p in shared.iterdir() if (p / "model.safetensors").is_file())


def test_greedy_generation_matches_transformers_generate(shared_models: Path) -> None:
    """Every real checkpoint in ../shared/models: our greedy tokens equal HF generate's."""
    folders = _checkpoints_with_weights(shared_models)
    assert folders, f"no checkpoints in {shared_models}"
    prompts = ["Once upon a time", ""]
    for folder in folders:
        model, tok, _ = load(folder)
        ref = _hf_model(folder)
        strategy = Autoregressive(model)
        for prompt in prompts:
            ids = tok.encode(prompt)
            ours = Generation(
                strategy,
                strategy.new_session(128),
                tok,
                ids,
                SamplingParams(temperature=0.0),
                max_tokens=32,
                ignore_eos=True,
            ).run()
            with torch.no_grad():
                out = ref.generate(
                    torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None
                )
            assert ours.token_ids == out[0, len(ids) :].tolist(), (folder.name, prompt)


def test_query_chunked_attention_agrees(tiny_checkpoint, monkeypatch) -> None:
    """Long passes attend over chunks of queries (bounded score memory): with a bound so
    small that every query row is its own chunk, the logits are those of one chunk."""
    import modeling.layers.attention as attention_module

    path = tiny_checkpoint("qwen2", vocab_size=96)
    model, _, _ = load(path)
    tokens = torch.arange(3, 40)
    tree = torch.arange(50, 50 + len(TREE_PARENTS))
    depth = torch.tensor([len(p) - 1 for p in _ancestors(TREE_PARENTS)])

    def run() -> torch.Tensor:
        cache = model.new_cache(64)
        causal = model(tokens, torch.arange(len(tokens)), cache)
        masked = model(tree, len(tokens) + depth, cache, mask=_tree_mask(TREE_PARENTS))
        return torch.cat((causal, masked))

    whole = run()
    monkeypatch.setattr(attention_module, "ATTENTION_CHUNK_BYTES", 1)
    torch.testing.assert_close(run(), whole, atol=1e-5, rtol=0)


def test_keep_compacts_an_accepted_tree_path(tiny_checkpoint) -> None:
    """After a tree pass, keeping prefix + one root-to-leaf path leaves the cache exactly as
    if that path had been fed in order: the next token's logits agree with a fresh run."""
    model, _, _ = load(tiny_checkpoint("llama", vocab_size=96))
    prefix = torch.arange(3, 14)
    tree = torch.arange(30, 30 + len(TREE_PARENTS))
    paths = _ancestors(TREE_PARENTS)
    accepted = paths[2]  # nodes 0 -> 1 -> 2
    depth = torch.tensor([len(p) - 1 for p in paths])
    cache = model.new_cache(64)
    model(prefix, torch.arange(len(prefix)), cache)
    model(tree, len(prefix) + depth, cache, mask=_tree_mask(TREE_PARENTS))
    cache.keep(list(range(len(prefix))) + [len(prefix) + i for i in accepted])
    assert cache.length == len(prefix) + len(accepted)
    nxt = torch.tensor([77])
    got = model(nxt, torch.tensor([cache.length]), cache)

    fresh = model.new_cache(64)
    sequence = torch.cat((prefix, tree[accepted], nxt))
    want = model(sequence, torch.arange(len(sequence)), fresh)[-1:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    cache.truncate(len(prefix))
    assert cache.length == len(prefix)
    with pytest.raises(ValueError, match=r"keep\(\) indices must lie in"):
        cache.keep([0, len(prefix)])


def test_the_kv_cache_grows_on_demand_without_changing_logits(tiny_checkpoint):
    """A 128k-token context must not allocate 128k slots up front: the cache starts small
    and doubles as the sequence grows, and growth is invisible to the logits."""
    model, _, _ = load(tiny_checkpoint("llama"))
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0))
    small = KVCache(model.config, capacity=200, initial=4)
    big = KVCache(model.config, capacity=200, initial=200)
    assert small.allocated == 4 and small.nbytes < big.nbytes
    outs = []
    for cache in (small, big):
        prefill = model(ids[:30], torch.arange(30), cache)
        steps = [model(ids[i : i + 1], torch.tensor([i]), cache) for i in range(30, 40)]
        outs.append(torch.cat([prefill, *steps]))
    assert small.allocated >= 40 and small.length == big.length == 40
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(CacheFullError):
        KVCache(model.config, capacity=8, initial=2).reserve(9)


def test_construction_draws_as_torch_modules_off_meta_and_nothing_on_it(
    tiny_checkpoint,
) -> None:
    """The embedding is drawn as nn.Embedding draws it (tests seed random models), except on
    the meta device, where only shapes count and drawing would import torch._dynamo."""
    from torch import nn

    from modeling.checkpoints.checkpoint import open_checkpoint
    from modeling.decoder import Transformer
    from modeling.layers.rope import rope_inv_freq

    cfg = open_checkpoint(tiny_checkpoint("llama")).config
    torch.manual_seed(0)
    model = Transformer(cfg)
    torch.manual_seed(0)
    reference = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    assert torch.equal(model.embed_tokens.weight, reference.weight)
    assert torch.equal(model.inv_freq, rope_inv_freq(cfg.head_dim, cfg.rope))
    with torch.device("meta"):
        meta = Transformer(cfg)
    assert meta.embed_tokens.weight.is_meta and meta.inv_freq.shape == model.inv_freq.shape


@pytest.mark.parametrize("text", ["ministral3", "mistral"])
def test_a_mistral3_multimodal_checkpoint_runs_its_text_model(tmp_path: Path, text: str) -> None:
    """Ministral 3 and Mistral Small 3.x come as `Mistral3ForConditionalGeneration`: the
    text model's config in `text_config` (model_type ministral3, or mistral for Mistral
    Small), its tensors under `model.language_model.`, a vision tower specd skips, and the
    head tied by the top level's `tie_word_embeddings` (transformers' rule)."""
    check_mistral3_wrapper(tmp_path, text)


def check_mistral3_wrapper(tmp_path: Path, text: str, options: dict | None = None) -> None:
    """A tiny `Mistral3ForConditionalGeneration` around a `text` model (`options` over its
    config), loaded by specd and run against transformers (tests/test_mistral3.py too)."""
    from scripts.tiny_models import build_tokenizer

    reference = build_mistral3_wrapper(tmp_path, text, 96, options)
    build_tokenizer(96).save(str(tmp_path / "tokenizer.json"))
    loaded = load(tmp_path)[2].config
    assert loaded.model_type == "mistral3" and loaded.tie_word_embeddings
    assert (loaded.query_scale is not None) is (text == "ministral3")  # (Mistral: never)
    _check_parity(tmp_path, f"mistral3-{text}", reference)


def build_mistral3_wrapper(
    folder: Path, text: str, vocab: int, options: dict | None = None, **top: Any
) -> torch.nn.Module:
    """A tiny random `Mistral3ForConditionalGeneration` (a one-layer Pixtral tower) around a
    `text` model of scripts/tiny_models.py's family, saved to `folder`; transformers'
    model of it (the reference). `top`: keys of the top level (tie_word_embeddings)."""
    from transformers import (
        AutoConfig,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralVisionConfig,
    )

    from scripts.tiny_models import FAMILIES

    spec = dict(FAMILIES["ministral3" if text == "ministral3" else "mistral"])
    spec.pop("model_type")
    spec.update(options or {})
    text_config = AutoConfig.for_model(
        text, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6, **spec,
    )  # fmt: skip
    vision = PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    config = Mistral3Config(
        vision_config=vision, text_config=text_config, image_token_index=10, **top
    )
    reference = Mistral3ForConditionalGeneration(config).eval()
    reference.save_pretrained(folder)
    return reference
