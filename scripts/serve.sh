#!/usr/bin/env bash
# Set up (scripts/setup.sh: about a second once done, no network), then serve the embedded default model with the
# OpenAI-compatible server. Extra arguments go to the server, e.g. `scripts/serve.sh --port 8080 --ui-server`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m cvllm_lab.entrypoints.serve "$@"
