"""GGUF files made by llama.cpp's own converter, checked against transformers through specd.

The tests write GGUF files the way the converter does (tests/gguf_writers.py); this script
runs the converter itself (`convert_hf_to_gguf.py` of a llama.cpp tree: the one vendored in
the `llama-cpp-python` sdist on PyPI will do) on tiny random checkpoints of the
architectures it names, loads each file with specd, and compares the logits of a prefill,
cached decode steps and a tree pass with transformers on the source checkpoint (with the
file's Q8_0 rounding applied to it for `--outtype q8_0`). Nothing is kept or committed.

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-*.tar.gz -C /tmp/lcpp
    .venv/bin/python scripts/converter_parity.py \\
        --llama-cpp /tmp/lcpp/llama_cpp_python-*/vendor/llama.cpp

The converter reads the SentencePiece vocabulary with the `sentencepiece` package; give a
folder holding it with `--extra-path` if the environment lacks it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from scripts.tiny_models import make_checkpoint  # noqa: E402
from tests.conftest import SHARED_MODELS  # noqa: E402
from tests.test_model_parity import _check_parity, build_mistral3_wrapper  # noqa: E402

TOKENIZER = SHARED_MODELS / "stories260k"  # a 512-piece SentencePiece vocabulary
VOCAB = 512
# name → (what it is, how to build it)
CASES = {
    "ministral3": "Ministral3ForCausalLM (YaRN, the attention temperature)",
    "mistral3-ministral3": "Mistral3ForConditionalGeneration around a ministral3 text model",
    "mistral3-mistral": "Mistral3ForConditionalGeneration around a mistral text model (Mistral Small)",
}


def _tokenizer(folder: Path) -> None:
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):  # fmt: skip
        shutil.copy(TOKENIZER / name, folder / name)


def build(case: str, folder: Path) -> torch.nn.Module:
    """The case's checkpoint in `folder`, and transformers' model of it (the reference)."""
    if case == "ministral3":
        make_checkpoint(folder, "ministral3", vocab_size=VOCAB)
        from transformers import AutoModelForCausalLM

        _tokenizer(folder)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = build_mistral3_wrapper(folder, case.split("-", 1)[1], VOCAB,
                                       tie_word_embeddings=False)  # fmt: skip
    _tokenizer(folder)
    return reference


def q8_rounded(folder: Path, out: Path) -> Path:
    """`folder` with every matrix through Q8_0 and back, as the converter's q8_0 stores it."""
    shutil.copytree(folder, out)
    kind = gguf.GGMLQuantizationType.Q8_0
    tensors = {}
    for file in folder.glob("*.safetensors"):
        for name, value in load_file(file).items():
            value = np.ascontiguousarray(value, dtype=np.float32)
            if value.ndim == 2 and value.shape[1] % 32 == 0:
                value = gguf.quants.dequantize(gguf.quants.quantize(value, kind), kind)
            tensors[name] = value
        save_file(tensors, out / file.name, metadata={"format": "pt"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree")
    ap.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    ap.add_argument("--outtypes", default="f32,q8_0")
    ap.add_argument("--extra-path", default="", help="folders for the converter's PYTHONPATH")
    args = ap.parse_args()
    tree = args.llama_cpp.resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(tree / "gguf-py"), args.extra_path) if p)}  # fmt: skip
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        for case in args.cases.split(","):
            folder = Path(scratch) / case
            reference = build(case, folder)
            for outtype in args.outtypes.split(","):
                path = Path(scratch) / f"{case}-{outtype}.gguf"
                subprocess.run(
                    [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(folder),
                     "--outtype", outtype, "--outfile", str(path)],
                    check=True, env=env, cwd=tree, capture_output=True,
                )  # fmt: skip
                ref = reference
                if outtype == "q8_0":
                    rounded = q8_rounded(folder, Path(scratch) / f"{case}-q8-ref")
                    ref = type(reference).from_pretrained(rounded, dtype=torch.float32).eval()
                try:
                    _check_parity(path, f"converter-{case}-{outtype}", ref)
                    verdict = "equal (1e-4)"
                except AssertionError as exc:
                    failed += 1
                    verdict = f"DIFFERENT: {str(exc).splitlines()[0]}"
                print(f"{case:22} {outtype:5} {verdict}  ({CASES[case]})", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
