#!/usr/bin/env bash
# The GPU check, in one run that fits in 6 minutes on one H200 (nothing is downloaded), so that a
# second try fits in the 15 device-minutes a task is lent:
#   1. the tests marked `gpu` (Triton kernels on the device, CUDA-graph replay == eager with an fp8
#      KV cache, top-p sampling, an MoE model and multi-LoRA batches too, one host sync per sampling
#      step under torch's sync debug mode; with two GPUs also the TP=2 graphs captured over NCCL,
#      replay == eager: marked `multi_gpu`, skipped with one device)
#   2. a random ~1.1B Llama (benchmarks/gpu_check.py: hidden 2048, 16 layers, 32 heads, 8 KV heads,
#      vocab 32000) built on the GPU and saved in bfloat16 to a temporary directory
#   3. benchmarks/attention.py: decode attention at batch 1 and 64, context 4096, that model's heads,
#      timed as kernels only (a captured CUDA graph replayed back to back)
#   4. benchmarks/throughput.py against transformers `generate` in the same process, bfloat16:
#      single (1 x 128 -> 128), lognormal (64 mixed requests) and 256 requests of 512 -> 128
#   5. the targets next to the results (benchmarks/gpu_check.py report)
# Every result is JSON under $OUT (default: a new temporary directory). Each step has its own
# time limit, so a slow or failing step costs at most its share and the later ones still run,
# and no step runs past BUDGET_S (default 335 s: with the version probe the check stays within
# 6 minutes).
# Exit status: 0 when every step ran, whether or not the targets were met (the report records
# them); 1, with the failed steps named, when a step failed or ran out of time.
#
#   OUT=/tmp/gpu-out bash benchmarks/gpu_check.sh
# Environment: PYTHON (default python, else python3: images may have only the latter);
# GPU_TEST_WORKERS (default 8; 0, or pytest-xdist absent: one process); LIMIT_SCALE (default 1); DEVICE=cpu SCALE=tiny
# runs the same steps on a CPU with a tiny model and small shapes, which is how CI rehearses the
# script's shape (benchmarks/device_rehearsal.sh --shape).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
MODEL_DIR=$(mktemp -d)  # 2 GiB of weights: not under $OUT, which is copied back
trap 'rm -rf "$MODEL_DIR"' EXIT
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_DEFAULT_FP_FUSION=1
PY=${PYTHON:-python}
command -v "$PY" > /dev/null || PY=python3  # an image with only python3 has no `python`
# LIMIT_SCALE multiplies every step's limit and the budget: the CPU rehearsal checks the script's
# shape, not the device's timings, and a loaded CI machine ran its 30 s model build in 31 s
LIMIT_SCALE=${LIMIT_SCALE:-1}
BUDGET_S=$(( ${BUDGET_S:-335} * LIMIT_SCALE ))
DEVICE=${DEVICE:-cuda}
SCALE=${SCALE:-full}
failed=""

step() {  # step NAME SECONDS COMMAND...: runs it with a time limit, logs to $OUT/NAME.log
    local name=$1 limit=$(($2 * LIMIT_SCALE))
    shift 2
    local left=$((BUDGET_S - SECONDS - 5))  # 5 s: the kill grace below
    [ "$limit" -le "$left" ] || limit=$left
    if [ "$limit" -le 0 ]; then
        echo "=== $name: SKIPPED, the ${BUDGET_S}s budget is spent"
        failed="$failed $name(skipped)"
        return 0
    fi
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0))s"
    [ "$rc" -eq 0 ] || failed="$failed $name(exit $rc)"
    return 0
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, \
transformers.__version__)" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

if [ "$SCALE" = tiny ]; then  # the CPU rehearsal: every step's command line, at sizes a CPU runs in seconds
    MODEL_ARGS=(--tiny)
    ATTENTION_ARGS=(--num-heads 4 --num-kv-heads 2 --head-dim 64 --contexts 64 --cases decode-bs1-ctx64,decode-bs4-ctx64
        --quick --repeats 2 --bw-mib 8)
    THROUGHPUT_ARGS=(--kv-cache-memory 64MiB --max-num-seqs 8 --concurrency 8 --sweep-prompt-len 16
        --sweep-output-len 4 --quick)
else
    MODEL_ARGS=()
    ATTENTION_ARGS=(--num-heads 32 --num-kv-heads 8 --head-dim 64 --contexts 4096
        --cases decode-bs1-ctx4096,decode-bs64-ctx4096 --repeats 10 --bw-mib 1024)
    THROUGHPUT_ARGS=(--kv-cache-memory 40GiB --max-num-seqs 256 --concurrency 256 --sweep-prompt-len 512
        --sweep-output-len 128)
fi

# the files holding gpu tests, named: collecting all of tests/ would need the server's packages too.
# In 8 processes where pytest-xdist is installed (it is on the H200 image): a fresh machine JITs
# every kernel variant, ~150 of them, one at a time per process (device_rehearsal.sh measured
# 127 s of sm_90 compiles for the interpreted tests' launches on this CPU, with triton 3.6).
# `-o addopts=`: pyproject's addopts name xdist's -n, an error where xdist is not installed
WORKERS=${GPU_TEST_WORKERS:-8}
XDIST=()
if [ "$WORKERS" -gt 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
    XDIST=(-n "$WORKERS" --dist load)  # by test, not by module
fi
step gpu-tests 110 "$PY" -m pytest -q -o addopts= -p no:cacheprovider "${XDIST[@]}" -m gpu \
    --junitxml="$OUT/gpu-tests.xml" tests/layers/triton_ops tests/attention/test_triton_attention.py \
    tests/e2e/test_cuda_graph_replay.py tests/e2e/test_gpu_paths.py tests/layers/test_sampler_syncs.py \
    tests/distributed/test_tp_cuda_graphs.py tests/lora/test_lora_cuda_graphs.py
step build-model 30 "$PY" benchmarks/gpu_check.py build-model "$MODEL_DIR" --device "$DEVICE" "${MODEL_ARGS[@]}"
step attention 25 "$PY" benchmarks/attention.py --device "$DEVICE" --cache-dtype bfloat16 --skip-ref \
    "${ATTENTION_ARGS[@]}" --output "$OUT/attention.json"
step throughput 155 "$PY" benchmarks/throughput.py --model "$MODEL_DIR" --device "$DEVICE" --dtype bfloat16 \
    --workloads single,lognormal --repeats 1 "${THROUGHPUT_ARGS[@]}" --output "$OUT/throughput.json"
step report 15 "$PY" benchmarks/gpu_check.py report "$OUT" --model "$MODEL_DIR"

if [ -n "$failed" ]; then
    echo "FAILED:$failed (logs and results in $OUT)"
    exit 1
fi
echo "every step ran; results in $OUT"
