#!/usr/bin/env bash
# Multi-head latent attention on one GPU (DeepSeek-V2-Lite shape, bf16): the CUDA tests of the MLA kernels and the
# DeepSeek models, the decode-kernel tuner (writing kernels/configs/mla_decode/<device>.json), the `+sweep=mla`
# decode/prefill points, and a per-kernel profile of one batch-64 decode step.
#
#   benchmarks/mla_gpu.sh OUT_DIR        (default results/mla_gpu)
#
# Under 9 minutes in all; every stage runs under its own time limit, the profile only if time is left. Writes at
# most 8 files into OUT_DIR: tests.log, tune.log, tune_mla_decode.csv, <device>.json (the tuned configs, also
# written into kernels/configs/mla_decode/), sweep.log, h200_mla.csv (+ .png), profile.log. Run from the
# repository root with the package installed (`pip install -e .`).
set -u
cd "$(dirname "$0")/.."
out=${1:-results/mla_gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rc=0

# 1. kernels at real sizes against their references; tiny V2/V3 through the engine (Triton MLA, CUDA graphs) against
#    transformers; the real V2-Lite shape's graph decode: expect all to pass.
timeout 130 python -m pytest -q -m cuda -rs tests/test_kernels_mla.py tests/test_models_deepseek.py 2>&1 \
  | tee "$out/tests.log" | tail -8
rc=$((rc | PIPESTATUS[0]))

# 2. tuner: per batch bucket (64, 256, 1, 16 first) the current and the best config's microseconds; --write: the
#    device's config file, used by the sweep below.
timeout 150 python -m benchmarks.kernels.tune_mla_decode --budget 100 --out "$out" --write 2>&1 \
  | tee "$out/tune.log" | grep -E '^(NVIDIA|B=|budget|wrong|failed|done)' | tail -14
rc=$((rc | PIPESTATUS[0]))

# 3. the sweep: one CSV row per point (decode_tok_s, prefill_tok_s, ms_per_step) and a plot
timeout 210 python -m cvllm_lab.bench +sweep=mla out="$out/h200_mla.csv" 2>&1 | tee "$out/sweep.log" \
  | grep -v Capturing | tail -10
rc=$((rc | PIPESTATUS[0]))

# 4. where a batch-64 decode step (1024-token prompts) goes: GPU time per kernel (PDL off, so a kernel's time is its
#    own), from the difference of a 66- and a 2-token generation (64 pure decode steps; the prefills cancel)
left=$((530 - SECONDS))
if [ "$left" -gt 50 ]; then
  CVLLM_PDL=0 timeout "$left" python - <<'PY' 2>&1 | tee "$out/profile.log" | tail -36
import collections, time, yaml, torch
from cvllm_lab import LLM
from cvllm_lab.sampling_params import SamplingParams
from cvllm_lab.bench.sweep import model_dir
B, P = 64, 1024
llm = LLM(str(model_dir(yaml.safe_load(open('conf/model/deepseek_v2_lite.yaml')))), load_format='dummy',
          skip_tokenizer_init=True, progress=False, max_model_len=4096, max_num_seqs=B)   # the sweep's graph bound
sp = lambda O: SamplingParams(temperature=0, max_tokens=O, ignore_eos=True, detokenize=False)
g = torch.Generator().manual_seed(0)
prompts = [{'prompt_token_ids': torch.randint(100, 100000, (P,), generator=g).tolist()} for _ in range(B)]
def run(O):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, sp(O), use_tqdm=False); torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:80]]; a[0] += 1; a[1] += e.device_time
    return agg
def wall(O):
    torch.cuda.synchronize(); t = time.perf_counter(); llm.generate(prompts, sp(O), use_tqdm=False); torch.cuda.synchronize()
    return time.perf_counter() - t
run(4)
w = sorted(wall(66) - wall(2) for _ in range(3))[1]
a1, a2 = run(2), run(66)
rows = sorted(((k, (a2[k][0] - a1.get(k, [0, 0])[0]) / 64, (a2[k][1] - a1.get(k, [0, 0])[1]) / 64) for k in a2),
              key=lambda r: -r[2])
print(f'batch {B} x {P}: wall per decode step {w / 64 * 1e6:.1f} us, kernel time {sum(r[2] for r in rows):.1f} us, '
      f'{sum(r[1] for r in rows):.0f} kernels')
for k, n, us in rows[:30]: print(f'{us:8.1f} us {n:6.1f}/step  {k}')
PY
  rc=$((rc | PIPESTATUS[0]))
else
  echo "profile skipped: ${left}s left"
fi
ls -l "$out"
exit $rc
