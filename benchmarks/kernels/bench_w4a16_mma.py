"""The W4A16 MMA kernel (`w4a16_mma`, 1 .. 8 rows) against the kernels it replaces, on the Llama-3-8B shapes.

    python -m benchmarks.kernels.bench_w4a16_mma [--ms 1,2,4,8] [--out DIR] [--write]

Correctness first at real sizes: every shape, M = 1 .. 8, symmetric and asymmetric g128 weights, a per-channel
layer, fp16 x, the fused activation, and an N that needs masks, each against the fp32 reference. Then per shape a
sweep of launch configs at M = 1 (warps x word tensors per thread x register cap x split-K; other M: the best of
M = 1), each timed over rotating weight copies in a CUDA graph (`common.time_fn`) beside the kernel that
`w4a16_matmul` ran before it: the GEMV at M = 1 (tuned, symmetric, gate_up with its fused activation), the
tensor-core kernel above. Rows go to
DIR/w4a16_mma.csv; the best config per shape at M = 1 is printed in the format of `kernels/configs/w4a16_mma/`, and
`--write` writes the device's file there (on the H200, the reference device, `default.json` too). `--ms` must start
with 1: the other row counts time the best config of M = 1.
"""

from benchmarks.kernels import common as C  # first: `--dry` sets TRITON_INTERPRET before the kernels load

import csv
import itertools
import json
import os
import sys

import torch

from cvllm_lab.kernels import tuned
from cvllm_lab.kernels import w4a16 as KW
from cvllm_lab.kernels.activation import silu_and_mul_ref
from cvllm_lab.kernels.split_k import pick_split
from cvllm_lab.kernels.w4a16_mma import w4a16_mma

MS = [int(m) for m in C.arg('--ms', '1,2,4,8').split(',')]


def check():
    "Correctness at real sizes; returns the rows (case, rel_err)."
    rows = []
    g = torch.Generator(device='cuda').manual_seed(0)
    cases = [(name, N, K, 128, sym, torch.bfloat16) for name, (N, K) in C.L3_8B.items() for sym in (True, False)]
    cases += [
        ('o_channel', 4096, 4096, -1, False, torch.bfloat16),
        ('o_fp16', 4096, 4096, 128, True, torch.float16),
        ('odd_n', 4100, 4096, 128, False, torch.bfloat16),
        ('odd_k', 1024, 1000, 128, True, torch.bfloat16),
    ]
    for name, N, K, group, sym, dt in cases:
        p = C.packed_w4a16(N, K, group, sym)[:3]
        w = KW.dequantize_packed_ref(*p, 4, group, N, K)
        for M in (1, 2, 3, 5, 8):
            x = torch.randn(M, K, device='cuda', dtype=dt, generator=g)
            ref = x.float() @ w.T
            y = w4a16_mma(x, *p, 4, group, N, K, sym=sym, out_dtype=torch.float32)
            err = C.rel_err(y, ref)
            rows.append(dict(case=f'{name} sym={sym} M={M}', rel_err=err))
            assert err < 2e-3, (name, sym, M, err)
            if name == 'gate_up':
                ya = w4a16_mma(x, *p, 4, group, N, K, sym=sym, act='silu_and_mul', out_dtype=torch.float32)
                err = C.rel_err(ya, silu_and_mul_ref(ref, interleaved=True))
                rows.append(dict(case=f'{name} act sym={sym} M={M}', rel_err=err))
                assert err < 2e-3, (name, 'act', sym, M, err)
            for sk, nh in ((1, 2), (2, 1), (4, 2)):
                y = w4a16_mma(x, *p, 4, group, N, K, sym=sym, split_k=sk, num_warps=4, nh=nh)
                err = C.rel_err(y, ref)
                assert err < 1e-2, (name, sym, M, sk, nh, err)
    print(f'correct: {len(rows)} cases, max rel err {max(r["rel_err"] for r in rows):.2e}', flush=True)
    return rows


def configs(N, K):
    "Launch configs to time: warps x word tensors per thread x register cap x split-K (programs per SM)."
    tiles, out = K // 128, []
    for nw, nh, reg, tg in itertools.product((4, 8), (1, 2), (None, 128), (4, 8)):
        sk = pick_split(tiles, -(-int(tg * C.num_sms()) // -(-N // (nh * nw * 32))))
        c = dict(num_warps=nw, nh=nh, split_k=sk, **({'maxnreg': reg} if reg else {}))
        if c not in out:
            out.append(c)
    return out


def main():
    out_dir = C.arg('--out', '.')
    os.makedirs(out_dir, exist_ok=True)
    print(C.device_name(), torch.__version__, flush=True)
    torch.manual_seed(0)
    check()
    rows, best = [], {}
    for name, (N, K) in C.L3_8B.items():
        p, _, _, nb, _, act = C.gemv_case(name, N, K, 128, True)
        for M in MS:
            mk = lambda i: (torch.randn(M, K, device='cuda', dtype=C.XDT),) + tuple(t.clone() for t in p)
            if M == 1:
                base = C.time_fn(
                    mk, lambda x_, q, s, o: KW.w4a16_gemv(x_, q, s, o, 4, 128, N, K, act=act, sym=True), nb
                )
                kind = 'gemv'
            else:
                base = C.time_fn(mk, lambda x_, q, s, o: KW.w4a16_tc(x_, q, s, o, 4, 128, N, K, sym=True), nb)
                kind = 'tc'
            rows.append(
                dict(
                    gpu=C.device_name(),
                    shape=name,
                    N=N,
                    K=K,
                    M=M,
                    kernel=kind,
                    cfg='tuned',
                    us=round(base, 2),
                    gbps=round(nb / base / 1e3, 1),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
            for cfg in configs(N, K) if M == 1 else [best[(N, K, 1)][1]]:
                try:
                    us = C.time_fn(
                        mk,
                        lambda x_, q, s, o: w4a16_mma(
                            x_, q, s, o, 4, 128, N, K, sym=True, act=act if M == 1 else None, **cfg
                        ),
                        nb,
                    )
                except Exception as e:
                    print('failed', name, M, cfg, repr(e)[:300], flush=True)
                    continue
                rows.append(
                    dict(
                        gpu=C.device_name(),
                        shape=name,
                        N=N,
                        K=K,
                        M=M,
                        kernel='mma',
                        cfg=json.dumps(cfg),
                        us=round(us, 2),
                        gbps=round(nb / us / 1e3, 1),
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
                k = (N, K, M)
                if k not in best or us < best[k][0]:
                    best[k] = (us, cfg)
            print(
                f'{name} M={M}: {kind} {base:.2f} us, mma best {best[(N, K, M)][0]:.2f} us {best[(N, K, M)][1]}',
                flush=True,
            )
    with open(os.path.join(out_dir, 'w4a16_mma.csv'), 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    tables = {'default': dict(tuned.configs_for('w4a16_mma', C.DEVICE)['default']), 'shapes': {}}
    for (N, K, M), (us, cfg) in best.items():
        if M == 1:
            tables['shapes'][(N, K)] = dict(
                num_warps=cfg['num_warps'],
                nh=cfg['nh'],
                split=cfg['split_k'],
                **{k: cfg[k] for k in ('maxnreg',) if k in cfg},
            )
    print(tuned.dump_configs(tables), flush=True)
    if '--write' in sys.argv:
        dev = tuned.device_key(C.device_name())
        for name in [dev] + (['default'] if dev == 'NVIDIA_H200' else []):  # the H200 is the reference device
            path = tuned.CONFIG_DIR / 'w4a16_mma' / f'{name}.json'
            path.write_text(tuned.dump_configs(tables))
            print('wrote', path, flush=True)


if __name__ == '__main__':
    main()
