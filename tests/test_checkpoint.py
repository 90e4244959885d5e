"""Checkpoint loading: tensor checks with messages that name the tensor, config refusals,
tied embeddings stored under either name, sharded indexes, and hub ids through the
huggingface_hub cache in offline mode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling.checkpoints import tied_head
from modeling.checkpoints.checkpoint import ModelNotFoundError, load, open_checkpoint, resolve
from modeling.checkpoints.folder_files import CheckpointError
from modeling.checkpoints.safetensors_model import weight_files
from modeling.config import ModelConfig, UnsupportedModelError
from modeling.models import config_from_hf, parameter_count

VOCAB = 96


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def _logits(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    t = torch.tensor(ids)
    return model(t, torch.arange(len(ids)), model.new_cache(32))  # (T, V)


@pytest.fixture
def llama(tiny_checkpoint, tmp_path: Path) -> Path:
    return _copy(tiny_checkpoint("llama", vocab_size=VOCAB), tmp_path / "llama")


def test_missing_tensor_is_named(llama: Path) -> None:
    _rewrite_weights(llama, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj"):
        load(llama)


def test_wrong_shape_is_named(llama: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    _rewrite_weights(llama, shrink)
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight \(8, 64\)"
    ):
        load(llama)


def test_unexpected_tensor_is_named(llama: Path) -> None:
    def extra(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rope_bonus"] = torch.zeros(3)

    _rewrite_weights(llama, extra)
    with pytest.raises(
        CheckpointError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.rope_bonus"
    ):
        load(llama)


def test_stored_rotary_inv_freq_is_ignored(llama: Path) -> None:
    """Older exporters store the RoPE buffer; it is recomputed, not an unexpected tensor."""
    want = _logits(load(llama)[0], [5, 6, 7])

    def add_buffer(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _rewrite_weights(llama, add_buffer)
    torch.testing.assert_close(_logits(load(llama)[0], [5, 6, 7]), want, atol=0, rtol=0)


def test_unknown_model_type_is_named(llama: Path) -> None:
    _edit_config(llama, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match=r"'gpt2' \(GPT2LMHeadModel\)"):
        open_checkpoint(llama)


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type_is_named(llama: Path, layout: str) -> None:
    """Both config layouts: transformers 5.x `rope_parameters`, 4.x `rope_scaling`."""
    raw = json.loads((llama / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw[layout] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    (llama / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'dynamic'"):
        open_checkpoint(llama)


@pytest.mark.parametrize("theta", [0, -1.0, "abc", None, float("nan"), 1e-300, 0.5])
def test_a_rope_theta_that_is_no_positive_number_is_named(llama: Path, theta: Any) -> None:
    """0 made every RoPE frequency infinite (every answer token id 0, silently), and so did
    1e-300 (each frequency past float32)."""
    raw = json.loads((llama / "config.json").read_text())
    raw.pop("rope_parameters", None)  # (whose rope_theta would win over the top level's)
    raw["rope_theta"] = theta
    (llama / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=r"rope_theta .* is not a number of at least 1"):
        open_checkpoint(llama)


@pytest.mark.parametrize(
    ("template", "says"),
    [("{% if %}", "chat_template, the model's chat template, does not compile"),
     (5, "chat_template is a int, not a template"),
     ([{"name": "default"}], "chat_template is a list, but not of named templates")],
)  # fmt: skip
def test_a_folders_broken_template_is_refused_when_it_is_opened(
    llama: Path, template: Any, says: str
) -> None:
    """As a GGUF file's: `specd plan` refuses it as loading does, naming the file."""
    from modeling.text.model_template import ChatTemplateError

    file = llama / "tokenizer_config.json"
    tc = json.loads(file.read_text()) if file.is_file() else {}
    file.write_text(json.dumps({**tc, "chat_template": template}))
    with pytest.raises(ChatTemplateError) as raised:
        open_checkpoint(llama)
    assert str(raised.value).startswith(f"{file}") and says in str(raised.value)
    assert open_checkpoint(llama, verify=False).config is not None  # (a scan's open)


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers() -> None:
    """A config carrying both layouts: transformers applies the non-empty rope_scaling."""
    from transformers import LlamaConfig

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    raw = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    reference = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    ours = config_from_hf(raw).rope
    assert ours.kind == reference.rope_parameters["rope_type"] == "llama3"
    assert ours.theta == reference.rope_parameters["rope_theta"] == 500000.0
    assert ours.factor == 8.0 and ours.original_max_position_embeddings == 64


def test_partial_rotary_factor_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match=r"partial_rotary_factor 0\.5"):
        _config(partial_rotary_factor=0.5)


def test_unsupported_activation_is_named(llama: Path) -> None:
    _edit_config(llama, hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        open_checkpoint(llama)


def _config(**changes: object) -> ModelConfig:
    raw = {
        "model_type": "mistral",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 4096,
    }
    raw.update(changes)
    return config_from_hf(raw)


def test_sliding_windows_are_read_per_layer() -> None:
    """A window is computed by position, so the context stays the model's; which layers
    slide comes from layer_types, Qwen's max_window_layers, or every layer (Mistral)."""
    mistral = _config(model_type="mistral", sliding_window=1024, num_hidden_layers=2)
    assert mistral.max_context == 4096 and mistral.sliding_window == 1024
    assert [mistral.layer_window(i) for i in range(2)] == [1024, 1024]
    assert _config(sliding_window=8192).sliding_window is None  # covers everything
    assert _config(sliding_window=None).sliding_window is None
    # Qwen2/3 carry a window but use it only with use_sliding_window.
    assert _config(model_type="qwen2", sliding_window=1024).sliding_window is None
    qwen = _config(
        model_type="qwen2",
        sliding_window=1024,
        use_sliding_window=True,
        max_window_layers=1,
        num_hidden_layers=2,
    )
    assert qwen.max_context == 4096
    assert [qwen.layer_window(i) for i in range(2)] == [None, 1024]
    listed = _config(
        model_type="qwen3",
        sliding_window=64,
        use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention"],
        num_hidden_layers=2,
    )
    assert [listed.layer_window(i) for i in range(2)] == [64, None]
    with pytest.raises(UnsupportedModelError, match="layer_types must list 2"):
        _config(sliding_window=64, layer_types=["full_attention"], num_hidden_layers=2)


def test_sliding_window_checkpoint_keeps_its_context(tiny_checkpoint) -> None:
    path = tiny_checkpoint("mistral", vocab_size=VOCAB, sliding_window=32)
    model, _, ckpt = load(path)
    assert ckpt.config.max_context == ckpt.config.max_position_embeddings > 32
    assert model.new_cache(64).positions is not None  # window layers read slot positions


def test_parameter_count_matches_the_weights(tiny_checkpoint) -> None:
    for family, tie in [("llama", False), ("qwen2", True), ("qwen3", False)]:
        path = tiny_checkpoint(family, tie_word_embeddings=tie, vocab_size=VOCAB)
        model, _, ckpt = load(path)
        unique = {id(p): p.numel() for p in model.parameters()}
        assert parameter_count(ckpt.config) == sum(unique.values()), family


@pytest.mark.parametrize("stored_as", ["lm_head.weight", "model.embed_tokens.weight", "both"])
def test_tied_embedding_under_either_name(tiny_checkpoint, tmp_path: Path, stored_as: str) -> None:
    src = tiny_checkpoint("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    want = _logits(load(src)[0], [3, 9, 4, 1])
    folder = _copy(src, tmp_path / "tied")

    def restore(t: dict[str, torch.Tensor]) -> None:
        embedding = t.pop("model.embed_tokens.weight", None)
        if embedding is None:
            embedding = t.pop("lm_head.weight")
        if stored_as in ("lm_head.weight", "both"):
            t["lm_head.weight"] = embedding.clone()
        if stored_as in ("model.embed_tokens.weight", "both"):
            t["model.embed_tokens.weight"] = embedding.clone()

    _rewrite_weights(folder, restore)
    model, _, _ = load(folder)
    assert model.lm_head.weight is model.embed_tokens.weight
    torch.testing.assert_close(_logits(model, [3, 9, 4, 1]), want, atol=0, rtol=0)


@pytest.mark.parametrize("changed_row", [0, VOCAB - 1])
def test_tied_config_beside_a_head_of_its_own_keeps_the_head(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changed_row: int
) -> None:
    """A config that says tied next to a stored head with other values: transformers keeps
    the stored head (and warns), and so does specd, in the plan's config and at load. The
    rows are compared a few at a time, so a difference in the last block is found too."""
    transformers = pytest.importorskip("transformers")
    folder = _copy(tiny_checkpoint("llama", vocab_size=VOCAB), tmp_path / "both")

    def head_like_the_embedding_but_one_row(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["lm_head.weight"][changed_row] += 0.5

    _rewrite_weights(folder, head_like_the_embedding_but_one_row)
    _edit_config(folder, tie_word_embeddings=True)
    monkeypatch.setattr("modeling.checkpoints.tied_head._COMPARE_BYTES", 3 * 64 * 4)
    assert not open_checkpoint(folder).config.tie_word_embeddings
    model, _, _ = load(folder)
    assert model.lm_head.weight is not model.embed_tokens.weight
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = [3, 9, 4, 1]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(model, ids), want, atol=1e-4, rtol=1e-4)


def test_a_scan_of_models_does_not_read_a_stored_head(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Comparing a stored head with the embedding reads both (seconds at a 262k vocabulary,
    for each model `specd models` lists and each draft candidate): only a plan or a load
    compares them."""
    from daemon.cli.models import cannot_run

    folder = _copy(tiny_checkpoint("llama", vocab_size=VOCAB), tmp_path / "scan")
    _rewrite_weights(
        folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 0.5})
    )
    _edit_config(folder, tie_word_embeddings=True)
    read: list[Path] = []
    real = tied_head._head_differs
    monkeypatch.setattr(
        tied_head,
        "_head_differs",
        lambda files, cfg: read.append(files[0]) or real(files, cfg),
    )
    assert cannot_run(folder) is None
    assert open_checkpoint(folder, compare_head=False).config.tie_word_embeddings
    assert read == []
    assert not open_checkpoint(folder).config.tie_word_embeddings  # a plan's or a load's
    assert len(read) == 1


def test_tied_config_beside_a_head_of_another_shape_names_it(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """A stored head of another shape is no copy of the embedding: the config is untied,
    so the loader reads the head and names its shape (tied, it was skipped unread when the
    embedding came first)."""
    folder = _copy(tiny_checkpoint("llama", vocab_size=VOCAB), tmp_path / "odd")
    _rewrite_weights(folder, lambda t: t.update({"lm_head.weight": torch.zeros(VOCAB - 1, 64)}))
    _edit_config(folder, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match=r"wrongly shaped tensors: lm_head\.weight"):
        load(folder)


def test_nan_weights_stop_a_generation_with_a_line_that_says_so(
    llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN in a weight made every logit NaN and every answer token 0, silently: the pass
    that computes such logits says the file is damaged (one line from the command line)."""
    from daemon.cli.commands import main
    from modeling.errors import ModelOutputError

    def poison(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")

    _rewrite_weights(llama, poison)
    model, _, _ = load(llama)
    with pytest.raises(ModelOutputError, match="NaN or infinite logits"):
        _logits(model, [3, 9, 4])
    status = main(["generate", "--model", str(llama), "--prompt-ids", "3,9,4", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "computed NaN or infinite logits" in err


def test_untied_checkpoint_without_head_is_refused(tiny_checkpoint, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("qwen2", vocab_size=VOCAB), tmp_path / "nohead")
    _rewrite_weights(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: lm_head\.weight"):
        load(folder)


def test_sharded_index_loads_like_a_single_file(tiny_checkpoint) -> None:
    single = tiny_checkpoint("llama", vocab_size=VOCAB, seed=3)
    sharded = tiny_checkpoint("llama", vocab_size=VOCAB, seed=3, max_shard_size="20KB")
    files = weight_files(sharded)
    assert len(files) > 1 and (sharded / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(
        _logits(load(sharded)[0], [4, 5, 6]), _logits(load(single)[0], [4, 5, 6]), atol=0, rtol=0
    )


def test_sharded_index_with_a_missing_shard(tiny_checkpoint, tmp_path: Path) -> None:
    folder = _copy(
        tiny_checkpoint("llama", vocab_size=VOCAB, max_shard_size="20KB"), tmp_path / "s"
    )
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"shard files missing: {victim.name}"):
        load(folder)


def test_pytorch_bin_only_folder_says_convert(llama: Path) -> None:
    (llama / "model.safetensors").rename(llama / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="convert to safetensors"):
        load(llama)


# ---- model references: folders, bad paths and hub ids --------------------------------------


def test_bad_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not found: give a Hugging Face model folder"):
        resolve(tmp_path / "no-such-model")
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json"):
        resolve(tmp_path)


def _hub_cache(root: Path, repo_id: str, source: Path) -> Path:
    """Lay out a huggingface_hub cache entry by hand: refs/main names a snapshot folder."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """huggingface_hub reads its environment at import time, so patch its constants."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_hub_id_resolves_from_the_offline_cache(offline_hub: Path, llama: Path) -> None:
    snapshot = _hub_cache(offline_hub, "tiny-org/tiny-llama", llama)
    assert resolve("tiny-org/tiny-llama").resolve() == snapshot.resolve()
    model, tok, ckpt = load("tiny-org/tiny-llama")
    assert ckpt.config.model_type == "llama"
    torch.testing.assert_close(
        _logits(model, [4, 5]), _logits(load(llama)[0], [4, 5]), atol=0, rtol=0
    )
    assert tok.vocab_size == VOCAB


def test_hub_id_not_in_the_cache(offline_hub: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve("nobody/not-cached")
    message = str(info.value)
    assert "'nobody/not-cached' is not in the local Hugging Face cache" in message
    assert "specd pull nobody/not-cached" in message


def test_every_model_missing_from_the_cache_is_named_at_once(
    offline_hub: Path, llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile's target and draft both missing offline were named one at a time, and
    `plan` (the target first) and `start` (the draft first) named different ones."""
    from daemon.cli import main
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime

    assert main(["plan", "--model", "org/target", "--draft", "org/draft"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'org/target' is not in the local Hugging Face cache" in err
    assert "nor is 'org/draft' (`specd pull --config-only org/draft`)" in err
    with pytest.raises(ModelNotFoundError) as info:
        Runtime(RuntimeOptions(model="org/target", draft="org/draft", device="cpu"))
    assert "'org/draft' is not in the local Hugging Face cache" in str(info.value)
    assert "nor is 'org/target' (`specd pull org/target`)" in str(info.value)
    # One that is there is not named.
    _hub_cache(offline_hub, "org/target", llama)
    with pytest.raises(ModelNotFoundError) as info:
        Runtime(RuntimeOptions(model="org/target", draft="org/draft", device="cpu"))
    assert "'org/draft' is not in" in str(info.value) and "nor is" not in str(info.value)


def test_skipped_parameters_stay_on_meta_and_the_rest_loads(tiny_checkpoint):
    """The disk offload tier loads a target without its streamed layers: they must take no
    memory (meta) yet keep their dtype and shape so the streamer can lay them out."""
    from modeling.checkpoints.checkpoint import open_checkpoint
    from modeling.checkpoints.safetensors_model import load_model

    ckpt = open_checkpoint(tiny_checkpoint("llama"))
    model = load_model(
        ckpt.path, ckpt.config, dtype=torch.bfloat16, skip=lambda n: n.startswith("layers.1.")
    )
    for name, p in model.named_parameters():
        if name.startswith("layers.1."):
            assert p.is_meta and p.dtype == torch.bfloat16, name
        else:
            assert not p.is_meta, name
    full = load_model(ckpt.path, ckpt.config, dtype=torch.bfloat16)
    assert torch.equal(
        model.layers[0].mlp.gate_up_proj.weight, full.layers[0].mlp.gate_up_proj.weight
    )


# ---- planning before downloading, and pull's messages ------------------------------------


def test_plan_needs_only_the_config_of_a_hub_id(
    offline_hub: Path, llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specd pull --config-only ID` leaves config files in the cache: `specd plan` works
    from them, with no weights downloaded."""
    from daemon.cli import main

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(llama / "config.json", config_only / "config.json")
    _hub_cache(offline_hub, "tiny-org/not-downloaded", config_only)
    assert main(["plan", "--model", "tiny-org/not-downloaded", "--device", "cpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (
        plan["target"]["num_layers"]
        == config_from_hf(json.loads((llama / "config.json").read_text()), source="x").num_layers
    )
    # Not in the cache at all: the message names the config-only pull.
    assert main(["plan", "--model", "tiny-org/absent", "--device", "cpu"]) == 2
    assert "specd pull --config-only tiny-org/absent" in capsys.readouterr().err


def test_pull_says_what_is_wrong_offline_and_without_a_network(
    offline_hub: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    from daemon.cli import main
    from daemon.cli import pull as pull_cmd

    assert main(["pull", "org/model"]) == 2
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE is set" in err and "resume" not in err
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(**kwargs: object) -> str:
        raise LocalEntryNotFoundError("cannot reach the hub")

    monkeypatch.setattr("huggingface_hub.snapshot_download", unreachable)
    assert main(["pull", "--config-only", "org/model"]) == 2
    err = capsys.readouterr().err
    assert "the hub cannot be reached from here" in err and "resume" not in err
    from modeling.checkpoints.checkpoint import CONFIG_FILES

    assert pull_cmd.CONFIG_FILES == CONFIG_FILES  # restated: pull imports no torch


def test_load_refuses_a_quantize_for_an_opened_checkpoint(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    from modeling.checkpoints.checkpoint import load, open_checkpoint

    opened = open_checkpoint(tiny_checkpoint())
    with pytest.raises(ValueError, match="open_checkpoint"):
        load(opened, "fp32", quantize="int8")
    packed = open_checkpoint(tiny_checkpoint(), "int8")
    assert packed.config.quantization is not None


def test_mistrals_own_format_beside_the_checkpoint_is_neither_downloaded_nor_read(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    """Mistral's repositories hold `consolidated.safetensors` (their own tensor names, as
    large as the checkpoint) beside the Hugging Face files: a hub id or `specd pull` skips
    it (it doubled the download), and a folder that has it loads the others (without a
    shard index every *.safetensors was read: unexpected tensors)."""
    from daemon.cli import main

    folder = tmp_path / "mistral"
    shutil.copytree(tiny_checkpoint(), folder)
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)},
              str(folder / "consolidated.safetensors"))  # fmt: skip
    assert load(folder)[0] is not None
    alone = tmp_path / "native"  # Mistral's format only: say so, not list every tensor
    alone.mkdir()
    for name in ("config.json", "tokenizer.json", "consolidated.safetensors"):
        shutil.copy(folder / name, alone)
    with pytest.raises(CheckpointError, match="Mistral's own format") as info:
        load(alone)
    assert len(str(info.value)) < 300
    calls: list[dict] = []
    monkeypatch.setattr(
        "huggingface_hub.snapshot_download", lambda **kw: calls.append(kw) or str(folder)
    )
    assert resolve("mistralai/Model") == folder
    assert main(["pull", "mistralai/Model"]) == 0
    assert [c["ignore_patterns"] for c in calls] == [["consolidated*.safetensors"]] * 2
    capsys.readouterr()


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn])
def test_a_float_weight_stored_as_another_dtype_is_refused_by_name(
    tiny_checkpoint, tmp_path: Path, dtype: torch.dtype
) -> None:
    """Integers, booleans or FP8 values where a float weight belongs (a damaged file, or an
    FP8 export whose scales the config does not declare) are named with their dtype,
    never cast into weights that load without a word and answer nonsense."""
    folder = _copy(tiny_checkpoint("llama", vocab_size=VOCAB), tmp_path / "ints")
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite_weights(folder, lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(CheckpointError, match=rf"another dtype: {name} \w+ \(expected F32"):
        load(folder)
