"""A quantized checkpoint's packed layers once read: their group indices and scales
checked (`check_packed_layers`; a disk-tier layer's indices as it is read,
`check_group_index`), and GPTQ/AWQ/compressed-tensors projections replaced by the block
form the CPU kernels multiply (`to_blocks`), where every one of them has an exact one."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from modeling.checkpoints.folder_files import CheckpointError
from modeling.decoder import Transformer
from modeling.weights.block_layout import BlockQuantizedLinear
from modeling.weights.packed import AWQLinear, CompressedLinear, GPTQLinear, PackedLinear
from modeling.weights.quant import QuantizationSpec

log = logging.getLogger("specd.checkpoint")


def check_packed_layers(model: Transformer, path: Path) -> None:
    """GPTQ's g_idx names each input's group: one outside 0 .. G-1 (a damaged or hostile
    file) would index past the scales at the first pass, or wrap to the last group, so it
    is refused at load, naming the tensor (the disk tier's layers are checked as they are
    read, `check_group_index`). And a packed layer's scales must be numbers: one NaN or
    infinite scale makes every logit NaN, and greedy decoding then repeats token 0."""
    for owner, module in model.named_modules():
        if isinstance(module, GPTQLinear) and not module.g_idx.is_meta:
            check_group_index(model, f"{owner}.g_idx", module.g_idx, path)
        for name in ("scales", "weight_scale"):
            scale = getattr(module, name, None)
            if not isinstance(module, PackedLinear) or not isinstance(scale, torch.Tensor):
                continue
            if not scale.is_meta and not bool(torch.isfinite(scale).all()):
                raise CheckpointError(
                    f"{path}: {owner}.{name} holds NaN or infinite scales (the file is "
                    "damaged: download or quantize it again)"
                )


def check_group_index(model: Transformer, name: str, g_idx: torch.Tensor, path: Path) -> None:
    module = model.get_submodule(name.rsplit(".", 1)[0])
    assert isinstance(module, GPTQLinear)
    groups = module.qzeros.shape[0]
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise CheckpointError(
            f"{path}: {name} names groups outside 0..{groups - 1} (the file is damaged: "
            "download or quantize it again)"
        )


def to_blocks(model: Transformer, path: Path, spec: QuantizationSpec) -> None:
    """Every packed projection replaced by its block form (one projection's two forms at
    a time), or none where one has no exact block form against what config.json says
    (zero points other than 2^(b-1) under `sym`, groups of unequal sizes): then the model
    loads as stored, all its layers alike (a streamer needs one layout), and the plan,
    which counts each projection at the larger of its forms, holds it."""
    packed = [
        (owner, module)
        for owner, module in model.named_modules()
        if isinstance(module, GPTQLinear | AWQLinear | CompressedLinear)
    ]
    symmetric, act_order = spec.symmetric, spec.act_order
    odd = next(
        (o for o, m in packed if not BlockQuantizedLinear.has_block_form(m, symmetric, act_order)),
        None,
    )
    if odd is not None:
        log.warning(
            "%s: %s has no exact block form (its zero points, groups or scales are not what "
            "quantization_config says): the packed layers are rebuilt for each product",
            path, odd,
        )  # fmt: skip
        return
    for owner, module in packed:
        blocks = BlockQuantizedLinear.from_packed(module, symmetric, act_order)
        assert blocks is not None
        parent_name, _, attr = owner.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, blocks)
