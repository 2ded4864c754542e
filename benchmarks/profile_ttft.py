"""Where one prompt's time to first token goes in the engine (no HTTP): a fresh prompt of P random tokens, one output
token, through `LLM.generate` (schedule, inputs, eager forward, sampling, the device-to-host copy), median of `reps`
runs, against the GPU kernel time of one profiled run; then the top kernels of that run.

    python -m benchmarks.profile_ttft [model] [prompt_len ...]      (default llama3_8b 512 1024 2048)

Dummy weights, the server's token budget, prefix caching off (every run computes the whole prompt). The gap between
the wall time and the kernel time is host work the GPU waits for. `CVLLM_LAB_CUDNN_PREFILL=0` for FlashAttention-2;
`PROFILE_HOST=1` also prints the ops with the most host (self CPU) time.
"""

import collections
import os
import statistics
import sys
import time
import torch
import yaml
from cvllm_lab import LLM
from cvllm_lab.bench.sweep import model_dir
from cvllm_lab.sampling_params import SamplingParams


def main(model='llama3_8b', *lens, reps=15):
    lens = [int(x) for x in lens] or [512, 1024, 2048]
    llm = LLM(
        str(model_dir(yaml.safe_load(open(f'conf/model/{model}.yaml')))),
        load_format='dummy',
        skip_tokenizer_init=True,
        progress=False,
        max_model_len=max(4096, max(lens) + 8),
        enable_prefix_caching=False,
        usage_context='server',
    )
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    g = torch.Generator().manual_seed(0)
    prompt = lambda P: [{'prompt_token_ids': torch.randint(100, 30000, (P,), generator=g).tolist()}]
    for P in lens:
        for _ in range(3):
            llm.generate(prompt(P), sp, use_tqdm=False)
        walls = []
        for _ in range(reps):
            p = prompt(P)
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(p, sp, use_tqdm=False)
            walls.append(time.perf_counter() - t)
        host = os.environ.get('PROFILE_HOST') == '1'
        acts = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host else [])
        with torch.profiler.profile(activities=acts) as prof:
            llm.generate(prompt(P), sp, use_tqdm=False)
            torch.cuda.synchronize()
        agg = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                a = agg[e.name[:90]]
                a[0] += 1
                a[1] += e.device_time
        kern = sum(v[1] for v in agg.values()) / 1e3
        w = statistics.median(walls) * 1e3
        print(
            f'{model} one prompt of {P}: wall p50 {w:.2f} ms (min {min(walls) * 1e3:.2f}, max {max(walls) * 1e3:.2f}), '
            f'kernels {kern:.2f} ms, host-only {w - kern:.2f} ms',
            flush=True,
        )
        if P == (1024 if 1024 in lens else lens[len(lens) // 2]):
            for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:14]:
                print(f'{us / 1e3:8.3f} ms {n:5d}  {k}')
            if host:
                print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=25, max_name_column_width=60))


if __name__ == '__main__':
    main(*sys.argv[1:])
