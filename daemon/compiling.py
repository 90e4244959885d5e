"""Which models run compiled passes (`--compile auto|off|on`, `runtime.compile`), and warming
them: in the foreground for a one-shot command, on a thread of its own for the daemon, so
that no request waits for the compiler (it runs eager until the graphs are ready).

`auto` compiles where `scripts/bench_overhead.py` measured a gain that pays for compiling,
and keeps the compiled passes only if they are faster here: once warm, a one-token step
is timed eager and compiled, interleaved (`step_seconds`), and a compiled step that is not
faster is dropped, its state saying so (SmolLM2's compiled steps once ran at half the eager
speed, a KV cache copy per layer; any such regression now costs the measurement only):
the daemon (long-running; the graphs are compiled once and loaded from PyTorch's disk cache
after a restart) on a CPU with small layers (under SMALL_LAYER_PARAMETERS weights, where a
step is dispatch-bound: decode 1.8x faster on the stories pair). Not for a one-shot
command (compiling takes longer than the generation), not for bigger layers on a CPU (a
1B-shaped draft gained nothing: its step is arithmetic), and not yet on CUDA, where the
compiled kernels and their CUDA graphs (modeling/graphs.py) are unmeasured: `on`
compiles and captures there.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from modeling.checkpoints.checkpoint import DTYPES, load
from modeling.compiled import CompiledPasses, ineligible, rebuilds_in_graph, use_cache_dir
from modeling.decoder import Transformer
from modeling.models import layer_parameter_count
from modeling.weights.quant import QUANTIZE_CHOICES

log = logging.getLogger("specd.compile")

# Below this many weights per decoder layer a CPU step is a few hundred tiny kernels, and
# its time is dispatch: extra intra-op threads only add wake-ups (and spin-waits when cores
# are shared; measured 10x slower with 2 threads than 1 on the stories260k pair), and
# compiled passes pay (above). Bigger layers get the physical cores and run eager.
SMALL_LAYER_PARAMETERS = 1_000_000


@dataclass
class CompileState:
    """One model's compiled passes: `state` is off, warming, ready or failed; `reason` says
    why (the choice, or the error)."""

    role: str  # "target" or "draft"
    state: str
    reason: str
    warm_seconds: float | None = None  # compiling (or loading from the cache) in process
    precompile_seconds: float | None = None  # a child process's compile before it, on a CPU
    passes: CompiledPasses | None = None  # once ready
    step_ms: tuple[float, float] | None = None  # auto's measurement: (eager, compiled)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "state": self.state,
            "reason": self.reason,
            "warm_seconds": self.warm_seconds,
        }
        if self.precompile_seconds is not None:
            out["precompile_seconds"] = self.precompile_seconds
        if self.step_ms is not None:
            out["step_ms"] = {"eager": self.step_ms[0], "compiled": self.step_ms[1]}
        graphs = self.passes.graphs if self.passes is not None else None
        if graphs is not None:  # CUDA graphs: how many, and what capturing has cost
            out["cuda_graphs"] = {
                "kept": len(graphs),
                "captured": graphs.captures,
                "capture_seconds": round(graphs.capture_seconds, 3),
                "replays": graphs.replays,
            }
        return out


def decide(choice: str, model: Transformer, serving: bool) -> tuple[bool, str]:
    """(compile?, why) for one model under `choice` (auto | off | on)."""
    if choice == "off":
        return False, "off (--compile off)"
    reason = ineligible(model)
    if reason is not None:
        return False, f"not compiled: {reason}"
    if choice == "on":
        return True, "on (--compile on)"
    if not serving:
        return False, "auto: a one-shot command (compiling takes longer than it saves)"
    if model.device.type == "cuda":
        return False, "auto: not measured on a GPU yet (--compile on: kernels and CUDA graphs)"
    if rebuilds_in_graph(model):  # (the child precompiles a checkpoint, not a substitute)
        return False, "auto: its packed projections would be rebuilt in the graph (--compile on)"
    params = layer_parameter_count(model.config)
    if params >= SMALL_LAYER_PARAMETERS:
        return False, f"auto: {params:,} weights per layer are compute-bound on a CPU"
    return True, f"auto: a CPU step of {params:,} weights per layer is dispatch-bound"


# `auto` keeps compiled passes whose one-token step takes less than this share of the
# eager step's (a gain inside the measurement's noise is no gain), timed STEP_SAMPLES times
# each way, interleaved, the medians compared.
KEEP_BELOW = 0.95
STEP_SAMPLES = 9


def step_seconds(
    model: Transformer,
    passes: CompiledPasses,
    samples: int = STEP_SAMPLES,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """(eager, compiled) median seconds of a one-token step of `model` on a scratch cache
    of a few hundred tokens, the two taking turns (a shared machine's drift hits both)."""
    from modeling.kv_cache import KVCache

    context = 256
    cache = KVCache(model.config, context + 1, dtype=model.dtype, device=model.device)
    cache.reserve(context + 1)  # every slot allocated now, not during a timed step
    times: dict[bool, list[float]] = {False: [], True: []}
    token = torch.zeros(1, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        for i in range(2 * samples + 2):
            compiled = i % 2 == 1
            cache.truncate(0)
            cache.commit_append(context)  # a context's worth of rows (contents do not matter)
            model.compiled = passes if compiled else None
            try:
                start = clock()
                model(token, torch.tensor([context], device=model.device), cache)
                if model.device.type == "cuda":
                    torch.cuda.synchronize(model.device)
                if i >= 2:  # the first of each: warm-up
                    times[compiled].append(clock() - start)
            finally:
                model.compiled = None
    return statistics.median(times[False]), statistics.median(times[True])


def print_progress(line: str) -> None:
    """A one-shot command's compile progress: one line each on stderr."""
    print(f"specd: compiling {line}", file=sys.stderr, flush=True)


def compile_cache_dir() -> Path:
    """Where PyTorch keeps compiled graphs for specd (platformdirs' cache folder)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("specd")) / "compile"


# Warm-up threads that have not finished (`still_compiling`).
_WARMING: set[threading.Thread] = set()


# Precompiling child processes running now (`stop_compiling`).
_CHILDREN: set[subprocess.Popen[str]] = set()


def still_compiling() -> bool:
    """Whether a warm-up thread is still compiling (a daemon stopping then exits at once)."""
    return any(thread.is_alive() for thread in _WARMING)


def stop_compiling() -> None:
    """End the precompiling children: a daemon that exits leaves no compiler behind."""
    for child in list(_CHILDREN):
        child.kill()


class Compilation:
    """Compiling the runtime's models: which of them run compiled passes (`decide`), warming
    their graphs, and each model's state (off, warming, ready or failed). The graphs
    themselves are each model's `CompiledPasses` (modeling/compiled.py)."""

    def __init__(
        self,
        choice: str,
        models: dict[str, Transformer],
        serving: bool,
        cache_dir: Path | None = None,
        folders: dict[str, Path] | None = None,
    ) -> None:
        """`folders`: each model's checkpoint folder, from which a background warm-up first
        compiles the model's graphs in a child process (`precompile`)."""
        self.models = models
        self.choice = choice
        self.folders = folders or {}
        self.states: dict[str, CompileState] = {}
        self._wanted: list[str] = []
        self._thread: threading.Thread | None = None
        self.ready_count = 0  # models whose compiled passes are attached (the engine watches)
        for role, model in models.items():
            on, reason = decide(choice, model, serving)
            self.states[role] = CompileState(role, "warming" if on else "off", reason)
            if on:
                self._wanted.append(role)
        self.cache_dir = cache_dir or compile_cache_dir()
        if self._wanted:
            try:
                use_cache_dir(self.cache_dir)
            except OSError as exc:  # an unwritable cache folder: run eager, say why
                log.warning("no compile cache folder (%s): the models run eager", exc)
                for role in self._wanted:
                    self.states[role].state = "failed"
                    self.states[role].reason = f"compile cache folder: {exc}"
                self._wanted = []

    @property
    def wanted(self) -> bool:
        return bool(self._wanted)

    def warm(self, progress: Callable[[str], None] | None = None, precompile: bool = False) -> None:
        """Compile every chosen model's graphs and attach them; a model whose compilation
        fails keeps running eager (logged, and its state says why). With `precompile`, a
        CPU model's graphs are first compiled by a child process into the disk cache."""
        for role in self._wanted:
            model, state = self.models[role], self.states[role]
            say = (lambda line, r=role: progress(f"{r}: {line}")) if progress else None
            if progress is not None and model.device.type == "cpu":
                # (a first compile on a CPU ran for minutes with nothing said of why)
                progress(
                    f"the {role}'s passes: minutes the first time on a CPU (C++ compilation), "
                    f"less once they are in {self.cache_dir}"
                )
            if precompile and role in self.folders and model.device.type == "cpu":
                began = time.monotonic()
                self._precompile(role)
                state.precompile_seconds = round(time.monotonic() - began, 1)
            try:
                passes = CompiledPasses(model)
                state.warm_seconds = passes.warm(say)
                if self.choice == "auto":
                    eager, compiled = step_seconds(model, passes)
                    state.step_ms = (round(eager * 1e3, 3), round(compiled * 1e3, 3))
                    if compiled >= eager * KEEP_BELOW:
                        state.state = "off"
                        state.reason = (
                            f"auto: compiled steps measured no faster ({compiled * 1e3:.2f} ms "
                            f"against {eager * 1e3:.2f} ms eager): runs eager"
                        )
                        log.info("the %s runs eager: %s", role, state.reason)
                        continue
            except Exception as exc:  # the compiler is optional: never fatal
                state.state, state.reason = "failed", f"{type(exc).__name__}: {exc}"
                log.warning(
                    "compiling the %s's passes failed; it runs eager: %s (if this repeats at "
                    "every start, the compile cache may be damaged: remove %s)",
                    role, str(exc)[:300], self.cache_dir,
                )  # fmt: skip
                continue
            model.compiled = passes  # from now on its passes run compiled
            state.state, state.passes = "ready", passes
            self.ready_count += 1
            before = state.precompile_seconds
            child = f"{before:.1f} s in a child process, then " if before is not None else ""
            log.info("the %s's passes are compiled (%s%.1f s)", role, child, state.warm_seconds)
            if say is not None:
                say(f"done in {state.warm_seconds:.1f} s")

    def _precompile(self, role: str) -> None:
        """Compile `role`'s graphs in a child process, into the disk cache the in-process
        warm-up then loads from. Compiling in this process would hold its interpreter for
        tens of seconds while requests are served: every operator of their eager passes
        waits for the interpreter lock between kernels (64-token answers took up to 12 s
        instead of 0.15 s on the project's 2-core CPU). Waiting for a child holds nothing.
        Best effort: if the child fails, the in-process warm-up compiles by itself."""
        command = precompile_command(self.models[role], self.folders[role])
        try:
            child = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        except OSError as exc:
            log.info("precompiling the %s in a child process failed: %s", role, exc)
            return
        _CHILDREN.add(child)
        try:
            _, err = child.communicate(timeout=3600)
        except subprocess.TimeoutExpired:
            child.kill()
            _, err = child.communicate()
        finally:
            _CHILDREN.discard(child)
        if child.returncode != 0:
            tail = err.strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
            log.info("precompiling the %s in a child process failed: %s", role, tail[0])

    def warm_in_background(self) -> None:
        """Warm on a thread of its own; passes run eager until each model is ready."""
        if not self._wanted or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._warm_quietly, name="specd-compile", daemon=True
        )
        _WARMING.add(self._thread)
        self._thread.start()

    def _warm_quietly(self) -> None:
        # One compiler process (Inductor's default is one per core), so that requests keep
        # a core while the daemon compiles.
        import torch._inductor.config as inductor

        inductor.compile_threads = 1
        try:
            with torch.inference_mode():
                self.warm(lambda line: log.info("compiling: %s", line), precompile=True)
        finally:
            _WARMING.discard(threading.current_thread())

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def to_dict(self) -> dict[str, dict[str, object]]:
        return {role: state.to_dict() for role, state in self.states.items()}


def precompile_command(model: Transformer, folder: Path | str) -> list[str]:
    """The child's command line: `model`'s checkpoint loaded as the daemon loaded it (its
    dtype, vocabulary width and `--quantize`), so that it compiles the same graphs."""
    dtype = next(name for name, value in DTYPES.items() if value == model.dtype)
    command = [sys.executable, "-m", "daemon.compiling", str(folder)]
    command += ["--dtype", dtype, "--vocab-width", str(model.vocab_width)]
    spec = model.config.quantization
    if spec is not None and spec.on_load and spec.method == "compressed-tensors":
        command += ["--quantize", f"int{spec.bits}"]
    return command


def precompile_main(argv: list[str] | None = None) -> int:
    """The child of `Compilation._precompile`: load a checkpoint as the daemon did and
    compile its graphs into the disk cache (TORCHINDUCTOR_CACHE_DIR, inherited)."""
    ap = argparse.ArgumentParser(description="compile a model's passes into the disk cache")
    ap.add_argument("folder")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--vocab-width", type=int, default=None)
    ap.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None)
    args = ap.parse_args(argv)
    import torch._inductor.config as inductor

    inductor.compile_threads = 1  # the daemon's requests keep the other cores
    torch.set_num_threads(1)
    model = load(args.folder, args.dtype, quantize=args.quantize)[0]
    if args.vocab_width is not None:
        model.set_vocab_width(args.vocab_width)
    seconds = CompiledPasses(model).warm()
    print(f"compiled {args.folder} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(precompile_main())
