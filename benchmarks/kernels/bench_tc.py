"""Tune the tensor-core W4A16 kernel (`_tc_kernel`, `w4a16_tc`) on the Llama-3-8B shapes and write its configs as data.

    python -m benchmarks.kernels.bench_tc [--ms 16,64] [--bns 64,128,256] [--nss 3,4] [--tgs 1,2,4] [--budget S]
        [--out DIR] [--write] [--dry]

Correctness first at real sizes (M = 1, 5, 16, 64 and an odd shape, symmetric and asymmetric weights, the fused
activation applied after), then a config sweep for symmetric g128 weights (what RTN `--isq w4a16` and GPTQ sym
give; `sym=True`: the weights are `q - 8` in the MMA, no offsets): block rows (`bm`) x block N x warps x stages x
split-K programs per SM, compiled in parallel first, each timed over rotating weight copies in a CUDA graph against
the current pick of `w4a16_matmul`. `--budget` (seconds, default 120) stops the timing loop. Rows go to
DIR/tc_sweep.json; the best config per (shape, row bucket) is printed in the JSON format of
`kernels/configs/w4a16_tc/`, and `--write` puts those that beat the current config by more than 1% into the
device's file there (on the H200, the reference device, `default.json` too). `--dry`: one small shape and M = 16
under the Triton interpreter (a check of the script).
"""

from benchmarks.kernels import common as C  # first: `--dry` sets TRITON_INTERPRET before the kernels load

import copy
import itertools
import json
import os
import sys
import time

import torch

from cvllm_lab.kernels import tuned
from cvllm_lab.kernels import w4a16 as KW
from cvllm_lab.kernels.activation import silu_and_mul, silu_and_mul_ref
from cvllm_lab.kernels.split_k import m_bucket, pick_split

MS = [int(m) for m in C.arg('--ms', '16' if C.DRY else '16,64').split(',')]
BNS = [int(b) for b in C.arg('--bns', '64,128,256').split(',')]
NSS = [int(b) for b in C.arg('--nss', '3,4').split(',')]
TGS = [float(b) for b in C.arg('--tgs', '1,2,4').split(',')]
SHAPES = dict(list(C.L3_8B.items())[1:2]) if C.DRY else C.L3_8B


def configs(N, K, M):
    "Launch configs to sweep (the `w4a16_tc` keyword arguments), split-K resolved per target."
    tiles = K // 128
    shapes = (
        [(16, 64, 4), (16, 128, 4), (16, 256, 4), (16, 128, 8), (16, 256, 8), (16, 128, 2)]
        if M <= 16
        else [(bm, bn, nw) for bm in (32, 64) for bn, nw in ((64, 4), (128, 4), (128, 8), (256, 8))]
    )
    out = []
    for (bm, bn, nw), ns, tg in itertools.product([s for s in shapes if s[1] in BNS], NSS, TGS):
        sk = pick_split(tiles, -(-int(tg * C.num_sms()) // (-(-N // bn) * -(-M // bm))))
        cfg = dict(bm=bm, bn=bn, num_stages=ns, split_k=sk, num_warps=nw)
        if cfg not in out:
            out.append(cfg)
    return out[:2] if C.DRY else out


def warm(jobs):
    "Compile each (shape, M, config) once into Triton's disk cache."
    for name, M, cfg in jobs:
        N, K = SHAPES[name]
        p = C.packed_w4a16(N, K)
        x = torch.randn(M, K, device=C.DEVICE, dtype=C.XDT)
        try:
            KW.w4a16_tc(x, *p, N, K, sym=True, **cfg)
        except Exception as e:
            print('compile fail', name, M, cfg, repr(e)[:200], flush=True)
    return 0


def check():
    "The defaults at real sizes against the fp32 reference (symmetric and not), the fused activation after the tc output."
    for name, (N, K) in list(SHAPES.items()) + ([] if C.DRY else [('odd', (1000, 4096 + 128))]):
        for sym in (True, False):
            p = C.packed_w4a16(N, K, sym=sym)
            wd = KW.dequantize_packed_ref(*p, N, K)
            for M in (1, 5, 16, 64):
                x = torch.randn(M, K, device=C.DEVICE, dtype=C.XDT)
                for s in {False, sym}:
                    err = C.rel_err(KW.w4a16_tc(x, *p, N, K, sym=s), x.float() @ wd.T)
                    assert err < 5e-3, (name, M, sym, s, err)
        x = torch.randn(1, K, device=C.DEVICE, dtype=C.XDT)
        if N % 2 == 0:
            y = silu_and_mul(KW.w4a16_tc(x, *p, N, K), interleaved=True)
            assert C.rel_err(y, silu_and_mul_ref(x.float() @ wd.T, interleaved=True)) < 5e-3
        print('ok', name, flush=True)


def main():
    out_dir = C.arg('--out', '.')
    os.makedirs(out_dir, exist_ok=True)
    budget = float(C.arg('--budget', 120))
    torch.manual_seed(0)
    check()
    jobs = [(n, M, c) for n in SHAPES for M in MS for c in configs(*SHAPES[n], M)]
    if not C.DRY:
        C.precompile(warm, jobs, 12, timeout=budget)
    T = tuned.configs_for('w4a16_tc', C.DEVICE)
    tables = copy.deepcopy(T)
    rows, t0 = [], time.time()
    for M in MS:
        for name, (N, K) in SHAPES.items():
            if time.time() - t0 > budget:
                print('budget spent: stopping before', name, M, flush=True)
                break
            p = C.packed_w4a16(N, K)
            nb = sum(t.numel() * t.element_size() for t in p[:3])

            def args(i):
                return (torch.randn(M, K, device=C.DEVICE, dtype=C.XDT),) + tuple(t.clone() for t in p[:3])

            base = C.time_fn(args, lambda x, q, s, o: KW.w4a16_matmul(x, q, s, o, 4, 128, N, K, sym=True), nb)
            rows.append(dict(shape=name, M=M, kernel='current', cfg='default', us=base))
            best = None
            for cfg in configs(N, K, M):
                try:
                    us = C.time_fn(args, lambda x, q, s, o: KW.w4a16_tc(x, q, s, o, 4, 128, N, K, sym=True, **cfg), nb)
                except Exception as e:
                    print('fail', name, M, cfg, repr(e)[:200])
                    continue
                rows.append(dict(shape=name, M=M, kernel='tc', cfg=json.dumps(cfg), us=us))
                if best is None or us < best[0]:
                    best = (us, cfg)
            if best is None:
                continue
            entry = dict(
                bm=best[1]['bm'],
                bn=best[1]['bn'],
                num_warps=best[1]['num_warps'],
                num_stages=best[1]['num_stages'],
                split=best[1]['split_k'],
            )
            key = (N, K, m_bucket(M))
            print(
                f'{name:8s} M={M:3d} current {base:7.1f} us  tc best {best[0]:7.1f} us '
                f'({nb / best[0] / 1e6 / 4200:.0%} of 4.2 TB/s)  "{N},{K},{m_bucket(M)}": {json.dumps(entry)}',
                flush=True,
            )
            if best[0] < 0.99 * base:
                tables['shapes'][key] = entry
    with open(os.path.join(out_dir, 'tc_sweep.json'), 'w') as f:
        json.dump(rows, f)
    for M in MS:
        done = [s for s in SHAPES if any(r['M'] == M and r['shape'] == s and r['kernel'] == 'tc' for r in rows)]
        cur = sum(r['us'] for r in rows if r['M'] == M and r['kernel'] == 'current' and r['shape'] in done)
        tc = sum(min(r['us'] for r in rows if r['M'] == M and r['kernel'] == 'tc' and r['shape'] == s) for s in done)
        print(f'layer M={M} ({len(done)} of {len(SHAPES)} matmuls): current {cur:.1f} us, tc best {tc:.1f} us')
    if '--write' in sys.argv:
        if C.DRY:
            sys.exit('--write is for GPU runs (a dry run would overwrite default.json)')
        dev = tuned.device_key(C.device_name())
        for f in [dev] + (['default'] if dev == 'NVIDIA_H200' else []):
            path = tuned.CONFIG_DIR / 'w4a16_tc' / f'{f}.json'
            path.write_text(tuned.dump_configs(tables))
            print('wrote', path, flush=True)


if __name__ == '__main__':
    main()
