#!/usr/bin/env bash
# Rehearses benchmarks/gpu_check.sh on this CPU machine with the H200 device's software, so that a
# version mismatch shows here and not in the device's 15 minutes. Not part of CI (triton alone is
# a ~190 MB download). What it checks, in a venv that mimics the device (below):
#   1. pagedllm and the scripts gpu_check.sh runs import without fastapi, uvicorn, pydantic,
#      openai or xgrammar (none is on the device)
#   2. the Triton kernels under TRITON_INTERPRET=1: every file gpu_check.sh's gpu-tests step names
#      plus the end-to-end Triton-backend tests, and inside them the ahead-of-time compiles for
#      sm_80/sm_90 with this triton's own ptxas (the device's compiler version)
#   3. tests/benchmarks/test_gpu_check.py, and gpu_check.py build-model / attention.py / throughput.py /
#      gpu_check.py report with gpu_check.sh's flags on the CPU (smaller sizes where noted)
#   4. the JIT compile time of every kernel launch the tests of step 2 make (benchmarks/probes/jit_variants.py:
#      each distinct launch key compiled for sm_90), against gpu_check.sh's gpu-tests limit
#   5. what a device call carries: the tracked files (limit 64 MiB)
# What it cannot check: the GPU itself, Python 3.12 (not installable here, so numpy stays at the
# newest release for 3.11), torch 2.11's CUDA build (torch 2.13 CPU stands in).
#
#   bash benchmarks/device_rehearsal.sh [DIR]   # DIR, else $REHEARSAL_DIR, else ~/.cache/pagedllm-rehearsal
# The venv is built once under DIR (rebuilt when the pins below change); logs, pip-freeze.txt and
# summary.txt go to DIR/logs. Exit status 0 when every step passed.
#
#   bash benchmarks/device_rehearsal.sh --shape [OUT]   # what CI runs (tests/benchmarks/test_gpu_check.py)
# The script's shape only, with this machine's python and nothing installed: gpu_check.sh itself
# on the CPU at tiny sizes (DEVICE=cpu SCALE=tiny), with a PATH that has python3 but no `python`
# and pytest's xdist plugin disabled (as on an image without them); passes when every step
# started and ran and the report (OUT/gpu_check.json) was written.
set -uo pipefail

cd "$(dirname "$0")/.."

shape() {  # shape [OUT]: see the header
    local out=${1:-$(mktemp -d)} bin dir path
    bin=$(mktemp -d)
    path=$bin
    local IFS=:
    for dir in $PATH; do  # the PATH less every directory holding a `python` (compilers etc. stay)
        [ -x "$dir/python" ] || path="$path:$dir"
    done
    unset IFS
    # a wrapper, not a symlink: a venv's python finds its site-packages from the path it runs as
    # (and sys.executable, not the PATH's entry: that may be a shim needing more than this PATH)
    printf '#!/bin/sh\nexec %s "$@"\n' "$("${PYTHON3:-python3}" -c 'import sys; print(sys.executable)')" \
        > "$bin/python3"
    chmod +x "$bin/python3"
    env -u PYTHON PATH="$path" DEVICE=cpu SCALE=tiny LIMIT_SCALE=${LIMIT_SCALE:-4} GPU_TEST_WORKERS=0 PYTEST_ADDOPTS="-p no:xdist" OUT="$out" \
        bash benchmarks/gpu_check.sh
    local rc=$? missing=""
    rm -rf "$bin"
    for name in $(sed -n 's/^step \([a-z-]*\) [0-9]* .*/\1/p' benchmarks/gpu_check.sh); do
        [ -s "$out/$name.log" ] || missing="$missing $name"
    done
    [ -s "$out/gpu_check.json" ] || missing="$missing gpu_check.json"
    if [ "$rc" -ne 0 ] || [ -n "$missing" ]; then
        echo "shape rehearsal FAILED: gpu_check.sh exit $rc; missing:${missing:- nothing} (in $out)"
        return 1
    fi
    echo "shape rehearsal passed: every step of gpu_check.sh ran and wrote its log; report in $out/gpu_check.json"
}

if [ "${1:-}" = --shape ]; then
    shape "${2:-}"
    exit
fi
DIR=${1:-${REHEARSAL_DIR:-$HOME/.cache/pagedllm-rehearsal}}
PY311=${PYTHON311:-python3.11}
VENV=$DIR/venv
LOGS=$DIR/logs
PY=$VENV/bin/python

# The H200 device image's versions (Python 3.12.3, torch 2.11.0+cu130, numpy 2.5.2, the pins
# below). numpy 2.5 needs Python 3.12: the newest for 3.11 stands in.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}  # this machine's CPU build (pip's find-links)
DEVICE_PINS="triton==3.6.0 transformers==5.17.0 numpy<2.5 safetensors==0.8.0 tokenizers==0.23.2
huggingface_hub==1.33.0 sentencepiece==0.2.2 accelerate==1.15.0"
DEVICE_UNPINNED="pytest pytest-xdist hypothesis psutil jinja2 prometheus-client tqdm httpx pyyaml scipy matplotlib"
NOT_ON_DEVICE="pydantic pydantic-core annotated-types typing-inspection"  # typer pulls these in here
ABSENT_MODULES="fastapi uvicorn pydantic openai xgrammar"
# triton 3.6's interpreter calls int() on 1-element arrays, an error from numpy 2.4 on (3.9 fixed
# it): the interpreted tests alone run with this numpy first on PYTHONPATH. The device never
# interprets.
INTERP_NUMPY="numpy==2.3.5"
PINS="$TORCH_SPEC $DEVICE_PINS $DEVICE_UNPINNED -$NOT_ON_DEVICE $INTERP_NUMPY"

build_venv() {
    rm -rf "$VENV" "$DIR/interp-numpy"
    "$PY311" -m venv "$VENV" &&
        "$VENV/bin/pip" install -q "$TORCH_SPEC" &&
        "$VENV/bin/pip" install -q $DEVICE_PINS $DEVICE_UNPINNED &&
        "$VENV/bin/pip" uninstall -y -q $NOT_ON_DEVICE &&
        "$VENV/bin/pip" install -q --target "$DIR/interp-numpy" "$INTERP_NUMPY" &&
        echo "$PINS" > "$VENV/rehearsal-pins.txt"
}

mkdir -p "$LOGS"
if [ "$(cat "$VENV/rehearsal-pins.txt" 2>/dev/null)" != "$PINS" ]; then
    echo "=== building the device-mimic venv in $VENV (log: $LOGS/install.log)"
    t0=$SECONDS
    build_venv > "$LOGS/install.log" 2>&1 || { echo "venv build failed: $LOGS/install.log"; exit 1; }
    echo "=== venv built in $((SECONDS - t0))s"
fi
"$VENV/bin/pip" freeze > "$LOGS/pip-freeze.txt"

failed=""
summary=()
step() {  # step NAME COMMAND...: runs it, logs to $LOGS/NAME.log, records exit status, time, pytest counts
    local name=$1
    shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    local counts
    counts=$(grep -E "^=*\s*[0-9]+ (passed|failed|skipped|deselected|error)" "$LOGS/$name.log" | tail -1 | tr -d '=')
    summary+=("$(printf '%-18s exit %-3s %5ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$counts")")
    [ "$rc" -eq 0 ] || failed="$failed $name"
}

env_py() {  # env_py [VAR=VALUE...] ARGS...: the venv's python with this checkout first on the path
    env PYTHONPATH="$PWD:$PWD/benchmarks" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false "$@"
}

versions() {
    "$PY" -c "import sys, torch, triton, transformers, numpy
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__, 'numpy', numpy.__version__)"
    "$PY" -c "import importlib.util as u, sys
present = [m for m in sys.argv[1:] if u.find_spec(m)]
print('absent as on the device:', ', '.join(sys.argv[1:]) if not present else 'NO, present: ' + ', '.join(present))
sys.exit(bool(present))" $ABSENT_MODULES
}

imports() {  # every module gpu_check.sh's steps import, without the server's packages
    env_py "$PY" -c "import pagedllm, pagedllm.attention.triton.backend, pagedllm.layers.triton_ops.sampling
from pagedllm import LLM, SamplingParams" &&
        for script in gpu_check.py attention.py throughput.py; do
            env_py "$PY" "benchmarks/$script" --help > /dev/null || return 1
        done && echo "pagedllm and benchmarks/{gpu_check,attention,throughput}.py import"
}

# the gpu-tests step's files, read from gpu_check.sh, and the end-to-end Triton-backend tests
GPU_TEST_FILES=$(sed -n '/^step gpu-tests/,/^step build-model/p' benchmarks/gpu_check.sh | grep -o 'tests/[^ ]*')
E2E_FILES="tests/attention/test_triton_attention_engine.py tests/attention/test_triton_graph_safety.py"
# needs xgrammar (a grammar row): not on the device, where this file's `gpu` tests run without it
NEEDS_XGRAMMAR=tests/layers/test_sampler_syncs.py::test_engine_steps_fetch_samples_and_prompt_logprobs_in_one_transfer
JIT_LOG=$LOGS/jit-launches.jsonl
rm -f "$JIT_LOG"*

WORK=$(mktemp -d)  # the 1.1B checkpoint (2 GiB) and the benchmarks' JSON
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/out"
TINY="dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
num_key_value_heads=2, max_position_embeddings=1024)"  # the 1.1B's head_dim 64 and GQA group 4

step versions versions
step imports imports
step interpreted-tests env_py PYTHONPATH="$DIR/interp-numpy:$PWD:$PWD/benchmarks:$PWD/benchmarks/probes" TRITON_INTERPRET=1 \
    "$PY" -m pytest -p no:cacheprovider -n 2 -p jit_variants --jit-log "$JIT_LOG" --deselect "$NEEDS_XGRAMMAR" \
    $GPU_TEST_FILES $E2E_FILES  # -n: under pytest-xdist, as gpu_check.sh runs them
step gpu-check-tests env_py "$PY" -m pytest -p no:cacheprovider tests/benchmarks/test_gpu_check.py
step build-model env_py "$PY" benchmarks/gpu_check.py build-model "$WORK/model-1b" --device cpu
step attention env_py "$PY" benchmarks/attention.py --device cpu --cache-dtype bfloat16 --num-heads 32 \
    --num-kv-heads 8 --head-dim 64 --contexts 512 --cases decode-bs1-ctx512,decode-bs64-ctx512 --skip-ref \
    --repeats 3 --bw-mib 256 --output "$WORK/out/attention.json"
step tiny-model env_py "$PY" -c "import sys, gpu_check; gpu_check.build_model(gpu_check.Path(sys.argv[1]), **$TINY)" \
    "$WORK/tiny"
step throughput env_py "$PY" benchmarks/throughput.py --model "$WORK/tiny" --device cpu --dtype bfloat16 \
    --kv-cache-memory 256MiB --max-num-seqs 32 --workloads single,lognormal --concurrency 32 \
    --sweep-prompt-len 64 --sweep-output-len 16 --repeats 1 --quick --output "$WORK/out/throughput.json"
step report env_py "$PY" benchmarks/gpu_check.py report "$WORK/out" --model "$WORK/model-1b"
# the launches of the CPU twins of the `gpu` tests (the tests parametrized over triton_devices.DEVICES)
step jit-estimate env_py "$PY" benchmarks/probes/jit_variants.py "$JIT_LOG"* --arch 90 --tests "cpu]"
step carry bash -c 'git ls-files -z | du -b --files0-from=- -c | tail -1 |
    awk "{printf \"tracked files: %.1f MiB of the 64 MiB a device call carries\n\", \$1 / 2^20}"'

printf '%s\n' "versions: $(head -1 "$LOGS/versions.log")" "${summary[@]}" | tee "$LOGS/summary.txt"
if [ -n "$failed" ]; then
    echo "FAILED:$failed (logs in $LOGS)"
    exit 1
fi
echo "every step passed (logs in $LOGS)"
