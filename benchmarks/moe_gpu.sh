#!/usr/bin/env bash
# Mixture-of-Experts on one GPU (Qwen3-30B-A3B shape, bf16): the CUDA tests of the fused MoE kernels, the tuner
# (writing kernels/configs/fused_moe/<device>.json), the `+sweep=moe` decode/prefill points, and a per-kernel
# profile of one batch-1 decode step.
#
#   benchmarks/moe_gpu.sh OUT_DIR        (default results/moe_gpu)
#
# About 8 minutes in all; every stage runs under its own time limit, the profile only if time is left. Writes at
# most 8 files into OUT_DIR: tests.log, tune.log, tune_fused_moe.csv, <device>.json (the tuned configs, also written
# into kernels/configs/fused_moe/), sweep.log, h200_moe.csv (+ .png), profile.log. Run from the repository root
# with the package installed (`pip install -e .`).
set -u
cd "$(dirname "$0")/.."
out=${1:-results/moe_gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rc=0

# 1. kernels at real sizes (every path against the loop over experts) and a tiny Qwen3-MoE through the engine
#    against transformers: expect all to pass.
timeout 130 python -m pytest -q -m cuda -rs tests/test_kernels_moe.py \
  "tests/test_models_moe.py::test_qwen3_moe_fused_kernel_through_engine" 2>&1 | tee "$out/tests.log" | tail -15
rc=$((rc | PIPESTATUS[0]))

# 2. tuner: the decode-path buckets first, then the sweep's; per bucket the current, best grouped and best decode
#    microseconds. --write: the device's config file, used by the sweep below.
timeout 210 python -m benchmarks.kernels.tune_fused_moe --ms 1,2,4,64,256,8192,16 --budget 150 --workers 14 \
  --out "$out" --write 2>&1 | tee "$out/tune.log" | grep -E '^(NVIDIA|M=|precompiled|budget|wrong)' | tail -20
rc=$((rc | PIPESTATUS[0]))
dev=$(python -c "import torch; print(torch.cuda.get_device_name().strip().replace(' ', '_'))")
cp "kernels/configs/fused_moe/$dev.json" "$out/" 2>/dev/null

# 3. the sweep: one CSV row per point (decode_tok_s, prefill_tok_s, ms_per_step) and a plot
timeout 220 python -m cvllm_lab.bench +sweep=moe out="$out/h200_moe.csv" 2>&1 | tee "$out/sweep.log" \
  | grep -v Capturing | tail -12
rc=$((rc | PIPESTATUS[0]))

# 4. where a batch-1 decode step goes: GPU time per kernel (PDL off, so a kernel's time is its own)
left=$((520 - SECONDS))
if [ "$left" -gt 60 ]; then
  CVLLM_PDL=0 timeout "$left" python - <<'PY' 2>&1 | tee "$out/profile.log" | tail -32
import collections, time, yaml, torch
from cvllm_lab import LLM
from cvllm_lab.sampling_params import SamplingParams
from cvllm_lab.bench.sweep import model_dir
llm = LLM(str(model_dir(yaml.safe_load(open('conf/model/qwen3_30b_a3b.yaml')))), load_format='dummy',
          skip_tokenizer_init=True, progress=False, max_model_len=1024, max_num_seqs=8)
sp = lambda O: SamplingParams(temperature=0, max_tokens=O, ignore_eos=True, detokenize=False)
prompt = [{'prompt_token_ids': list(range(100, 132))}]
def run(O):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, sp(O), use_tqdm=False); torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:70]]; a[0] += 1; a[1] += e.device_time
    return agg
def wall(O):
    torch.cuda.synchronize(); t = time.perf_counter(); llm.generate(prompt, sp(O), use_tqdm=False); torch.cuda.synchronize()
    return time.perf_counter() - t
run(8)
w = sorted(wall(66) - wall(2) for _ in range(3))[1]
a1, a2 = run(2), run(66)
rows = sorted(((k, (a2[k][0] - a1.get(k, [0, 0])[0]) / 64, (a2[k][1] - a1.get(k, [0, 0])[1]) / 64) for k in a2),
              key=lambda r: -r[2])
print(f'batch 1: wall per decode step {w / 64 * 1e6:.1f} us, kernel time {sum(r[2] for r in rows):.1f} us, '
      f'{sum(r[1] for r in rows):.0f} kernels')
for k, n, us in rows[:28]: print(f'{us:8.1f} us {n:6.1f}/step  {k}')
PY
  rc=$((rc | PIPESTATUS[0]))
else
  echo "profile skipped: ${left}s left"
fi
ls -l "$out"
exit $rc
