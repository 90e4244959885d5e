"""The CPU kernels on GGUF blocks (modeling/weights/cpu_kernels.py): every weight they
compute is the reference decoder's bit for bit, products equal the rebuilt matrix's to
float summation order, a projection or head takes them only where they apply, and a
real model's greedy text is unchanged with them."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType as GGMLType

from modeling.weights import cpu_kernels
from modeling.weights.gguf_blocks import BLOCK_SIZES, SpecdType, dequantize
from modeling.weights.gguf_modules import GGUFEmbedding, GGUFLinear

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"no CPU kernels here: {cpu_kernels.status()}"
)

KINDS = list(cpu_kernels.TYPES)


def test_the_kernels_build_wherever_they_can() -> None:
    """The tests below skip where the kernels are unavailable; that must mean a machine
    without them (another vector unit, no C compiler, turned off), never a C file that does
    not compile or a library that does not load, which would skip them all silently."""
    vector_unit = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    compiler = any(shutil.which(name) for name in ("cc", "gcc", "clang"))
    turned_off = os.environ.get("SPECD_CPU_KERNELS", "").lower() in ("off", "0", "false", "no")
    if not vector_unit or not compiler or turned_off:
        assert not cpu_kernels.available()
        return
    assert cpu_kernels.available(), cpu_kernels.status()
    assert cpu_kernels.status() == "compiled for this CPU (AVX2, FMA)"


def random_blocks(kind: GGMLType, rows: int, columns: int, seed: int) -> torch.Tensor:
    """Random bytes as `rows` rows of `kind` blocks: every code and scale bit pattern, so
    half scales include subnormals, negatives, infinities and NaNs."""
    elements, size = BLOCK_SIZES[kind]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(
        0, 256, (rows, columns // elements * size), dtype=torch.uint8, generator=g
    )
    if kind in (SpecdType.Q4_0B, SpecdType.Q8_0B, SpecdType.Q4_ZB):  # bf16 scales of
        # either sign, 2^-31 .. 2^1 (a bf16's range would overflow the rows' sums)
        high = blocks.view(-1, size)[:, 1]
        high.copy_((high & 0x80) | (0x30 + high % 16))
    if kind == GGMLType.MXFP4:  # its scale byte: 2^(e - 128), subnormal ones included, but
        # none so large that a row's sum overflows (12 x 2^127 is already infinite)
        blocks.view(-1, size)[:, 0] %= 160
    return blocks


@needs_kernels
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_weight_is_the_reference_decoders(kind: GGMLType) -> None:
    """Multiplying by one-hot rows reads each weight alone: where the reference decodes a
    finite row, the kernel's weights are equal bit for bit."""
    elements, _ = BLOCK_SIZES[kind]
    columns = 2 * max(elements, 64)
    blocks = random_blocks(kind, 23, columns, seed=int(kind))
    reference = dequantize(blocks, kind, columns)  # (23, columns)
    finite = torch.isfinite(reference).all(1)
    assert int(finite.sum()) >= 5  # (random scales: most rows are finite)
    eye = torch.eye(columns)
    rows = cpu_kernels.max_product_rows()  # (chunks of max_rows within a call)
    got = torch.cat(
        [cpu_kernels.gemv(eye[i : i + rows], blocks, kind) for i in range(0, columns, rows)]
    )
    assert torch.equal(got.T[finite], reference[finite])
    # The one-row path (its own scale and offset handling): every 7th column alone.
    alone = torch.stack([cpu_kernels.gemv(eye[i], blocks, kind) for i in range(0, columns, 7)])
    assert torch.equal(alone.T[finite], reference[finite][:, ::7])


@needs_kernels
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_products_equal_the_rebuilt_matrix(kind: GGMLType) -> None:
    """Up to `max_rows` rows at once, any row count of the matrix (odd, one): the rebuilt
    matrix's product to float summation order (1e-5 of sum |x| |w|)."""
    elements, _ = BLOCK_SIZES[kind]
    columns = 3 * max(elements, 32)
    blocks = random_blocks(kind, 41, columns, seed=100 + int(kind))
    w = dequantize(blocks, kind, columns)
    finite = torch.isfinite(w).all(1)
    g = torch.Generator().manual_seed(7)
    for rows in (1, 2, 5, cpu_kernels.max_rows(), 13, cpu_kernels.max_product_rows()):
        x = torch.randn(rows, columns, generator=g)
        got = cpu_kernels.gemv(x, blocks, kind)[:, finite]
        want = (x @ w.T)[:, finite]
        scale = x.abs() @ w[finite].abs().T
        assert bool(((got - want).abs() <= 1e-5 * scale + 1e-30).all()), (kind.name, rows)
    one = cpu_kernels.gemv(torch.randn(columns, generator=g), blocks[:1], kind)
    assert one.shape == (1,)


@needs_kernels
def test_shapes_that_do_not_fit_never_reach_the_kernel() -> None:
    """The C code trusts its sizes: every mismatch is a ValueError here first."""
    kind = GGMLType.Q4_0
    blocks = random_blocks(kind, 4, 64, seed=1)
    bad = [
        (torch.randn(1, 96), blocks),  # K does not match the rows' bytes
        (torch.randn(1, 48), random_blocks(kind, 4, 32, seed=1)[:, :9]),  # not whole blocks
        (torch.randn(cpu_kernels.max_product_rows() + 1, 64), blocks),  # too many rows
        (torch.randn(1, 64, dtype=torch.float64), blocks),
        (torch.randn(1, 64), blocks.view(torch.int8)),
        (torch.randn(0, 64), blocks),
    ]
    for x, b in bad:
        with pytest.raises(ValueError, match="do not fit"):
            cpu_kernels.gemv(x, b, kind)


@needs_kernels
def test_a_projection_takes_the_kernel_for_a_few_rows_only(monkeypatch) -> None:
    """GGUFLinear: up to `max_product_rows` rows of fp32 on the CPU go to the kernel (bias added),
    more rows and other dtypes rebuild the weight; both give the same product."""
    kind = GGMLType.Q4_K
    layer = GGUFLinear(256, 48, True, kind)
    layer.blocks.copy_(random_blocks(kind, 48, 256, seed=3))
    layer.blocks.view(48, -1, 144)[..., :4] = torch.tensor([0, 40, 0, 36], dtype=torch.uint8)
    torch.nn.init.normal_(layer.bias)
    calls = []
    real = cpu_kernels.BlockProduct.__call__

    def counted(*args):  # type: ignore[no-untyped-def]
        out = real(*args)
        if out is not None:
            calls.append(args)
        return out

    monkeypatch.setattr(cpu_kernels.BlockProduct, "__call__", counted)
    x = torch.randn(3, 256)
    with torch.no_grad():
        few = layer(x)
        assert len(calls) == 1
        w = layer.dequantize(torch.float32)
        rebuilt = torch.nn.functional.linear(x, w, layer.bias)
        assert bool(((few - rebuilt).abs() <= 1e-5 * (x.abs() @ w.abs().T) + 1e-5).all())
        many = layer(torch.randn(cpu_kernels.max_product_rows() + 1, 256))
        half = layer.to(torch.bfloat16)(x.bfloat16())
    assert len(calls) == 1 and many.shape == (cpu_kernels.max_product_rows() + 1, 48)
    assert half.dtype == torch.bfloat16


def test_turned_off_it_says_why(monkeypatch) -> None:
    monkeypatch.setenv("SPECD_CPU_KERNELS", "off")
    library = cpu_kernels._Library()
    assert not library.load() and "SPECD_CPU_KERNELS" in library.reason


@needs_kernels
def test_a_real_chat_models_greedy_text_is_unchanged(shared_models, monkeypatch) -> None:
    """SmolLM2 as shipped (Q4_1, tied head): on the CPU its layers stay packed and its head
    is the embedding's blocks (no dense copy); greedy ids with the kernels (products,
    norms, attention) equal those of PyTorch's operators on the rebuilt weights."""
    from modeling.checkpoints.checkpoint import load

    path = shared_models / "smollm2-135m-instruct" / "smollm2-135m-instruct-q4_1.gguf"
    model, tokenizer, _ = load(path, torch.float32, "cpu")
    assert isinstance(model.lm_head, GGUFLinear) and isinstance(model.embed_tokens, GGUFEmbedding)
    assert model.lm_head.blocks is model.embed_tokens.blocks
    ids = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])

    def greedy(n: int) -> list[int]:
        cache = model.new_cache(len(ids) + n)
        logits = model(torch.tensor(ids), torch.arange(len(ids)), cache)[-1]
        out = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            pos = torch.tensor([cache.length])
            logits = model(torch.tensor(out[-1:]), pos, cache)[-1]
        return out

    with torch.inference_mode():
        fast = greedy(24)
        # PyTorch's operators throughout: rebuilt projections, its norms and attention
        monkeypatch.setattr(cpu_kernels.BlockProduct, "__call__", lambda self, x: None)
        monkeypatch.setattr(cpu_kernels, "rms_norm", lambda *args: None)
        monkeypatch.setattr(cpu_kernels, "attention", lambda *args: None)
        rebuilt = greedy(24)
    assert fast == rebuilt
    assert "Paris" in tokenizer.decode(fast)


@needs_kernels
def test_threads_split_rows_and_change_nothing() -> None:
    """Each row is computed the same way whichever thread computes it: products with the
    rows split among 2 and 3 threads equal one thread's bit for bit, also while another
    Python thread multiplies at the same time (it then computes alone)."""
    import threading

    kind = GGMLType.Q4_K
    blocks = random_blocks(kind, 384, 512, seed=11)
    blocks.view(384, -1, 144)[..., :4] = torch.tensor([0, 40, 0, 36], dtype=torch.uint8)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    try:
        assert cpu_kernels.set_threads(1) == 1
        alone = cpu_kernels.gemv(x, blocks, kind)
        for n in (2, 3):
            assert cpu_kernels.set_threads(n) == n
            assert torch.equal(cpu_kernels.gemv(x, blocks, kind), alone)
        results: list[bool] = []

        def other() -> None:
            results.extend(
                torch.equal(cpu_kernels.gemv(x, blocks, kind), alone) for _ in range(200)
            )

        side = threading.Thread(target=other)
        side.start()
        mine = [torch.equal(cpu_kernels.gemv(x, blocks, kind), alone) for _ in range(200)]
        side.join()
        assert all(mine) and all(results) and len(results) == 200
        # Jobs of every size one after another: each cut into its own number of chunks and
        # threads (the workers claim chunks of whichever job is current, never an old one's).
        cpu_kernels.set_threads(3)
        for rows in [*range(128, 385, 8)] * 4:
            assert torch.equal(cpu_kernels.gemv(x, blocks[:rows], kind), alone[:, :rows]), rows
    finally:
        cpu_kernels.set_threads(1)


@needs_kernels
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_computes_with_threads_of_its_own() -> None:
    """A child forked while the pool's workers sleep (or spin) starts with a pool of its
    own: asking for threads again used to hang it at its first product, broadcasting to
    the parent's sleepers under the parent's locks."""
    import multiprocessing

    kind = GGMLType.Q4_K
    blocks = random_blocks(kind, 384, 512, seed=5)
    blocks.view(384, -1, 144)[..., :4] = torch.tensor([0, 40, 0, 36], dtype=torch.uint8)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4))
    try:
        cpu_kernels.set_threads(3)
        alone = cpu_kernels.gemv(x, blocks, kind)  # the workers now spin, then sleep
        deadline = time.monotonic() + 60
        while cpu_kernels.sleeping_workers() < 2:  # (their spin is at most a millisecond)
            assert time.monotonic() < deadline, "the workers never slept"
        child = multiprocessing.get_context("fork").Process(
            target=_products_in_a_child, args=(x, blocks, kind, alone)
        )
        child.start()
        child.join(timeout=120)
        if child.exitcode is None:
            child.kill()
        assert child.exitcode == 0, "the forked child hung or failed"
    finally:
        cpu_kernels.set_threads(1)


def _products_in_a_child(
    x: torch.Tensor, blocks: torch.Tensor, kind: int, want: torch.Tensor
) -> None:
    assert cpu_kernels.gemv(x, blocks, kind).equal(want)  # alone, as forked
    assert cpu_kernels.set_threads(3) == 3
    for _ in range(50):
        assert cpu_kernels.gemv(x, blocks, kind).equal(want)


@needs_kernels
def test_a_runtime_gives_the_threads_to_the_kernels(shared_models) -> None:
    """A CPU runtime whose projections the kernels compute gives them its threads and keeps
    PyTorch's operators on one (both pools spinning on two cores was 4x slower), and says so
    in its status; a dense model keeps PyTorch's threads."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime

    path = shared_models / "smollm2-135m-instruct" / "smollm2-135m-instruct-q4_1.gguf"
    before = torch.get_num_threads()
    try:
        rt = Runtime(RuntimeOptions(model=str(path), device="cpu", threads=2, prefix_cache=0))
        status = rt.cpu_kernels_status()
        assert status["used"] and status["kernel_threads"] == 2 and status["torch_threads"] == 1
        dense = Runtime(RuntimeOptions(model=str(shared_models / "stories260k"), device="cpu",
                                       threads=2, prefix_cache=0))  # fmt: skip
        assert not dense.cpu_kernels_status()["used"] and torch.get_num_threads() == 2
    finally:
        cpu_kernels.set_threads(1)
        torch.set_num_threads(before)


def test_a_runtime_says_when_the_kernels_are_unavailable(
    shared_models, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a C compiler every CPU model runs several times slower: the runtime warns
    once, with the reason and what to install; turned off on purpose (or on a CPU without
    AVX2) it does not warn."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime

    reason = "no C compiler (cc, gcc or clang) to build them with: install one"
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(cpu_kernels, "status", lambda: reason)
    monkeypatch.setattr(cpu_kernels, "fixable", lambda: True)
    options = RuntimeOptions(model=str(shared_models / "stories260k"), device="cpu",
                             threads=1, prefix_cache=0)  # fmt: skip
    before = torch.get_num_threads()
    try:
        with caplog.at_level("WARNING", logger="specd.runtime"):
            Runtime(options)
        assert [r.getMessage() for r in caplog.records] == [
            f"the CPU kernels are unavailable: {reason}"
        ]
        caplog.clear()
        monkeypatch.setattr(cpu_kernels, "status", lambda: "turned off by SPECD_CPU_KERNELS")
        monkeypatch.setattr(cpu_kernels, "fixable", lambda: False)
        with caplog.at_level("WARNING", logger="specd.runtime"):
            Runtime(options)
        assert not caplog.records
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_a_projection_follows_its_blocks_when_a_slot_changes_layer() -> None:
    """A GGUFLinear checks its blocks once per tensor and type (`BlockProduct`): a streamed
    slot that takes another layer's type in place, or a new tensor bound in place of the
    old, is multiplied as what it now holds."""
    layer = GGUFLinear(64, 16, False, GGMLType.Q4_0, kinds=(GGMLType.Q8_0,))
    x = torch.randn(2, 64)

    def check() -> None:
        with torch.no_grad():
            got = layer(x)
        w = layer.dequantize(torch.float32)
        assert bool(((got - x @ w.T).abs() <= 1e-5 * (x.abs() @ w.abs().T) + 1e-5).all())

    def blocks(kind: GGMLType, seed: int) -> torch.Tensor:  # d = 0.5 in every block
        out = random_blocks(kind, 16, 64, seed)
        out.view(16, 2, -1)[..., :2] = torch.tensor([0, 56], dtype=torch.uint8)
        return out

    q4 = blocks(GGMLType.Q4_0, 5)
    layer.blocks.view(-1)[: q4.numel()] = q4.view(-1)
    check()
    layer.load_stream_state(int(GGMLType.Q8_0))  # the same slot, the next layer's type
    layer.blocks.copy_(blocks(GGMLType.Q8_0, 6))
    check()
    layer._buffers["blocks"] = blocks(GGMLType.Q8_0, 7)
    check()


def close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> bool:
    """Equal to float summation order: within 1e-5 of the magnitudes summed (`scale`)."""
    return bool(((got - want).abs() <= 1e-5 * scale + 1e-6).all())


@needs_kernels
def test_stacked_projections_are_one_call_with_each_ones_values(monkeypatch) -> None:
    """q/k/v (or gate/up) of one input in one kernel call, each part of its own type and
    bias: the columns of each are its product alone, bit for bit; more rows than the
    kernels take, or a part that is not GGUF blocks, are not stacked (None)."""
    from modeling.weights.projections import linear, stacked

    g = torch.Generator().manual_seed(4)
    parts = []
    for kind, rows, seed in (
        (GGMLType.Q4_K, 64, 1),
        (GGMLType.Q8_0, 32, 2),
        (GGMLType.Q6_K, 32, 3),
        (GGMLType.Q2_K, 32, 4),  # an offset per 16: the call sums halves of x too
    ):
        layer = GGUFLinear(256, rows, True, kind)
        blocks = random_blocks(kind, rows, 256, seed)
        size = BLOCK_SIZES[kind][1]
        if kind == GGMLType.Q8_0:  # finite scales: d = 2^-8
            blocks.view(rows, -1, size)[..., :2] = torch.tensor([0, 28], dtype=torch.uint8)
        elif kind == GGMLType.Q4_K:
            blocks.view(rows, -1, size)[..., :4] = torch.tensor([0, 40, 0, 36], dtype=torch.uint8)
        elif kind == GGMLType.Q2_K:  # d, dmin last
            blocks.view(rows, -1, size)[..., -4:] = torch.tensor([0, 28, 0, 24], dtype=torch.uint8)
        else:  # Q6_K: d last
            blocks.view(rows, -1, size)[..., -2:] = torch.tensor([0, 28], dtype=torch.uint8)
        layer.blocks.copy_(blocks)
        layer.bias.data.normal_(generator=g)
        parts.append(layer)
    calls = []
    real = cpu_kernels._LIBRARY.products
    monkeypatch.setattr(cpu_kernels._LIBRARY, "products", lambda *a: calls.append(a) or real(*a))
    with torch.no_grad():
        for rows in (1, 3, cpu_kernels.max_rows(), cpu_kernels.max_product_rows()):
            x = torch.randn(rows, 256, generator=g)
            calls.clear()
            both = stacked(parts, x)
            assert both is not None and len(calls) == 1 and both.shape == (rows, 160)
            assert torch.equal(both, torch.cat([linear(p, x) for p in parts], dim=-1))
        assert stacked(parts, torch.randn(cpu_kernels.max_product_rows() + 1, 256)) is None
        assert stacked([parts[0], torch.nn.Linear(256, 8)], x) is None


@needs_kernels
def test_the_compiled_operator_stacks_any_number_of_rows() -> None:
    """`specd::gguf_products`, as a compiled pass calls it: a few rows through the kernels,
    more through the rebuilt matrices, the parts' outputs side by side either way."""
    kinds = [GGMLType.Q8_0, GGMLType.Q4_0]
    blocks = [random_blocks(k, 16, 64, seed=int(k)) for k in kinds]
    for b in blocks:
        b.view(16, 2, -1)[..., :2] = torch.tensor([0, 56], dtype=torch.uint8)  # d = 0.5
    weight = torch.cat([dequantize(b, k, 64) for b, k in zip(blocks, kinds, strict=True)])
    for rows in (2, cpu_kernels.max_rows() + 5, cpu_kernels.max_product_rows() + 5):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        got = torch.ops.specd.gguf_products(x, blocks, [int(k) for k in kinds])
        assert close(got, x @ weight.T, x.abs() @ weight.abs().T)


@needs_kernels
def test_norms_of_a_few_rows_equal_pytorchs() -> None:
    """RMSNorm's kernel on (T, d) rows and on a (heads, T, hd) view of a stacked output (a
    q/k norm), with and without Gemma's offset: PyTorch's values to float rounding; more
    rows than the kernels take, another dtype, or a gradient to keep are not taken."""
    from modeling.layers.norms import RMSNorm

    g = torch.Generator().manual_seed(5)
    for offset in (0.0, 1.0):
        norm = RMSNorm(64, 1e-6, offset)
        norm.weight.data.normal_(generator=g)
        qkv = torch.randn(3, 12 * 64, generator=g) * 7  # (T, heads * hd): heads 0-8 are q
        views = [
            torch.randn(1, 64, generator=g),
            torch.randn(cpu_kernels.max_rows(), 64, generator=g) * 1e3,
            qkv.view(3, 12, 64).transpose(0, 1)[:9],  # (9, 3, 64), rows 768 floats apart
        ]
        for x in views:
            want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + norm.weight)
            with torch.no_grad():
                got = norm(x)
            assert got.shape == x.shape and got.is_contiguous()
            assert torch.allclose(got, want, rtol=2e-6, atol=1e-6)
    w = torch.ones(64)
    assert cpu_kernels.rms_norm(torch.randn(cpu_kernels.max_rows() + 1, 64), w, 1e-6) is None
    assert cpu_kernels.rms_norm(torch.randn(2, 64, dtype=torch.float64), w, 1e-6) is None
    with torch.enable_grad():  # the kernels have no backward: a gradient to keep stays PyTorch's
        assert cpu_kernels.rms_norm(torch.randn(2, 64, requires_grad=True), w, 1e-6) is None
        trained = torch.nn.Parameter(torch.ones(64))
        assert cpu_kernels.rms_norm(torch.randn(2, 64), trained, 1e-6) is None
        q = torch.randn(2, 1, 8)
        sinks = torch.nn.Parameter(torch.zeros(2))
        assert cpu_kernels.attention(q, q, q, None, 1.0, None, sinks) is None


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "kv_heads", "rows", "keys", "hd", "softcap", "sinks", "masked"),
    [
        (9, 3, 1, 150, 64, None, False, False),  # SmolLM2's decode step
        (32, 8, 8, 3000, 128, None, False, True),  # an 8B's short chain
        (8, 8, 1, 10, 256, 30.0, False, False),  # soft cap (Gemma 2), head 256
        (64, 8, 3, 77, 64, None, True, True),  # sinks (gpt-oss)
        (4, 1, 1, 1, 8, None, False, False),  # one key
    ],
)
def test_attention_of_a_few_rows_equals_pytorchs(
    heads: int, kv_heads: int, rows: int, keys: int, hd: int, softcap, sinks: bool, masked: bool
) -> None:
    """The kernels' attention against `_attend` (PyTorch's operators), over strided views
    of a longer cache: the same values to float rounding, on any number of threads."""
    from modeling.layers.attention import AttentionOptions, _attend

    g = torch.Generator().manual_seed(heads * keys)
    q = torch.randn(heads, rows, hd, generator=g)
    cache_k = torch.randn(kv_heads, keys + 20, hd, generator=g) * 2
    cache_v = torch.randn(kv_heads, keys + 20, hd, generator=g)
    k, v = cache_k[:, :keys], cache_v[:, :keys]
    mask = None
    if masked:
        mask = torch.rand(rows, keys, generator=g) > 0.3
        mask[:, 0] = True
    sink = torch.randn(heads, generator=g) if sinks else None
    scale = hd**-0.5
    want = _attend(q, k, v, mask, AttentionOptions(scale, None, softcap), sink)
    got = cpu_kernels.attention(q, k, v, mask, scale, softcap, sink)
    assert got is not None and got.shape == (heads, rows, hd)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    try:  # (kv head, row) items split among threads: the same values bit for bit
        cpu_kernels.set_threads(3)
        assert torch.equal(cpu_kernels.attention(q, k, v, mask, scale, softcap, sink), got)
    finally:
        cpu_kernels.set_threads(1)


@needs_kernels
def test_attention_reads_no_key_past_the_last_one_a_row_sees() -> None:
    """A compiled pass attends over the cache's whole allocation, its unwritten slots
    hidden: the kernels stop at each row's last visible key, so what lies past it (NaN
    here) is never read; rows the kernels do not take are left to PyTorch (None)."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(4, 2, 64, generator=g)
    k = torch.randn(2, 100, 64, generator=g)
    v = torch.randn(2, 100, 64, generator=g)
    k[:, 60:] = float("nan")
    v[:, 60:] = float("nan")
    mask = torch.zeros(2, 100, dtype=torch.bool)
    mask[0, :59] = True
    mask[1, :60] = True
    got = cpu_kernels.attention(q, k, v, mask, 0.125)
    want = cpu_kernels.attention(q, k[:, :60], v[:, :60], mask[:, :60], 0.125)
    assert got is not None and want is not None and torch.equal(got, want)
    assert bool(torch.isfinite(got).all())
    hidden = mask.clone()
    hidden[1] = False  # a row that sees nothing: NaN, as PyTorch's softmax gives
    nothing = cpu_kernels.attention(q, k[:, :60], v[:, :60], hidden[:, :60], 0.125)
    assert nothing is not None and bool(nothing[:, 1].isnan().all())
    assert torch.equal(nothing[:, 0], want[:, 0])
    many = torch.randn(4, cpu_kernels.max_rows() + 1, 64)
    assert cpu_kernels.attention(many, k, v, None, 0.125) is None
    assert (
        cpu_kernels.attention(q[..., :60], k[..., :60], v[..., :60], None, 0.125) is None
    )  # hd % 8


@needs_kernels
def test_a_library_cut_short_in_the_cache_is_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached library cut short (a full disk) killed every run with SIGBUS when loaded;
    a zero-length one disabled the kernels for good. Its digest is kept beside it now."""
    from modeling.weights import cpu_library

    monkeypatch.setenv("SPECD_KERNEL_CACHE", str(tmp_path))
    built = cpu_library._build()
    whole = built.read_bytes()
    assert cpu_library._intact(built)
    for damaged in (whole[: len(whole) // 2], b""):
        built.write_bytes(damaged)
        assert not cpu_library._intact(built)
        assert cpu_library._build() == built and built.read_bytes() == whole
