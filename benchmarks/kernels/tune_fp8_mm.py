"""Tune the FP8 matmuls for M > 1 (`fp8_matmul`'s backends) on a GPU and write the picks as data.

    python -m benchmarks.kernels.tune_fp8_mm [--ms 16,64,512] [--layouts block[,channel]] [--shapes qkv,o,...]
        [--budget SECONDS] [--limit N] [--workers N] [--out DIR] [--write] [--dry]

For every layout (`block`: 128 x 128 weight scales, `channel`: per-channel), Llama-3-8B shape and row count M
(each M stands for its row bucket, `fp8_gemm.gemm_bucket`), the candidates are: the current config; the W8A8
Triton kernel over a grid of variants (activation quantization fused into the kernel or not, swap-AB or not, block
M x block N x warps x stages, split-K by programs per SM; per-token activations for the channel layout);
`torch._scaled_mm` (`scaled_mm`; the block layout only where the PyTorch build has 1x128 x 128x128 scaling); the
W8A16 kernel (`w8a16`, block layout, M <= 128). Each is checked against the fp32 reference of its own quantization
(`fp8_gemm_ref`, relative error < 2e-2), then timed as `fp8_matmul` runs it (the activation quantization
included) over rotating weight copies in a CUDA graph (`common.time_fn`). Triton candidates are compiled first by
parallel workers. `--budget` (seconds, default 150) stops the timing loop; cases not reached keep their config.

Written to `--out` (default `.`): `tune_fp8_mm.csv` (every timing) and `<device>.json`, the `configs/fp8_gemm`
tables with each (shape, bucket) entry set to its fastest candidate where that beats the current config by more
than 1% (`--write`: into `kernels/configs/fp8_gemm/` directly; on the H200, the reference device, `default.json`
too, so that untuned GPUs run the H200's picks). Also printed: per bucket, the Llama-3-8B layer time (4 matmuls)
of the current and the best configs. `--dry`: one small shape, two candidates, on the CPU under the Triton
interpreter (a check of the script, not a measurement).
"""

from benchmarks.kernels import common as C  # first: `--dry` sets TRITON_INTERPRET before the kernels load

import copy
import csv
import itertools
import json
import os
import sys
import time

import torch
import triton

from cvllm_lab.kernels import tuned
from cvllm_lab.kernels.fp8_gemm import fp8_gemm_ref, gemm_bucket
from cvllm_lab.kernels.fp8_matmul import fp8_dequantize, fp8_matmul, gemm_config
from cvllm_lab.quant.fp8 import quantize_fp8_block, quantize_fp8_channel

KERNEL = 'fp8_gemm'
TABLE = {'block': ('default', 'block_shapes'), 'channel': ('channel', 'channel_shapes')}


def candidates(layout, M, cur):
    "Configs (dicts in the JSON format) to time for M rows against the current config `cur`."
    out = []
    tiles = (
        [(16, 64), (16, 128)]
        if M <= 16
        else [(32, 64), (32, 128), (16, 128)]
        if M <= 32
        else [(64, 64), (64, 128), (32, 128)]
        if M <= 64
        else [(64, 128), (128, 128)]
        if M <= 128
        else [(128, 128), (128, 256), (64, 256)]
    )
    for (bm, bn), swap, fused, nw, tg in itertools.product(tiles, (True, False), (True, False), (4, 8), (1, 3)):
        if (nw == 8) != (bm * bn >= 128 * 128):
            continue
        if swap and M > 64 or (fused and M > 128) or (tg > 1 and M > 128):
            continue
        ns = 4 if M <= 64 else 3
        out.append(dict(backend='triton', fused=fused, swap=swap, bm=bm, bn=bn, num_warps=nw, num_stages=ns, target=tg))
    if layout == 'channel':
        for bm, bn, nw in ((64, 128, 4), (128, 128, 8)) if M > 64 else ((16, 64, 4), (64, 128, 4)):
            out.append(
                dict(
                    backend='triton',
                    fused=False,
                    act_group=None,
                    swap=M <= 64,
                    bm=bm,
                    bn=bn,
                    num_warps=nw,
                    num_stages=4,
                    target=1 if M > 64 else 2,
                )
            )
    out.append(dict(backend='scaled_mm', act_group=None) if layout == 'channel' else dict(backend='scaled_mm'))
    if layout == 'block' and M <= 128:
        out.append(dict(backend='w8a16'))
    return [c for i, c in enumerate(out) if c != cur and c not in out[:i]]


def _install(layout, key, cfg):
    "Make `cfg` what `fp8_matmul` reads for (N, K, bucket) `key` (None: remove the entry)."
    T = tuned.configs_for(KERNEL, C.DEVICE)[TABLE[layout][1]]
    if cfg is None:
        T.pop(key, None)
    else:
        T[key] = cfg


def _weights(layout, N, K, device=None):
    w = torch.randn(N, K, device=device or C.DEVICE) * 0.02
    return quantize_fp8_block(w) if layout == 'block' else quantize_fp8_channel(w)


def _ref(cfg, layout, x, w, s, N, K):
    "The reference of what `cfg` computes: W8A16 (x unquantized) or W8A8 with its activation scales."
    if cfg.get('backend') == 'w8a16':
        return x.float() @ fp8_dequantize(w, s).T
    ag = cfg.get('act_group', 128) if cfg.get('backend') != 'scaled_mm' else (None if layout == 'channel' else 128)
    return fp8_gemm_ref(x.float(), w, s, N, K, ag)


def _compile_worker(jobs):
    "Run each (layout, N, K, M, cfg) once: compiles the Triton ones into the disk cache."
    bad = 0
    for layout, N, K, M, cfg in jobs:
        try:
            _install(layout, (N, K, gemm_bucket(M)), cfg)
            w, s = _weights(layout, N, K)
            fp8_matmul(torch.randn(M, K, device=C.DEVICE, dtype=C.XDT), w, s, N, K)
        except Exception as e:
            bad += 1
            print('compile failed', layout, N, K, M, cfg, repr(e)[:200], flush=True)
    return bad


def main():
    out_dir = C.arg('--out', '.')
    os.makedirs(out_dir, exist_ok=True)
    layouts = C.arg('--layouts', 'block').split(',')
    names = C.arg('--shapes', 'o' if C.DRY else ','.join(C.L3_8B)).split(',')
    ms = [int(m) for m in C.arg('--ms', '16' if C.DRY else '16,64,512').split(',')]
    limit = int(C.arg('--limit', 2 if C.DRY else 0)) or None
    budget = float(C.arg('--budget', 150))
    dev_key = 'default' if C.DRY else tuned.device_key(C.device_name())
    print(C.device_name(), torch.__version__, 'triton', triton.__version__, flush=True)
    torch.manual_seed(0)
    T = tuned.configs_for(KERNEL, C.DEVICE)
    before = copy.deepcopy(T)
    plan = []  # (layout, name, N, K, M, current config, candidates); the decode buckets first
    for M in sorted(ms, key=lambda m: (m > 64, m)):
        for layout in layouts:
            for name in names:
                N, K = C.L3_8B[name]
                cur = gemm_config(N, K, M, layout, C.DEVICE)
                plan.append((layout, name, N, K, M, cur, candidates(layout, M, cur)[:limit]))
    jobs = [(l, N, K, M, c) for l, _, N, K, M, cur, cs in plan for c in [cur] + cs if c.get('backend') != 'scaled_mm']
    if not C.DRY:
        C.precompile(_compile_worker, jobs, int(C.arg('--workers', min(12, (os.cpu_count() or 2) - 1))), timeout=budget)
    rows, best, t_start = [], {}, time.time()
    for layout, name, N, K, M, cur, cands in plan:
        if time.time() - t_start > budget:
            print('budget spent: stopping before', layout, name, M, flush=True)
            break
        key = (N, K, gemm_bucket(M))
        w, s = _weights(layout, N, K)
        x = torch.randn(M, K, device=C.DEVICE, dtype=C.XDT)
        nb = w.numel() + s.numel() * 4
        args = lambda i: (torch.randn(M, K, device=C.DEVICE, dtype=C.XDT), w.clone(), s.clone())
        for kind, cfg in [('current', cur)] + [('candidate', c) for c in cands]:
            _install(layout, key, cfg)
            try:
                err = C.rel_err(fp8_matmul(x, w, s, N, K), _ref(cfg, layout, x, w, s, N, K))
                if not err < 2e-2:
                    print('WRONG', layout, name, M, cfg, err, flush=True)
                    continue
                us = C.time_fn(args, lambda x_, w_, s_: fp8_matmul(x_, w_, s_, N, K), nb)
            except Exception as e:
                print('failed', layout, name, M, cfg, repr(e)[:200], flush=True)
                continue
            rows.append(
                dict(
                    gpu=C.device_name(),
                    layout=layout,
                    shape=name,
                    N=N,
                    K=K,
                    M=M,
                    kind=kind,
                    cfg=json.dumps(cfg),
                    us=round(us, 2),
                    tbps=round(nb / us / 1e6, 3),
                    rel_err=f'{err:.2e}',
                )
            )
            print(json.dumps(rows[-1]), flush=True)
            b = best.setdefault(
                (layout, key), dict(us=us, cfg=cfg, cur_us=us if kind == 'current' else None, name=name)
            )
            if kind == 'current':
                b['cur_us'] = us
            if us < b['us']:
                b.update(us=us, cfg=cfg)
        _install(layout, key, before[TABLE[layout][1]].get(key))
    if rows:
        with open(os.path.join(out_dir, f'tune_{KERNEL}.csv'), 'w', newline='') as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    tables = copy.deepcopy(before)
    layer = {}
    for (layout, key), b in best.items():
        cur_us = b['cur_us'] or float('inf')
        print(f'{layout} {key}: current {cur_us:.2f} us, best {b["us"]:.2f} us {json.dumps(b["cfg"])}', flush=True)
        if b['us'] < 0.99 * cur_us:
            tables[TABLE[layout][1]][key] = b['cfg']
        lc = layer.setdefault((layout, key[2]), [0.0, 0.0, 0])
        lc[0] += cur_us
        lc[1] += min(b['us'], cur_us)
        lc[2] += 1
    for (layout, bucket), (cu, bu, n) in sorted(layer.items()):
        if n == len(names):
            print(f'{layout} M<={bucket}: layer (4 matmuls) {cu:.1f} -> {bu:.1f} us', flush=True)
    if '--write' in sys.argv and C.DRY:
        sys.exit('--write is for GPU runs (a dry run would overwrite default.json)')
    where = tuned.CONFIG_DIR / KERNEL if '--write' in sys.argv else out_dir
    for f in [dev_key] + (['default'] if '--write' in sys.argv and dev_key == 'NVIDIA_H200' else []):
        path = os.path.join(where, f'{f}.json')
        with open(path, 'w') as fh:
            fh.write(tuned.dump_configs(tables))
        print('wrote', path, flush=True)


if __name__ == '__main__':
    main()
