#!/usr/bin/env bash
# Mixture-of-Experts on one GPU (Qwen3-30B-A3B shape, bf16): the CUDA tests of the fused MoE kernels, the tuner for
# the prefill buckets (writing kernels/configs/fused_moe/<device>.json), the `+sweep=moe` decode/prefill points, and
# a per-kernel profile of one 8192-token prefill step.
#
#   benchmarks/moe_gpu.sh OUT_DIR        (default results/moe_gpu)
#
# About 8 minutes in all; every stage runs under its own time limit, the profile only if time is left. Writes 8
# files into OUT_DIR: tests.log, tune.log, tune_fused_moe.csv, <device>.json (the tuned configs, also written into
# kernels/configs/fused_moe/), sweep.log, h200_moe.csv, h200_moe.png, profile.log. Run from the repository root
# with the package installed (`pip install -e .`).
set -u
cd "$(dirname "$0")/.."
out=${1:-results/moe_gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rc=0

# 1. kernels at real sizes (every path and prefill layout against the loop over experts) and a tiny Qwen3-MoE
#    (offline word-level tokenizer) through the engine against transformers, bf16 and FP8: expect all to pass.
timeout 150 python -m pytest -q -m cuda -rs tests/test_kernels_moe.py \
  "tests/test_models_moe.py::test_qwen3_moe_fused_kernel_through_engine" 2>&1 | tee "$out/tests.log" | tail -15
rc=$((rc | PIPESTATUS[0]))

# 2. tuner, prefill buckets first (the decode buckets keep their rows): per bucket the current and best
#    microseconds; at 4096 / 8192 the CSV's `layout` rows (SORTED / XSORT / ATOMIC on the best 3 tiles) and `down`
#    rows (launch 2's own tile) say whether the A gather, the intermediate layout or the top-k sum matter.
#    Expect M=8192 well under the old 1,499 us (232 GFLOP: 600 TFLOP/s would be ~390 us). --write: used below.
timeout 220 python -m benchmarks.kernels.tune_fused_moe --ms 8192,4096,256 --budget 160 --workers 14 \
  --out "$out" --write 2>&1 | tee "$out/tune.log" | grep -E '^(NVIDIA|M=|precompiled|budget|wrong| +per kernel)' | tail -20
rc=$((rc | PIPESTATUS[0]))
dev=$(python -c "import torch; print(torch.cuda.get_device_name().strip().replace(' ', '_'))")
cp "kernels/configs/fused_moe/$dev.json" "$out/" 2>/dev/null

# 3. the sweep: one CSV row per point (decode_tok_s, prefill_tok_s, ms_per_step) and a plot; the prefill target is
#    vLLM's 67-73k tok/s, the decode rows should stay at 321 / 1,151 / 3,124 / 10,758 (batch 1 / 16 / 64 / 256).
timeout 160 python -m cvllm_lab.bench +sweep=moe out="$out/h200_moe.csv" 2>&1 | tee "$out/sweep.log" \
  | grep -v Capturing | tail -12
rc=$((rc | PIPESTATUS[0]))

# 4. where one 8192-token prefill step goes: GPU time per kernel (PDL off, so a kernel's time is its own), the MoE
#    kernels (grouped GEMMs, alignment, router, permute, the top-k sum) against the rest (attention, cuBLAS linears,
#    norms); any PyTorch copy / index / scatter kernel near the top is a candidate to fuse.
left=$((530 - SECONDS))
if [ "$left" -gt 45 ]; then
  CVLLM_PDL=0 timeout "$left" python - <<'PY' 2>&1 | tee "$out/profile.log" | tail -34
import collections, time, yaml, torch
from cvllm_lab import LLM
from cvllm_lab.sampling_params import SamplingParams
from cvllm_lab.bench.sweep import model_dir
T = 8192
llm = LLM(str(model_dir(yaml.safe_load(open('conf/model/qwen3_30b_a3b.yaml')))), load_format='dummy',
          skip_tokenizer_init=True, progress=False, max_model_len=T + 256, max_num_seqs=4, enforce_eager=True,
          prefill_chunk_size=T, max_num_batched_tokens=T)
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
g = torch.Generator().manual_seed(0)
prompt = lambda: [{'prompt_token_ids': torch.randint(0, 151936, (T,), generator=g).tolist()}]   # no prefix hits
def step():
    p = prompt(); torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate(p, sp, use_tqdm=False); torch.cuda.synchronize()
    return time.perf_counter() - t
step()                                                       # compile, warm up
w = sorted(step() for _ in range(3))[1]
p = prompt()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    llm.generate(p, sp, use_tqdm=False); torch.cuda.synchronize()
agg = collections.defaultdict(lambda: [0, 0.0])
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        a = agg[e.name[:70]]; a[0] += 1; a[1] += e.device_time
rows = sorted(((k, n, us) for k, (n, us) in agg.items()), key=lambda r: -r[2])
total = sum(r[2] for r in rows)
moe = sum(us for k, _, us in rows if any(s in k.lower() for s in ('moe', 'align', 'topk')))
print(f'prefill {T} tokens: wall {w * 1e3:.1f} ms ({T / w:.0f} tok/s), kernel time {total / 1e3:.1f} ms in '
      f'{sum(r[1] for r in rows)} kernels; MoE kernels {moe / 1e3:.1f} ms ({moe / 48:.0f} us per layer)')
for k, n, us in rows[:30]: print(f'{us / 1e3:8.2f} ms {n:5d}x  {k}')
PY
  rc=$((rc | PIPESTATUS[0]))
else
  echo "profile skipped: ${left}s left"
fi
ls -l "$out"
exit $rc
