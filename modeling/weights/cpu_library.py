"""The CPU kernels' C library (modeling/weights/cpu_kernels.c): built and loaded once.

The C file is compiled once per machine with the system's C compiler (`$CC`, else cc, gcc
or clang) into the user cache (`platformdirs.user_cache_dir("specd")/kernels/`, named by a
hash of the source and the flags), on x86-64 CPUs with AVX2 and FMA (every desktop CPU
since 2013-2015); elsewhere, without a compiler, or with SPECD_CPU_KERNELS=off, there is
no library and `_LIBRARY.reason` says why. modeling/weights/cpu_kernels.py is what the
model calls; this module only builds, loads and describes the library (its types in the
C file's order, its entry points' ctypes signatures).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from gguf.constants import GGMLQuantizationType as GGMLType

from modeling.weights.gguf_blocks import BlockType, SpecdType

log = logging.getLogger("specd.kernels")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11",
    "-pthread",
)  # fmt: skip
LIBRARIES = ("-lm",)  # after the source: expf's and tanhf's libm
VERSION = 11  # what the C file's specd_kernels_version() must return
COMPILE_SECONDS = 120

# ggml type (or specd's own) → (C function suffix, block bytes, elements per block), in the
# order of the C file's table.
TYPES: dict[BlockType, tuple[str, int, int]] = {
    GGMLType.Q8_0: ("q8_0", 34, 32),
    GGMLType.Q4_0: ("q4_0", 18, 32),
    GGMLType.Q4_1: ("q4_1", 20, 32),
    GGMLType.Q5_0: ("q5_0", 22, 32),
    GGMLType.Q5_1: ("q5_1", 24, 32),
    GGMLType.Q4_K: ("q4_k", 144, 256),
    GGMLType.Q5_K: ("q5_k", 176, 256),
    GGMLType.Q6_K: ("q6_k", 210, 256),
    GGMLType.IQ4_NL: ("iq4_nl", 18, 32),
    GGMLType.IQ4_XS: ("iq4_xs", 136, 256),
    GGMLType.MXFP4: ("mxfp4", 17, 32),
    GGMLType.Q3_K: ("q3_k", 110, 256),
    SpecdType.Q4_Z: ("q4_z", 19, 32),
    GGMLType.Q2_K: ("q2_k", 84, 256),
    SpecdType.Q4_0B: ("q4_0b", 18, 32),
    SpecdType.Q8_0B: ("q8_0b", 34, 32),
    SpecdType.Q4_ZB: ("q4_zb", 19, 32),
}


class _Library:
    """The compiled kernels, or why there are none (built on first use, once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self.functions: dict[BlockType, int] = {}  # kind → the C file's type index
        self.gemv: Any = None  # specd_gemv, through ctypes
        self.products: Any = None  # specd_products
        self.rms_norm: Any = None  # specd_rms_norm
        self.attention: Any = None  # specd_attention
        self.set_threads: Any = None
        self.sleeping_workers: Any = None
        self.threads = 1
        self.max_rows = 0  # a norm's or an attention's rows
        self.max_product_rows = 0  # a product's rows
        self.reason = "not built yet"
        self.fixable = False  # unavailable for a reason the user can remedy (a compiler)

    def load(self) -> bool:
        if self._tried:  # (every projection of every pass asks)
            return bool(self.functions)
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self._load()
                    self.reason = "compiled for this CPU (AVX2, FMA)"
                except _Unavailable as err:
                    self.reason = str(err)
                    self.fixable = isinstance(err, _Fixable)
                    log.info("CPU kernels on GGUF blocks unavailable: %s", err)
            return bool(self.functions)

    def will_build(self) -> bool:
        """Whether loading would build the library now (its first use on this machine, or
        a new source): a few seconds a command says it spends."""
        if self._tried:
            return False
        try:
            _check_usable()
            return not _intact(_target()[0])
        except _Unavailable:
            return False

    def _load(self) -> None:
        _check_usable()
        path = _build()
        try:
            lib = ctypes.CDLL(str(path))
            if lib.specd_kernels_version() != VERSION:
                raise _Unavailable(f"{path} is not version {VERSION} of the kernels")
            self.max_rows = int(lib.specd_max_rows())
            self.max_product_rows = int(lib.specd_max_product_rows())
            if lib.specd_type_count() != len(TYPES):
                raise _Unavailable(f"{path} does not know this file's {len(TYPES)} types")
            gemv = lib.specd_gemv
            gemv.restype = ctypes.c_int
            gemv.argtypes = [
                ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                ctypes.c_int64,
            ]  # fmt: skip
            products = lib.specd_products
            products.restype = ctypes.c_int
            products.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64]
            lib.specd_rms_norm.restype = None
            lib.specd_rms_norm.argtypes = (
                [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_float,
                ctypes.c_float, ctypes.c_void_p]
            )  # fmt: skip
            lib.specd_attention.restype = None
            lib.specd_attention.argtypes = [ctypes.c_void_p]
            self.rms_norm, self.attention = lib.specd_rms_norm, lib.specd_attention
            lib.specd_set_threads.restype = ctypes.c_int
            lib.specd_set_threads.argtypes = [ctypes.c_int]
            self.gemv, self.products = gemv, products
            self.set_threads = lib.specd_set_threads
            lib.specd_sleeping_workers.restype = ctypes.c_int
            self.sleeping_workers = lib.specd_sleeping_workers
            self.functions = {kind: index for index, kind in enumerate(TYPES)}
        except (OSError, AttributeError) as err:
            raise _Unavailable(f"{path} could not be loaded: {err}") from None


class _Unavailable(RuntimeError):
    pass


def _check_usable() -> None:
    if os.environ.get("SPECD_CPU_KERNELS", "").lower() in ("off", "0", "false", "no"):
        raise _Unavailable("turned off by SPECD_CPU_KERNELS")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise _Unavailable(
            f"this CPU's vector unit ({torch.backends.cpu.get_cpu_capability()}) is not "
            "AVX2 with FMA; projections are rebuilt for each product"
        )


class _Fixable(_Unavailable):
    """Unavailable for want of something the user can install (a C compiler that works)."""


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise _Fixable(
        "no C compiler (cc, gcc or clang) to build them with: install one (Debian and "
        "Ubuntu: sudo apt install gcc) and CPU decoding runs several times faster"
    )


def _cache_dir() -> Path:
    from platformdirs import user_cache_dir

    override = os.environ.get("SPECD_KERNEL_CACHE")
    return Path(override) if override else Path(user_cache_dir("specd")) / "kernels"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(target: Path) -> bool:
    """Whether the cached library is the one built: its bytes' digest is the one written
    beside it. A library cut short (a full disk, a crash) is a SIGBUS when loaded, not an
    error: it is never loaded, and is built again."""
    try:
        if not stat.S_ISREG(os.stat(target).st_mode) or target.stat().st_size > 1 << 26:
            return False
        return _digest(target) == target.with_name(target.name + ".sha256").read_text().strip()
    except OSError:
        return False


def _target() -> tuple[Path, str]:
    """Where the library for this source, compiler and flags is kept, and the compiler."""
    compiler = _compiler()
    flags = " ".join((compiler, *FLAGS, *LIBRARIES)).encode()
    key = hashlib.sha256(SOURCE.read_bytes() + flags).hexdigest()[:16]
    return _cache_dir() / f"specd-cpu-kernels-{key}.so", compiler


def _build() -> Path:
    """The shared library for this source and these flags: built into the cache once
    (into a temporary name, then renamed, so that two processes never load half a file),
    with its digest beside it (`_intact`)."""
    target, compiler = _target()
    folder = target.parent
    if _intact(target):
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            built = Path(scratch) / target.name
            done = subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", str(built), *LIBRARIES],
                capture_output=True,
                text=True,
                timeout=COMPILE_SECONDS,
            )
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise _Fixable(f"{compiler} could not build {SOURCE.name}: {last}")
            digest = target.with_name(target.name + ".sha256")
            (Path(scratch) / digest.name).write_text(_digest(built))
            os.replace(Path(scratch) / digest.name, digest)
            os.replace(built, target)
    except (OSError, subprocess.SubprocessError) as err:
        raise _Fixable(f"building {SOURCE.name} failed: {err}") from None
    log.info("built the CPU kernels on GGUF blocks: %s", target)
    return target


_LIBRARY = _Library()
