"""Autoregressive decode speed: specd's runtime against transformers' `generate`, and
(`--real`) on a real model's forms against llama.cpp.

Same checkpoint, prompt, dtype, token count and thread count; greedy; repeats interleaved
(ours, theirs, ours, ...) so that drift on a shared machine hits both alike. Prints a table
with the ratio and writes JSON. transformers is a bench/test-only dependency.

    .venv/bin/python scripts/bench_decode.py [--model DIR] [--max-tokens 128] [--repeats 5]

`--real`: SmolLM2-135M-Instruct (../shared/models) as its Q4_1 GGUF with the CPU kernels
(modeling/weights/cpu_kernels.py) and without them (SPECD_CPU_KERNELS=off: its layers
dequantized at load where they fit, as before them),
its F32 form (scripts/real_forms.py) and that form `--quantize int8` / `int4`, or any
other GGUF of it (`file:PATH`, e.g. llama.cpp's `llama-quantize` Q4_K_M of the Q4_1 file;
llama.cpp runs that file too); eager and
`--compile on`; 1 and 2 threads; each a fresh process per repeat, repeats interleaved.
Decode tokens/s over `--max-tokens` after the prompt, and the weight bytes a decode step
reads (layers and head; a rebuilt projection also writes and reads its float matrix).
With `--llama-bench PATH` (llama.cpp's, built from the `llama-cpp-python` sdist's vendored
source, never committed) the Q4_1 file runs there too, in the same loop. `--busy N` keeps N
other processes spinning throughout (a desktop's busy cores: a browser, a build), to see
what each thread count does when fewer cores are free than it asks for.

    .venv/bin/python scripts/bench_decode.py --real [--llama-bench PATH] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling.checkpoints.checkpoint import DTYPES, load  # noqa: E402
from speculative.generation import Generation  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402
from speculative.strategies.autoregressive import Autoregressive  # noqa: E402

DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "stories260k"


@dataclass
class Result:
    implementation: str
    seconds: list[float]  # one per repeat: the whole call, prompt prefill included
    tokens: int

    @property
    def median_tokens_per_second(self) -> float:
        return self.tokens / statistics.median(self.seconds)

    def row(self) -> dict:
        return {
            **asdict(self),
            "median_tokens_per_second": self.median_tokens_per_second,
            "median_ms_per_token": 1000 * statistics.median(self.seconds) / self.tokens,
            "best_tokens_per_second": self.tokens / min(self.seconds),
        }


def run_ours(model, tokenizer, prompt_ids: list[int], n: int) -> tuple[float, list[int]]:  # type: ignore[no-untyped-def]
    strategy = Autoregressive(model)
    session = strategy.new_session(len(prompt_ids) + n)
    t0 = time.perf_counter()
    gen = Generation(
        strategy,
        session,
        tokenizer,
        prompt_ids,
        SamplingParams(temperature=0.0),
        max_tokens=n,
        ignore_eos=True,
    ).run()
    return time.perf_counter() - t0, gen.token_ids


def run_transformers(model, prompt_ids: list[int], n: int) -> tuple[float, list[int]]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return time.perf_counter() - t0, out[0, len(prompt_ids) :].tolist()


REAL_FORMS = ("q4_1", "q4_1-no-kernels", "f32", "int8", "int4", "int8-no-kernels")


# A form's suffix for where its layers live: every layer streamed through two slots from
# the RAM tier, or read from the file at every pass (the disk tier).
STREAMED = {
    "-streamed": {"offload": "stream", "resident_layers": 0, "slots": 2},
    "-disk": {"offload": "stream", "resident_layers": 0, "slots": 2, "host_tier": "disk"},
}


def form_offload(form: str) -> tuple[str, dict[str, object]]:
    """`form` without its `-streamed` or `-disk` suffix, and that suffix's options."""
    for suffix, options in STREAMED.items():
        if form.endswith(suffix):
            return form.removesuffix(suffix), options
    return form, {}


def real_form(form: str) -> tuple[str, str | None, dict[str, str]]:
    """(model path, --quantize, environment) of one form of SmolLM2: the Q4_1 file, its F32
    form, that form `--quantize int8|int4`; `-no-kernels`: with SPECD_CPU_KERNELS=off (a
    `-streamed` or `-disk` suffix after it: `form_offload`)."""
    from scripts.real_forms import SMOLLM2_GGUF, smollm2_f32

    bare = form_offload(form)[0]
    base = bare.removesuffix("-no-kernels")
    env = {"SPECD_CPU_KERNELS": "off"} if base != bare else {}
    if base == "q4_1":
        return str(SMOLLM2_GGUF), None, env
    if base.startswith("file:"):  # another GGUF of SmolLM2 (llama-quantize's Q4_K_M of it)
        return base.removeprefix("file:"), None, env
    if base not in ("f32", "int8", "int4"):
        raise SystemExit(f"unknown form {form!r}: choose from {', '.join(REAL_FORMS)}")
    return str(smollm2_f32()), None if base == "f32" else base, env


def step_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Weight bytes one decode step reads: each projection's stored bytes where a kernel
    computes from them (a packed one) or where it is dense; a rebuilt packed one also
    writes and reads its float matrix. The embedding's one row is left out."""
    from modeling.weights import cpu_kernels
    from modeling.weights.gguf_modules import GGUFLinear
    from modeling.weights.packed import PackedLinear

    total = 0
    x = torch.zeros(1, 1, dtype=dtype)
    for module in model.modules():
        if isinstance(module, PackedLinear):
            stored = sum(t.numel() * t.element_size() for t in module.buffers(recurse=False))
            kernel = isinstance(module, GGUFLinear) and cpu_kernels.usable(x, module.ggml_type)
            dense = module.in_features * module.out_features * x.element_size()
            total += stored + (0 if kernel else 2 * dense)
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def measure_real(form: str, compiled: bool, threads: int, n: int) -> dict:
    """One process's run: load the form, warm up, decode n tokens after a short prompt."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from speculative.passes import alone

    path, quantize, _ = real_form(form)
    torch.set_num_threads(threads)
    options = RuntimeOptions(
        model=path, quantize=quantize, device="cpu", threads=threads, draft=None,
        compile="on" if compiled else "off", prefix_cache=0, **form_offload(form)[1],  # type: ignore[arg-type]
    )  # fmt: skip
    rt = Runtime(options)
    if compiled:
        rt.compile(serving=False).warm(lambda *_: None)
    strategy = rt.strategy("autoregressive")
    prompt = rt.tokenizer.encode_chat([{"role": "user", "content": "Tell me about Paris."}])

    def decode(tokens: int) -> tuple[float, list[int]]:
        session = strategy.new_session(rt.context)
        steps = strategy.steps(
            session, prompt, SamplingParams(temperature=0.0), tokens, torch.Generator()
        )
        ids: list[int] = []
        start = None
        for rnd in alone(steps):
            if start is None and rnd.tokens:
                start = time.perf_counter()  # the first token: the prompt is in
            ids += rnd.tokens
        assert start is not None
        return (tokens - 1) / (time.perf_counter() - start), ids

    decode(16)  # warm-up: first calls allocate, pick kernels (and compile)
    rate, ids = decode(n)
    streamer = rt.streamer
    read = step_bytes(rt.target, rt.target.dtype)
    if streamer is not None:  # (its layers are not modules of the model: the stream's bytes)
        read += streamer.layout.nbytes * len(streamer.order)
    return {"tokens_per_second": rate, "bytes_per_token": read, "ids": ids}


def run_llama_bench(binary: str, model: str, threads: int, n: int) -> float:
    import subprocess

    done = subprocess.run(
        [binary, "-m", model, "-p", "0", "-n", str(n), "-t", str(threads), "-r", "1", "-o", "json"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return float(json.loads(done.stdout)[0]["avg_ts"])


def llama_files(forms: str) -> list[str]:
    """The GGUF files llama.cpp runs beside `forms`: the Q4_1 file, and each `file:` form's."""
    from scripts.real_forms import SMOLLM2_GGUF

    return [str(SMOLLM2_GGUF)] + [
        f.removeprefix("file:") for f in forms.split(",") if f.startswith("file:")
    ]


def real_main(args: argparse.Namespace) -> None:
    import subprocess

    configs = [
        (form, compiled, threads)
        for form in args.forms.split(",")
        for compiled in ([False, True] if args.compile else [False])
        for threads in (int(t) for t in args.threads_list.split(","))
    ]
    rows: dict[tuple, list[dict]] = {c: [] for c in configs}
    llama: dict[tuple[str, int], list[float]] = {}  # (GGUF file, threads) → tokens/s
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin) for _ in range(args.busy)]  # stopped below
    try:
        _real_runs(args, configs, rows, llama)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    _real_table(args, rows, llama)


def _real_runs(
    args: argparse.Namespace,
    configs: list[tuple[str, bool, int]],
    rows: dict[tuple, list[dict]],
    llama: dict[tuple[str, int], list[float]],
) -> None:
    import os
    import subprocess

    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else configs[::-1]
        for form, compiled, threads in order:
            _, _, env = real_form(form)
            done = subprocess.run(
                [sys.executable, __file__, "--real-one", form, "--real-compiled", str(int(compiled)),
                 "--threads", str(threads), "--max-tokens", str(args.max_tokens)],
                capture_output=True, text=True, env={**os.environ, **env}, timeout=1800,
            )  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"{form}: {done.stderr.strip().splitlines()[-1:]}")
            rows[(form, compiled, threads)].append(json.loads(done.stdout.splitlines()[-1]))
        if args.llama_bench:
            for path in llama_files(args.forms):
                for threads in (int(t) for t in args.threads_list.split(",")):
                    rate = run_llama_bench(args.llama_bench, path, threads, args.max_tokens)
                    llama.setdefault((path, threads), []).append(rate)


def _real_table(
    args: argparse.Namespace,
    rows: dict[tuple, list[dict]],
    llama: dict[tuple[str, int], list[float]],
) -> None:
    from scripts.real_forms import SMOLLM2_GGUF

    configs = list(rows)
    busy = f", {args.busy} other process(es) spinning throughout" if args.busy else ""
    print(f"SmolLM2-135M-Instruct, decode of {args.max_tokens} tokens after a chat prompt, "
          f"median of {args.repeats} interleaved runs, {platform.machine()}{busy}")  # fmt: skip
    print(
        "| form | compiled | threads | tokens/s | x llama.cpp (its file, or Q4_1) | MB read per token |"
    )
    print("|---|---|---|---|---|---|")
    reference = rows[configs[0]][0]["ids"]
    record = []
    for (form, compiled, threads), runs in rows.items():
        rate = statistics.median(r["tokens_per_second"] for r in runs)
        path = real_form(form)[0] if form.startswith("file:") else str(SMOLLM2_GGUF)
        ref = statistics.median(llama[path, threads]) if (path, threads) in llama else None
        ref = None if form_offload(form)[1] else ref  # (llama.cpp keeps every layer in RAM)
        ratio = f"{rate / ref:.2f}" if ref else "-"
        same = "" if runs[0]["ids"] == reference else " (other tokens)"
        mb = runs[0]["bytes_per_token"] / 1e6
        print(f"| {form}{same} | {'on' if compiled else 'off'} | {threads} | {rate:.1f} | {ratio} "
              f"| {mb:.0f} |")  # fmt: skip
        record.append({"form": form, "compiled": compiled, "threads": threads,
                       "tokens_per_second": rate, "bytes_per_token": runs[0]["bytes_per_token"],
                       "same_ids": runs[0]["ids"] == reference})  # fmt: skip
    for (path, threads), rates in llama.items():
        name = "q4_1" if path == str(SMOLLM2_GGUF) else Path(path).name
        print(f"| llama.cpp {name} | - | {threads} | {statistics.median(rates):.1f} | 1.00 | - |")
        record.append({"form": f"llama.cpp {name}", "threads": threads,
                       "tokens_per_second": statistics.median(rates)})  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"max_tokens": args.max_tokens, "rows": record}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads for both (1: steadiest on a busy box)"
    )
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "decode.json"))
    ap.add_argument("--real", action="store_true", help="SmolLM2's forms and llama.cpp")
    ap.add_argument("--forms", default=",".join(REAL_FORMS))
    ap.add_argument("--threads-list", default="1,2")
    ap.add_argument("--compile", action="store_true", help="--real: also --compile on")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    ap.add_argument("--busy", type=int, default=0, help="--real: N processes spinning meanwhile")
    ap.add_argument("--real-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--real-compiled", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.real_one:
        torch.set_grad_enabled(False)
        result = measure_real(
            args.real_one, bool(args.real_compiled), args.threads, args.max_tokens
        )
        print(json.dumps(result))
        return
    if args.real:
        if args.out == str(ROOT / "bench-results" / "decode.json"):
            args.out = str(ROOT / "bench-results" / "decode-real.json")
        real_main(args)
        return

    from transformers import AutoModelForCausalLM  # bench-only reference

    torch.set_num_threads(args.threads)
    ours_model, tokenizer, _ = load(args.model, args.dtype)
    ref_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.dtype]).eval()
    prompt_ids = tokenizer.encode(args.prompt)
    n = args.max_tokens

    # Warm-up (first calls allocate and pick kernels), and the tokens both must agree on.
    _, ours_ids = run_ours(ours_model, tokenizer, prompt_ids, n)
    _, ref_ids = run_transformers(ref_model, prompt_ids, n)
    ours = Result("specd autoregressive", [], n)
    ref = Result("transformers generate", [], n)
    for i in range(args.repeats):
        order = [(ours, True), (ref, False)] if i % 2 == 0 else [(ref, False), (ours, True)]
        for result, is_ours in order:
            if is_ours:
                seconds, _ = run_ours(ours_model, tokenizer, prompt_ids, n)
            else:
                seconds, _ = run_transformers(ref_model, prompt_ids, n)
            result.seconds.append(seconds)

    ratio = ours.median_tokens_per_second / ref.median_tokens_per_second
    print(
        f"model {args.model}  dtype {args.dtype}  prompt {len(prompt_ids)} tokens  "
        f"new {n} tokens  threads {args.threads}  repeats {args.repeats} (interleaved)"
    )
    print(f"{'implementation':<24}{'tokens/s (median)':>19}{'ms/token':>10}{'best tok/s':>12}")
    for r in (ours, ref):
        row = r.row()
        print(
            f"{r.implementation:<24}{row['median_tokens_per_second']:>19.1f}"
            f"{row['median_ms_per_token']:>10.3f}{row['best_tokens_per_second']:>12.1f}"
        )
    same = ours_ids == ref_ids
    print(f"ratio specd / transformers: {ratio:.2f}   identical greedy tokens: {same}")

    record = {
        "model": args.model,
        "dtype": args.dtype,
        "prompt": args.prompt,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": n,
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "results": [ours.row(), ref.row()],
        "ratio": ratio,
        "identical_tokens": same,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
