"""Built substitute drafts kept on disk, so that a restart does not quantize again.

A substitute's quantized layers go to one safetensors file under the state directory
(`<state dir>/substitutes/<key>.safetensors`), named by a key over everything they depend
on: the target's weight files (path, size, modification time), the bits, which layers were
quantized, the dtype, and the quantizer's own settings (a change to HQQ's iteration or
layout makes new files, never a mismatch). A file is written whole under a temporary name
and renamed into place, so an interrupted build leaves no half file to be trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from speculative import hqq
from speculative.checkpoint import Checkpoint
from speculative.config import ModelConfig
from speculative.substitute import empty_layer, quantized_layer

log = logging.getLogger("specd.loading")

FORMAT = 1  # the file's layout: bump when what is stored changes


def cache_key(
    checkpoint: Checkpoint, bits: int, dtype: torch.dtype, quantized: Sequence[int]
) -> str:
    identity = {
        "format": FORMAT,
        "bits": bits,
        "dtype": str(dtype),
        "layers": list(quantized),
        "hqq": [hqq.GROUP, hqq.LP_NORM, hqq.BETA, hqq.KAPPA, hqq.ITERATIONS],
        "files": [
            [str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
            for f in sorted(checkpoint.weight_files())
        ],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


class SubstituteCache:
    """Makes a substitute's layers (`LayerMaker`), from the stored file when there is one,
    else by quantizing, recording them to store once all are made (`save`)."""

    def __init__(
        self,
        directory: Path,
        checkpoint: Checkpoint,
        config: ModelConfig,
        bits: int,
        dtype: torch.dtype,
        device: torch.device,
        quantized: Sequence[int],
    ) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        key = cache_key(checkpoint, bits, dtype, quantized)
        self.path = directory / f"{key}.safetensors"
        self.hit = self.path.is_file()
        self.made: dict[int, nn.Module] = {}
        self.meta = {"target": str(checkpoint.path), "bits": str(bits), "layers": str(quantized)}

    def __call__(self, index: int, dense: nn.Module) -> nn.Module:
        if self.hit:
            layer = empty_layer(self.config, self.device, self.dtype)
            prefix = f"layers.{index}."
            with safe_open(self.path, framework="pt", device="cpu") as f:
                state = {name: f.get_tensor(prefix + name) for name in layer.state_dict()}
            layer.load_state_dict(state)
            return layer
        layer = quantized_layer(self.config, dense, self.device, self.dtype)
        self.made[index] = layer
        return layer

    def save(self) -> None:
        """Store what was quantized (nothing when it was all read from the file)."""
        if self.hit or not self.made:
            return
        tensors = {
            f"layers.{i}.{name}": tensor.detach().contiguous().cpu()
            for i, layer in self.made.items()
            for name, tensor in layer.state_dict().items()
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(f".{os.getpid()}.partial")
        save_file(tensors, str(partial), metadata=self.meta)
        os.replace(partial, self.path)
        log.info("substitute draft stored: %s", self.path)
