"""Time the quantized matmul kernels on a GPU:
`python -m benchmarks.kernels.bench_quant [OUT_DIR] [--budget SECONDS] [--sweep PARTS] [--fmts F,..] [--prefill] [--dry]`.

Each timing is a CUDA graph of calls that rotate over enough copies of the weight (>= 256 MB in all) that every
call reads its weight from HBM, not L2 (`common.time_fn`); reported: microseconds per call and the achieved bandwidth
for the bytes of the quantized weight (and scales) against the device's 4.2 TB/s (H200 measured copy bandwidth).
Every swept config is also checked against the dequantize + fp32 matmul reference (rows that disagree are printed,
not kept).

1. config sweeps of the batched kernels (`--sweep` picks parts, comma separated; default `w16b`, `none` for none)
   on the Llama-3-8B shapes: `w16` / `w16b` / `w64` / `w64b` W4A16 M=16 / 64 (tl.dot kernel), `f1` / `f16` FP8
   M=1 / 16. All configs are compiled first by parallel worker processes (Triton's disk cache), then timed. The M = 1
   W4A16 GEMV has its own tuner, `benchmarks.kernels.tune_w4a16_gemv`.
2. the formats with their default configs at M = 1, 16, 64: bf16 (cuBLAS), W4A16 g128, q4_k / q8_0 / q4_0 packed,
   FP8, q4_k / q6_k raw GGUF bytes; prefill (M = 2048) with `--prefill`,
3. an estimate of Llama-3-8B decode tok/s from the per-layer times (32 layers x 4 matmuls + the bf16 LM head).
Results go to OUT_DIR/bench_quant.json and .csv; the summary is printed. `--dry` runs every part on the CPU
under the Triton interpreter at shapes divided by 32 (a check of this script, not a measurement).
"""

from benchmarks.kernels import common as C  # first: `--dry` sets TRITON_INTERPRET before the kernels load
from benchmarks.kernels.common import DRY, L3_8B, LM_HEAD, PEAK, XDT, arg as _arg, time_fn

import csv
import json
import math
import os
import sys
import time

import torch

T0 = time.time()


# ------------------------------------------------------------------------------------------------ the sweep


def _splits(tiles, progs, multiple, targets, sms):
    "Distinct split-K values that bring progs * split nearest below each target (in SMs)."
    from cvllm_lab.kernels.split_k import pick_split

    return sorted({pick_split(tiles, -(-int(t * sms) // progs), multiple) for t in targets})


def sweep_jobs(parts, sms):
    "The configs to time: dicts with part, fmt, op, N, K, M, bits, group, cfg (a label) and kw (the launcher's)."
    jobs = []
    small = DRY
    for name, (N, K) in L3_8B.items():
        tiles = -(-K // 128)
        kb = tiles
        if 'w64b' in parts:
            for bn, nw, ns in [(256, 4, 3), (256, 8, 3), (128, 4, 4)]:
                if small:
                    bn = 16
                for sk in _splits(tiles, -(-N // bn), 1, (1, 2, 4), sms):
                    jobs.append(
                        dict(
                            part='mm_sweep',
                            fmt='w4a16',
                            op='mm',
                            N=N,
                            K=K,
                            M=64,
                            bits=4,
                            group=128,
                            cfg=f'dot-bn{bn}-w{nw}-sk{sk}-ns{ns}',
                            kw=dict(bn=bn, num_warps=nw, split_k=sk, num_stages=ns),
                        )
                    )
        if 'w16b' in parts:
            for bn, nw, ns in [(256, 8, 3), (256, 4, 3), (128, 8, 4), (128, 8, 2), (256, 8, 2)]:
                if small:
                    bn = 16
                for sk in _splits(tiles, -(-N // bn), 1, (2, 4, 8), sms):
                    jobs.append(
                        dict(
                            part='mm_sweep',
                            fmt='w4a16',
                            op='mm',
                            N=N,
                            K=K,
                            M=16,
                            bits=4,
                            group=128,
                            cfg=f'dot-bn{bn}-w{nw}-sk{sk}-ns{ns}',
                            kw=dict(bn=bn, num_warps=nw, split_k=sk, num_stages=ns),
                        )
                    )
        for M, part in ((16, 'w16'), (64, 'w64')):
            if part not in parts:
                continue
            cfgs = (
                [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (64, 8, 3)]
                if M == 16
                else [(64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 8, 4)]
            )
            for bn, nw, ns in cfgs:
                if small:
                    bn = 16
                for sk in _splits(tiles, -(-N // bn) * -(-M // 64), 1, (1, 2, 4) if M == 16 else (1, 2), sms):
                    jobs.append(
                        dict(
                            part='mm_sweep',
                            fmt='w4a16',
                            op='mm',
                            N=N,
                            K=K,
                            M=M,
                            bits=4,
                            group=128,
                            cfg=f'dot-bn{bn}-w{nw}-sk{sk}-ns{ns}',
                            kw=dict(bn=bn, num_warps=nw, split_k=sk, num_stages=ns),
                        )
                    )
        if 'f1' in parts:
            for bn, tpi, nw, ns in [
                (16, 2, 4, 1),
                (16, 4, 4, 1),
                (32, 2, 8, 1),
                (32, 4, 8, 1),
                (8, 4, 4, 1),
                (16, 2, 4, 3),
                (64, 2, 8, 1),
            ]:
                if small:
                    bn, tpi = 8, 1
                for sk in _splits(kb, -(-N // bn), tpi, (1, 2, 4), sms):
                    jobs.append(
                        dict(
                            part='gemv_sweep',
                            fmt='fp8',
                            op='fp8gemv',
                            N=N,
                            K=K,
                            M=1,
                            cfg=f'bn{bn}-tpi{tpi}-w{nw}-sk{sk}-ns{ns}',
                            kw=dict(bn=bn, tpi=tpi, num_warps=nw, split_k=sk, num_stages=ns),
                        )
                    )
        if 'f16' in parts:
            for bn, nw, ns in [(64, 4, 3), (128, 4, 3), (64, 4, 4), (32, 4, 3), (128, 8, 3)]:
                if small:
                    bn = 16
                for sk in _splits(kb, -(-N // bn), 1, (1, 2, 4), sms):
                    jobs.append(
                        dict(
                            part='mm_sweep',
                            fmt='fp8',
                            op='fp8mm',
                            N=N,
                            K=K,
                            M=16,
                            cfg=f'bn{bn}-w{nw}-sk{sk}-ns{ns}',
                            kw=dict(bn=bn, num_warps=nw, split_k=sk, num_stages=ns),
                        )
                    )
    return jobs


def fake_args(job, dev, gen=None):
    "Operands of the job's shape (random bits, sane scales) as a tuple for `call`."
    N, K, M = job['N'], job['K'], job['M']
    x = torch.randn(M, K, device=dev, dtype=XDT)
    if job['op'].startswith('fp8'):
        w = (torch.randn(N, K, device=dev) * 0.5).to(torch.float8_e4m3fn)
        s = torch.rand(-(-N // 128), -(-K // 128), device=dev) * 0.01
        return (x, w, s)
    bits, G, Kp = job['bits'], job['group'], -(-K // 128) * 128
    qw = torch.randint(-(2**31), 2**31, (Kp * bits // 32, N), device=dev, dtype=torch.int64).to(torch.int32)
    s = (torch.rand(Kp // G, N, device=dev) * 0.01).half()
    return (x, qw, s, -8 * s, bits, G)


def call(job, args):
    from cvllm_lab.kernels import w4a16 as KW, fp8_matmul as KF

    N, K, op, kw = job['N'], job['K'], job['op'], job['kw']
    if op == 'gemv':
        return KW.w4a16_gemv(*args, N, K, **kw)
    if op == 'mm':
        return KW.w4a16_mm(*args, N, K, **kw)
    if op == 'fp8gemv':
        return KF.fp8_gemv(*args, N, K, **kw)
    if op == 'fp8mm':
        return KF.fp8_mm(*args, N, K, **kw)
    raise ValueError(op)


def _compile_worker(jobs):
    "Run each job once (compiles it into Triton's disk cache); returns the number of failures."
    dev = C.DEVICE
    cache, bad = {}, 0
    for j in jobs:
        key = (j['op'][:3], j['N'], j['K'], j['M'], j.get('group'))
        try:
            if key not in cache:
                cache = {key: fake_args(j, dev)}
            call(j, cache[key])
        except Exception as e:
            bad += 1
            print('compile failed', j['cfg'], j['N'], j['K'], repr(e)[:300], flush=True)
    if not DRY:
        torch.cuda.synchronize()
    return bad


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith('--') else '.'
    os.makedirs(out_dir, exist_ok=True)
    budget = float(_arg('--budget', 200))
    parts = _arg('--sweep', 'w16b').split(',')
    from cvllm_lab.kernels import w4a16 as KW, fp8_matmul as KF, gguf_matmul as KG
    from cvllm_lab.kernels.fp8_layout import dequantize_fp8_block
    from cvllm_lab.kernels.w4a16 import dequantize_packed_ref
    from cvllm_lab.quant.fp8 import quantize_fp8_block
    from cvllm_lab.quant.gguf import GGUFLinear, random_blocks
    from cvllm_lab.quant.w4a16 import W4A16Linear

    dev = C.DEVICE
    sms = C.num_sms()
    print(C.device_name(), torch.__version__, 'triton', __import__('triton').__version__, 'SMs', sms, flush=True)
    rows = []

    def rec(part, fmt, N, K, M, cfg, us, nbytes):
        r = dict(
            part=part,
            fmt=fmt,
            N=N,
            K=K,
            M=M,
            cfg=cfg,
            us=round(us, 2),
            GBs=round(nbytes / us / 1e3, 1),
            pct_peak=round(100 * nbytes / (us * 1e-6) / PEAK, 1),
        )
        rows.append(r)
        print(json.dumps(r), flush=True)
        return r

    def nbytes_of(args):
        return sum(t.numel() * t.element_size() for t in args[1:] if torch.is_tensor(t))

    # 1. sweeps: compile everything in parallel, then time shape by shape on real (quantized) weights
    jobs = [] if parts == ['none'] else sweep_jobs(parts, sms)
    if jobs:
        jobs = sorted(jobs, key=lambda j: (j['op'], j['N'], j['K'], j['M']))
        bad = C.precompile(
            _compile_worker,
            jobs,
            2 if DRY else min(15, (os.cpu_count() or 2) - 1),
            max(1, T0 + budget * 0.45 - time.time()),
        )
        print(f'{sum(bad)} configs failed to compile', flush=True)
    if '--wait-pid' in sys.argv:  # e.g. the GPU tests, run alongside the compile phase: let them finish first
        pid = int(_arg('--wait-pid', 0))
        while os.path.exists(f'/proc/{pid}') and time.time() - T0 < budget * 0.6:
            time.sleep(0.5)
        print(f'waited for pid {pid} until {time.time() - T0:.0f} s', flush=True)
    best = {}
    groups = {}
    for j in jobs:
        groups.setdefault((j['fmt'], j['N'], j['K'], j['M']), []).append(j)
    for (fmt, N, K, M), js in groups.items():
        if time.time() - T0 > budget * 0.75:
            print('sweep stopped: budget')
            break
        w = torch.randn(N, K, device=dev, dtype=XDT) * 0.02
        if fmt == 'fp8':
            q, s = quantize_fp8_block(w)
            p = (q, s)
            wd = dequantize_fp8_block(q, s)
        elif fmt == 'q4k:packed':
            raw = random_blocks('q4k', N, K, generator=torch.Generator().manual_seed(0)).to(dev)
            pm = GGUFLinear.from_gguf(raw, 'q4k', (N, K)).pack().packed
            p = (pm.qweight, pm.scales, pm.offsets, pm.bits, pm.group)
            wd = dequantize_packed_ref(*p, N, K)
        else:
            m = W4A16Linear.from_float(w, 128, 4, sym=True)
            p = (m.qweight, m.scales, m.offsets, 4, m.group)
            wd = dequantize_packed_ref(*p, N, K)
        del w
        x = torch.randn(M, K, device=dev, dtype=XDT)
        ref = x.float() @ wd.T
        del wd
        nb = nbytes_of((x,) + p)
        ncp = 1 if DRY else max(2, min(16, math.ceil(256e6 / nb)))
        copies = [p] + [tuple(t.clone() if torch.is_tensor(t) else t for t in p) for _ in range(ncp - 1)]
        for j in js:
            if time.time() - T0 > budget * 0.75:
                break
            try:
                y = call(j, (x,) + p)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    print('WRONG', fmt, N, K, M, j['cfg'], err, flush=True)
                    continue
                us = time_fn(lambda i: (x,) + copies[i % ncp], lambda *a: call(j, a), nb)
            except Exception as e:
                print('config failed', fmt, N, K, M, j['cfg'], repr(e)[:300], flush=True)
                continue
            r = rec(j['part'], fmt, N, K, M, j['cfg'], us, nb)
            k = (fmt, N, K, M)
            if k not in best or r['us'] < best[k]['us']:
                best[k] = r
        copies = ref = None
        if not DRY:
            torch.cuda.empty_cache()
    for k, r in best.items():
        print('BEST', json.dumps(r), flush=True)

    # 2. formats with their default configs
    def bench_fmt(fmt, N, K, M=1):
        x = torch.randn(M, K, device=dev, dtype=XDT)
        w = torch.randn(N, K, device=dev, dtype=XDT) * 0.02
        if fmt == 'bf16':
            nb = N * K * 2
            return rec(
                f'M{M}',
                fmt,
                N,
                K,
                M,
                'cublas',
                time_fn(lambda i: (x, w.clone() if i else w), lambda x, w: x @ w.T, nb),
                nb,
            )
        if fmt == 'fp8':
            q, s = quantize_fp8_block(w)
            nb = q.numel() + s.numel() * 4
            y = KF.fp8_matmul(x, q, s, N, K)
            assert ((y.float() - x.float() @ dequantize_fp8_block(q, s).T).norm() / y.float().norm()).item() < 1e-2
            return rec(
                f'M{M}',
                fmt,
                N,
                K,
                M,
                'default',
                time_fn(lambda i: (x, q.clone(), s.clone()), lambda x, q, s: KF.fp8_matmul(x, q, s, N, K), nb),
                nb,
            )
        if fmt == 'w4a16':
            m = W4A16Linear.from_float(w, 128, 4, sym=True)
            p = (m.qweight, m.scales, m.offsets, 4, m.group)
        else:
            t, mode = fmt.split(':')
            if (t, N, K) not in gguf_cache:  # random block bytes with sane scales: the values don't matter for timing
                gguf_cache[(t, N, K)] = random_blocks(t, N, K, generator=torch.Generator().manual_seed(0)).to(dev)
            m = GGUFLinear.from_gguf(gguf_cache[(t, N, K)], t, (N, K))
            if mode == 'raw':
                raw = m.qweight
                nb = raw.numel()
                return rec(
                    f'M{M}',
                    fmt,
                    N,
                    K,
                    M,
                    'gguf-bytes',
                    time_fn(lambda i: (x, raw.clone()), lambda x, r: KG.gguf_matmul(x, r, m.qtype, N, K), nb),
                    nb,
                )
            pm = m.pack().packed
            p = (pm.qweight, pm.scales, pm.offsets, pm.bits, pm.group)
        nb = nbytes_of((x,) + p)
        y = KW.w4a16_matmul(x, *p, N, K)
        assert ((y.float() - x.float() @ dequantize_packed_ref(*p, N, K).T).norm() / y.float().norm()).item() < 1e-2
        return rec(
            f'M{M}',
            fmt,
            N,
            K,
            M,
            'default',
            time_fn(
                lambda i: (x, *[t_.clone() if torch.is_tensor(t_) else t_ for t_ in p]),
                lambda x, qw, s, o, b, g: KW.w4a16_matmul(x, qw, s, o, b, g, N, K),
                nb,
            ),
            nb,
        )

    gguf_cache = {}
    fmts = _arg('--fmts', 'bf16,w4a16,fp8,q4k:packed,q8_0:packed,q4_0:packed,q4k:raw,q6k:raw').split(',')
    per_layer = {}
    for M in (1, 16, 64):
        for fmt in fmts:
            if M > 1 and fmt in ('q4k:raw', 'q6k:raw'):
                continue
            if M == 64 and fmt not in ('bf16', 'w4a16', 'fp8'):
                continue
            for name, (N, K) in L3_8B.items():
                if time.time() - T0 > budget * 0.9:
                    break
                try:
                    r = bench_fmt(fmt, N, K, M)
                except Exception as e:
                    print('failed', fmt, M, name, repr(e)[:300], flush=True)
                    continue
                per_layer[(fmt, M, name)] = r['us']
                if not DRY:
                    torch.cuda.empty_cache()
    lm = {}  # LM head (bf16, never quantized)
    for M in (1, 16, 64):
        if time.time() - T0 > budget * 0.95:
            break
        try:
            lm[M] = bench_fmt('bf16', *LM_HEAD, M)['us']
        except Exception as e:
            print('lm head failed', repr(e)[:200])
    if '--prefill' in sys.argv:
        for fmt in ('w4a16', 'fp8', 'bf16'):
            if time.time() - T0 > budget * 0.95:
                break
            try:
                bench_fmt(fmt, *((448, 128) if DRY else (14336, 4096)), 64 if DRY else 2048)
            except Exception as e:
                print('failed prefill', fmt, repr(e)[:200])
    # 3. decode estimate
    est = []
    for fmt in fmts:
        for M in (1, 16, 64):
            ts = [per_layer.get((fmt, M, n)) for n in L3_8B]
            if None in ts or M not in lm:
                continue
            step_us = 32 * sum(ts) + lm[M]
            e = dict(
                fmt=fmt, batch=M, layer_us=round(sum(ts), 1), step_us=round(step_us, 1), tok_s=round(M * 1e6 / step_us)
            )
            est.append(e)
            print('ESTIMATE', json.dumps(e), flush=True)
    with open(f'{out_dir}/bench_quant.json', 'w') as f:
        json.dump(dict(rows=rows, best=list(best.values()), estimates=est, device=C.device_name()), f, indent=1)
    if rows:
        with open(f'{out_dir}/bench_quant.csv', 'w', newline='') as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f'done in {time.time() - T0:.0f} s', flush=True)


if __name__ == '__main__':
    main()
