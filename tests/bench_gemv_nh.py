"""The M = 1 GEMV with two column tiles sharing x (`nh=2`) against the defaults, W4A16 g128 and g32 (q4_k's repack
layout) on the Llama-3-8B shapes, on a GPU: correctness at real sizes (with the fused activation), then a sweep
(block N x K-tiles per iteration x prefetch x split-K). `OUT=dir python tests/bench_gemv_nh.py`; rows go to
OUT/nh_sweep.json (`results/h200_gemv_nh_sweep.csv` holds the H200 run behind `GEMV_CONFIGS`)."""
import itertools, json, os, sys, time, multiprocessing as mp
sys.path.insert(0, 'tests')
import torch
from bench_quant import time_fn
from cvllm_lab.kernels import w4a16 as KW
from cvllm_lab.kernels.activation import silu_and_mul_ref
from cvllm_lab.quant.w4a16 import W4A16Linear, dequantize_packed_ref

SHAPES = {'qkv': (6144, 4096), 'o': (4096, 4096), 'gate_up': (28672, 4096), 'down': (4096, 14336)}
FMTS = {'g128': (128, True), 'g32': (32, False)}
OUT = os.environ.get('OUT', '/tmp')

def packed(N, K, g, sym):
    m = W4A16Linear.from_float(torch.randn(N, K, device='cuda') * 0.02, g, 4, sym=sym)
    return (m.qweight, m.scales, m.offsets, 4, m.group)

def configs(N, K):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for bn, tpi, pf, tg in itertools.product((64, 128), (1, 2), (0, 1), (4, 7, 10)):
        sk = KW._pick_split(K // 128, -(-int(tg * sms) // -(-N // bn)), tpi)
        c = dict(bn=bn, tpi=tpi, prefetch=pf, split_k=sk, nh=2, num_warps=4)
        if c not in out: out.append(c)
    return out

def warm(jobs):
    for fmt, name, cfg in jobs:
        N, K = SHAPES[name]
        p = packed(N, K, *FMTS[fmt])
        x = torch.randn(1, K, device='cuda', dtype=torch.bfloat16)
        KW.w4a16_gemv(x, *p, N, K, **cfg)
        if name == 'gate_up': KW.w4a16_gemv(x, *p, N, K, act='silu_and_mul', **cfg)
    torch.cuda.synchronize()

def main():
    torch.manual_seed(0)
    for fmt, (g, sym) in FMTS.items():
        for name, (N, K) in list(SHAPES.items()) + [('odd', (1000, 4096 + 128))]:
            p = packed(N, K, g, sym)
            wd = dequantize_packed_ref(*p, N, K)
            x = torch.randn(1, K, device='cuda', dtype=torch.bfloat16)
            r = x.float() @ wd.T
            for cfg in (dict(nh=2, bn=128, tpi=2, split_k=2), dict(nh=2, bn=64, tpi=1, prefetch=True, split_k=4),
                        dict(nh=2, bn=128, tpi=1, prefetch=False, split_k=1, pdl=True)):
                if (K // 128 if K % 128 == 0 else K // 128 + 1) % (cfg['split_k'] * cfg['tpi']): continue
                y = KW.w4a16_gemv(x, *p, N, K, **cfg)
                assert ((y.float() - r).norm() / r.norm()).item() < 5e-3, (fmt, name, cfg)
                if N % 2 == 0:
                    ya = KW.w4a16_gemv(x, *p, N, K, act='silu_and_mul', **cfg)
                    ra = silu_and_mul_ref(r, interleaved=True)
                    assert ((ya.float() - ra).norm() / ra.norm()).item() < 5e-3, ('act', fmt, name, cfg)
        print('ok', fmt, flush=True)
    assert all(not ws.any() and not c.any() for ws, c in KW._WS.values())
    jobs = [(f, n, c) for f in FMTS for n in SHAPES for c in configs(*SHAPES[n])]
    t0 = time.time()
    with mp.get_context('spawn').Pool(12) as pool: pool.map(warm, [jobs[i::12] for i in range(12)])
    print(f'precompiled {len(jobs)} in {time.time() - t0:.0f}s', flush=True)
    rows, best = [], {}
    for fmt, (g, sym) in FMTS.items():
        for name, (N, K) in SHAPES.items():
            p = packed(N, K, g, sym)
            nb = sum(t.numel() * t.element_size() for t in p[:3])
            args = lambda i: (torch.randn(1, K, device='cuda', dtype=torch.bfloat16),) + tuple(t.clone() for t in p[:3])
            act = 'silu_and_mul' if name == 'gate_up' else None
            base = time_fn(args, lambda x, q, s, o: KW.w4a16_gemv(x, q, s, o, 4, g, N, K, act=act), nb)
            rows.append(dict(fmt=fmt, shape=name, cfg='default', us=base))
            bb = None
            for c in configs(N, K):
                us = time_fn(args, lambda x, q, s, o: KW.w4a16_gemv(x, q, s, o, 4, g, N, K, act=act, **c), nb)
                rows.append(dict(fmt=fmt, shape=name, cfg=json.dumps(c), us=us))
                if bb is None or us < bb[0]: bb = (us, c)
            best[(fmt, name)] = (base, bb)
            print(f'{fmt} {name:8s} default {base:6.1f} us   nh=2 best {bb[0]:6.1f} us {bb[1]}', flush=True)
    for fmt in FMTS:
        print(fmt, 'layer: default %.1f us, nh=2 %.1f us' % (sum(best[(fmt, n)][0] for n in SHAPES), sum(best[(fmt, n)][1][0] for n in SHAPES)))
    json.dump(rows, open(f'{OUT}/nh_sweep.json', 'w'))

if __name__ == '__main__':
    main()
