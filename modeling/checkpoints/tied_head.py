"""Whether a config that ties the head to the embedding sits beside a checkpoint whose
stored head differs from its embedding (`stored_head_differs`): the checkpoint's
files are compared a few sampled rows first, then in bounded chunks, without loading
either matrix whole."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from modeling.checkpoints.folder_files import CheckpointError
from modeling.checkpoints.safetensors_model import opened, weight_files
from modeling.config import ModelConfig
from modeling.models import architecture

# Rows of the head and the embedding compared at once (as float32).
_COMPARE_BYTES = 64 * 2**20


def stored_head_differs(path: Path, config: ModelConfig) -> bool:
    """Whether a config that ties the head to the embedding sits beside a checkpoint that
    stores a head of its own with other values (or of another shape). transformers then
    keeps the stored head (and warns), so specd does too: the caller unties the config,
    and the loader reads the head (naming it where its shape is wrong). A folder without
    its weights yet (a plan from the config alone) says no. The answer is kept per set of
    files (their sizes and times): several commands open the same checkpoint."""
    if not config.tie_word_embeddings:
        return False
    try:
        files = weight_files(path)
        key = (str(path), tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))
        if key not in _HEAD_DIFFERS:
            if len(_HEAD_DIFFERS) >= 64:
                _HEAD_DIFFERS.clear()
            _HEAD_DIFFERS[key] = _head_differs(files, config)
    except (CheckpointError, OSError):
        return False  # (a shard missing or cut short: loading says so, naming it)
    return _HEAD_DIFFERS[key]


_HEAD_DIFFERS: dict[tuple, bool] = {}
_SAMPLE_ROWS = 64  # rows compared before the whole matrix


def _head_differs(files: list[Path], config: ModelConfig) -> bool:
    arch = architecture(config)
    where: dict[str, tuple[Path, str]] = {}
    for file in files:
        with opened(file) as f:
            for stored in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = arch.hf_name(stored)
                if name in ("lm_head.weight", "embed_tokens.weight"):
                    where[name] = (file, stored)
    if len(where) < 2:
        return False
    (head_file, head_name), (embed_file, embed_name) = (
        where["lm_head.weight"],
        where["embed_tokens.weight"],
    )
    with opened(head_file) as hf, opened(embed_file) as ef:
        head, embed = hf.get_slice(head_name), ef.get_slice(embed_name)
        shape = tuple(head.get_shape())
        if shape != tuple(embed.get_shape()):
            return True  # (untied, the loader names the head's wrong shape)
        if len(shape) != 2 or 0 in shape:
            return False
        step = max(1, _COMPARE_BYTES // (shape[1] * 4))
        same_dtype = head.get_dtype() == embed.get_dtype()
        # A few rows spread over the matrix first: a head trained apart differs almost
        # everywhere, and is told in milliseconds; only a copy is read through to the end.
        sample = [(r, r + 1) for r in range(0, shape[0], max(1, shape[0] // _SAMPLE_ROWS))]
        for row, end in itertools.chain(sample, ((r, r + step) for r in range(0, shape[0], step))):
            a, b = head[row:end], embed[row:end]
            if same_dtype:  # the stored bits (a NaN equals itself)
                a, b = _bits(a), _bits(b)
            else:
                a, b = a.to(torch.float32), b.to(torch.float32)
            if not torch.equal(a, b):
                return True
    return False


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width (compared bit for bit)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t
