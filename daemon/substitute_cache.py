"""Built substitute drafts kept on disk, so that a restart does not quantize again.

A substitute's quantized layers go to a folder under the state directory
(`<state dir>/substitutes/<key>/`, one safetensors file per layer and a manifest), named by
a key over everything they depend on: the target's weight files (path, size, modification
time) and how it was loaded (`--quantize`), the bits, which layers were quantized, the
dtype, and the quantizer's own settings (a change to HQQ's iteration or layout makes new
folders, never a mismatch). Each layer is written as soon as it is built (one layer's
tensors in host memory at a time, never the whole substitute) into `<key>.partial/`, which
is renamed into place once complete, so an interrupted build leaves nothing to be trusted
(and is started over). The MAX_STORED most recently used substitutes are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from modeling.checkpoints.checkpoint import Checkpoint
from modeling.checkpoints.folder_files import refuse_irregular
from modeling.config import ModelConfig
from modeling.substitute import empty_layer, quantized_layer, routed_copies_layer
from modeling.weights import hqq

log = logging.getLogger("specd.loading")

FORMAT = 2  # the folder's layout: bump when what is stored changes
MAX_STORED = 4  # substitutes kept (each as large as the substitute itself)
MANIFEST = "manifest.json"
STORED_NAME = re.compile(r"[0-9a-f]{32}")  # `cache_key`'s names: the only folders evicted


def cache_key(
    checkpoint: Checkpoint,
    bits: int,
    dtype: torch.dtype,
    quantized: Sequence[int],
    routed_only: bool = False,
) -> str:
    spec = checkpoint.config.quantization
    identity: dict[str, object] = {
        "format": FORMAT,
        "bits": bits,
        "dtype": str(dtype),
        "layers": list(quantized),
        "target_quantization": spec.label if spec is not None else None,
        "hqq": [hqq.GROUP, hqq.LP_NORM, hqq.BETA, hqq.KAPPA, hqq.ITERATIONS],
        "files": [
            [str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
            for f in sorted(checkpoint.weight_files())
        ],
    }
    if routed_only:  # copies of the routed experts alone (the rest is the target's)
        identity["routed_only"] = True
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


class SubstituteCache:
    """Makes a substitute's layers (a `modeling.substitute.LayerMaker`): from the stored
    folder when there is one, else by quantizing, writing each layer as it is made."""

    def __init__(
        self,
        directory: Path,
        checkpoint: Checkpoint,
        config: ModelConfig,
        bits: int,
        dtype: torch.dtype,
        device: torch.device,
        quantized: Sequence[int],
        routed_only: bool = False,
    ) -> None:
        self.directory = directory
        self.config, self.dtype, self.device = config, dtype, device
        # A mixture whose experts live in RAM: its layers' expert copies alone are stored
        # (`routed_copies_layer`; the rest of each layer is the target's own)
        self.routed_only = routed_only
        self.path = directory / cache_key(checkpoint, bits, dtype, quantized, routed_only)
        self.hit = (self.path / MANIFEST).is_file()
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.quantized = list(quantized)
        self.meta = {"target": str(checkpoint.path), "bits": bits, "layers": self.quantized}
        self.writable = True  # False once the folder cannot be written: built, not kept
        if self.hit:
            with contextlib.suppress(OSError):
                os.utime(self.path / MANIFEST)  # recently used: kept longest
        else:
            shutil.rmtree(self.partial, ignore_errors=True)  # an interrupted build's

    def __call__(self, index: int, dense: nn.Module) -> nn.Module:
        name = f"layer-{index}.safetensors"
        if self.hit:
            try:
                return self._read(index, dense, self.path / name)
            except (OSError, RuntimeError, ValueError, KeyError, SafetensorError) as err:
                # A file of the cache is hostile input like any other: one line, and the
                # substitute is built (the folder is replaced on the next complete build).
                log.warning(
                    "substitute cache %s: %s does not read back (%s); building the "
                    "substitute instead", self.path, name, " ".join(str(err).split())[:200],
                )  # fmt: skip
                self.hit = False  # (`save` drops the folder: it was read in part)
        if self.routed_only:
            layer = routed_copies_layer(self.config, index, dense, self.device, self.dtype)
        else:
            layer = quantized_layer(self.config, index, dense, self.device, self.dtype)
        if self.writable:
            state = self._own(layer).state_dict()
            tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
            try:
                self.partial.mkdir(parents=True, exist_ok=True)
                save_file(tensors, str(self.partial / name))
            except OSError as err:
                log.warning("substitute cache %s cannot be written (%s): built, not kept",
                            self.directory, err)  # fmt: skip
                self.writable = False
        return layer

    def _read(self, index: int, dense: nn.Module, file: Path) -> nn.Module:
        """Layer `index` as stored in `file`: a regular file holding exactly the layer's
        tensors, in its shapes, every value finite (else an error the caller handles)."""
        if self.routed_only:
            layer = routed_copies_layer(
                self.config, index, dense, self.device, self.dtype, quantize=False
            )
        else:
            layer = empty_layer(self.config, index, self.device, self.dtype)
        own = self._own(layer)
        refuse_irregular(file)  # (a FIFO would wait forever)
        expected = own.state_dict()
        with safe_open(file, framework="pt", device="cpu") as f:
            for key, want in expected.items():  # before any is read: a sparse file may
                # claim 2^30 values (46 s and 11.8 GB to read, then refused by its shape)
                shape = f.get_slice(key).get_shape()
                if list(shape) != list(want.shape):
                    raise ValueError(f"{key} is stored as {shape}, not {list(want.shape)}")
            stored = {key: f.get_tensor(key) for key in expected}
        bad = [k for k, v in stored.items() if v.is_floating_point() and not v.isfinite().all()]
        if bad:
            raise ValueError(f"{bad[0]} holds values that are not finite")
        own.load_state_dict(stored)  # (a wrong shape: RuntimeError)
        return layer

    def _own(self, layer: nn.Module) -> nn.Module:
        """What of `layer` is the substitute's own, stored: all of it, or its expert copies."""
        return layer.get_submodule("mlp.experts") if self.routed_only else layer

    def save(self) -> None:
        """Put the complete build in place (nothing to do when it was read), and keep only
        the MAX_STORED most recently used substitutes."""
        if self.hit or not self.partial.is_dir():
            return
        built = {f"layer-{i}.safetensors" for i in self.quantized}
        try:
            if not self.writable or not built <= {p.name for p in self.partial.iterdir()}:
                # (a stale folder read in part: the next run builds and keeps it whole)
                shutil.rmtree(self.partial, ignore_errors=True)
                shutil.rmtree(self.path, ignore_errors=True)
                return
            (self.partial / MANIFEST).write_text(json.dumps(self.meta))
            shutil.rmtree(self.path, ignore_errors=True)
            os.replace(self.partial, self.path)
            log.info("substitute draft stored: %s", self.path)
            # Only folders named as this cache names them: the folder may be the user's own.
            stored = sorted(
                (
                    p
                    for p in self.directory.iterdir()
                    if STORED_NAME.fullmatch(p.name) and (p / MANIFEST).is_file()
                ),
                key=lambda p: (p / MANIFEST).stat().st_mtime_ns,
                reverse=True,
            )
            for old in stored[MAX_STORED:]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as err:
            log.warning("substitute cache %s cannot be written (%s)", self.directory, err)
