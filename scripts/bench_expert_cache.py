"""The expert cache's own bookkeeping per pass at Qwen3-30B-A3B's expert count (48 layers
of 128 experts) with the device slots the plan gives a 16 GB and a 24 GB card (1,383 and
2,293): a pass waking 8 experts a layer (one token), 126 (a 64-node tree) and all 128. The
experts are tiny, so the copies cost nothing and what is timed is the Python work. The
former victim rule (a scan of every slot per miss) runs beside it in the same process and
makes the same choices (the same copies).

    .venv/bin/python scripts/bench_expert_cache.py
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload.experts import ExpertCache  # noqa: E402

LAYERS, EXPERTS = 48, 128


class Scanning(ExpertCache):
    """The former rule: each miss scans every slot for the least worth free one."""

    def _victim(self, key: tuple[int, int]) -> int:
        free = [s for s in range(self.slots) if s not in self.pinned and s != self.bypass]
        if not free:
            return self.bypass if self.bypass is not None else 0
        victim = min(free, key=self.worth.__getitem__)
        if self.bypass is not None and self.worth[victim] > self.count.get(key, 0.0):
            return self.bypass
        return victim


def per_pass(cache: ExpertCache, woken: int, seed: int) -> float:
    rng = random.Random(seed)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        for layer in range(LAYERS):
            wanted = sorted(rng.sample(range(EXPERTS), woken))
            cache.prepare(layer, wanted)
            for e in wanted:
                cache.expert(layer, e)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def main() -> None:
    torch.set_num_threads(1)
    layers = [[nn.Linear(4, 4, bias=False) for _ in range(EXPERTS)] for _ in range(LAYERS)]
    print(
        "| device slots | experts woken a layer | ms per pass, scanning | heap | ratio | copies |"
    )
    print("|---|---|---|---|---|---|")
    for slots in (1383, 2293):
        heap, scan = ExpertCache(layers, "cpu", slots), Scanning(layers, "cpu", slots)
        for seed, woken in enumerate((8, 126, 128)):
            old, new = per_pass(scan, woken, seed), per_pass(heap, woken, seed)
            assert heap.holder == scan.holder and heap.stats.copies == scan.stats.copies
            print(f"| {slots:,} | {woken} | {old * 1e3:.1f} | {new * 1e3:.1f} | "
                  f"{old / new:.0f}x | {heap.stats.copies:,} |")  # fmt: skip


if __name__ == "__main__":
    main()
