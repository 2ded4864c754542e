#!/usr/bin/env bash
# The server on CPU against llama-cpp-python's server, same GGUF (the embedded SmolLM2 Q4_1), same threads: our
# load generator at concurrency 1 and 16, the two servers' runs alternating, medians over repeats, the load average
# beside each run (benchmarks/cpu_serve.py). Writes results/cpu_serve_vs_llamacpp.csv and .png.
#   LLAMA_PY=/work/llamacpp-venv/bin/python scripts/bench_cpu_serve.sh [--repeats 3] [--threads 2] ...
# LLAMA_PY: a python with llama-cpp-python[server] (pip install 'llama-cpp-python[server]'; default: ours).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m benchmarks.cpu_serve "$@"
