"""Tensor-core W4A16 (`_tc_kernel`) against `w4a16_matmul`'s pick on the Llama-3-8B shapes, on a GPU: correctness at
real sizes (M = 1, 5, 16, 64 and an odd shape), then a config sweep (block N x warps x stages x split-K, compiled in
parallel first). `MS=1,16,64 NSS=2,3,4 TGS=1,2,4 OUT=dir python tests/bench_tc.py`; rows go to OUT/tc_sweep.json
(`results/h200_tc_sweep.csv` holds the H200 run behind `TC_CONFIGS`)."""
import itertools, json, os, sys, time, multiprocessing as mp
sys.path.insert(0, 'tests')
import torch
from bench_quant import time_fn
from cvllm_lab.kernels import w4a16 as KW
from cvllm_lab.kernels.activation import silu_and_mul_ref
from cvllm_lab.quant.w4a16 import W4A16Linear, dequantize_packed_ref

SHAPES = {'qkv': (6144, 4096), 'o': (4096, 4096), 'gate_up': (28672, 4096), 'down': (4096, 14336)}
MS = [int(m) for m in os.environ.get('MS', '1,16').split(',')]
BNS = [int(b) for b in os.environ.get('BNS', '64,128,256').split(',')]
NSS = [int(b) for b in os.environ.get('NSS', '1,3').split(',')]
TGS = [float(b) for b in os.environ.get('TGS', '1,2,4').split(',')]
OUT = os.environ.get('OUT', '/tmp')

def packed(N, K, dev='cuda'):
    w = torch.randn(N, K, device=dev) * 0.02
    m = W4A16Linear.from_float(w, 128, 4, sym=True)
    return (m.qweight, m.scales, m.offsets, 4, m.group)

def configs(N, K, M):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = K // 128
    out = []
    shapes = [(64, 4), (128, 4), (256, 4), (128, 8), (256, 8), (128, 2)] if M <= 16 else [(64, 4), (128, 4), (128, 8), (256, 8)]
    for (bn, nw), ns, tg in itertools.product(shapes, NSS, TGS):
        progs = -(-N // bn) * -(-M // 64)
        sk = KW._pick_split(tiles, -(-int(tg * sms) // progs))
        cfg = dict(bn=bn, num_stages=ns, split_k=sk, num_warps=nw)
        if cfg not in out: out.append(cfg)
    return out

def warm(jobs):
    torch.cuda.set_device(0)
    for name, M, cfg in jobs:
        N, K = SHAPES[name]
        p = packed(N, K)
        x = torch.randn(M, K, device='cuda', dtype=torch.bfloat16)
        try: KW.w4a16_tc(x, *p, N, K, **cfg)
        except Exception as e: print('compile fail', name, M, cfg, repr(e)[:200], flush=True)
    torch.cuda.synchronize()

def main():
    dev = 'cuda'
    torch.manual_seed(0)
    # correctness at real sizes (defaults), incl. act and a non-multiple N
    for name, (N, K) in list(SHAPES.items()) + [('odd', (1000, 4096 + 128))]:
        p = packed(N, K)
        wd = dequantize_packed_ref(*p, N, K)
        for M in (1, 5, 16, 64):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            y = KW.w4a16_tc(x, *p, N, K)
            r = x.float() @ wd.T
            err = ((y.float() - r).norm() / r.norm()).item()
            assert err < 5e-3, (name, M, err)
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        if N % 2 == 0:
            y = KW.w4a16_tc(x, *p, N, K, act='silu_and_mul')
            r = silu_and_mul_ref(x.float() @ wd.T, interleaved=True)
            assert ((y.float() - r).norm() / r.norm()).item() < 5e-3
        print('ok', name, flush=True)
    jobs = [(n, M, c) for n in SHAPES for M in MS for c in configs(*SHAPES[n], M)]
    t0 = time.time()
    ctx = mp.get_context('spawn')
    with ctx.Pool(12) as pool: pool.map(warm, [jobs[i::12] for i in range(12)])
    print(f'precompiled {len(jobs)} configs in {time.time() - t0:.0f}s', flush=True)
    rows = []
    for name, (N, K) in SHAPES.items():
        p = packed(N, K)
        nb = sum(t.numel() * t.element_size() for t in p[:3])
        def args(i, M): return (torch.randn(M, K, device=dev, dtype=torch.bfloat16),) + tuple(t.clone() for t in p[:3])
        for M in MS:
            base = time_fn(lambda i: args(i, M), lambda x, q, s, o: KW.w4a16_matmul(x, q, s, o, 4, 128, N, K), nb)
            rows.append(dict(shape=name, M=M, kernel='current', cfg='default', us=base))
            best = None
            for cfg in configs(N, K, M):
                try: us = time_fn(lambda i: args(i, M), lambda x, q, s, o: KW.w4a16_tc(x, q, s, o, 4, 128, N, K, **cfg), nb)
                except Exception as e: print('fail', name, M, cfg, repr(e)[:200]); continue
                rows.append(dict(shape=name, M=M, kernel='tc', cfg=json.dumps(cfg), us=us))
                if best is None or us < best[0]: best = (us, cfg)
            print(f'{name:8s} M={M:3d} current {base:7.1f} us  tc best {best[0]:7.1f} us {best[1]}  ({nb / best[0] / 1e6 / 4200:.0%} of 4.2 TB/s)', flush=True)
    json.dump(rows, open(f'{OUT}/tc_sweep.json', 'w'))
    for M in MS:
        cur = sum(r['us'] for r in rows if r['M'] == M and r['kernel'] == 'current')
        tc = sum(min(r['us'] for r in rows if r['M'] == M and r['kernel'] == 'tc' and r['shape'] == s) for s in SHAPES)
        print(f'layer M={M}: current {cur:.1f} us, tc {tc:.1f} us')

if __name__ == '__main__':
    main()
