# Source on a GPU machine (the device tool runs in the repository root of a copy of the tree, with no install):
#   . benchmarks/box_env.sh
# The machines ship torch, triton and transformers but not the rest of the project's packages: a call carrying
# `.whl` (wheels for Python 3.12 downloaded here: `benchmarks/tree_ab.sh prepare` and `.whl/agent` for the server's
# anthropic, openai and mcp packages with theirs, cryptography included; leave `.whl/extra` out of a call that carries a
# model folder too: a call carries 64 MiB in all) installs them once into /tmp/cvsite (kept while the machine stays warm). The library's
# `kernels/` (installed as `cvllm_lab.kernels` by the editable install here) is linked into the package.
if [ ! -f /tmp/cvsite/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cvsite \
    .whl/*.whl .whl/agent/*.whl || return 1
  python3 -c "import pandas, matplotlib" 2>/dev/null \
    || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/cvsite .whl/extra/*.whl
  touch /tmp/cvsite/.done
fi
[ -e cvllm_lab/kernels ] || ln -s ../kernels cvllm_lab/kernels
export PYTHONPATH=$PWD:$PWD/tests:/tmp/cvsite PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
