"""Where prefill time goes: per-kernel GPU time of a burst of fresh prompts (dummy weights), per 8192-token step.

    python -m benchmarks.profile_prefill [model] [batch] [prompt_len]     (default qwen3_30b_a3b 64 1024)

The model is `conf/model/<model>.yaml`. Runs `batch` fresh prompts of `prompt_len` random tokens with one output
token each (prefill only, chunked into steps of `max_num_batched_tokens` = 8192), once to warm up and once under
torch.profiler; prints the wall tok/s and the top kernels by GPU time, scaled to one 8192-token step. Set
`CVLLM_PDL=0` for kernel times without PDL's early-launch waits.
"""

import collections
import sys
import time

import torch
import yaml

from cvllm_lab import LLM
from cvllm_lab.bench.sweep import model_dir
from cvllm_lab.sampling_params import SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else 'qwen3_30b_a3b'
B = int(sys.argv[2]) if len(sys.argv) > 2 else 64
P = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
llm = LLM(
    str(model_dir(yaml.safe_load(open(f'conf/model/{model}.yaml')))),
    load_format='dummy',
    skip_tokenizer_init=True,
    progress=False,
    max_model_len=max(4096, P + 8),
    max_num_batched_tokens=8192,
    max_num_seqs=max(B, 8),
    enable_prefix_caching=False,
)
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
g = torch.Generator().manual_seed(0)
batch = lambda: [{'prompt_token_ids': torch.randint(100, 30000, (P,), generator=g).tolist()} for _ in range(B)]
llm.generate(batch(), sp, use_tqdm=False)
torch.cuda.synchronize()
prompts = batch()
torch.cuda.synchronize()
t = time.perf_counter()
llm.generate(prompts, sp, use_tqdm=False)
torch.cuda.synchronize()
wall = time.perf_counter() - t
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    llm.generate(batch(), sp, use_tqdm=False)
    torch.cuda.synchronize()
agg = collections.defaultdict(lambda: [0, 0.0])
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        a = agg[e.name[:90]]
        a[0] += 1
        a[1] += e.device_time
steps = B * P / 8192
total = sum(v[1] for v in agg.values())
print(
    f'{model} prefill {B} x {P}: {B * P / wall:,.0f} tok/s wall ({wall / steps * 1e3:.1f} ms per 8192 tokens), '
    f'kernel time {total / steps / 1e3:.1f} ms per 8192 tokens'
)
for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:25]:
    print(f'{us / steps / 1e3:8.2f} ms {n / steps:7.1f}/step  {k}')
