"""Tune the one-token decode path of `paged_attention` per batch bucket on a GPU and write the configs as data.

    python -m benchmarks.kernels.tune_paged_attention [--buckets 'decode,64;short,1;...'] [--budget SECONDS] [--out DIR] [--write] [--dry]

Shape: Llama-3-8B's attention (32 query heads, 8 KV heads, head dim 128), bf16, block size 16, a paged cache with
shuffled blocks. Each bucket is timed at one context and at the `max_seq_len` bound its CUDA graph is captured
with (`CASES`: the `short` table at the runner's short-context bound, 256, for batch 1 at the quantization sweep's
32 -> 128 tokens; the `decode` table at 8192, the server's `max_model_len`, at the contexts of the c=64 server
benchmark and of the `vllm_table` sweep's points), so the split count is the one the engine launches. Per bucket:

1. the tile (`tile_n` keys per loop step) x `num_warps` x `num_stages` grid, at the current split policy;
2. the split policy (`min_keys` x `waves`, which give the number of KV splits) with the best tile; timings are
   shared between policies that launch the same grid.

Each candidate is checked against `paged_attention_ref` (relative error < 2e-2) and timed in a CUDA graph over
rotating copies of the cache (`common.graph_time`, >= 256 MB of K/V in all), so a call reads its keys from HBM as
it does between a layer's weights. The merge of the splits' partials is in the timing. `--budget` (seconds,
default 240) bounds the run; buckets not reached keep their config. Written to `--out` (default `.`) after every
bucket: `tune_paged_attention.csv` (every timing) and `<device>.json` (the `decode` and `short` tables); `--write`
also writes it into `kernels/configs/paged_attention/`. Printed per bucket: microseconds of the current config and
of the best, and the best's K + V read rate. `--dry`: a small cache, two buckets, two candidates of each kind, on
the CPU under the Triton interpreter (a check of the script).
"""

from benchmarks.kernels import common as C  # first: `--dry` sets TRITON_INTERPRET before the kernels load

import itertools
import math
import os
import sys
import time

import torch

from cvllm_lab.kernels import tuned
from cvllm_lab.kernels import paged_attention as pa

KERNEL = 'paged_attention'
H, HKV, D, PAGE = (8, 2, 32, 16) if C.DRY else (32, 8, 128, 16)
DT = torch.float16 if C.DRY else torch.bfloat16
# (table, bucket) -> (context per sequence, the max_seq_len bound of its graph)
CASES = {
    ('short', 1): (96, 256),
    ('decode', 1): (2112, 8192),
    ('decode', 8): (1152, 8192),
    ('decode', 16): (2112, 8192),
    ('decode', 32): (1152, 8192),
    ('decode', 64): (1152, 8192),
    ('decode', 128): (768, 8192),
    ('decode', 256): (576, 8192),
}
if C.DRY:
    CASES = {('short', 1): (40, 64), ('decode', 4): (300, 1024)}
ORDER = [
    'decode,64',
    'short,1',
    'decode,16',
    'decode,32',
    'decode,128',
    'decode,1',
    'decode,8',
    'decode,256',
]  # most used first


def case(B, ctx, copies):
    "`copies` K/V caches (shuffled blocks) with the same queries; the fp32 reference output of the first."
    nblk = -(-ctx // PAGE)
    g = torch.Generator(device=C.DEVICE).manual_seed(B)
    q = torch.randn(B, H, D, device=C.DEVICE, dtype=DT, generator=g)
    kvs = [
        tuple(torch.randn(B * nblk, PAGE, HKV, D, device=C.DEVICE, dtype=DT, generator=g) for _ in range(2))
        for _ in range(copies)
    ]
    bt = torch.randperm(B * nblk, device=C.DEVICE, generator=g).view(B, nblk).to(torch.int32)
    qsl = torch.arange(B + 1, device=C.DEVICE, dtype=torch.int32)
    sl = torch.full((B,), ctx, dtype=torch.int32, device=C.DEVICE)
    ref = pa.paged_attention_ref(q, *kvs[0], qsl, sl, bt, D**-0.5)
    return q, kvs, qsl, sl, bt, ref


def splits_of(cfg, B, bound):
    return pa._default_num_splits(torch.empty(0, device=C.DEVICE), B, HKV, bound, cfg['min_keys'], waves=cfg['waves'])


def time_cfg(cfg, bound, q, kvs, qsl, sl, bt, ref):
    "Microseconds per call of `cfg` (None when it fails or is wrong)."
    out = torch.empty_like(q)
    return C.time_checked(
        lambda i: pa.paged_attention(
            q, *kvs[i], qsl, sl, bt, D**-0.5, max_query_len=1, max_seq_len=bound, out=out, config=cfg
        ),
        len(kvs),
        ref,
        cfg,
    )


def tiles():
    if C.DRY:
        return [dict(tile_n=16, num_warps=4, num_stages=1), dict(tile_n=32, num_warps=4, num_stages=1)]
    return [
        dict(tile_n=tn, num_warps=w, num_stages=s)
        for tn, w, s in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4))
        if tn * D * 2 * 2 * s <= 160 * 1024
    ]  # K and V tiles per stage in shared memory


def policies():
    if C.DRY:
        return [dict(min_keys=16, waves=4), dict(min_keys=256, waves=4)]
    return [dict(min_keys=k, waves=w) for k in (64, 128, 256, 512) for w in (1, 2, 4, 8)]


def main():
    budget = float(C.arg('--budget', 240))
    out_dir = C.arg('--out', '.')
    todo = [(t, int(b)) for t, b in (k.split(',') for k in C.arg('--buckets', ';'.join(ORDER)).split(';'))]
    todo = list(CASES) if C.DRY else [k for k in todo if k in CASES]
    os.makedirs(out_dir, exist_ok=True)
    dev = tuned.device_key(C.device_name())
    tables = tuned.load_configs(KERNEL, 'default' if C.DRY else dev)
    out_tables = {'decode': dict(tables['decode']), 'short': dict(tables['short'])}
    rows, t0 = [], time.time()
    print(f'{C.device_name()}: H={H} Hkv={HKV} D={D} {DT}, budget {budget:.0f} s', flush=True)
    for name, B in todo:
        if time.time() - t0 > budget:
            print(f'budget spent: {name} {B} and later keep their config')
            break
        ctx, bound = CASES[name, B]
        nbytes = 2 * B * ctx * HKV * D * 2
        copies = 2 if C.DRY else max(2, min(1024, math.ceil(256e6 / nbytes)))
        q, kvs, qsl, sl, bt, ref = case(B, ctx, copies)
        cur = dict(pa.decode_config(B, bound, D, C.DEVICE))  # what the launcher takes now
        timed = {}

        def measure(cfg, stage):
            n = splits_of(cfg, B, bound)
            key = (cfg['tile_n'], cfg['num_warps'], cfg['num_stages'], n)
            if key not in timed:
                timed[key] = time_cfg(cfg, bound, q, kvs, qsl, sl, bt, ref)
            rows.append(
                dict(
                    device=C.device_name(),
                    table=name,
                    bucket=B,
                    ctx=ctx,
                    bound=bound,
                    stage=stage,
                    splits=n,
                    **cfg,
                    us=timed[key],
                )
            )
            return timed[key]

        best, best_us, us_cur = C.tune_two_stage(cur, tiles(), policies(), measure, t0 + 1.2 * budget)
        out_tables[name][D, B] = best
        gbs = nbytes / (best_us * 1e-6) / 1e9 if best_us < float('inf') else float('nan')
        print(
            f'{name} B={B} ctx={ctx} bound={bound}: current {us_cur or float("nan"):.1f} us -> best {best_us:.1f} us '
            f'({splits_of(best, B, bound)} splits, {gbs:.0f} GB/s of K + V) {best}',
            flush=True,
        )
        C.write_tuning(
            out_dir,
            KERNEL,
            dev,
            rows,
            {k: dict(sorted(v.items())) for k, v in out_tables.items()},
            '--write' in sys.argv,
        )
    print(f'done in {time.time() - t0:.0f} s')


if __name__ == '__main__':
    main()
