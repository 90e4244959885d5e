"""Memory pressure at run time (daemon/pressure.py): the monitor's levels and hysteresis,
the relief ladder's order, the settings, an out-of-memory pass retried after a step, and
the daemon under real pressure: a child process takes host RAM until the monitor reads
tight, then critical; requests keep their exact outputs, new ones get 503 at critical,
and the daemon recovers when the child lets go. Device pressure through an injected
probe (a running request finishes, new ones are refused)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch import nn

from daemon.http.server import BackgroundServer
from daemon.pressure import MAX_SLACK, PressureMonitor, PressureThresholds, settled
from daemon.relief import Relief, Step
from daemon.settings_loading import load_settings

GIB = 1 << 30
MODEL = "stories260k"
PROMPT = "Once upon a time there was a little"


def monitor_on(values: list[int], **limits: Any) -> tuple[PressureMonitor, list[int]]:
    """A monitor whose host probe reads `values` (available bytes), one per poll."""
    thresholds = PressureThresholds(
        tight_host_free=10 * GIB, critical_host_free=5 * GIB, critical_swap_rate=1 << 40,
        **limits,
    )  # fmt: skip
    feed = list(values)
    return PressureMonitor(thresholds, host=lambda: (feed.pop(0), 0, 0)), feed


def test_levels_rise_at_once_and_fall_one_at_a_time_past_the_slack() -> None:
    monitor, _ = monitor_on(
        [12 * GIB, 9 * GIB, 4 * GIB, 5 * GIB + (100 << 20), 10 * GIB + (1 << 20), 11 * GIB,
         5 * GIB + 1],
        recover_seconds=0.0,
    )  # fmt: skip
    assert [monitor.poll() for _ in range(3)] == ["ok", "tight", "critical"]
    # Above critical's line, but not by the slack (10% of the line, at most 512 MiB):
    # still critical. Past it, one level down per reading: tight until tight's line and
    # its slack are passed too.
    assert monitor.poll() == "critical"
    assert monitor.poll() == "tight"
    assert monitor.poll() == "ok"
    assert monitor.poll() == "tight"  # just above critical's line: tight, at once


def test_levels_fall_only_after_recover_seconds() -> None:
    monitor, _ = monitor_on([9 * GIB, 12 * GIB, 12 * GIB], recover_seconds=3600.0)
    assert monitor.poll() == "tight"
    assert monitor.poll() == "tight" and monitor.poll() == "tight"


def test_the_ladder_climbs_in_order_and_descends_in_reverse() -> None:
    done: list[str] = []

    def step(name: str, available: bool = True) -> Step:
        return Step(
            name, lambda: done.append(f"+{name}") or "", lambda: done.append(f"-{name}"),
            available,
        )  # fmt: skip

    relief = Relief([step("a"), step("b", available=False), step("c"), step("d")])
    t = PressureThresholds(period_seconds=0.0, recover_seconds=0.0)
    relief.follow("tight", t)
    relief.follow("tight", t)
    assert done == ["+a", "+c"] and relief.in_force == ["a", "c"]  # b: nothing to do here
    relief.follow("critical", t)
    assert done[-1] == "+d" and relief.in_force == ["a", "c", "d"]
    for _ in range(4):
        relief.follow("ok", t)
    assert done[-3:] == ["-d", "-c", "-a"] and relief.in_force == []


def test_steps_are_taken_only_for_the_memory_that_is_short() -> None:
    """Device pressure never moves layers into host RAM's way for nothing, and host
    pressure never takes a step that frees only the device (moving resident layers to
    host RAM would make it worse): the monitor says which is short."""
    done: list[str] = []

    def step(name: str, **frees: bool) -> Step:
        return Step(
            name, lambda: done.append(f"+{name}") or "", lambda: done.append(f"-{name}"),
            **frees,
        )  # fmt: skip

    relief = Relief([step("cache", device=False), step("graphs", host=False), step("both")])
    t = PressureThresholds(period_seconds=0.0, recover_seconds=0.0)
    relief.follow("critical", t, frozenset({"host"}))
    assert relief.in_force == ["cache", "both"]
    relief.follow("critical", t, frozenset({"device"}))
    assert relief.in_force == ["cache", "both", "graphs"]
    relief.follow("tight", t, frozenset())  # held above the line by hysteresis: no more
    for _ in range(3):
        relief.follow("ok", t)
    assert done == ["+cache", "+both", "+graphs", "-graphs", "-both", "-cache"]

    device = [8 * GIB]
    monitor = PressureMonitor(
        PressureThresholds(
            tight_host_free=10 * GIB, critical_host_free=5 * GIB, tight_device_free=2 * GIB,
            critical_device_free=GIB, critical_swap_rate=1 << 40,
        ),
        device_free=lambda: device[0], host=lambda: (12 * GIB, 0, 0),
    )  # fmt: skip
    assert monitor.poll() == "ok" and monitor.short == frozenset()
    device[0] = GIB // 2
    assert monitor.poll() == "critical" and monitor.short == frozenset({"device"})


def test_auto_lines_follow_the_machine_and_the_plan() -> None:
    auto = PressureThresholds(tight_host_free=None, critical_host_free=None)
    small = settled(auto, available=3 * GIB, margin=None)
    assert (small.tight_host_free, small.critical_host_free) == (3 * GIB // 2, 3 * GIB // 4)
    big = settled(auto, available=40 * GIB, margin=10 * GIB)
    assert (big.tight_host_free, big.critical_host_free) == (2 * GIB, GIB)
    assert (big.tight_device_free, big.critical_device_free) == (GIB, GIB // 2)
    given = settled(
        PressureThresholds(tight_device_free=0, critical_device_free=None), 40 * GIB, 10 * GIB
    )
    assert (given.tight_device_free, given.critical_device_free) == (0, 0)  # 0 is not auto


def test_the_settings_are_a_section_in_a_section(tmp_path: Path) -> None:
    path = tmp_path / "specd.yaml"
    path.write_text("memory:\n  pressure:\n    tight_host_free: 3GiB\n    colour: red\n")
    with pytest.raises(Exception, match=r"memory\.pressure\.colour: unknown key"):
        load_settings(config_file=path, environ={})
    path.write_text("memory:\n  pressure:\n    tight_host_free: 3GiB\n")
    settings = load_settings(
        config_file=path, environ={"SPECD_MEMORY_PRESSURE_RECOVER_SECONDS": "2"}
    )
    assert settings.memory_pressure.tight_host_free == "3GiB"
    assert settings.memory_pressure.recover_seconds == 2.0
    assert settings.sources["memory.pressure.recover_seconds"].startswith("env")


# -- the daemon ------------------------------------------------------------------------


def serve(
    stories_target: Path, stories_draft: Path, streamed: bool = False, **pressure: Any
) -> BackgroundServer:
    """A daemon on the stories pair; `streamed`: every target layer streamed from RAM."""
    offload = {"offload.mode": ("stream", "test"), "offload.resident_layers": (0, "test")}
    overrides = {
        "models.target": (str(stories_target), "test"),
        "models.draft": (str(stories_draft), "test"),
        "runtime.compile": ("off", "test"),
        "server.port": (0, "test"),
        **(offload if streamed else {}),
        **{f"memory.pressure.{k}": (v, "test") for k, v in pressure.items()},
    }
    return BackgroundServer(load_settings(environ={}, overrides=overrides))


def call(srv: BackgroundServer, body: dict[str, Any]) -> tuple[int, dict[str, Any], Any]:
    request = urllib.request.Request(
        srv.url + "/v1/completions", json.dumps({"model": MODEL, **body}).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, dict(reply.headers), json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def status(srv: BackgroundServer) -> dict[str, Any]:
    with urllib.request.urlopen(srv.url + "/v1/specd/status", timeout=10) as reply:
        return json.loads(reply.read())


def wait_for(
    check: Callable[[], bool], what: str, srv: BackgroundServer | None = None,
    timeout: float = 20.0,
) -> None:  # fmt: skip
    """Poll `check` (each poll is a request to the daemon) until it holds; on a timeout,
    say what the daemon's monitor saw last."""
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            seen = status(srv)["memory_pressure"] if srv is not None else "-"
            lines = srv.server.engine.pressure.thresholds if srv is not None else "-"
            # Another program taking or freeing memory meanwhile moves what is available
            # (two of these tests at once on one machine disturb each other).
            raise AssertionError(f"timed out waiting for {what}; the daemon saw {seen}, {lines}")


GREEDY = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}
# A token a pass: the pass that fails is one token's.
ONE_BY_ONE = {**GREEDY, "strategy": "autoregressive"}


class Hog:
    """A child process holding touched RAM until closed, grown 256 MiB at a time until what
    the machine has available is below a line (`grow_until`). A fixed size was not always
    enough: this VM's accounting moves by most of a GiB on its own (4 GiB held took 3.2
    from what was available)."""

    CHUNK = 256 << 20

    def __init__(self) -> None:
        code = (
            "import sys\n"
            "held = []\n"
            "for line in sys.stdin:\n"
            f"    b = bytearray({self.CHUNK})\n"
            "    b[::4096] = b'\\x01' * len(range(0, len(b), 4096))\n"
            "    held.append(b)\n"
            "    print('held', flush=True)\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.held = 0

    def grow_until(self, line: int, most: int = 8 * GIB) -> None:
        """Hold more until available memory is below `line` (at most `most` bytes)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        while psutil.virtual_memory().available >= line:
            assert self.held < most, f"held {self.held} bytes and memory is still available"
            self.proc.stdin.write("more\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline().strip() == "held"
            self.held += self.CHUNK

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def hogs() -> Iterator[list[Hog]]:
    held: list[Hog] = []
    yield held
    for hog in held:
        if hog.proc.poll() is None:
            hog.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_real_host_pressure_steps_refusal_and_recovery(
    stories_target: Path, stories_draft: Path, hogs: list[Hog], streamed: bool
) -> None:
    """The lines are set relative to what is available once the daemon has loaded and
    answered (what it holds then is not pressure), so that a child holding 2.5 GiB makes
    it tight and one more holding 2 GiB critical, each a GiB past its line (and back at
    ok a GiB short of the start: what is available moves while other programs run). A
    streamed target's layers move to the disk tier at the end of the ladder, and back to
    RAM after."""
    with serve(
        stories_target, stories_draft, streamed, period_seconds=0.1, recover_seconds=0.3,
        tight_host_free=0, critical_host_free=0, critical_swap_rate="1TB/s",
    ) as srv:  # fmt: skip
        code, _, reference = call(srv, GREEDY)
        monitor = srv.server.engine.pressure
        assert monitor is not None
        available = psutil.virtual_memory().available
        monitor.thresholds = replace(
            monitor.thresholds, tight_host_free=available - 3 * GIB // 2,
            critical_host_free=available - 3 * GIB,
        )  # fmt: skip
        assert code == 200 and status(srv)["memory_pressure"]["level"] == "ok"
        assert status(srv)["prefix_cache"]["allocated_bytes"] > 0
        tight, critical = monitor.thresholds.tight_host_free, monitor.thresholds.critical_host_free
        assert tight is not None and critical is not None
        hogs.append(Hog())
        hogs[0].grow_until(tight - GIB)
        wait_for(lambda: status(srv)["memory_pressure"]["level"] == "tight", "tight", srv)
        # One step per period while tight, in the ladder's order.
        steps = ["prefix_cache", "cached_sessions", "pass_size"] + ["disk_tier"] * streamed
        wait_for(lambda: status(srv)["memory_pressure"]["steps"] == steps, "all steps", srv)
        streamer = srv.server.engine.runtime.streamer  # type: ignore[union-attr]
        assert (streamer.storage.tier if streamer else None) == ("disk" if streamed else None)
        now = status(srv)
        assert now["prefix_cache"]["allocated_bytes"] == 0  # its chunks freed
        code, _, answer = call(srv, GREEDY)  # smaller passes, no cache: the same text
        assert code == 200 and answer["choices"][0]["text"] == reference["choices"][0]["text"]
        hogs.append(Hog())
        hogs[1].grow_until(critical - GIB)
        wait_for(lambda: status(srv)["memory_pressure"]["level"] == "critical", "critical", srv)
        code, headers, refused = call(srv, GREEDY)
        assert code == 503 and refused["error"]["code"] == "memory_pressure"
        assert headers.get("Retry-After") == "5"
        with urllib.request.urlopen(srv.url + "/health", timeout=10) as reply:
            assert json.loads(reply.read())["memory_pressure"] == "critical"
        for hog in hogs:
            hog.close()
        # Back at ok once available is past the tight line by its slack: where this VM
        # gave back less than it took, the lines move down by the shortfall (the way
        # down is what is tested, not the VM's accounting).
        short = tight + MAX_SLACK + GIB // 4 - psutil.virtual_memory().available
        if short > 0:
            monitor.thresholds = replace(
                monitor.thresholds, tight_host_free=tight - short, critical_host_free=critical - short
            )  # fmt: skip
        wait_for(lambda: status(srv)["memory_pressure"]["level"] == "ok", "ok", srv)
        wait_for(lambda: status(srv)["memory_pressure"]["steps"] == [], "steps undone", srv)
        if streamer is not None:  # read back into RAM, adopted at the start of a pass
            assert streamer._refill is not None
            streamer._refill[0].result(timeout=60)
        code, _, answer = call(srv, GREEDY)
        assert code == 200 and answer["choices"][0]["text"] == reference["choices"][0]["text"]
        assert streamer is None or streamer.storage.tier == "ram"
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        assert 'specd_memory_relief_steps_taken_total{step="prefix_cache"} 1.0' in metrics
        assert "specd_memory_pressure_level 0.0" in metrics


# The steps a CPU daemon watching a device takes at critical (graph_pools needs CUDA).
STEPS = ["prefix_cache", "cached_sessions", "pass_size", "resident_layers"]


def test_device_pressure_lets_a_running_request_finish(
    stories_target: Path, stories_draft: Path
) -> None:
    free = [8 * GIB]
    srv = serve(
        stories_target, stories_draft, period_seconds=0.05, recover_seconds=0.1,
        tight_host_free=0, critical_host_free=0, tight_device_free="2GiB",
        critical_device_free="1GiB", critical_swap_rate="1TB/s",
    )  # fmt: skip
    srv.server.engine.device_probe = lambda: free[0]
    with srv:
        body = {**GREEDY, "max_tokens": 400, "ignore_eos": True, "strategy": "autoregressive"}
        _, _, reference = call(srv, body)
        runtime = srv.server.engine.runtime
        request = urllib.request.Request(
            srv.url + "/v1/completions",
            json.dumps({"model": MODEL, **body, "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as stream:
            first = stream.readline()
            assert first.startswith(b"data: ")
            free[0] = GIB // 2  # another program takes the device's memory
            wait_for(lambda: status(srv)["memory_pressure"]["level"] == "critical", "critical", srv)
            code, _, _ = call(srv, GREEDY)
            assert code == 503
            # Every step, the last one moving 3 of the target's 5 resident layers into a
            # stream made for them while the request runs.
            wait_for(lambda: status(srv)["memory_pressure"]["steps"] == STEPS, "every step", srv)
            streamer = runtime.streamer
            assert streamer is not None and streamer.streamed_layers == 3
            text = json.loads(first[6:])["choices"][0]["text"]
            for line in stream:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
        assert text == reference["choices"][0]["text"]
        assert set(streamer.fetch_log) == {2, 3, 4}  # the request's last passes streamed them
        free[0] = 8 * GIB
        wait_for(lambda: status(srv)["memory_pressure"]["steps"] == [], "steps undone", srv)
        assert runtime.streamer is None and isinstance(runtime.target.layers, nn.ModuleList)
        _, _, again = call(srv, body)
        assert again["choices"][0]["text"] == reference["choices"][0]["text"]


def test_an_out_of_memory_pass_is_rolled_back_relieved_and_run_again(
    stories_target: Path, stories_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import speculative.batching

    real = speculative.batching.execute
    calls = [0]
    fail_at = [0]  # the pass that fails once (0: none)

    def counted(requests: Any) -> None:
        # The pass runs (its keys and values appended, as a pass that fails at the head
        # leaves them), then fails as CUDA does when it cannot allocate.
        real(requests)
        calls[0] += 1
        if calls[0] == fail_at[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(speculative.batching, "execute", counted)
    # Two servers, so that the second request meets no cache the first one left.
    with serve(stories_target, stories_draft, period_seconds=60.0) as srv:
        _, _, reference = call(srv, ONE_BY_ONE)
    passes, calls[0], fail_at[0] = calls[0], 0, 5
    with serve(stories_target, stories_draft, period_seconds=60.0) as srv:
        code, _, answer = call(srv, ONE_BY_ONE)
        assert code == 200 and answer["choices"][0]["text"] == reference["choices"][0]["text"]
        assert status(srv)["memory_pressure"]["steps"] == ["prefix_cache"]
    assert calls[0] == passes + 1  # the failed pass once more, nothing else


def test_the_pass_size_step_shortens_prefill_chunks_and_gives_them_back() -> None:
    from types import SimpleNamespace

    from daemon.pools import StrategyPool

    class Builds:
        default_strategy = "tree"

        def strategy(self, name: str, budget: int | None = None, verification: Any = None) -> Any:
            return SimpleNamespace(name=name, prefill_chunk=2048)

    pool, runtime = StrategyPool(), Builds()
    held = pool.get(runtime, "tree", None)  # type: ignore[arg-type]
    pool.shorten_prefill(4)
    later = pool.get(runtime, "tree", 64)  # type: ignore[arg-type]
    assert (held.prefill_chunk, later.prefill_chunk) == (512, 512)
    pool.shorten_prefill(1)
    assert (held.prefill_chunk, later.prefill_chunk) == (2048, 2048)
