"""Time prefill attention on a GPU: the paged Triton kernel against PyTorch's FlashAttention-2 varlen kernel.

    python -m benchmarks.kernels.bench_prefill_attention [--shapes 8x1024,4x2048,1x8192] [--heads 32,8,128 32,4,128]
        [--reps 20] [--out FILE.csv]

Per (sequences x length, heads): fresh prompts of that length, their K/V already in a paged cache whose blocks are
a random permutation of the pool (as the model's cache-write kernel leaves them). Timed, median of CUDA-event
runs: `paged_attention` over the block table, and what the attention layer does for a fresh prefill instead
(`flash_varlen_attention` plus the two `index_select`s that read the rows' K/V back from their slots). Printed with
TFLOP/s of the causal attention (2 matmuls, half the score matrix: `2 * H * D * sum(L^2)` FLOPs) and the two
outputs' largest difference.
"""
from benchmarks.kernels import common as C

import csv
import sys

import torch

from cvllm_lab.kernels import paged_attention as pa
from cvllm_lab.layers.attention import flash_varlen_attention


def fresh_prefill(B, L, H, Hkv, D, bs=16, dtype=torch.bfloat16, device='cuda'):
    "B fresh prompts of L tokens with their K/V in a shuffled paged cache."
    nblk = -(-L // bs)
    bt = torch.randperm(B * nblk, device=device).int().view(B, nblk)
    kc, vc = (torch.randn(B * nblk, bs, Hkv, D, device=device, dtype=dtype) for _ in range(2))
    q = torch.randn(B * L, H, D, device=device, dtype=dtype)
    pos = torch.arange(L, device=device)
    slots = (bt[:, pos // bs].long() * bs + pos % bs).reshape(-1)
    qsl = torch.arange(0, B * L + 1, L, device=device, dtype=torch.int32)
    return q, kc, vc, qsl, torch.full((B,), L, device=device, dtype=torch.int32), bt, slots


def main():
    shapes = [tuple(int(x) for x in s.split('x')) for s in C.arg('--shapes', '8x1024,4x2048,1x8192').split(',')]
    i = sys.argv.index('--heads') + 1 if '--heads' in sys.argv else None
    heads = [tuple(int(x) for x in h.split(',')) for h in (sys.argv[i:i + 2] if i else ['32,8,128', '32,4,128'])]
    reps, out = int(C.arg('--reps', 20)), C.arg('--out', None)
    rows = []
    print(f'{torch.cuda.get_device_name()}\n{"B x L":>9} {"H/Hkv/D":>10} {"paged us":>9} {"flash us":>9} {"paged TF":>8} '
          f'{"flash TF":>8} {"speedup":>7} {"max diff":>8}')
    for H, Hkv, D in heads:
        for B, L in shapes:
            torch.manual_seed(0)
            q, kc, vc, qsl, sl, bt, slots = fresh_prefill(B, L, H, Hkv, D)
            scale = D ** -0.5
            paged = lambda: pa.paged_attention(q, kc, vc, qsl, sl, bt, scale, max_query_len=L, max_seq_len=L)
            def flash():
                k, v = kc.flatten(0, 1).index_select(0, slots), vc.flatten(0, 1).index_select(0, slots)
                return flash_varlen_attention(q, k, v, qsl, L, scale)
            diff = (paged().float() - flash().float()).abs().max().item()
            tp, tf = C.event_time_us(paged, reps), C.event_time_us(flash, reps)
            flops = 2 * H * D * B * L * L   # causal: half of 2 matmuls of 2*L*L*D each
            row = dict(device=torch.cuda.get_device_name(), seqs=B, seq_len=L, heads=H, kv_heads=Hkv, head_dim=D,
                       paged_us=round(tp, 1), flash_us=round(tf, 1), paged_tflops=round(flops / tp / 1e6, 1),
                       flash_tflops=round(flops / tf / 1e6, 1), max_abs_diff=diff)
            rows.append(row)
            print(f'{f"{B}x{L}":>9} {f"{H}/{Hkv}/{D}":>10} {tp:>9.1f} {tf:>9.1f} {row["paged_tflops"]:>8.1f} '
                  f'{row["flash_tflops"]:>8.1f} {tp / tf:>6.2f}x {diff:>8.4f}')
    if out:
        with open(out, 'w', newline='') as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0])); w.writeheader(); w.writerows(rows)


if __name__ == '__main__':
    main()
