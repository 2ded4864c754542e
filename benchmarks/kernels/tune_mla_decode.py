"""Tune the absorbed MLA decode kernel's launch configs per batch bucket on a GPU and write them as data.

    python -m benchmarks.kernels.tune_mla_decode [--buckets 64,256,1,...] [--budget SECONDS] [--out DIR] [--write] [--dry]

Shape: DeepSeek-V2/V3's latent (16 heads, kv_lora_rank 512, RoPE key 64), bf16, block size 16, a paged cache with
shuffled blocks. Each bucket B is timed at the context the `+sweep=mla` point of that batch reaches halfway
through its decode (`CTX`) and at the `max_seq_len` bound its CUDA graph is captured with (4096; 256 for the
runner's short-context graphs of batch 1), so the split count is the one the engine launches. Per bucket:

1. the tile (`tile_n` keys per loop step) x `num_warps` x `num_stages` grid, at the current split policy;
2. the split policy (`min_keys` x `waves`, which together give the number of KV splits, and `min_keys` the
   splits a sequence keeps busy) with the best tile; timings are shared between policies that launch the same.

Each candidate is checked against `mla_decode_ref` (relative error < 2e-2) and timed in a CUDA graph over rotating
copies of the cache (`common.graph_time`), so a call reads its rows from HBM where the cache is larger than L2.
`--budget` (seconds, default 150) bounds the run; buckets not reached keep their config. Written to `--out`
(default `.`) after every bucket: `tune_mla_decode.csv` (every timing) and `<device>.json` (the `decode` table);
`--write` also writes it into `kernels/configs/mla_decode/`. Printed per bucket: microseconds of the current
config and of the best, and the best's bandwidth over the latent rows read. `--dry`: a small latent, buckets 1
and 4, two candidates of each kind, on the CPU under the Triton interpreter (a check of the script).
"""

from benchmarks.kernels import common as C  # first: `--dry` sets TRITON_INTERPRET before the kernels load

import itertools
import math
import os
import sys
import time

import torch

from cvllm_lab.kernels import tuned
from cvllm_lab.kernels import mla_decode as md

KERNEL = 'mla_decode'
H, L, R, PAGE = (16, 64, 16, 16) if C.DRY else (16, 512, 64, 16)
DT = torch.float16 if C.DRY else torch.bfloat16
# bucket -> (context per sequence, the max_seq_len bound of its graph)
CTX = {
    1: (96, 256),
    2: (1024, 4096),
    4: (1024, 4096),
    8: (1024, 4096),
    16: (2112, 4096),
    32: (1024, 4096),
    64: (1088, 4096),
    128: (768, 4096),
    256: (576, 4096),
}
if C.DRY:
    CTX = {1: (40, 64), 4: (24, 64)}
ORDER = [b for b in (64, 256, 1, 16, 128, 32, 8, 4, 2) if b in CTX]


def case(B, ctx, copies):
    "`copies` caches (shuffled blocks) with the same queries; the fp32 reference output of the first."
    nblk = -(-ctx // PAGE)
    g = torch.Generator(device=C.DEVICE).manual_seed(B)
    qn = torch.randn(B, H, L, device=C.DEVICE, dtype=DT, generator=g)
    qp = torch.randn(B, H, R, device=C.DEVICE, dtype=DT, generator=g)
    caches = [torch.randn(B * nblk + 1, PAGE, L + R, device=C.DEVICE, dtype=DT, generator=g) for _ in range(copies)]
    bt = torch.randperm(B * nblk, device=C.DEVICE, generator=g).view(B, nblk).to(torch.int32)
    sl = torch.full((B,), ctx, dtype=torch.int32, device=C.DEVICE)
    return qn, qp, caches, sl, bt, md.mla_decode_ref(qn, qp, caches[0], sl, bt, L**-0.5)


def splits_of(cfg, B, bound):
    return md._num_splits(torch.empty(0, device=C.DEVICE), B, 1, bound, cfg)


def time_cfg(cfg, B, bound, qn, qp, caches, sl, bt, ref):
    "Microseconds per call of `cfg` (None when it fails or is wrong)."
    return C.time_checked(
        lambda i: md.mla_decode(qn, qp, caches[i], sl, bt, L**-0.5, max_seq_len=bound, config=cfg),
        len(caches),
        ref,
        cfg,
    )


def tiles():
    if C.DRY:
        return [dict(tile_n=16, num_warps=4, num_stages=1), dict(tile_n=32, num_warps=4, num_stages=1)]
    out = []
    for tn, w, s in itertools.product((16, 32, 64), (4, 8), (1, 2, 3)):
        if tn * (L + R) * 2 * s <= 160 * 1024:
            out.append(dict(tile_n=tn, num_warps=w, num_stages=s))
    return out


def policies():
    if C.DRY:
        return [dict(min_keys=16, waves=4), dict(min_keys=256, waves=4)]
    return [dict(min_keys=k, waves=w) for k in (32, 64, 128, 256, 512) for w in (1, 2, 4, 8)]


def main():
    budget = float(C.arg('--budget', 150))
    out_dir = C.arg('--out', '.')
    buckets = [int(b) for b in C.arg('--buckets', ','.join(map(str, ORDER))).split(',')]
    os.makedirs(out_dir, exist_ok=True)
    dev = tuned.device_key(C.device_name())
    tables = tuned.load_configs(KERNEL, 'default' if C.DRY else dev)
    table = dict(tables['default'])
    rows, t0 = [], time.time()
    print(f'{C.device_name()}: H={H} L={L} R={R} {DT}, budget {budget:.0f} s', flush=True)
    for B in buckets:
        if time.time() - t0 > budget:
            print(f'budget spent: bucket {B} and later keep their config')
            break
        ctx, bound = CTX[B]
        nbytes = B * ctx * (L + R) * 2
        copies = 2 if C.DRY else max(2, min(32, math.ceil(256e6 / nbytes)))
        qn, qp, caches, sl, bt, ref = case(B, ctx, copies)
        cur = dict(table[max([b for b in table if b <= B], default=min(table))])
        timed = {}

        def measure(cfg, stage):
            n = splits_of(cfg, B, bound)  # the grid; min_keys also sets the busy splits of a short sequence
            key = (cfg['tile_n'], cfg['num_warps'], cfg['num_stages'], n, 1 if n == 1 else cfg['min_keys'])
            if key not in timed:
                timed[key] = time_cfg(cfg, B, bound, qn, qp, caches, sl, bt, ref)
            rows.append(
                dict(
                    device=C.device_name(), bucket=B, ctx=ctx, bound=bound, stage=stage, splits=n, **cfg, us=timed[key]
                )
            )
            return timed[key]

        best, best_us, us_cur = C.tune_two_stage(cur, tiles(), policies(), measure, t0 + 1.2 * budget)
        table[B] = best
        gbs = nbytes / (best_us * 1e-6) / 1e9 if best_us < float('inf') else float('nan')
        print(
            f'B={B} ctx={ctx} bound={bound}: current {us_cur or float("nan"):.1f} us -> best {best_us:.1f} us '
            f'({splits_of(best, B, bound)} splits, {gbs:.0f} GB/s of latent rows) {best}',
            flush=True,
        )
        C.write_tuning(out_dir, KERNEL, dev, rows, {'default': dict(sorted(table.items()))}, '--write' in sys.argv)
    print(f'done in {time.time() - t0:.0f} s')


if __name__ == '__main__':
    main()
