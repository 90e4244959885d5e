#!/usr/bin/env bash
# The checks only a CUDA machine can answer, in one run, each bounded in time: the GPU tests
# (`pytest -m gpu`: the streamer, the prefix cache's device path, CUDA graphs) and the
# benchmarks' GPU sections (draft steps eager / compiled / graphed; the auto budget's tree
# for a streamed target; what rebuilding a packed layer costs, eager and compiled). Logs and
# JSON go to $OUT (default ./gpu-results).
#
#     bash scripts/gpu_checks.sh                 # with .venv (scripts/setup.sh), or
#     PYTHON=python3 bash scripts/gpu_checks.sh  # a Python that has torch with CUDA
#
# Needs ../shared/models beside the checkout (the tests' tiny checkpoints). TEST_TIMEOUT and
# BENCH_TIMEOUT (seconds) bound the two parts. On a bare GPU image whose python3 has torch,
# carry platformdirs as a wheel (the README's GPU section says how).
set -u -o pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$out/device.txt" || exit 1
status=0
# Only the modules that hold GPU tests: the others need test-only packages (openai,
# selenium) a bare GPU image lacks, and hold nothing `-m gpu` would run.
mapfile -t modules < <(grep -l "pytest.mark.gpu" tests/*.py)
timeout "${TEST_TIMEOUT:-300}" "$python" -m pytest -m gpu -q -p no:cacheprovider -rs "${modules[@]}" 2>&1 | tee "$out/pytest-gpu.txt" || status=1
timeout "${BENCH_TIMEOUT:-240}" "$python" scripts/bench_overhead.py --sections shaped budget --json "$out/overhead.json" \
    2>&1 | tee "$out/overhead.txt" || status=1
timeout "${BENCH_TIMEOUT:-240}" "$python" scripts/bench_rebuild.py --json "$out/rebuild.json" \
    2>&1 | tee "$out/rebuild.txt" || status=1
exit $status
