"""Time decode `paged_attention` on a GPU at the Llama-3-8B shape (32 q heads, 8 KV heads, D = 128, bf16, block 16).

    python -m benchmarks.kernels.bench_attention [--batches 1,16,64] [--contexts 1024,2048,4096] [--reps 20] [--splits 1,2,4]

Per (batch, context): the split-KV count the launcher picks (or each of `--splits`), the median time of eager calls
(launch included) and of CUDA-graph replays (the merge of the splits' partials included), and the K + V bytes read
per second. The sequences' blocks are a random permutation of the pool,
as a running server's are.
"""

from benchmarks.kernels import common as C

import torch

from cvllm_lab.kernels import paged_attention as pa


def decode_batch(B, L, H=32, Hkv=8, D=128, bs=16, dtype=torch.bfloat16, device='cuda'):
    "B sequences of L tokens, one new query token each: `q, k_cache, v_cache, query_start_loc, seq_lens, block_tables`."
    nblk = -(-L // bs)
    bt = torch.randperm(B * nblk, device=device).int().view(B, nblk)
    kc, vc = (torch.randn(B * nblk, bs, Hkv, D, device=device, dtype=dtype) for _ in range(2))
    q = torch.randn(B, H, D, device=device, dtype=dtype)
    qsl = torch.arange(B + 1, device=device, dtype=torch.int32)
    return q, kc, vc, qsl, torch.full((B,), L, device=device, dtype=torch.int32), bt


def main():
    batches = [int(b) for b in C.arg('--batches', '1,16,64').split(',')]
    contexts = [int(c) for c in C.arg('--contexts', '1024,2048,4096').split(',')]
    reps = int(C.arg('--reps', 20))
    splits = [int(s) for s in C.arg('--splits', '0').split(',')]  # 0: the launcher's choice
    Hkv, D = 8, 128
    print(f'{"batch":>5} {"ctx":>5} {"splits":>6} {"eager us":>9} {"graph us":>9} {"GB/s":>6}')
    for B in batches:
        for L in contexts:
            torch.manual_seed(0)
            q, kc, vc, qsl, sl, bt = decode_batch(B, L)
            out = torch.empty_like(q)
            for n in splits:
                f = lambda: pa.paged_attention(
                    q, kc, vc, qsl, sl, bt, D**-0.5, max_query_len=1, max_seq_len=L, out=out, num_kv_splits=n or None
                )
                cfg = pa.decode_config(B, L, D, q.device)  # the launcher's tuned config and split policy
                time_one(
                    f,
                    B,
                    L,
                    n or pa._default_num_splits(q, B, Hkv, L, cfg['min_keys'], waves=cfg['waves']),
                    reps,
                    Hkv,
                    D,
                )


def time_one(f, B, L, n, reps, Hkv, D):
    "Print the eager and CUDA-graph times of `f` (n splits) and the K + V read rate of the graph replay."
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    eager = C.event_time_us(f, reps)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f()
    graph = C.event_time_us(g.replay, reps)
    gbs = 2 * B * L * Hkv * D * 2 / graph / 1e3
    print(f'{B:>5} {L:>5} {n:>6} {eager:>9.1f} {graph:>9.1f} {gbs:>6.0f}', flush=True)


if __name__ == '__main__':
    main()
