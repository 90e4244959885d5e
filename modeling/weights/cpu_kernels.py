"""Products on GGUF blocks where they lie, on the CPU (modeling/weights/cpu_kernels.c).

Rebuilding a 4-bit projection to a float matrix for every product costs a token the bytes
of the float matrix twice (written, then read by the product): a Q4_1 model decoded no
faster than its F32 copy. These kernels read each group of 32 weights from the blocks into
registers and multiply them into up to `max_product_rows()` rows of input (decoded once
for each chunk of `max_rows()` rows, the weights read from memory once), each group's
scale and offset factored out of its sum (rounding as another summation order would; a
one-hot input gives the reference decoder's weights bit for bit, see the C file): a decode
step, a short chain, a few sequences in one pass. Longer passes (a prefill, a large tree)
are bound by arithmetic, not by bytes, and keep the rebuilt matrix and the BLAS product.

The C file is built once per machine (modeling/weights/cpu_library.py); where it cannot
be (another CPU, no compiler, SPECD_CPU_KERNELS=off) projections are rebuilt as before,
and `status()` says why. Calls go through ctypes, which releases the GIL; every pointer's
extent is checked here before the call.
"""

from __future__ import annotations

import ctypes
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from modeling.weights.cpu_library import _LIBRARY
from modeling.weights.cpu_library import TYPES as TYPES  # (the kernels' types, for callers)
from modeling.weights.cpu_library import _Library as _Library  # (tests build their own)
from modeling.weights.gguf_blocks import BlockType, block_type


def available() -> bool:
    """Whether the kernels run here (they are built on the first call)."""
    return sys.byteorder == "little" and _LIBRARY.load()


def will_build() -> bool:
    """Whether `available()` would build the kernels now: once per machine, a few seconds."""
    return sys.byteorder == "little" and _LIBRARY.will_build()


def loaded() -> bool:
    """Whether the kernels were built and loaded (without building them: a traced pass
    asks, where taking the build's lock cannot be traced)."""
    return bool(_LIBRARY.functions)


def status() -> str:
    """Why the kernels are used or not (after `available()`)."""
    if sys.byteorder != "little":
        return "this CPU is big-endian; the kernels read little-endian blocks"
    return _LIBRARY.reason


def fixable() -> bool:
    """Whether the kernels are unavailable for want of what the user can install (a C
    compiler), not for this CPU or a setting (after `available()`)."""
    return _LIBRARY.fixable


def max_product_rows() -> int:
    """The most input rows one product call multiplies (0 where the kernels are
    unavailable): a chain's or a small tree's verification, where rebuilding the matrix
    for BLAS costs more than the kernels' rows."""
    return _LIBRARY.max_product_rows if available() else 0


def max_rows() -> int:
    """The most input rows one call multiplies (0 where the kernels are unavailable)."""
    return _LIBRARY.max_rows if available() else 0


def supports(kind: int | BlockType) -> bool:
    return block_type(kind) in TYPES and available()


def computes(kind: int | BlockType, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model computing in `dtype` on `device` multiplies blocks of `kind` with
    these kernels (one pass's few rows; longer passes rebuild)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and supports(kind)


def usable(x: torch.Tensor, kind: int | BlockType) -> bool:
    """Whether `gemv` takes this input for blocks of `kind`: fp32 on the CPU, at most
    `max_product_rows()` rows, outside autograd (the kernels have no backward). Asked by every
    projection of every pass, so it reads as little as it can."""
    if not available():
        return False
    shape = x.shape
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and len(shape) >= 1
        and x.numel() <= _LIBRARY.max_product_rows * shape[-1]
        and kind in _LIBRARY.functions
        and not (x.requires_grad and torch.is_grad_enabled())
    )


_SCRATCH = threading.local()  # per thread: a float buffer for the groups' sums


def gemv(x: torch.Tensor, blocks: torch.Tensor, kind: int | BlockType) -> torch.Tensor:
    """x (..., K) fp32 times the (N, K) matrix whose rows are `blocks` (N, row_bytes) uint8
    of ggml type `kind`: (..., N) fp32. Raises ValueError for inputs that do not fit, and
    RuntimeError where the kernels are unavailable (`status()` says why)."""
    if not available():
        raise RuntimeError(f"the CPU kernels are unavailable: {status()}")
    out = try_gemv(x, blocks, kind)
    if out is None:
        raise ValueError(
            f"ggml type {kind} product: input {x.dtype} {tuple(x.shape)} on {x.device} and "
            f"these kernels do not fit (fp32 on the CPU, 1 to {_LIBRARY.max_product_rows} rows, no "
            "gradient)"
        )
    return out


def try_gemv(x: torch.Tensor, blocks: torch.Tensor, kind: int | BlockType) -> torch.Tensor | None:
    """`gemv`, or None where the kernels do not take this input (unavailable, another
    dtype or device, more rows than `max_product_rows()`, a gradient to keep). Blocks that do not
    fit the input are a ValueError: the C code trusts its sizes, and every extent it reads
    or writes is checked first. A projection called for every pass holds a `BlockProduct`
    instead, its blocks checked once."""
    return try_products(x, [(blocks, kind)])


def try_products(
    x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, int | BlockType]]
) -> torch.Tensor | None:
    """x times several projections' blocks, their outputs side by side (`BlockProduct`),
    or None where the kernels do not take x; each geometry checked once (a compiled
    pass's operator calls here for every product)."""
    if not _LIBRARY._tried:
        available()
    if not x.dim() or any(kind not in _LIBRARY.functions for _, kind in parts):  # type: ignore[comparison-overlap]
        return None
    parts = [(b if b.is_contiguous() else b.contiguous(), kind) for b, kind in parts]
    k = x.shape[-1]
    key = (k, *((b.data_ptr(), b.shape, b.dtype, b.device.type, int(kind)) for b, kind in parts))
    product = _PRODUCTS.get(key)
    if product is None:
        product = BlockProduct(parts, k)
        if len(_PRODUCTS) >= 4096:  # plans only, no tensors: a bound, not a leak
            _PRODUCTS.clear()
        _PRODUCTS[key] = product
    return product(x)


_PRODUCTS: dict[tuple[Any, ...], BlockProduct] = {}


class BlockProduct:
    """The products of one input by one or more projections' blocks (each (N, row_bytes)
    uint8 of its ggml type, over the same K inputs), their outputs side by side: a layer's
    q/k/v or gate/up in one call. Every extent is checked once, here: each call then checks
    only its input, which a projection pays for every pass (a decode step of a 30-layer
    model makes 120-210 products, and the checks cost more than a small product's kernel).
    It holds no tensor but the blocks' addresses: its owner keys it on them (with their
    shapes and types, `GGUFLinear`) and makes another when they change, and the bytes there
    are read at each call."""

    __slots__ = ("_address", "_plan", "k", "n")

    def __init__(self, parts: Sequence[tuple[torch.Tensor, int | BlockType]], k: int) -> None:
        plan = [len(parts), k]
        for blocks, kind in parts:
            index = _LIBRARY.functions.get(kind)  # type: ignore[arg-type]
            if index is None:
                raise ValueError(f"no kernel for ggml type {kind}: {status()}")
            _, size, elements = TYPES[kind]  # type: ignore[index]
            if (
                blocks.dtype != torch.uint8
                or blocks.device.type != "cpu"
                or blocks.dim() != 2
                or not blocks.is_contiguous()
                or k <= 0
                or k % elements
                or blocks.shape[1] != k // elements * size
            ):
                raise ValueError(
                    f"ggml type {kind} product: {k} inputs and blocks {blocks.dtype} "
                    f"{tuple(blocks.shape)} do not fit"
                )
            plan += [index, blocks.data_ptr(), blocks.shape[1], blocks.shape[0]]
        if not parts:
            raise ValueError("a product of no projections")
        self.k, self.n = k, sum(int(blocks.shape[0]) for blocks, _ in parts)
        self._plan = (ctypes.c_int64 * len(plan))(*plan)
        self._address = ctypes.addressof(self._plan)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """x (..., K) fp32 times the parts' matrices: (..., N) fp32, the parts' outputs in
        order; None where the kernels do not take x (another dtype or device, 0 or more than
        `max_product_rows()` rows, a gradient to keep)."""
        lib, k = _LIBRARY, self.k
        shape = x.shape
        if not shape or shape[-1] != k:
            raise ValueError(f"input {tuple(shape)} and {k} inputs a row do not fit")
        if x.dtype is not torch.float32 or not x.is_cpu:
            return None
        rows = x.numel() // k
        if not 1 <= rows <= lib.max_product_rows or (x.requires_grad and torch.is_grad_enabled()):
            return None
        if not x.is_contiguous():
            x = x.contiguous()
        sums = getattr(_SCRATCH, "sums", None)  # each group's sum, then each half's (Q2_K)
        if sums is None or sums.numel() < 3 * rows * (k // 32):
            sums = _SCRATCH.sums = torch.empty(
                3 * lib.max_product_rows * (k // 32), dtype=torch.float32
            )
        out = torch.empty((*shape[:-1], self.n), dtype=torch.float32)  # what the C code writes
        lib.products(self._address, x.data_ptr(), sums.data_ptr(), out.data_ptr(), rows)
        return out


def _few_rows(t: torch.Tensor) -> bool:
    """fp32 on the CPU, outside autograd (no gradient to keep for it: the kernels have no
    backward), each row contiguous: what the C code reads. Asked of every input, weights
    and sinks included."""
    return (
        t.dtype is torch.float32
        and t.is_cpu
        and t.stride(-1) == 1
        and not (t.requires_grad and torch.is_grad_enabled())
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor | None:
    """RMSNorm of x's last dimension, (..., d) fp32 with at most `max_rows()` rows in its
    second-last (a pass's tokens; a per-head norm's (H, T, hd) has H of them each):
    x / sqrt(mean(x²) + eps) * (offset + weight), a new contiguous tensor; None where the
    kernels do not take it (then PyTorch's operators compute the same values)."""
    lib = _LIBRARY
    if not _few_rows(x) or (not lib.functions and not available()):
        return None
    shape = x.shape
    if not 2 <= len(shape) <= 3 or not 1 <= shape[-2] <= lib.max_rows:
        return None
    d = shape[-1]
    if not _few_rows(weight) or weight.shape != (d,) or not weight.is_contiguous():
        return None
    strides = x.stride()
    a, sa = (shape[0], strides[0]) if len(shape) == 3 else (1, 0)
    out = torch.empty(shape, dtype=torch.float32)
    lib.rms_norm(x.data_ptr(), sa, strides[-2], a, shape[-2], d, weight.data_ptr(), offset, eps,
                 out.data_ptr())  # fmt: skip
    return out


# specd_attention's argument: 7 addresses, 13 counts and strides, 2 doubles (the C struct).
_ATTENTION = struct.Struct("<7Q13q2d")
_ATTENTION_ARGS = threading.local()
MAX_GROUP_WIDTH = 16384  # query heads per kv head x head_dim: the C code's accumulators


def attention(
    q: torch.Tensor,  # (H, T, hd)
    k: torch.Tensor,  # (Hkv, S, hd), rows contiguous (a view of the cache)
    v: torch.Tensor,
    mask: torch.Tensor | None,  # (T, S) bool, True = may attend
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
) -> torch.Tensor | None:
    """Grouped-query attention of at most `max_rows()` query rows, as
    modeling/layers/attention.py computes it (scores times `scale`, the soft cap, -inf where
    the mask hides, softmax in fp32 with the sinks' column, weights times values): (H, T,
    hd) fp32; keys past the last one a row sees are not read (a compiled pass's whole
    allocation). None where the kernels do not take these tensors."""
    lib = _LIBRARY
    if not _few_rows(q) or (not lib.functions and not available()):
        return None
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return None
    heads, t, hd = q.shape
    kv_heads, s = k.shape[0], k.shape[1]
    if (
        not 1 <= t <= lib.max_rows
        or v.shape != k.shape
        or k.shape[2] != hd
        or hd % 8
        or kv_heads == 0
        or heads % kv_heads
        or heads // kv_heads * hd > MAX_GROUP_WIDTH
        or not (_few_rows(q) and _few_rows(k) and _few_rows(v))
    ):
        return None
    if mask is not None and (
        mask.dtype is not torch.bool or mask.shape != (t, s) or mask.stride(-1) != 1
        or not mask.is_cpu
    ):  # fmt: skip
        return None
    if sinks is not None:
        if not _few_rows(sinks) or sinks.shape != (heads,):
            return None
        sinks = sinks.contiguous()
    parts = min(lib.threads, kv_heads * t)  # each part's scores: (H / Hkv, S) fp32
    scratch = getattr(_SCRATCH, "scores", None)
    need = parts * (heads // kv_heads) * s
    if scratch is None or scratch.numel() < need:
        scratch = _SCRATCH.scores = torch.empty(need, dtype=torch.float32)
    out = torch.empty((heads, t, hd), dtype=torch.float32)
    args = getattr(_ATTENTION_ARGS, "buffer", None)
    if args is None:
        args = _ATTENTION_ARGS.buffer = ctypes.create_string_buffer(_ATTENTION.size)
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    _ATTENTION.pack_into(
        args, 0,
        q.data_ptr(), k.data_ptr(), v.data_ptr(), 0 if sinks is None else sinks.data_ptr(),
        0 if mask is None else mask.data_ptr(), out.data_ptr(), scratch.data_ptr(),
        qs[0], qs[1], ks[0], ks[1], vs[0], vs[1], 0 if mask is None else mask.stride(0),
        heads, kv_heads, t, s, hd, parts,
        scale, softcap or 0.0,
    )  # fmt: skip
    lib.attention(args)
    return out


def set_threads(threads: int) -> int:
    """The threads each product's rows are split among from now on (this one and a pool of
    workers that sleep when idle); returns the count in effect (1 where the kernels are
    unavailable). Results do not depend on it."""
    if not available():
        return 1
    _LIBRARY.threads = int(_LIBRARY.set_threads(max(1, int(threads))))
    return _LIBRARY.threads


def threads() -> int:
    return _LIBRARY.threads


def sleeping_workers() -> int:
    """The pool's workers asleep now (0 where the kernels are unavailable)."""
    return int(_LIBRARY.sleeping_workers()) if available() else 0


# An opaque operator for torch.compile: a traced pass calls it as one node instead of
# breaking its graph at the ctypes call, for any number of rows (a compiled pass's token
# count is symbolic): a few rows go to the kernel, more to the rebuilt matrices. Several
# projections of one input (q/k/v, gate/up) are one call, their outputs side by side.
# Registered with the dispatcher directly (`operator`): `torch.library.custom_op`'s wrappers
# cost a compiled decode step of a 30-layer model more than its norms and RoPE.
def gguf_products(x: torch.Tensor, blocks: list[torch.Tensor], kinds: list[int]) -> torch.Tensor:
    out = try_products(x, list(zip(blocks, kinds, strict=True)))
    if out is not None:
        return out
    from modeling.weights.gguf_blocks import dequantize

    return torch.cat(
        [
            torch.nn.functional.linear(x, dequantize(b, kind, x.shape[-1], x.dtype))  # (N, K)
            for b, kind in zip(blocks, kinds, strict=True)
        ],
        dim=-1,
    )


def _gguf_products_fake(
    x: torch.Tensor, blocks: list[torch.Tensor], kinds: list[int]
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(b.shape[0] for b in blocks)))


_OPERATORS = torch.library.Library("specd", "FRAGMENT")  # kept for the process


def operator(
    schema: str, impl: Callable[..., Any], fake: Callable[..., Any], dispatch: str = "CPU"
) -> None:
    """Define `specd::<schema>`, computed by `impl` on the CPU (or the `dispatch` key's
    devices), its shapes by `fake`."""
    _OPERATORS.define(schema)
    name = schema.split("(", 1)[0]
    _OPERATORS.impl(name, impl, dispatch)
    torch.library.register_fake(f"specd::{name}", fake, lib=_OPERATORS)


operator("gguf_products(Tensor x, Tensor[] blocks, int[] kinds) -> Tensor", gguf_products,
         _gguf_products_fake)  # fmt: skip
