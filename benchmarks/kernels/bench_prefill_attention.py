"""Time prefill attention on a GPU: the paged Triton kernel against the attention layer's FlashAttention-2 split.

    python -m benchmarks.kernels.bench_prefill_attention [--shapes 8x1024,4x2048,16x512+3000 (default: SHAPES)]
        [--heads 32,8,128 32,4,128] [--reps 20] [--out FILE.csv]

A shape `BxL` is B fresh prompts of L tokens; `BxL+P` is B chunks of L new tokens over P cached tokens each (a later
chunk of a long prompt, or a prefix-cache hit). Their K/V (prefix and new rows) sit in one paged cache whose blocks
are a random permutation of the pool (as the model's cache-write kernel leaves them). Timed, median of CUDA-event
runs: `paged_attention` over the block table, and what the attention layer does for a prefill run instead
(`Attention._split_prefill`: one `index_select` gathering each sequence's P+L keys out of the cache, then
`flash_varlen_attention` with separate query and key bounds). The gather's slots are worked out once per step
(`PrefillMetadata.kv_slots`), outside the timing, as in the engine. Printed with TFLOP/s of the causal attention
(2 matmuls over P+L/2 keys per query on average: `4 * H * D * B * (L*P + L^2/2)` FLOPs) and the two outputs' largest
difference. The last points (short chunks over long prefixes) show where the gather stops paying for itself: the
runner keeps chunks under `PREFILL_SPLIT_MIN_TOKENS` over cached tokens on the paged kernel.
"""

from benchmarks.kernels import common as C

import csv
import sys

import torch

from cvllm_lab.kernels import paged_attention as pa
from cvllm_lab.layers.attention import Attention
from cvllm_lab.utils.context import ForwardContext, PrefillMetadata

SHAPES = '8x1024,4x2048,1x8192,16x512+3000,4x2048+2000,2x4096+4000,32x64+4000,32x128+4000,16x256+4000'


def prefill_step(B, L, P, H, Hkv, D, bs=16, dtype=torch.bfloat16, device='cuda'):
    "B chunks of L tokens over P cached ones: q, the layer (its cache in shuffled blocks), the step's context."
    S = P + L
    nblk = -(-S // bs)
    bt = torch.randperm(B * nblk, device=device).int().view(B, nblk)
    att = Attention(H, D, D**-0.5, Hkv, backend='triton')
    att.kv_cache = torch.randn(2, B * nblk, bs, Hkv, D, device=device, dtype=dtype)
    q = torch.randn(B * L, H, D, device=device, dtype=dtype)
    pos = torch.arange(P, S, device=device)
    slots = (bt[:, pos // bs].long() * bs + pos % bs).reshape(-1)
    qsl = list(range(0, B * L + 1, L))
    ctx = ForwardContext(
        slots,
        torch.tensor(qsl, device=device, dtype=torch.int32),
        torch.full((B,), S, device=device, dtype=torch.int32),
        bt,
        L,
        S,
    )
    ctx.prefill = PrefillMetadata.build(qsl, [S] * B, 0, device)
    ctx.prefill.kv_slots(bt, 0, None, bs)  # once per step
    return q, att, ctx


def main():
    shapes = []
    for s in C.arg('--shapes', SHAPES).split(','):
        bl, _, p = s.partition('+')
        shapes.append(tuple(int(x) for x in bl.split('x')) + (int(p or 0),))
    i = sys.argv.index('--heads') + 1 if '--heads' in sys.argv else None
    heads = [tuple(int(x) for x in h.split(',')) for h in (sys.argv[i : i + 2] if i else ['32,8,128', '32,4,128'])]
    reps, out = int(C.arg('--reps', 20)), C.arg('--out', None)
    rows = []
    print(
        f'{torch.cuda.get_device_name()}\n{"B x L + P":>14} {"H/Hkv/D":>10} {"paged us":>9} {"flash us":>9} '
        f'{"paged TF":>8} {"flash TF":>8} {"speedup":>7} {"max diff":>8}'
    )
    for H, Hkv, D in heads:
        for B, L, P in shapes:
            torch.manual_seed(0)
            q, att, ctx = prefill_step(B, L, P, H, Hkv, D)
            kc, vc = att.kv_cache[0], att.kv_cache[1]
            assert att._prefill_split_ok(q, kc), 'FlashAttention does not run here'
            paged = lambda: pa.paged_attention(
                q,
                kc,
                vc,
                ctx.query_start_loc,
                ctx.seq_lens,
                ctx.block_tables,
                att.scale,
                max_query_len=L,
                max_seq_len=P + L,
            )
            flash = lambda: att._split_prefill(q, kc, vc, None, None, ctx, ctx.block_tables)
            diff = (paged().float() - flash().float()).abs().max().item()
            tp, tf = C.event_time_us(paged, reps), C.event_time_us(flash, reps)
            flops = 4 * H * D * B * (L * P + L * L / 2)
            row = dict(
                device=torch.cuda.get_device_name(),
                seqs=B,
                seq_len=L,
                prefix_len=P,
                heads=H,
                kv_heads=Hkv,
                head_dim=D,
                paged_us=round(tp, 1),
                flash_us=round(tf, 1),
                paged_tflops=round(flops / tp / 1e6, 1),
                flash_tflops=round(flops / tf / 1e6, 1),
                max_abs_diff=diff,
            )
            rows.append(row)
            print(
                f'{f"{B}x{L}+{P}":>14} {f"{H}/{Hkv}/{D}":>10} {tp:>9.1f} {tf:>9.1f} {row["paged_tflops"]:>8.1f} '
                f'{row["flash_tflops"]:>8.1f} {tp / tf:>6.2f}x {diff:>8.4f}'
            )
    if out:
        with open(out, 'w', newline='') as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == '__main__':
    main()
