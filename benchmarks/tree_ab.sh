#!/usr/bin/env bash
# Two builds of the project side by side on one GPU machine, in one lease (an A/B of a refactor or a change).
#
#   benchmarks/tree_ab.sh prepare OLD_REV NEW_REV     # here: .ab/old and .ab/new from two commits, .whl wheels
#   benchmarks/tree_ab.sh run old:sweep new:sweep ... # there: each tree's `+sweep=vllm_table` (or `:serve`:
#                                                     #   serve_load at concurrency 1 and 64), CSVs into $OUT
#
# Each tree runs from its own folder (`python -m` puts the working directory first on the path, so the checkout's
# own `cvllm_lab` must not be it). Each tree is the library with its kernels copied in (the package's `kernels/` -> `cvllm_lab.kernels`), its conf,
# benchmarks and reference results, imported through PYTHONPATH, so both run from one checkout. The GPU machines lack a
# few of the project's packages: `prepare` downloads them as Python 3.12 wheels into .whl (add `/.whl/` and `/.ab/`
# to .git/info/exclude), and a device call carries both folders (`carry: [".whl", ".ab"]`).
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
  old=$2 new=$3
  rm -rf .ab && mkdir -p .ab/old .ab/new
  for t in old new; do
    rev=$([ $t = old ] && echo "$old" || echo "$new")
    git archive "$rev" cvllm_lab kernels conf benchmarks results/reference tests pyproject.toml | tar -x -C .ab/$t
    cp -r .ab/$t/kernels .ab/$t/cvllm_lab/kernels; rm -f .ab/$t/cvllm_lab/_modidx.py
  done
  dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
           --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any "$@"; }
  [ -f .whl/extra/.done ] && { du -sh .ab .whl; exit 0; }  # the wheels are downloaded once
  mkdir -p .whl/extra
  dl -d .whl hydra-core==1.3.8 omegaconf==2.3.1 msgspec pyzmq fastcore llguidance==1.6.1 gguf fastapi starlette uvicorn \
     httptools uvloop prometheus_client aiohttp aiohappyeyeballs aiosignal frozenlist multidict yarl propcache \
     opentelemetry-api importlib-metadata zipp annotated-types typing-inspection pydantic pydantic_core anyio sniffio h11 httpx httpcore
  python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3     # hydra's parser: an sdist only
  dl -d .whl/extra pandas matplotlib contourpy cycler fonttools kiwisolver pyparsing python-dateutil tzdata
  touch .whl/extra/.done; du -sh .ab .whl ;;
run)
  shift
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  if [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    python3 -c "import pandas, matplotlib" 2>/dev/null \
      || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/extra/*.whl
  fi
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  for t in "$@"; do
    tree=${t%%:*}; what=${t#*:}
    echo "=== $tree $what $(date +%T)"
    if [ "$what" = sweep ]; then
      (cd .ab/$tree && PYTHONPATH=.:/tmp/site CVLLM_LAB_COMMIT=$tree python3 -m cvllm_lab.bench \
        +sweep=${AB_SWEEP:-vllm_table} out="$OUT/vllm_table_$tree.csv" plot=false 2>&1 | grep -v "Warning\|warn(" | tail -15)
    else
      (cd .ab/$tree && PYTHONPATH=.:/tmp/site CVLLM_LAB_COMMIT=$tree python3 benchmarks/serve_load.py --model llama3_8b \
        --concurrency 1 64 --out "$OUT/serve_$tree.csv" -- --max-model-len 8192 --gpu-memory-utilization 0.85 2>&1 | tail -8)
    fi
  done ;;
*) sed -n 2,12p "$0"; exit 2 ;;
esac
