"""Where a CPU decode step's time goes: the embedded SmolLM2 Q4_1 GGUF on the CPU fast path, per-op self CPU time
from torch.profiler per decode step, beside the wall time per step. `python -m benchmarks.cpu_profile_decode [batch]`
from the repository root (default 1)."""

import sys
import time
import collections
import torch
from cvllm_lab import LLM
from cvllm_lab.sampling_params import SamplingParams

B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
llm = LLM(progress=False)
sp = lambda O: SamplingParams(temperature=0, max_tokens=O, ignore_eos=True, detokenize=False)
prompts = [{'prompt_token_ids': list(range(100 + i, 132 + i))} for i in range(B)]
gen = lambda O: llm.generate(prompts, sp(O), use_tqdm=False)
gen(8)


def wall(O):
    t = time.perf_counter()
    gen(O)
    return time.perf_counter() - t


steps = 64
w = sorted(wall(steps + 2) - wall(2) for _ in range(3))[1]
print(
    f'B={B} threads={torch.get_num_threads()}: wall per decode step {w / steps * 1e3:.2f} ms ({B * steps / w:.1f} tok/s)'
)


def prof(O):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        gen(O)
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in p.key_averages():
        agg[e.key][0] += e.count
        agg[e.key][1] += e.self_cpu_time_total
    return agg


a1, a2 = prof(2), prof(steps + 2)
rows = sorted(
    ((k, (a2[k][0] - a1.get(k, [0, 0])[0]) / steps, (a2[k][1] - a1.get(k, [0, 0])[1]) / steps) for k in a2),
    key=lambda r: -r[2],
)
print(f'self CPU time per decode step (sum over ops, profiled): {sum(r[2] for r in rows) / 1e3:.2f} ms')
for k, n, us in rows[:30]:
    print(f'{us:8.1f} us {n:6.1f}/step  {k}')
