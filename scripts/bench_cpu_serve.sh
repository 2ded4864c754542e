#!/usr/bin/env bash
# The server on CPU against llama-cpp-python's server, same GGUF (the embedded SmolLM2 Q4_1), same threads:
# our load generator (TTFT, TPOT, ITL and tok/s as vLLM's benchmark_serving defines them) at concurrency 1 and 16,
# one JSON line per run appended to $OUT (default results/cpu_serve_vs_llamacpp.jsonl).
#   scripts/bench_cpu_serve.sh                 # needs llama-cpp-python[server] in $LLAMA_PY's environment for its half
# Env: LLAMA_PY (python with llama_cpp, default .venv/bin/python), THREADS (default: the cores we may use),
#      N1/N16 (requests at concurrency 1/16, default 8/64), IN/OUTLEN (prompt/output tokens, default 128/128).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
PY=.venv/bin/python
LLAMA_PY=${LLAMA_PY:-$PY}
OUT=${OUT:-results/cpu_serve_vs_llamacpp.jsonl}
THREADS=${THREADS:-$($PY -c 'import os; print(len(os.sched_getaffinity(0)))')}
GGUF=$($PY -c 'from cvllm_lab.config import default_model_path; print(default_model_path())')
N1=${N1:-8}; N16=${N16:-64}; IN=${IN:-128}; OUTLEN=${OUTLEN:-128}
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
wait_up() { for _ in $(seq 300); do curl -sf "$1/models" >/dev/null && return 0; sleep 1; done; echo "no server at $1"; return 1; }
load() {   # name url concurrency requests
  $PY -m cvllm_lab.bench.loadgen --base-url "$2" --endpoint completions --dataset words --input-len "$IN" \
      --output-len "$OUTLEN" --concurrency "$3" --num-requests "$4" --temperature 0 --json --no-progress \
    | $PY -c "import json,sys,platform; r=json.loads(sys.stdin.read().strip().splitlines()[-1]); r.update(server='$1', concurrency=$3, threads=$THREADS, cpu=open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].split('\n')[0].strip()); print(json.dumps(r))" \
    | tee -a "$OUT"
}
mkdir -p "$(dirname "$OUT")"
OMP_NUM_THREADS=$THREADS $PY -m cvllm_lab.entrypoints.serve --port 8010 > /tmp/cvllm_serve.log 2>&1 & pids+=($!)
wait_up http://127.0.0.1:8010/v1
load cvllm_lab http://127.0.0.1:8010/v1 1 "$N1"; load cvllm_lab http://127.0.0.1:8010/v1 16 "$N16"
kill "${pids[0]}"; wait "${pids[0]}" 2>/dev/null || true
if $LLAMA_PY -c 'import llama_cpp.server' 2>/dev/null; then
  $LLAMA_PY -m llama_cpp.server --model "$GGUF" --n_threads "$THREADS" --n_threads_batch "$THREADS" --n_ctx 4096 \
      --port 8011 > /tmp/llamacpp_serve.log 2>&1 & pids+=($!)
  wait_up http://127.0.0.1:8011/v1
  load llama.cpp http://127.0.0.1:8011/v1 1 "$N1"; load llama.cpp http://127.0.0.1:8011/v1 16 "$N16"
else echo "llama_cpp.server not importable by $LLAMA_PY: pip install 'llama-cpp-python[server]' there (its half skipped)"; fi
