"""Cost of a cuDNN SDPA call on a shape it has not seen (its execution plan is built on first use) against the same
call again, for the batched fresh-prompt prefill of `layers/attention.py` at the Llama-3-8B attention shape.

    python -m benchmarks.bench_cudnn_plans
"""

import time
import torch
from cvllm_lab.layers.attention import cudnn_prefill_attention


def timed(f):
    torch.cuda.synchronize()
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - t


if __name__ == '__main__':
    H, Hkv, D = 32, 8, 128
    print('n_seqs  L      first_ms  again_ms')
    for L in (1024, 968, 2048, 777):
        for n in (1, 2, 3, 5, 8):
            q = torch.randn(n * L, H, D, device='cuda', dtype=torch.bfloat16)
            k, v = (torch.randn(n * L, Hkv, D, device='cuda', dtype=torch.bfloat16) for _ in range(2))
            f = lambda: cudnn_prefill_attention(q, k, v, n, D**-0.5)
            t1 = timed(f)
            t2 = min(timed(f) for _ in range(3))
            print(f'{n:6d} {L:5d} {1e3 * t1:9.1f} {1e3 * t2:9.3f}', flush=True)
