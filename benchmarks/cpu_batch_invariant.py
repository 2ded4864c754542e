"""What `EngineConfig.batch_invariant` costs on the CPU fast path (issue 40): decode tok/s at batch 1 and 8 and
prefill tok/s on the embedded SmolLM2, the flag off and on, in one process, A/B alternated, median of the trials
after a warm-up.

    python -m benchmarks.cpu_batch_invariant [--trials 5] [--steps 32] [--prompt 256] [--threads N]   (from the repository root)
"""

import argparse
import statistics
import time
import torch
from cvllm_lab.config import EngineConfig
from cvllm_lab.engine.model_runner import ModelRunner
from cvllm_lab.engine.scheduler import Scheduler
from cvllm_lab.engine.kv_cache_manager import KVCacheManager
from cvllm_lab.engine.request import Request
from cvllm_lab.sampling_params import SamplingParams
from cvllm_lab.weights.loader import resolve_model_source, load_hf_config


def decode_rate(runner, batch: int, steps: int, prompt_len: int = 64) -> float:
    "Decode tokens per second of `batch` greedy streams over `steps` steps (prefill not timed)."
    sched = Scheduler(KVCacheManager(runner.num_blocks, runner.block_size, enable_caching=False), batch, 8192, 8192)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        p = torch.randint(100, 40000, (prompt_len + i,), generator=g).tolist()  # lengths differ, as in a server
        sched.add_request(
            Request(
                str(i),
                p,
                SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True),
                block_size=runner.block_size,
            )
        )

    def step():
        so = sched.schedule()
        o = runner.execute_model(so)
        sched.update_computed(so)
        sched.update_from_output(so, o.sampled)

    step()  # the prefill
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - t)


def prefill_rate(runner, n: int) -> float:
    "Prompt tokens per second of one `n`-token prefill."
    sched = Scheduler(KVCacheManager(runner.num_blocks, runner.block_size, enable_caching=False), 1, 8192, 8192)
    p = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    sched.add_request(Request('p', p, SamplingParams(temperature=0, max_tokens=1), block_size=runner.block_size))
    t = time.perf_counter()
    so = sched.schedule()
    runner.execute_model(so)
    return n / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--trials', type=int, default=5)
    ap.add_argument('--steps', type=int, default=32)
    ap.add_argument('--prompt', type=int, default=256)
    ap.add_argument('--threads', type=int, help="intra-op threads (default: the runner's, the cores we may use)")
    a = ap.parse_args()
    src = resolve_model_source(None)
    hf = load_hf_config(src)
    base = EngineConfig(max_model_len=1024, kv_cache_memory=64 << 20, cpu_fast_path=True).finalize(8192)
    runners = {
        bi: ModelRunner(base.__class__(**{**base.__dict__, 'batch_invariant': bi}), hf, src, progress=False)
        for bi in (False, True)
    }
    cases = [
        ('decode b1', lambda r: decode_rate(r, 1, a.steps)),
        ('decode b8', lambda r: decode_rate(r, 8, a.steps)),
        (f'prefill {a.prompt}', lambda r: prefill_rate(r, a.prompt)),
    ]
    if a.threads:
        torch.set_num_threads(a.threads)
    print(
        f'threads {torch.get_num_threads()}, {a.trials} trials after one warm-up, A/B alternated; tok/s median (min-max)'
    )
    with torch.no_grad():
        for name, f in cases:
            for r in runners.values():
                f(r)  # warm-up
            got = {bi: [] for bi in runners}
            for t in range(a.trials):
                for bi in (False, True) if t % 2 == 0 else (True, False):
                    got[bi].append(f(runners[bi]))
            m = {bi: statistics.median(v) for bi, v in got.items()}
            print(
                f'{name:12s} off {m[False]:7.1f} ({min(got[False]):.1f}-{max(got[False]):.1f})   '
                f'on {m[True]:7.1f} ({min(got[True]):.1f}-{max(got[True]):.1f})   on/off {m[True] / m[False]:.2f}',
                flush=True,
            )


if __name__ == '__main__':
    main()
