#!/usr/bin/env bash
# The GPU check, in one run that fits in 8 minutes on one H200 (nothing is downloaded):
#   1. the tests marked `gpu` (Triton kernels on the device, CUDA-graph replay == eager, one host
#      sync per sampling step under torch's sync debug mode; with two GPUs also the TP=2 graphs
#      captured over NCCL, replay == eager: marked `multi_gpu`, skipped with one device)
#   2. a random ~1.1B Llama (benchmarks/gpu_check.py: hidden 2048, 16 layers, 32 heads, 8 KV heads,
#      vocab 32000) built on the GPU and saved in bfloat16 to a temporary directory
#   3. benchmarks/attention.py: decode attention at batch 1 and 64, context 4096, that model's heads
#   4. benchmarks/throughput.py against transformers `generate` in the same process, bfloat16:
#      single (1 x 128 -> 128), lognormal (64 mixed requests) and 256 requests of 512 -> 128
#   5. the targets next to the results (benchmarks/gpu_check.py report)
# Every result is JSON under $OUT (default: a new temporary directory). Each step has its own
# time limit, so a slow or failing step costs at most its share and the later ones still run,
# and no step runs past BUDGET_S (default 460 s: the whole check stays within 8 minutes).
# Exit status: 0 when every step ran, whether or not the targets were met (the report records
# them); 1, with the failed steps named, when a step failed or ran out of time.
#
#   OUT=/tmp/gpu-out bash benchmarks/gpu_check.sh
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
MODEL_DIR=$(mktemp -d)  # 2 GiB of weights: not under $OUT, which is copied back
trap 'rm -rf "$MODEL_DIR"' EXIT
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_DEFAULT_FP_FUSION=1
PY=${PYTHON:-python}
BUDGET_S=${BUDGET_S:-460}
failed=""

step() {  # step NAME SECONDS COMMAND...: runs it with a time limit, logs to $OUT/NAME.log
    local name=$1 limit=$2
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

# the files holding gpu tests, named: collecting all of tests/ would need the server's packages too.
# In 8 processes where pytest-xdist is installed (it is on the H200 image): a fresh machine JITs
# every kernel variant, ~150 of them, one at a time per process (device_rehearsal.sh measured
# 127 s of sm_90 compiles for the interpreted tests' launches on this CPU, with triton 3.6)
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8 --dist load")  # by test, not pyproject's by module
step gpu-tests 150 "$PY" -m pytest -q -p no:cacheprovider $XDIST -m gpu --junitxml="$OUT/gpu-tests.xml" \
    tests/triton_ops tests/attention/test_triton_attention.py tests/e2e/test_cuda_graph_replay.py \
    tests/unit/test_sampler_syncs.py tests/distributed/test_tp_cuda_graphs.py
step build-model 40 "$PY" benchmarks/gpu_check.py build-model "$MODEL_DIR" --device cuda
step attention 50 "$PY" benchmarks/attention.py --device cuda --cache-dtype bfloat16 --num-heads 32 \
    --num-kv-heads 8 --head-dim 64 --contexts 4096 --cases decode-bs1-ctx4096,decode-bs64-ctx4096 --skip-ref \
    --repeats 10 --bw-mib 1024 --output "$OUT/attention.json"
step throughput 200 "$PY" benchmarks/throughput.py --model "$MODEL_DIR" --device cuda --dtype bfloat16 \
    --kv-cache-memory 40GiB --max-num-seqs 256 --workloads single,lognormal --concurrency 256 \
    --sweep-prompt-len 512 --sweep-output-len 128 --repeats 1 --output "$OUT/throughput.json"
step report 15 "$PY" benchmarks/gpu_check.py report "$OUT" --model "$MODEL_DIR"

if [ -n "$failed" ]; then
    echo "FAILED:$failed (logs and results in $OUT)"
    exit 1
fi
echo "every step ran; results in $OUT"
