#!/usr/bin/env bash
# The checks only a CUDA machine can answer, in one run, inside one deadline: the GPU tests
# (`pytest -m gpu`: the streamer, the prefix cache's device path, CUDA graphs) and the
# benchmarks' GPU sections (draft steps eager / compiled / graphed; the auto budget's tree
# for a streamed target; what rebuilding a packed layer costs, eager and compiled; a
# streamed 8B-shaped int4 pass against its transfer time; SmolLM2 on real text, streamed,
# in tokens per second). Logs and JSON go to $OUT (default ./gpu-results).
#
#     bash scripts/gpu_checks.sh                 # with .venv (scripts/setup.sh), or
#     PYTHON=python3 bash scripts/gpu_checks.sh  # a Python that has torch with CUDA
#
# GPU_CHECKS names the sections to run (default: tests overhead rebuild substitute offload
# realtext);
# GPU_CHECKS_SECONDS (default 540) bounds them all: each section gets its own cap or what is
# left, whichever is less, so one call of the device tool (10 minutes) holds the run.
# On a bare GPU image with no network, scripts/gpu_kit.sh gathers what is missing into
# .gpu-kit/ (wheels, ../shared/models, the prompts, SmolLM2 in two parts), and this script
# uses it: docs/gpu-checks.md.
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -z "${PYTHON:-}" ] && [ ! -x .venv/bin/python ]; then PYTHON=python3; fi
python=${PYTHON:-.venv/bin/python}
deadline=$((SECONDS + ${GPU_CHECKS_SECONDS:-540}))
sections=" ${GPU_CHECKS:-tests overhead rebuild substitute offload realtext} "

# ---- the kit (scripts/gpu_kit.sh), where one came along ----
kit=/tmp/specd-kit  # kept between two calls on a warm machine
mkdir -p "$kit"
if [ -d .gpu-kit/wheels ] && [ ! -d "$kit/site" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$kit/site" \
        .gpu-kit/wheels/*.whl || echo "gpu_checks: the kit's wheels did not install"
fi
[ -d "$kit/site" ] && export PYTHONPATH=$PYTHONPATH:$kit/site
if [ -d .gpu-kit/data ]; then
    mkdir -p "$kit/cache/data" && cp .gpu-kit/data/* "$kit/cache/data/"
fi
[ -d "$kit/cache" ] && export SPECD_MODEL_CACHE=$kit/cache/models
if [ -d .gpu-kit/shared/models ] && [ ! -d ../shared/models ]; then
    rm -rf "$kit/shared" && cp -a .gpu-kit/shared "$kit/shared"
    { mkdir -p ../shared && ln -sfn "$kit/shared/models" ../shared/models; } 2>/dev/null \
        || echo "gpu_checks: could not link ../shared/models to the kit's models"
fi
for part in 1 2; do
    [ -f ".gpu-kit/smollm2-$part/part" ] && cp ".gpu-kit/smollm2-$part/part" "$kit/smollm2.part$part"
done
smollm2_dir=../shared/models/smollm2-135m-instruct
if [ ! -f "$smollm2_dir/smollm2-135m-instruct-q4_1.gguf" ] && [ -f "$kit/smollm2.part1" ] && [ -f "$kit/smollm2.part2" ]; then
    mkdir -p "$smollm2_dir"
    cat "$kit/smollm2.part1" "$kit/smollm2.part2" >"$smollm2_dir/smollm2-135m-instruct-q4_1.gguf"
    cp "$kit/cache/data/smollm2-README.md" "$smollm2_dir/README.md" 2>/dev/null
    if [ -f "$kit/cache/data/smollm2.sha256" ] && [ "$(sha256sum "$smollm2_dir/smollm2-135m-instruct-q4_1.gguf" | cut -d' ' -f1)" != "$(cat "$kit/cache/data/smollm2.sha256")" ]; then
        echo "gpu_checks: SmolLM2's two parts do not make the file (checksum)"; rm -f "$smollm2_dir/smollm2-135m-instruct-q4_1.gguf"
        joined_badly=1
    fi
fi

"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$out/device.txt" || exit 1
status=0

# section NAME CAP COMMAND...: runs when GPU_CHECKS names it, for at most CAP seconds or
# what is left of the deadline; its output in $OUT/NAME.txt.
section() {
    local name=$1 cap=$2
    shift 2
    [[ $sections == *" $name "* ]] || return 0
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "gpu_checks: $name not run: the deadline is reached" | tee "$out/$name.txt"
        status=1
        return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo "== $name (at most $cap s)"
    timeout "$cap" "$@" 2>&1 | tee "$out/$name.txt" || { echo "gpu_checks: $name failed or timed out"; status=1; }
}

# Only the modules that hold GPU tests: the others need test-only packages (openai,
# selenium) a bare GPU image lacks, and hold nothing `-m gpu` would run.
mapfile -t modules < <(grep -l "pytest.mark.gpu" tests/*.py)
section tests 240 "$python" -m pytest -m gpu -q -p no:cacheprovider -rs "${modules[@]}"
# Issue 36: the 4-bit substitute's step (8B-shaped layers, HQQ) eager against compiled and
# compiled+graphed (what --compile on runs), its projections rebuilt inside the graph.
section substitute 120 "$python" scripts/bench_overhead.py --sections shaped --shaped llama-3.1-8b \
    --shaped-layers 4 --shaped-bits 4 --shaped-repeats 20 --json "$out/substitute-step.json"
# Issue 36: a streamed 8B-shaped int4 pass within 1.2x of its transfer time (the ratio column).
section offload 90 "$python" scripts/bench_offload.py --shapes 8b --layers 8 --tokens 1,64,256 \
    --quantize int4 --no-accelerate --repeats 3 --out "$out/offload-int4.json"
section overhead 120 "$python" scripts/bench_overhead.py --sections shaped budget --json "$out/overhead.json"
section rebuild 60 "$python" scripts/bench_rebuild.py --json "$out/rebuild.json"
# Issue 35: SmolLM2 streamed on the GPU, measured tokens/s against plain decoding and the
# projection (the file comes in two parts: the second call of docs/gpu-checks.md).
if [ -f "$smollm2_dir/smollm2-135m-instruct-q4_1.gguf" ]; then
    section realtext 420 "$python" scripts/bench_realtext.py --device cuda --timed --compile on \
        --drafts sub4,ngram --temperatures 0,1 --cells writing,humaneval --humaneval 1 \
        --no-projection --json "$out/realtext-gpu.json"
elif [[ $sections == *" realtext "* ]]; then
    echo "gpu_checks: realtext not run: no SmolLM2 file (docs/gpu-checks.md: its second part comes in a second call)" \
        | tee "$out/realtext.txt"
    # Asked for by name (the second call), or the parts did not join: nothing measured.
    if [ -n "${GPU_CHECKS:-}" ] || [ -n "${joined_badly:-}" ]; then status=1; fi
fi
exit $status
