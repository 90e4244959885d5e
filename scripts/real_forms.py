"""Other forms of the shared real chat model, built once from its GGUF file and cached
(never committed): SmolLM2-135M-Instruct as an F32 safetensors folder, so that what only a
full-precision checkpoint allows (`--quantize int8|int4`, `--draft-quantize`: the target
quantized on load as its own aligned draft) can be measured on a real model.

The folder is written by transformers' GGUF loader (a benchmark and test tool here, never
a run-time dependency of specd), with the tokenizer and chat template the file carries,
under `platformdirs.user_cache_dir("specd")/models/` (override: SPECD_MODEL_CACHE).

    .venv/bin/python scripts/real_forms.py        # build, print the path
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.pypi_models import Unavailable, cache_dir  # noqa: E402

SMOLLM2 = ROOT.parent / "shared" / "models" / "smollm2-135m-instruct"
SMOLLM2_GGUF = SMOLLM2 / "smollm2-135m-instruct-q4_1.gguf"
SMOLLM2_F32 = "smollm2-135m-instruct-f32"


def smollm2_f32() -> Path:
    """The F32 safetensors folder of the shared SmolLM2 GGUF (its Q4_1 weights
    dequantized), built once; Unavailable when the file or transformers is missing."""
    out = cache_dir() / SMOLLM2_F32
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    if not SMOLLM2_GGUF.is_file():
        raise Unavailable(f"{SMOLLM2_GGUF} is missing (../shared/models/ beside the checkout)")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise Unavailable(f"transformers is needed to convert the GGUF file: {err}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        folder = Path(scratch) / SMOLLM2_F32
        name = SMOLLM2_GGUF.name
        model = AutoModelForCausalLM.from_pretrained(
            str(SMOLLM2), gguf_file=name, torch_dtype=torch.float32
        )
        # (save_pretrained refuses a model it loaded from GGUF: write its tensors directly.)
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        folder.mkdir()
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        model.config.torch_dtype = torch.float32
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config  # the file's; these tensors are F32
        model.config.save_pretrained(folder)
        AutoTokenizer.from_pretrained(str(SMOLLM2), gguf_file=name).save_pretrained(folder)
        shutil.rmtree(out, ignore_errors=True)
        folder.rename(out)
    return out


if __name__ == "__main__":
    try:
        print(smollm2_f32())
    except Unavailable as err:
        sys.exit(f"unavailable: {err}")
