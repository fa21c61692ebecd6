#!/usr/bin/env bash
# Data parallelism on one host: serving.py against one replica with every core, then against
# `serve --data-parallel-size 2` behind the prefix-aware router, then the same with round-robin.
# Same workload each time: shared system prompts (--dataset prefix), streaming, ignore_eos.
#   benchmarks/data_parallel.sh [RATE ...]    (default rates: 4 inf); results in benchmarks/results/
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
MODEL=$(python -c "import sys; sys.path.insert(0, 'benchmarks'); import common; print(common.ensure_model(common.default_model_dir()))")
PORT=${PORT:-8019}
RATES=("${@:-4 inf}")
LOAD=(--dataset prefix --num-prefixes 32 --prefix-len 256 --random-input-len 32 --random-output-len 32
      --num-prompts 128 --tokenizer "$MODEL" --prefix-metrics)
LOGS=${TMPDIR:-/tmp}

run_config() {  # name, then serve flags
  local name=$1; shift
  python -m pagedllm.entrypoints.cli serve "$MODEL" --port "$PORT" --uvicorn-log-level warning "$@" \
    > "$LOGS/pagedllm-dp-$name.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 "$pid" 2> /dev/null || { tail -20 "$LOGS/pagedllm-dp-$name.log"; exit 1; }
    sleep 1
  done
  local seed=0
  for rate in ${RATES[*]}; do  # a seed per rate: other prompts, so no run finds the last one's prefixes cached
    echo "=== $name, request rate $rate"
    python benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" "${LOAD[@]}" --request-rate "$rate" \
      --seed $((seed++)) --result-file "benchmarks/results/dp-$name-rate$rate.json"
  done
  kill -TERM "$pid"; wait "$pid" || true
}

mkdir -p benchmarks/results
run_config single --kv-cache-memory 1GiB
run_config dp2-prefix --data-parallel-size 2 --kv-cache-memory 512MiB --routing-policy prefix
run_config dp2-round-robin --data-parallel-size 2 --kv-cache-memory 512MiB --routing-policy round_robin
