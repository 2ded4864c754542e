"""Time the quantized matmul kernels on a GPU: `python tests/bench_quant.py [OUT_DIR] [--budget SECONDS]`.

Each timing is a CUDA graph of calls that rotate over enough copies of the weight (>= 256 MB in all) that every
call reads its weight from HBM, not L2; reported: microseconds per call and the achieved bandwidth for the bytes
of the quantized weight (and scales) against the device's 4.2 TB/s (H200 measured copy bandwidth). Parts:

1. W4A16 GEMV (M=1) config sweep on the Llama-3-8B shapes (block N, K-tiles per iteration, warps, split-K),
2. the other formats at M=1 with their default configs: q4_k / q4_0 / q8_0 packed, q4_k raw GGUF bytes, FP8, bf16,
3. batched (M = 16, 64) and prefill (M = 2048) paths,
4. an estimate of Llama-3-8B decode tok/s from the per-layer times (32 layers x 4 matmuls + the bf16 LM head).
Results go to OUT_DIR/bench_quant.json and .csv; the summary is printed. `--dry` runs every part on the CPU
under the Triton interpreter at shapes divided by 32 (a check of this script, not a measurement).
"""
import csv
import json
import math
import statistics
import sys
import time

import torch

PEAK = 4.2e12
L3_8B = {'qkv': (6144, 4096), 'o': (4096, 4096), 'gate_up': (28672, 4096), 'down': (4096, 14336)}
LM_HEAD = (128256, 4096)
T0 = time.time()


DRY = '--dry' in sys.argv
if DRY:
    import os
    os.environ['TRITON_INTERPRET'] = '1'
    L3_8B = {k: (n // 32, k_ // 32) for k, (n, k_) in L3_8B.items()}
    LM_HEAD = (LM_HEAD[0] // 64, LM_HEAD[1] // 32)


def time_fn(make_args, fn, nbytes, reps=10):
    "Median microseconds per call of fn(*args) over rotating weight copies, in a CUDA graph."
    if DRY:
        a = make_args(0); t = time.time(); fn(*a); return (time.time() - t) * 1e6
    copies = max(2, min(16, math.ceil(256e6 / nbytes)))
    argsets = [make_args(i) for i in range(copies)]
    for a in argsets[:2]: fn(*a)  # compile / warm up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for a in argsets: fn(*a)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for a in argsets: fn(*a)
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / copies)
    return statistics.median(ts)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith('--') else '.'
    budget = float(sys.argv[sys.argv.index('--budget') + 1]) if '--budget' in sys.argv else 200
    from cvllm_lab.kernels import w4a16 as KW, fp8_matmul as KF, gguf_matmul as KG
    from cvllm_lab.quant.w4a16 import W4A16Linear
    from cvllm_lab.quant.gguf import GGUFLinear, random_blocks
    from cvllm_lab.quant.fp8 import quantize_fp8_block
    dev = torch.device('cpu' if DRY else 'cuda')
    print('dry run' if DRY else torch.cuda.get_device_name(), torch.__version__, 'triton', __import__('triton').__version__, flush=True)
    rows = []

    def rec(part, fmt, N, K, M, cfg, us, nbytes):
        r = dict(part=part, fmt=fmt, N=N, K=K, M=M, cfg=cfg, us=round(us, 2), GBs=round(nbytes / us / 1e3, 1),
                 pct_peak=round(100 * nbytes / (us * 1e-6) / PEAK, 1))
        rows.append(r)
        print(json.dumps(r), flush=True)
        return r

    def packed(N, K, bits=4, group=128):
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        m = W4A16Linear.from_float(w, group, bits, sym=True)
        return m.qweight, m.scales, m.offsets, bits, m.group

    def nbytes_p(p):
        return sum(t.numel() * t.element_size() for t in p[:3])

    # 1. W4A16 GEMV sweep
    base = {}
    for name, (N, K) in L3_8B.items():
        p = packed(N, K)
        base[name] = p
        copies = [p] + [tuple(t.clone() if torch.is_tensor(t) else t for t in p) for _ in range(15)]
        nb = nbytes_p(p)
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        best = None
        for var, bn, tpi, nw in [('2d', 32, 4, 4), ('2d', 64, 4, 4), ('2d', 128, 4, 4), ('2d', 64, 2, 4), ('2d', 128, 2, 8),
                                 ('2d', 16, 4, 2), ('2d', 32, 4, 2), ('3d', 16, 8, 4), ('3d', 32, 4, 4), ('3d', 32, 8, 8), ('3d', 32, 16, 16)]:
            for sk in ((1, 2, 4) if N <= 6144 else (1,)):
                if time.time() - T0 > budget * 0.5: break
                tiles = (K + 127) // 128
                if tiles % sk or (tiles // sk) % tpi: continue
                try:
                    us = time_fn(lambda i: (x, *copies[i % 16], N, K),
                                 lambda x, qw, s, o, b, g, N, K: KW.w4a16_gemv(x, qw, s, o, b, g, N, K, bn=bn, tpi=tpi, num_warps=nw, split_k=sk, variant=var), nb)
                except Exception as e:
                    print('config failed', name, var, bn, tpi, nw, sk, repr(e)[:300], flush=True); continue
                r = rec('gemv_sweep', 'w4a16', N, K, 1, f'{var}-bn{bn}-tpi{tpi}-w{nw}-sk{sk}', us, nb)
                if best is None or r['us'] < best['us']: best = r
        if best: print('BEST', name, best, flush=True)
        del copies
        if not DRY: torch.cuda.empty_cache()

    # 1b. the packed q4_k (group 32) GEMV: a few configs on two shapes
    for (N, K) in ((4096, 14336), (14336, 4096)):
        raw = random_blocks('q4k', N, K, generator=torch.Generator().manual_seed(0)).to(dev)
        pm = GGUFLinear.from_gguf(raw, 'q4k', (N, K)).pack().packed
        p = (pm.qweight, pm.scales, pm.offsets, pm.bits, pm.group)
        nb = nbytes_p(p)
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        for bn, tpi, nw in [(32, 4, 4), (64, 4, 4), (128, 4, 4), (64, 2, 4)]:
            for sk in ((1, 2, 4) if N <= 6144 else (1,)):
                if time.time() - T0 > budget * 0.6: break
                tiles = (K + 127) // 128
                if tiles % sk or (tiles // sk) % tpi: continue
                try:
                    us = time_fn(lambda i: (x, *[t_.clone() if torch.is_tensor(t_) else t_ for t_ in p]),
                                 lambda x, qw, s, o, b, g: KW.w4a16_gemv(x, qw, s, o, b, g, N, K, bn=bn, tpi=tpi, num_warps=nw, split_k=sk), nb)
                except Exception as e:
                    print('q4k config failed', bn, tpi, nw, sk, repr(e)[:300], flush=True); continue
                rec('gemv_sweep_q4k', 'q4k:packed', N, K, 1, f'2d-bn{bn}-tpi{tpi}-w{nw}-sk{sk}', us, nb)
        if not DRY: torch.cuda.empty_cache()

    # 2. formats at M=1, default configs
    def bench_fmt(fmt, N, K, M=1):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        if fmt == 'bf16':
            nb = N * K * 2
            return rec(f'M{M}', fmt, N, K, M, 'cublas', time_fn(lambda i: (x, w.clone() if i else w), lambda x, w: x @ w.T, nb), nb)
        if fmt == 'fp8':
            q, s = quantize_fp8_block(w)
            nb = q.numel() + s.numel() * 4
            return rec(f'M{M}', fmt, N, K, M, 'default', time_fn(lambda i: (x, q.clone(), s.clone()), lambda x, q, s: KF.fp8_matmul(x, q, s, N, K), nb), nb)
        if fmt == 'marlin':
            p = base.get(next((n for n, v in L3_8B.items() if v == (N, K)), None)) or packed(N, K)
            nb = nbytes_p(p)
            return rec(f'M{M}', fmt, N, K, M, 'default', time_fn(lambda i: (x, *[t.clone() if torch.is_tensor(t) else t for t in p]),
                                                                 lambda x, qw, s, o, b, g: KW.w4a16_matmul(x, qw, s, o, b, g, N, K), nb), nb)
        t, mode = fmt.split(':')
        if (t, N, K) not in gguf_cache:  # random block bytes with sane scales: the values don't matter for timing
            gguf_cache[(t, N, K)] = random_blocks(t, N, K, generator=torch.Generator().manual_seed(0)).to(dev)
        m = GGUFLinear.from_gguf(gguf_cache[(t, N, K)], t, (N, K))
        if mode == 'packed':
            m.pack()
            pm = m.packed
            p = (pm.qweight, pm.scales, pm.offsets, pm.bits, pm.group)
            nb = nbytes_p(p)
            return rec(f'M{M}', fmt, N, K, M, 'default', time_fn(lambda i: (x, *[t_.clone() if torch.is_tensor(t_) else t_ for t_ in p]),
                                                                 lambda x, qw, s, o, b, g: KW.w4a16_matmul(x, qw, s, o, b, g, N, K), nb), nb)
        raw = m.qweight
        nb = raw.numel()
        return rec(f'M{M}', fmt, N, K, M, 'gguf-bytes', time_fn(lambda i: (x, raw.clone()), lambda x, r: KG.gguf_matmul(x, r, m.qtype, N, K), nb), nb)

    gguf_cache = {}
    fmts = ['bf16', 'marlin', 'q4k:packed', 'q8_0:packed', 'q4_0:packed', 'fp8', 'q4k:raw', 'q6k:raw']
    per_layer = {}
    for M in (1, 16):
        for fmt in fmts:
            if M == 16 and fmt in ('q4k:raw', 'q6k:raw'): continue
            for name, (N, K) in L3_8B.items():
                if time.time() - T0 > budget * 0.85: break
                try: r = bench_fmt(fmt, N, K, M)
                except Exception as e: print('failed', fmt, M, name, repr(e)[:300], flush=True); continue
                per_layer[(fmt, M, name)] = r['us']
                if not DRY: torch.cuda.empty_cache()
    # LM head (bf16, never quantized)
    lm = {}
    for M in (1, 16):
        try: lm[M] = bench_fmt('bf16', *LM_HEAD, M)['us']
        except Exception as e: print('lm head failed', repr(e)[:200])
    # 3. prefill
    for fmt in ('marlin', 'fp8', 'bf16'):
        if time.time() - T0 > budget * 0.95: break
        for M in (64, 2048):
            try: bench_fmt(fmt, *((448, 128) if DRY else (14336, 4096)), M // 16 if DRY else M)
            except Exception as e: print('failed prefill', fmt, M, repr(e)[:200])
    # 4. decode estimate
    est = []
    for fmt in fmts:
        for M in (1, 16):
            ts = [per_layer.get((fmt, M, n)) for n in L3_8B]
            if None in ts or M not in lm: continue
            step_us = 32 * sum(ts) + lm[M]
            e = dict(fmt=fmt, batch=M, layer_us=round(sum(ts), 1), step_us=round(step_us, 1), tok_s=round(M * 1e6 / step_us))
            est.append(e)
            print('ESTIMATE', json.dumps(e), flush=True)
    with open(f'{out_dir}/bench_quant.json', 'w') as f: json.dump(dict(rows=rows, estimates=est, device='dry' if DRY else torch.cuda.get_device_name()), f, indent=1)
    with open(f'{out_dir}/bench_quant.csv', 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0])); w.writeheader(); w.writerows(rows)
    print(f'done in {time.time() - T0:.0f} s', flush=True)


if __name__ == '__main__':
    main()
