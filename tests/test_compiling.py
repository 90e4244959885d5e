"""`--compile auto|off|on` (`runtime.compile`): which models run compiled passes, the daemon
warming them on a thread of its own while it serves, and one-shot commands warming first.

The real stories260k draft serves as the target here: its graphs are in the compile cache
once tests/test_compiled.py has compiled them, so these tests load rather than compile."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
from torch._dynamo.utils import counters

from daemon import compiling
from daemon.cli.commands import main
from daemon.compiling import SMALL_LAYER_PARAMETERS, Compilation, decide
from daemon.http.server import BackgroundServer
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from daemon.settings import SettingsError
from daemon.settings_loading import load_settings
from modeling.checkpoints.checkpoint import load
from modeling.compiled import CompiledPasses
from modeling.config import ModelConfig
from modeling.decoder import Transformer
from modeling.models import layer_parameter_count

ROOT = Path(__file__).resolve().parents[1]


def _config(hidden: int, intermediate: int) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        head_dim=hidden // 4,
        rms_norm_eps=1e-5,
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=64,
    )


def test_auto_compiles_the_daemons_small_cpu_models_only(stories_draft: Path) -> None:
    model = load(str(stories_draft))[0]
    assert decide("off", model, serving=True) == (False, "off (--compile off)")
    assert decide("on", model, serving=False) == (True, "on (--compile on)")
    on, why = decide("auto", model, serving=True)
    assert on and "dispatch-bound" in why
    on, why = decide("auto", model, serving=False)
    assert not on and "one-shot" in why
    big = Transformer(_config(512, 1536))
    assert layer_parameter_count(big.config) >= SMALL_LAYER_PARAMETERS
    on, why = decide("auto", big, serving=True)
    assert not on and "compute-bound" in why


def test_the_hqq_substitute_compiles_when_asked_and_auto_leaves_it(stories_draft: Path) -> None:
    """Its HQQ projections are rebuilt inside the graph: `--compile on` compiles it (on
    CUDA its step at compiled speed); `auto` leaves it eager (the background warm-up's
    child compiles a checkpoint's graphs, never a substitute's)."""
    from modeling.substitute import build_substitute

    target = load(str(stories_draft))[0]
    sub = build_substitute(target, 4, list(target.layers), lambda i: True, torch.device("cpu"))
    assert decide("on", sub, serving=True) == (True, "on (--compile on)")
    on, why = decide("auto", sub, serving=True)
    assert not on and "rebuilt in the graph" in why
    assert decide("auto", target, serving=True)[0]  # the dense model it was made from


def test_the_runtime_offers_its_substitute_draft_to_the_compiler(stories_target: Path) -> None:
    """The substitute has no checkpoint folder of its own: it was left out of the models
    a runtime compiles, so --compile on never reached it."""
    rt = Runtime(
        RuntimeOptions(
            model=str(stories_target), draft="substitute", substitute_bits=4, device="cpu",
            offload="stream", resident_layers=0, context=256, compile="on",
        )
    )  # fmt: skip
    compilation = rt.compile(serving=True)
    assert compilation.models["draft"] is rt.draft and "draft" not in compilation.folders
    state = compilation.to_dict()["draft"]
    assert (state["state"], state["reason"]) == ("warming", "on (--compile on)")
    rt.options.compile = "auto"  # (no child can precompile it: auto leaves it out)
    assert "draft" not in rt.compile(serving=True).models


def test_models_that_cannot_compile_say_why_even_when_asked() -> None:
    model = Transformer(_config(64, 128))
    model.set_layers(list(model.layers))  # what a streamer looks like to the model
    compilation = Compilation("on", {"target": model}, serving=True)
    assert not compilation.wanted
    state = compilation.to_dict()["target"]
    assert state["state"] == "off" and "streamed" in str(state["reason"])


def test_a_failed_compile_leaves_the_model_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Transformer(_config(64, 128))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr("daemon.compiling.CompiledPasses", broken)
    compilation = Compilation("on", {"target": model}, serving=True)
    compilation.warm()
    assert model.compiled is None
    assert compilation.to_dict()["target"]["state"] == "failed"
    assert "no C++ compiler" in str(compilation.to_dict()["target"]["reason"])


class _SlowerPasses(CompiledPasses):
    """Compiled passes that are not compiled and do their step three times: a compile that
    made the model slower, without a compiler or a sleep."""

    def __init__(self, model: Transformer) -> None:
        super().__init__(model, compile=False)

    def hidden_states(self, segment):  # type: ignore[no-untyped-def]
        length = segment.cache.length
        for _ in range(2):
            super().hidden_states(segment)
            segment.cache.truncate(length)
        return super().hidden_states(segment)


def test_auto_keeps_compiled_passes_only_where_they_measured_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`auto` times a one-token step eager and compiled before it keeps the compiled one: a
    slower one is dropped (the model runs eager, and its state says why with both times);
    `on` keeps what the user asked for."""
    monkeypatch.setattr("daemon.compiling.CompiledPasses", _SlowerPasses)
    model = Transformer(_config(64, 128)).eval()
    now = [0.0]

    def clock() -> float:  # (its steps do three times the work: three times the seconds)
        now[0] += 1.5 if isinstance(model.compiled, _SlowerPasses) else 0.5
        return now[0]

    real = compiling.step_seconds
    monkeypatch.setattr("daemon.compiling.step_seconds", lambda m, p: real(m, p, clock=clock))
    compilation = Compilation("auto", {"target": model}, serving=True)
    assert compilation.wanted
    compilation.warm()
    state = compilation.to_dict()["target"]
    assert model.compiled is None and state["state"] == "off", state
    assert "measured no faster" in str(state["reason"])
    step = state["step_ms"]
    assert step == {"eager": 500.0, "compiled": 1500.0}
    asked = Compilation("on", {"target": model}, serving=True)
    asked.warm()
    assert isinstance(model.compiled, _SlowerPasses)
    assert asked.to_dict()["target"]["state"] == "ready"


def test_auto_keeps_compiled_passes_that_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same measurement with a clock on which a compiled step takes half an eager one."""
    monkeypatch.setattr(
        "daemon.compiling.CompiledPasses",
        lambda model: CompiledPasses(model, compile=False),
    )
    model = Transformer(_config(64, 128)).eval()
    now = [0.0]

    def clock() -> float:
        now[0] += 0.5 if model.compiled is not None else 1.0
        return now[0]

    real = compiling.step_seconds
    monkeypatch.setattr("daemon.compiling.step_seconds", lambda m, p: real(m, p, clock=clock))
    compilation = Compilation("auto", {"target": model}, serving=True)
    compilation.warm()
    state = compilation.to_dict()["target"]
    assert state["state"] == "ready" and model.compiled is not None, state
    assert state["step_ms"] == {"eager": 1000.0, "compiled": 500.0}


def test_runtime_compile_is_a_validated_setting(tmp_path: Path) -> None:
    # YAML reads bare on/off as booleans, in a file and in an environment variable alike.
    assert load_settings(environ={"SPECD_RUNTIME_COMPILE": "on"}).runtime.compile == "on"
    off = tmp_path / "off.yaml"
    off.write_text("models:\n  target: m\nruntime:\n  compile: off\n")
    assert load_settings(config_file=off, environ={}).runtime.compile == "off"
    assert load_settings(config_file=off, environ={}).runtime_options().compile == "off"
    bad = tmp_path / "bad.yaml"
    bad.write_text("runtime:\n  compile: fast\n")
    with pytest.raises(SettingsError, match=r"runtime\.compile"):
        load_settings(config_file=bad, environ={})


def test_the_daemon_serves_while_compiling_then_serves_compiled(stories_draft: Path) -> None:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_draft), "test"),
            "runtime.compile": ("auto", "test"),
            "server.port": (0, "test"),
        },
    )
    eager = Runtime(RuntimeOptions(model=str(stories_draft)))
    prompt = eager.tokenizer.encode("Once upon a time")
    expected = _greedy(eager, prompt, 24)
    with BackgroundServer(settings) as srv:
        runtime = srv.server.engine.runtime
        assert runtime is not None and runtime.compilation is not None
        runtime.compilation.join(timeout=600)  # warmed on its own thread
        status = _get(srv.url + "/v1/specd/status")
        assert status["compile"]["target"]["state"] == "ready", status["compile"]
        # (its time in the child process that compiled first is said apart from the rest)
        assert status["compile"]["target"]["precompile_seconds"] >= 0
        assert runtime.target.compiled is not None
        before = runtime.target.compiled.passes
        graphs = counters["stats"]["unique_graphs"]
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        answer = _post(srv.url + "/v1/completions", body)
        assert runtime.target.compiled.passes > before  # it ran compiled
        assert counters["stats"]["unique_graphs"] == graphs  # on the warm-up's graphs
    assert answer["choices"][0]["text"] == eager.tokenizer.decode(expected)


def test_an_unwritable_compile_cache_leaves_the_models_eager(tmp_path: Path) -> None:
    model = Transformer(_config(64, 128))
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    compilation = Compilation("on", {"draft": model}, serving=True, cache_dir=blocked / "x")
    assert not compilation.wanted
    state = compilation.to_dict()["draft"]
    assert state["state"] == "failed" and "cache folder" in str(state["reason"])


def test_generate_with_compile_on_warms_first_and_prints_the_same(
    stories_draft: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(stories_draft), "--prompt", "Once upon a time"]
    args += ["--max-tokens", "24", "--json"]
    assert main([*args, "--compile", "off"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main([*args, "--compile", "on"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["token_ids"] == eager["token_ids"]
    assert "specd: compiling target: compiling 1-token steps" in captured.err
    # what a first compile costs on a CPU, and where it is kept, said before it runs
    assert "specd: compiling the target's passes: minutes the first time on a CPU" in captured.err
    assert "specd: compiling target: done in " in captured.err


def _greedy(runtime: Runtime, prompt: list[int], n: int) -> list[int]:
    from speculative.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    return runtime.generation(prompt, greedy, n, ignore_eos=True).run().token_ids


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_a_daemon_stopping_while_compiling_exits_at_once(tmp_path: Path) -> None:
    """The interpreter's teardown would abort a process whose compiler threads are still
    running (seen as "terminate called without an active exception" on `specd stop`
    during a warm-up); the daemon leaves without it, with its status and logs flushed."""
    script = tmp_path / "stop.py"
    script.write_text(
        "import logging, sys, threading\n"
        "import daemon.compiling as compiling\n"
        "from daemon.cli.serve import exit_now_if_compiling\n"
        "logging.basicConfig(level='INFO', stream=sys.stderr)\n"
        "exit_now_if_compiling(5)  # nothing compiling: returns\n"
        "release = threading.Event()\n"
        "thread = threading.Thread(target=release.wait, daemon=True)\n"
        "compiling._WARMING.add(thread)\n"
        "thread.start()\n"
        "import subprocess\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "compiling._CHILDREN.add(child)  # a precompiling child\n"
        "print(child.pid, flush=True)\n"
        "exit_now_if_compiling(3)\n"
        "sys.exit(7)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 3, done.stderr
    assert "stopped while compiling" in done.stderr
    child = int(done.stdout.split()[0])  # killed, not left compiling (at most a zombie)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


def test_precompiling_in_a_child_fills_the_cache_the_daemon_loads(stories_draft: Path) -> None:
    """The daemon's background warm-up first compiles in a child process (waiting for it
    holds no interpreter lock that requests need); the child loads the checkpoint as the
    daemon did and compiles into the inherited cache (here the one test_compiled.py filled
    with this model's graphs, so it loads them)."""
    done = subprocess.run(
        [sys.executable, "-m", "daemon.compiling", str(stories_draft), "--vocab-width", "512"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("compiled ") and "stories260k-draft" in done.stdout


def test_the_precompile_child_loads_the_model_as_the_daemon_did(tiny_checkpoint) -> None:
    """A model quantized on load is compiled by the child from the same --quantize (else
    it would compile the full-precision model's graphs, holding all of its weights)."""
    path = tiny_checkpoint("llama")
    quantized = load(path, "fp32", "cpu", quantize="int8")[0]
    command = compiling.precompile_command(quantized, path)
    assert command[-2:] == ["--quantize", "int8"] and "--dtype" in command
    assert "--quantize" not in compiling.precompile_command(load(path, "fp32")[0], path)
    args = command[command.index(str(path)) :]
    model = load(path, "fp32", quantize="int8")[0]  # what precompile_main loads from them
    assert "--quantize" in args and type(model.layers[0].mlp.down_proj) is type(  # type: ignore[index]
        quantized.layers[0].mlp.down_proj  # type: ignore[index]
    )
