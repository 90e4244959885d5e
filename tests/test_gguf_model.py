"""GGUF files made by llama.cpp's own converter and quantizer (../shared/models/gguf):
every file loads, and greedy decoding in float32 gives exactly the 32 token ids that
transformers' GGUF loader gives for each reference prompt (the q/k row order, tied and
untied heads, and every block type in the files included). Also through the daemon's
runtime with speculation (the GGUF target with its own file as the draft), `specd
generate --model FILE.gguf`, and the one-line errors for bad files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from daemon.cli import main
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.checkpoints.checkpoint import load, open_checkpoint
from modeling.checkpoints.gguf_model import GGUFError, keeps_head_packed
from modeling.models import layer_parameter_count
from modeling.weights import cpu_kernels
from modeling.weights.gguf_modules import GGUFEmbedding, GGUFLinear
from offload.stream import LayerStreamer
from speculative.generation import Generation
from speculative.sampling import SamplingParams
from tests.conftest import SHARED_MODELS

GGUF = SHARED_MODELS / "gguf"
FILES = sorted(p.stem for p in GGUF.glob("*.gguf"))
FLOATS = ("F32", "F16", "BF16")


def reference(name: str) -> dict:
    return json.loads((GGUF / f"{name}.reference.json").read_text())


@pytest.mark.parametrize("name", FILES)
def test_greedy_ids_equal_transformers_gguf_loader(name: str) -> None:
    model, tokenizer, ckpt = load(GGUF / f"{name}.gguf", "fp32")
    ref = reference(name)
    quantized = any(isinstance(m, GGUFLinear) for m in model.modules())
    assert quantized == (ckpt.config.quantization is not None)
    stored = {t["name"]: t["type"] for t in ref["tensors"]}
    assert ckpt.config.tie_word_embeddings == ("output.weight" not in stored)
    # An untied quantized table stays as its blocks (rows decoded per lookup); a tied one
    # is also the output matrix: its blocks where the CPU kernels compute the head
    # (modeling/weights/cpu_kernels.py), else decoded whole.
    packed_head = keeps_head_packed(ckpt.config, torch.float32, "cpu")
    untied = "output.weight" in stored and stored["token_embd.weight"] not in FLOATS
    assert isinstance(model.embed_tokens, GGUFEmbedding) == (untied or packed_head)
    assert isinstance(model.lm_head, GGUFLinear) == packed_head
    for item in ref["items"]:
        assert tokenizer.encode(item["prompt"]) == item["prompt_ids"]
        feed = list(item["prompt_ids"])
        out: list[int] = []
        cache = model.new_cache(len(feed) + 40)
        position = 0
        for step in range(len(item["greedy_new_token_ids"])):
            positions = torch.arange(position, position + len(feed))
            logits = model(torch.tensor(feed), positions, cache, last_only=True)
            if step == 0:  # transformers' first-step logits, to fp32 rounding
                for top in item["first_step_top5"]:
                    assert abs(float(logits[-1, top["id"]]) - top["logit"]) < 1e-3, name
            position += len(feed)
            feed = [int(logits[-1].argmax())]
            out.append(feed[0])
        assert out == item["greedy_new_token_ids"], name


@pytest.mark.parametrize(
    ("target", "draft"),
    [
        ("llama-rand-256-Q4_K_M.gguf", "llama-rand-256-Q4_K_M.gguf"),
        ("stories260k-Q4_K_M.gguf", "stories260k-draft"),  # a safetensors draft
        ("stories260k-Q4_K_M.gguf", "stories260k-Q8_0.gguf"),
        ("stories260k-Q4_K_M.gguf", "substitute"),
        ("llama-rand-256-Q4_K_M.gguf", "substitute"),  # its embedding kept as blocks
    ],
)
def test_a_gguf_target_speculates_with_any_draft(
    target: str, draft: str, shared_models: Path
) -> None:
    """Paired by the tokenizer check on the GGUF's tokenizer, a safetensors, GGUF or
    substitute draft gives the reference's greedy ids through trees and chains."""
    draft_path = {
        "substitute": "substitute",
        "stories260k-draft": str(shared_models / "stories260k-draft"),
    }.get(draft, str(GGUF / draft))
    options = RuntimeOptions(
        model=str(GGUF / target), draft=draft_path, device="cpu", budget=8, dtype="fp32"
    )
    runtime = Runtime(options)
    item = reference(target.removesuffix(".gguf"))["items"][0]
    for strategy in ("autoregressive", "tree", "linear"):
        built = runtime.strategy(strategy)
        gen = Generation(
            built, runtime.new_session(built), runtime.tokenizer, item["prompt_ids"],
            SamplingParams(temperature=0.0), 32, ignore_eos=True,
        ).run()  # fmt: skip
        assert gen.token_ids == item["greedy_new_token_ids"], strategy


def test_generate_takes_a_gguf_file(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(GGUF / "stories260k-Q8_0.gguf"), "--prompt"]
    assert main([*argv, "Once upon a time", "--max-tokens", "8", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    item = reference("stories260k-Q8_0")["items"][0]  # transformers' GGUF loader, greedy
    assert item["prompt"] == "Once upon a time"
    assert record["prompt_ids"] == item["prompt_ids"]
    assert record["token_ids"] == item["greedy_new_token_ids"][:8]
    assert record["stats"]["generated_tokens"] == 8


def test_bad_files_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = GGUF / "llama-rand-256-Q4_K_M.gguf"
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(source.read_bytes()[:500_000])
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(100))
    for bad, words in [(truncated, "truncated"), (not_gguf, "not a GGUF file")]:
        with pytest.raises(GGUFError, match=words):
            open_checkpoint(bad)
        assert main(["generate", "--model", str(bad), "--prompt", "x"]) == 2
        err = capsys.readouterr().err
        assert str(bad) in err and "Traceback" not in err
    copy = tmp_path / "copy.gguf"
    shutil.copy(source, copy)
    ckpt = open_checkpoint(copy)
    assert ckpt.config.quantization is not None and "Q4_K_M" in ckpt.config.quantization.label


@pytest.mark.parametrize("name", ["llama-rand-256-Q4_K_M", "stories260k-Q4_K_M"])
def test_a_streamed_gguf_target_with_mixed_layer_types_is_exact(name: str) -> None:
    """Streamed through two slots, every layer in one shape (room for its projections'
    largest type in any layer): a slot takes on the types of the layer it computes, and
    greedy decoding still gives the reference ids. Q4_K_M stores attn_v and ffn_down of
    some layers as Q6_K (stories260k: Q5_0 and Q8_0)."""
    path = str(GGUF / f"{name}.gguf")
    options = RuntimeOptions(
        model=path, device="cpu", dtype="fp32", offload="stream", resident_layers=0, slots=2
    )
    runtime = Runtime(options)
    assert runtime.plan.streamed_layers == runtime.target.config.num_layers
    streamer = runtime.target.layers
    assert isinstance(streamer, LayerStreamer)
    per_layer = {i: dict(states) for i, states in streamer.states.items()}
    assert per_layer and len({repr(s) for s in per_layer.values()}) > 1  # types differ
    assert_greedy_ids_match(runtime, name)


def assert_greedy_ids_match(runtime: Runtime, name: str) -> None:
    """`runtime`'s greedy ids for the reference prompts of the GGUF file `name` equal
    transformers' GGUF loader's, 32 tokens each."""
    built = runtime.strategy("autoregressive")
    for item in reference(name)["items"]:
        gen = Generation(
            built, runtime.new_session(built), runtime.tokenizer, item["prompt_ids"],
            SamplingParams(temperature=0.0), 32, ignore_eos=True,
        ).run()  # fmt: skip
        assert gen.token_ids == item["greedy_new_token_ids"]


def test_a_model_in_ollamas_store_loads_and_is_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--model ollama:NAME` reads the store's own blob (nothing copied); the manifest's
    stop strings that are tokens end generations; `specd models` lists it."""
    from tests.test_model_stores import pull

    store = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    params = json.dumps({"stop": ["</s>", "▁said"]})
    pull(store, "registry.ollama.ai/library/tiny/latest", GGUF / "stories260k-Q8_0.gguf",
         params=params)  # fmt: skip
    before = sorted(p.name for p in store.rglob("*"))
    ckpt = open_checkpoint("ollama:tiny")
    assert ckpt.path.parent == store / "blobs"
    _, tokenizer, _ = load(ckpt, "fp32")
    assert tokenizer.backend.token_to_id("▁said") in tokenizer.eos_token_ids  # a stop token
    assert sorted(p.name for p in store.rglob("*")) == before
    argv = ["generate", "--model", "ollama:tiny", "--prompt", "Once upon a time"]
    assert main([*argv, "--max-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["generated_tokens"] <= 4
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(m["name"], m["type"], m["source"]) for m in listed] == [
        ("ollama:tiny:latest", "Q8_0", "ollama")
    ]
    assert main(["generate", "--model", "ollama:absent", "--prompt", "x"]) == 2
    assert "ollama pull absent" in capsys.readouterr().err


def with_metadata(tmp_path: Path, extra: dict[str, str | float]) -> Path:
    """stories260k-F32 written again by gguf-py's writer with `extra` keys (str, uint32 for
    an int, float32)."""
    import gguf
    import numpy as np

    from modeling.checkpoints.gguf_file import read_gguf

    source = read_gguf(GGUF / "stories260k-F32.gguf")
    path = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in source.metadata.items():
        if key == "general.architecture":
            continue
        if key == "tokenizer.ggml.tokens":
            writer.add_token_list(value)
        elif key == "tokenizer.ggml.scores":
            writer.add_token_scores(value)
        elif key == "tokenizer.ggml.token_type":
            writer.add_token_types(value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
    for key, value in extra.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    for info in source.tensors:
        shape = tuple(reversed(info.ne))
        writer.add_tensor(
            info.name, source.tensor_bytes(info).copy().view(np.float32).reshape(shape)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_rope_scaling_is_read_or_refused(tmp_path: Path) -> None:
    """Linear RoPE scaling in the metadata is applied as config.json's would be; a kind
    specd does not run (YaRN) is refused rather than run unscaled."""
    linear = with_metadata(
        tmp_path, {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    )
    rope = open_checkpoint(linear).config.rope
    assert rope.kind == "linear" and rope.factor == 4.0
    dynamic = with_metadata(
        tmp_path, {"llama.rope.scaling.type": "dynamic", "llama.rope.scaling.factor": 4.0}
    )
    with pytest.raises(Exception, match="RoPE scaling 'dynamic'"):
        open_checkpoint(dynamic)


YARN_KEYS = {
    "llama.rope.scaling.type": "yarn",
    "llama.rope.scaling.factor": 4.0,
    "llama.rope.scaling.original_context_length": 64,
    "llama.rope.scaling.yarn_beta_fast": 16.0,
}


def test_yarn_is_read_as_its_config_json_would_be(tmp_path: Path) -> None:
    """YaRN keys as llama.cpp's converter writes them (Qwen2.5's long-context files): the
    same logits, past the original context, as the safetensors source given that scaling
    in config.json; an option specd does not compute is refused by name."""
    path = with_metadata(tmp_path, YARN_KEYS)
    folder = tmp_path / "stories-yarn"
    shutil.copytree(SHARED_MODELS / "stories260k", folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                           "original_max_position_embeddings": 64}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(raw))
    ours, _, ckpt = load(path, "fp32")
    source, _, source_ckpt = load(folder, "fp32")
    assert ckpt.config.rope == source_ckpt.config.rope and ckpt.config.rope.kind == "yarn"
    tokens = torch.randint(3, 512, (100,), generator=torch.Generator().manual_seed(1))
    want = source(tokens, torch.arange(100), source.new_cache(100))
    torch.testing.assert_close(ours(tokens, torch.arange(100), ours.new_cache(100)), want)
    plain, _, _ = load(GGUF / "stories260k-F32.gguf", "fp32")
    unscaled = plain(tokens, torch.arange(100), plain.new_cache(100))
    assert not torch.allclose(unscaled, want, atol=1e-3)  # the scaling shows
    for key, value in (("yarn_log_multiplier", 0.1), ("yarn_ext_factor", 0.5)):
        bad = with_metadata(tmp_path, {**YARN_KEYS, f"llama.rope.scaling.{key}": value})
        with pytest.raises(Exception, match=key):
            open_checkpoint(bad)
    missing = {k: v for k, v in YARN_KEYS.items() if "original" not in k}
    with pytest.raises(Exception, match="original_context_length"):
        open_checkpoint(with_metadata(tmp_path, missing))


def test_a_plan_streams_a_gguf_from_disk(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(GGUF / "llama-rand-256-Q4_K_M.gguf"), "--offload", "stream"]
    argv += ["--resident-layers", "0", "--host-tier", "disk"]
    assert main(["plan", *argv]) == 0
    assert "disk" in capsys.readouterr().out
    assert main(["plan", *argv[:-2]]) == 0  # from RAM too
    # The packed size as stored (it was labelled "in float32"), and how its products run.
    out = capsys.readouterr().out
    assert "as stored, computed in" in out and " in float32\n" not in out.split("\n")[1]
    assert ("computed from the blocks by the CPU kernels" in out) is cpu_kernels.available()


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("llama-rand-256-Q4_K_M", "fp32"), ("llama-rand-256-Q8_0", "bf16"),
     ("stories260k-F16", "fp32")],
)  # fmt: skip
def test_a_gguf_streamed_from_disk_computes_what_it_does_in_ram(name: str, dtype: str) -> None:
    """The disk tier reads a GGUF's layers from the file at every pass, converted as
    loading converts them (q/k rows put back in order, Q4_K and Q6_K layers in one room,
    float norms decoded to the run's dtype): the same logits as the model in RAM, bit for
    bit, and none of the streamed layers' bytes held in RAM."""
    base = {"model": str(GGUF / f"{name}.gguf"), "device": "cpu", "dtype": dtype, "context": 64}
    disk = Runtime(
        RuntimeOptions(**base, offload="stream", resident_layers=0, host_tier="disk", slots=2)
    )
    streamer = disk.streamer
    assert streamer is not None and streamer.storage.tier == "disk"
    assert streamer.storage.host_bytes == 0
    plain = Runtime(RuntimeOptions(**base, offload="none"))
    tokens = torch.randint(3, 200, (9,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a = disk.target(tokens, torch.arange(9), disk.target.new_cache(16))
        b = plain.target(tokens, torch.arange(9), plain.target.new_cache(16))
    assert torch.equal(a, b)
    assert streamer.counters.passes >= 1


def test_a_streamed_q4_k_m_target_moves_its_packed_bytes() -> None:
    """Streamed, a Q4_K_M target's layers cross as their blocks: the bytes a pass copies
    are what the plan says, and a fraction of the same layers in bf16. Its first-step
    logits are transformers' within fp32 rounding."""
    path = GGUF / "llama-rand-256-Q4_K_M.gguf"
    options = RuntimeOptions(
        model=str(path), device="cpu", dtype="fp32", offload="stream", resident_layers=0,
        slots=2,
    )  # fmt: skip
    runtime = Runtime(options)
    streamer = runtime.target.layers
    assert isinstance(streamer, LayerStreamer)
    item = reference("llama-rand-256-Q4_K_M")["items"][0]
    ids = item["prompt_ids"]
    streamer.reset_counters()
    with torch.inference_mode():
        logits = runtime.target(
            torch.tensor(ids), torch.arange(len(ids)), runtime.target.new_cache(16), last_only=True
        )[0]
    per_pass = streamer.counters.bytes_copied / streamer.counters.passes
    # (Two layers and two slots: the plan's steady state copies nothing; this first pass
    # copies each layer once, at the size the plan gives a layer.)
    planned_layer = runtime.plan.request.target.layer_bytes
    layers = runtime.target.config.num_layers
    assert per_pass == layers * planned_layer == layers * streamer.layout.nbytes
    config = runtime.target.config
    bf16 = config.num_layers * layer_parameter_count(config) * 2
    assert per_pass < bf16 / 3  # Q4_K and Q6_K blocks: ~4.5-6.6 bits a weight
    for top in item["first_step_top5"]:
        assert abs(float(logits[top["id"]]) - top["logit"]) < 1e-3


def test_a_part_of_a_split_model_is_refused(tmp_path: Path) -> None:
    renamed = tmp_path / "model-00001-of-00003.gguf"
    shutil.copy(GGUF / "stories260k-Q8_0.gguf", renamed)
    with pytest.raises(GGUFError, match="llama-gguf-split --merge"):
        open_checkpoint(renamed)


def _from_disk_copy(path: Path) -> tuple[Runtime, Callable[[], torch.Tensor]]:
    """stories260k's Q8_0 file copied to `path`, its layers read from there at every pass,
    and its logits for three tokens."""
    shutil.copy(GGUF / "stories260k-Q8_0.gguf", path)
    runtime = Runtime(
        RuntimeOptions(model=str(path), device="cpu", dtype="fp32", context=64,
                       offload="stream", resident_layers=0, host_tier="disk", slots=2)
    )  # fmt: skip
    tokens = torch.tensor([5, 17, 40])

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return runtime.target(tokens, torch.arange(3), runtime.target.new_cache(8))

    return runtime, logits


def test_a_gguf_cut_short_under_the_disk_tier_is_an_error_naming_it(tmp_path: Path) -> None:
    """The disk tier reads a GGUF's layers with positioned reads, never through the
    loader's memory map: a file cut short while the model runs is an error naming the
    layer and the file on the pass that needed it (through a map it was a SIGBUS that
    killed the daemon), and once the file is whole again the next pass reads afresh."""
    from offload.storage import LayerReadError

    path = tmp_path / "model.gguf"
    _, logits = _from_disk_copy(path)
    intact = path.read_bytes()

    want = logits()
    path.write_bytes(intact[: len(intact) // 2])
    with pytest.raises(LayerReadError, match=r"layer \d+ .*model\.gguf") as err:
        logits()
    assert isinstance(err.value.__cause__, EOFError)
    path.write_bytes(intact)
    assert torch.equal(logits(), want)


def test_layers_dequantized_at_load_are_not_read_from_the_file() -> None:
    """A GGUF whose layers were kept dequantized (a plan with room for them on a GPU) holds
    dense weights the file does not: asked for disk-tier readers (memory pressure's
    `disk_tier` step, after its layers were demoted into a stream), it is a GGUFError
    saying so, which the step reports as "nothing moved" (it was an AttributeError, logged
    with a traceback at every try)."""
    from daemon.target_loading import disk_sources
    from offload.layout import FlatLayout

    model, _, ckpt = load(GGUF / "stories260k-Q4_0.gguf", "fp32")
    model.dequantize_layers()
    names = [e.name for e in FlatLayout.of(model.layers[0]).tensors]
    with pytest.raises(GGUFError, match=r"o_proj\.weight.*dequantized at load"):
        disk_sources(ckpt, [3, 4], names, "fp32")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "name",
    ["llama-rand-256-Q2_K", "llama-rand-256-Q4_K_M", "llama-rand-256-Q6_K",
     "llama-rand-256-F16", "stories260k-Q4_0", "stories260k-Q4_K_M", "stories260k-F32"],
)  # fmt: skip
def test_the_disk_tier_reads_each_layer_byte_for_byte_as_loaded(name: str, dtype: str) -> None:
    """Every layer read through the disk tier's readers (in place, in a wider type's room
    with zeros after, or converted: q/k rows reordered, floats of another dtype) is the
    layer loaded into RAM, byte for byte, in the streamer's layout."""
    from daemon.target_loading import disk_sources
    from offload.layout import FlatLayout
    from offload.storage import DiskStorage

    model, _, ckpt = load(GGUF / f"{name}.gguf", dtype)
    layers = list(model.layers)
    layout = FlatLayout.of(layers[0])
    names = [e.name for e in layout.tensors]
    storage = DiskStorage(layout, disk_sources(ckpt, list(range(len(layers))), names, dtype))
    for i, layer in enumerate(layers):
        want = torch.zeros(layout.nbytes, dtype=torch.uint8)
        layout.pack(layer, want)
        got = storage.read(i, torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8))
        theirs, ours = layout.views(want), layout.views(got)  # (the padding between is not read)
        for entry in layout.tensors:
            a, b = theirs[entry.name].view(torch.uint8), ours[entry.name].view(torch.uint8)
            assert torch.equal(a, b), (name, dtype, i, entry.name)
    storage.close()


def test_the_plan_holds_the_disk_tiers_conversion_scratch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A GGUF layer's q/k rows are reordered as they are read from the disk tier: their
    bytes and the reordered copy are held besides the staging buffers, and the plan's
    host RAM counts them (a safetensors read, at most one piece of a cast)."""
    import json

    from daemon.footprint import footprint
    from offload.planning import host_tier_bytes
    from offload.storage import CAST_CHUNK_BYTES

    path = GGUF / "llama-rand-256-Q4_K_M.gguf"
    ckpt = open_checkpoint(path)
    fp = footprint(ckpt.config, torch.float32, "t", device_type="cpu")
    q_proj = ckpt.config.num_heads * ckpt.config.head_dim // 256 * 144  # (Q4_K: 144 B / 256)
    assert fp.disk_scratch_bytes == 2 * ckpt.config.hidden_size * q_proj
    argv = ["plan", "--model", str(path), "--offload", "stream", "--resident-layers", "0",
            "--host-tier", "disk", "--device", "cpu", "--dtype", "fp32", "--json"]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    staging = host_tier_bytes(fp.layer_bytes, plan["slots"])
    assert plan["host_bytes"] == staging + fp.disk_scratch_bytes
    plain = footprint(open_checkpoint(SHARED_MODELS / "stories260k").config, torch.float32, "t")
    assert plain.disk_scratch_bytes == min(CAST_CHUNK_BYTES, plain.layer_bytes)  # (a cast's)


def test_the_disk_tier_reads_the_file_it_was_made_from(tmp_path: Path) -> None:
    """The disk tier opens its files as it is made: a file renamed over the model's, or a
    FIFO put there, later changes nothing (the file was opened at the first read: a FIFO
    hung the engine for good, SIGTERM and all, and a renamed-in file was read at the
    loaded file's offsets forever); a tier made where a FIFO is refuses it by name."""
    import os

    from daemon.target_loading import disk_sources
    from offload.layout import FlatLayout
    from offload.storage import DiskStorage

    path = tmp_path / "model.gguf"
    runtime, logits = _from_disk_copy(path)
    tokens = torch.tensor([5, 17, 40])

    plain = Runtime(RuntimeOptions(model=str(GGUF / "stories260k-Q8_0.gguf"), device="cpu",
                                   dtype="fp32", context=64))  # fmt: skip
    with torch.inference_mode():
        want = plain.target(tokens, torch.arange(3), plain.target.new_cache(8))
    other = tmp_path / "other.gguf"
    shutil.copy(GGUF / "llama-rand-256-Q8_0.gguf", other)
    os.replace(other, path)  # another model renamed over it before the first pass
    assert torch.equal(logits(), want)
    path.unlink()
    os.mkfifo(path)
    assert torch.equal(logits(), want)
    streamer = runtime.streamer
    assert streamer is not None
    names = [e.name for e in streamer.layout.tensors]
    layout = FlatLayout(streamer.layout.tensors, streamer.layout.nbytes)
    with pytest.raises(ValueError, match="is not a regular file"):
        DiskStorage(layout, disk_sources(runtime.checkpoint, streamer.order, names, "fp32"))
