"""Where a decode step's time goes: per-kernel GPU time of decode steps (dummy weights, CUDA graphs) from
torch.profiler, per step, and the wall time per step.

    python -m benchmarks.profile_decode [quantization] [batch] [model] [prompt_len]

from the repository root (default w4a16 1 llama3_8b 32; `none` for no quantization; the model is
`conf/model/<model>.yaml`). Set `CVLLM_PDL=0` for kernel times without PDL's early-launch waits (with PDL a kernel's
time includes waiting for its predecessor). Also prints the GPU idle time between kernels, by the kernel that follows."""

import sys
import time
import collections
import yaml
import torch
from cvllm_lab import LLM
from cvllm_lab.sampling_params import SamplingParams
from cvllm_lab.bench.sweep import model_dir

quant = sys.argv[1] if len(sys.argv) > 1 else 'w4a16'
quant = None if quant == 'none' else quant
B = int(sys.argv[2]) if len(sys.argv) > 2 else 1
model = sys.argv[3] if len(sys.argv) > 3 else 'llama3_8b'
P = int(sys.argv[4]) if len(sys.argv) > 4 else 32
mcfg = yaml.safe_load(open(f'conf/model/{model}.yaml'))
llm = LLM(
    str(model_dir(mcfg)),
    load_format='dummy',
    skip_tokenizer_init=True,
    quantization=quant,
    attention_backend='triton',
    progress=False,
    max_model_len=max(4096, P + 200),
    max_num_seqs=max(B, 16),
    max_num_batched_tokens=max(8192, B),
)
sp = lambda O: SamplingParams(temperature=0, max_tokens=O, ignore_eos=True, detokenize=False)
g = torch.Generator().manual_seed(0)
prompts = [{'prompt_token_ids': torch.randint(100, 30000, (P,), generator=g).tolist()} for _ in range(B)]
llm.generate(prompts, sp(40), use_tqdm=False)
torch.cuda.synchronize()
gaps = collections.defaultdict(list)  # kernel name -> GPU idle time before it (us), in the longest run


def run(O):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, sp(O), use_tqdm=False)
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    ev = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    for e in ev:
        a = agg[e.name[:60]]
        a[0] += 1
        a[1] += e.device_time
    gaps.clear()
    for p, e in zip(ev, ev[1:]):
        g = e.time_range.start - p.time_range.end
        if g < 200:
            gaps[e.name[:60]].append(g)  # larger: between generate() calls or host waits, not in a step
    return agg


def wall(O):
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, sp(O), use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t


w = sorted(wall(66) - wall(2) for _ in range(3))[1]
print(f'wall per decode step {w / 64 * 1e6:.1f} us')
a1, a2 = run(2), run(66)
steps = 64
rows = sorted(
    ((k, (a2[k][0] - a1.get(k, [0, 0])[0]) / steps, (a2[k][1] - a1.get(k, [0, 0])[1]) / steps) for k in a2),
    key=lambda r: -r[2],
)
tot = sum(r[2] for r in rows)
print(f'{model} {quant} B={B} P={P}: kernel time per decode step {tot:.1f} us (sum over kernels)')
for k, n, us in rows[:30]:
    print(f'{us:8.1f} us {n:6.1f}/step  {k}')
n_gap = sum(len(v) for v in gaps.values())
print(
    f'GPU idle between kernels (gaps < 200 us; negative: overlap under PDL), per decode step: {sum(sum(v) for v in gaps.values()) / 66:.1f} us '
    f'over {n_gap / 66:.0f} kernels; by the kernel after the gap (median, per step):'
)
for k, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:12]:
    v = sorted(v)
    print(f'{sum(v) / 66:8.1f} us  median {v[len(v) // 2]:5.2f} us  {len(v) / 66:6.1f}/step  {k}')
