"""Memory pressure over time: the daemon (in this process, the shared stories pair) serves
a client that asks for one greedy answer after another, while another program takes host
RAM in two steps (past the `tight` line, then past `critical`) and then lets it go. Every
tenth of a second: the daemon's RSS, host RAM available, its level and relief steps, and
the tokens per second the client got over the last second. The lines are set relative to
what is available once the models are loaded, so the run means the same on any machine:
tight 1.5 GiB below it, critical 2.5 GiB below; the other program takes 2 GiB, then 1 GiB
more.

    .venv/bin/python scripts/bench_pressure.py            # table; --plot FILE.png to draw it

`--streamed PRESET` serves instead a random-weight model of that real shape
(scripts/real_shapes.py; `--layers`, bf16, prompt-lookup drafting) with every layer
streamed from RAM, so the last host step, `disk_tier`, frees the RAM tier and the RSS
curve shows it (and its read-back once the pressure is gone):

    .venv/bin/python scripts/bench_pressure.py --streamed llama-3.2-1b --layers 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from daemon.http.server import BackgroundServer  # noqa: E402
from daemon.pressure import LEVELS  # noqa: E402
from daemon.settings_loading import load_settings  # noqa: E402

SHARED = ROOT.parent / "shared" / "models"
GIB = 1 << 30
HOG = (
    "import sys\n"
    "b = bytearray(int(sys.argv[1]))\n"
    "b[::4096] = b'\\x01' * len(range(0, len(b), 4096))\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


def hog(n: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOG, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def other_program(size: int, hogs: list[subprocess.Popen[str]]) -> None:
    """Take `size` more bytes, or (0) let go of everything taken."""
    if size:
        hogs.append(hog(size))
        return
    for proc in hogs:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()


def client(
    url: str,
    tokens: list[tuple[float, int]],
    refused: list[float],
    stop: threading.Event,
    max_tokens: int = 64,
    vary: bool = False,
) -> None:
    """One greedy answer after another; `vary`: each one sampled with a seed of its own, so
    answers are computed, not served whole from the prefix cache."""
    sent = 0
    while not stop.is_set():
        sampling = {"temperature": 1.0, "seed": sent} if vary else {"temperature": 0}
        sent += 1
        body = json.dumps(
            {"model": "served", "prompt": "Once upon a time", "max_tokens": max_tokens,
             "ignore_eos": True, **sampling}
        ).encode()  # fmt: skip
        request = urllib.request.Request(
            url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                usage = json.loads(reply.read())["usage"]
            tokens.append((time.monotonic(), usage["completion_tokens"]))
        except urllib.error.HTTPError as err:
            if err.code != 503:
                stop.set()  # the run is void: main() raises it
                refused.append(-float(err.code))
                return
            refused.append(time.monotonic())
            stop.wait(0.2)  # the daemon said Retry-After; a real client would wait longer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=ROOT / "bench-results" / "pressure.json")
    ap.add_argument("--streamed", default=None, help="a scripts/real_shapes.py preset")
    ap.add_argument("--layers", type=int, default=8, help="the --streamed model's layers")
    ap.add_argument("--hidden-scale", type=float, default=0.5, help="its width, scaled")
    args = ap.parse_args()
    models: dict[str, tuple[Any, str]] = {
        "models.target": (str(SHARED / "stories260k"), "bench"),
        "models.draft": (str(SHARED / "stories260k-draft"), "bench"),
    }
    max_tokens = 64
    scratch = tempfile.TemporaryDirectory(prefix="specd-bench-pressure-")
    if args.streamed:
        from scripts.real_shapes import model_config, write_folder

        config = model_config(args.streamed, args.layers, args.hidden_scale)
        folder = write_folder(config, scratch.name)
        models = {
            "models.target": (str(folder), "bench"),
            "models.draft": ("ngram", "bench"),
            "offload.mode": ("stream", "bench"),
            "offload.resident_layers": (0, "bench"),
        }
        max_tokens = 8
    overrides = {
        **models,
        "models.name": ("served", "bench"),
        "server.port": (0, "bench"),
        "memory.pressure.period_seconds": (0.2, "bench"),
        "memory.pressure.recover_seconds": (2.0, "bench"),
        # No pressure while loading: the lines are set once the models are in memory.
        "memory.pressure.tight_host_free": (0, "bench"),
        "memory.pressure.critical_host_free": (0, "bench"),
    }
    rows: list[dict[str, Any]] = []
    tokens: list[tuple[float, int]] = []
    refused: list[float] = []
    with BackgroundServer(load_settings(environ={}, overrides=overrides)) as srv:
        engine = srv.server.engine
        assert engine.pressure is not None
        available = psutil.virtual_memory().available
        lines = (available - 3 * GIB // 2, available - 5 * GIB // 2)
        engine.pressure.thresholds = replace(
            engine.pressure.thresholds, tight_host_free=lines[0], critical_host_free=lines[1]
        )
        stop = threading.Event()
        worker = threading.Thread(target=client, args=(srv.url, tokens, refused, stop, max_tokens))
        start = time.monotonic()
        worker.start()
        # The other program: 2 GiB (tight) at 25% of the run, 1 GiB more (critical) at
        # 40%, both let go at 55%.
        plan = [(0.25, 2 * GIB), (0.40, GIB), (0.55, 0)]
        hogs: list[subprocess.Popen[str]] = []
        me = psutil.Process()
        while (now := time.monotonic() - start) < args.seconds:
            while plan and now >= plan[0][0] * args.seconds:
                # On a thread of its own: the record goes on while the memory is taken.
                threading.Thread(target=other_program, args=(plan.pop(0)[1], hogs)).start()
            recent = sum(n for t, n in tokens if t > time.monotonic() - 1.0)
            monitor = engine.pressure
            assert monitor is not None
            rows.append(
                {
                    "t": round(now, 2),
                    "rss_mib": me.memory_info().rss / 2**20,
                    "available_gib": psutil.virtual_memory().available / GIB,
                    "level": monitor.level,
                    "steps": list(engine.relief.in_force),
                    "tokens_per_s": recent,
                    "refused": sum(1 for t in refused if t > time.monotonic() - 1.0),
                }
            )
            time.sleep(0.1)  # the sampling period of this record
        stop.set()
        worker.join()
    if any(t < 0 for t in refused):
        raise SystemExit(f"the client got HTTP {-min(refused):.0f}: the run is void")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    print(
        "| t (s) | level | relief steps | host available (GiB) | daemon RSS (MiB) | tokens/s | 503s/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows[::10]:
        print(
            f"| {row['t']:.1f} | {row['level']} | {', '.join(row['steps']) or '-'} | "
            f"{row['available_gib']:.1f} | {row['rss_mib']:.0f} | {row['tokens_per_s']} | "
            f"{row['refused']} |"
        )
    if args.plot is not None:
        plot(rows, args.plot, lines)
    return 0


def plot(rows: list[dict[str, Any]], path: Path, lines: tuple[float, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]
    fig, (memory, level, speed) = plt.subplots(3, 1, sharex=True, figsize=(8, 6.5))
    memory.plot(t, [r["available_gib"] for r in rows], label="host RAM available")
    rss = memory.twinx()
    rss.plot(t, [r["rss_mib"] for r in rows], color="tab:orange", label="daemon RSS (MiB, right)")
    rss.set_ylabel("MiB")
    rss.legend(loc="lower right", fontsize=8)
    for line, name in zip(lines, ("tight", "critical"), strict=True):
        memory.axhline(line / GIB, linestyle="--", linewidth=0.8, color="grey")
        memory.annotate(name, (t[0], line / GIB), fontsize=8, va="bottom")
    memory.set_ylabel("GiB")
    memory.legend(loc="center left", fontsize=8)
    level.step(t, [LEVELS.index(r["level"]) for r in rows], where="post", label="level")
    level.step(t, [len(r["steps"]) for r in rows], where="post", label="relief steps in force")
    level.set_yticks([0, 1, 2, 3, 4])
    level.set_yticklabels(["ok / 0", "tight / 1", "critical / 2", "3", "4"])
    level.legend(loc="upper right", fontsize=8)
    speed.plot(t, [r["tokens_per_s"] for r in rows], label="tokens/s the client got")
    speed.plot(t, [100 * r["refused"] for r in rows], label="503 answers/s (x100)")
    speed.set_xlabel("seconds")
    speed.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
