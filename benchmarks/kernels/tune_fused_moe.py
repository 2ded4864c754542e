"""Tune the fused MoE kernels' launch configs per token bucket on a GPU and write them as data.

    python -m benchmarks.kernels.tune_fused_moe [--ms 1,2,4,...] [--shape E,H,I,K] [--budget SECONDS]
        [--limit N] [--workers N] [--out DIR] [--write] [--dry]

The shape defaults to Qwen3-30B-A3B's experts: E = 128 experts, hidden H = 2048, moe_intermediate I = 768, top-K
= 8, bf16. `--ms` lists token counts M in the order they are tuned (each stands for its bucket,
`fused_moe.m_bucket`; default: the sweep's decode and prefill buckets first, then the rest). Per M:

- *grouped GEMMs*: a grid over BLOCK_M x BLOCK_N x BLOCK_K x GROUP_M x num_warps x num_stages x ACT (SiLU-and-mul
  in the first GEMM's epilogue) x SWAP (weights as the MMA's M side), pruned by how many assignments an expert gets
  (`M * K / E`: tall tiles only where experts have rows to fill them, SWAP only where they have few, GROUP_M > 1
  only where there are several M-blocks per expert) and by shared memory and accumulator registers;
- where experts get >= 32 rows (prefill buckets), two more stages, each compiled in parallel just before it runs:
  *layout* (the best 3 grouped configs with each combination of `SORTED` (intermediate in expert order), `XSORT`
  (x permuted into expert order before the first GEMM) and `ATOMIC` (top-k sum by fp32 atomics)), *persistent*
  (the best with `PERSISTENT` 1 / 2 (flattened) x `CTAS_PER_SM` 1 / 2), then *down* (the best so far with launch
  2's own BLOCK_N x BLOCK_K x GROUP_M x num_warps x num_stages, the `down` entry);
- *decode path* (`fused_moe_decode`, where `M * K <= 128`): launch 1's sizes (BN1, BK1, W1) with launch 2 at its
  default, then launch 2's (BN2, BK2, W2, SPLIT2) with launch 1 at its best.

Routing is random (softmax top-K of random logits), as in a dummy-weight benchmark. Each candidate runs the whole
`fused_moe` (alignment, both GEMMs, activation, the per-token sum; or the two GEMVs), is checked against the
loop-over-experts reference (max relative error < 3e-2), and is timed in a CUDA graph over rotating copies of the
expert weights (each call reads its experts from HBM, `common.graph_time`). Grouped candidates are compiled first
by parallel workers. `--budget` (seconds, default 300) bounds the whole run (compilation gets at most half; a bucket under way
stops at 1.2 x the budget with the best of what it timed); buckets not reached keep their config.

Written to `--out` (default `.`) after every bucket, so a run cut short keeps what it finished:
`tune_fused_moe.csv` (every timing) and `<device>.json`, holding the `default` table (bucket -> fastest config; a
`decode` entry where the decode path won) and `shapes` rows `E,H,I,K,bucket` for this shape; `--write` writes it
into `kernels/configs/fused_moe/` (the file `kernels/tuned.py` loads for this GPU). Printed: per bucket,
microseconds of the current config, the best grouped and the best decode candidates, and the bandwidth of the
winner over the expert weights the routing selects; from M = 1024 on, the winner's GPU time per kernel (the grouped
GEMMs against alignment, activation, permutation and the top-k sum). `--dry`: a small shape, buckets 1 and 16, two candidates of
each kind, on the CPU under the Triton interpreter (a check of the script, not a measurement).
"""

from benchmarks.kernels import common as C  # first: `--dry` sets TRITON_INTERPRET before the kernels load

import csv
import itertools
import os
import sys
import time

import torch
import triton

from cvllm_lab.kernels import tuned
from cvllm_lab.kernels import fused_moe as fm
from cvllm_lab.kernels.fused_moe_decode import DECODE_DEFAULT

KERNEL = 'fused_moe'
SHAPE = (16, 128, 64, 4) if C.DRY else (128, 2048, 768, 8)  # E, H, I, top-K
LAYOUT = ('SORTED', 'XSORT', 'ATOMIC')
KEYS = (
    ('BLOCK_M', 'BLOCK_N', 'BLOCK_K', 'GROUP_M', 'num_warps', 'num_stages', 'ACT', 'SWAP')
    + LAYOUT
    + ('PERSISTENT', 'CTAS_PER_SM')
)
FLAGS = ('ACT', 'SWAP', 'PERSISTENT') + LAYOUT  # stored only when on
MS = (1, 2, 4, 64, 256, 8192, 16, 512, 4096, 128, 32, 8, 1024)  # the decode path's and the sweep's first
DECODE_MAX_ASSIGNMENTS = 128
LAYOUT_MIN_PER_EXPERT = 0 if C.DRY else 32  # rows per expert from which layouts and the down tile are tuned
LAYOUTS = [dict(zip(LAYOUT, v)) for v in itertools.product((0, 1), repeat=3) if any(v)]
BREAKDOWN_MIN = 1024  # buckets whose winner is profiled kernel by kernel
LAYOUT_TOP = 3  # stage-1 winners tried with each layout
SMEM = 220 * 1024


def candidates(M, E, K):
    "Grouped-GEMM configs to time for M tokens: the grid pruned by the assignments per expert and by resources."
    per_expert = M * K / E
    bms = [16] if per_expert <= 8 else [16, 32] if per_expert <= 32 else [32, 64] if per_expert <= 128 else [64, 128]
    groups = [1] if per_expert <= min(bms) else [1, 8] if per_expert <= 128 else [1, 8, 16]
    out = []
    for bm, bn, bk, g, ns, act, swap in itertools.product(
        bms, (32, 64, 128, 256), (32, 64, 128, 256), groups, (2, 3, 4), (0, 1), (0, 1)
    ):
        small = bm <= 32
        if swap and not small or (bn == 256 or bk == 32) and small or (bn == 32 or bk == 256) and not small:
            continue
        if ns == 2 and bk < 256:
            continue
        nw = 4 if bm * bn * (1 + act) <= 64 * 128 else 8
        if (bm * bk + bn * bk * (1 + act)) * 2 * ns > SMEM:
            continue  # bf16 tiles per stage
        if bm * bn * (1 + act) // (nw * 32) > 128:
            continue  # fp32 accumulators per thread
        out.append(dict(zip(KEYS, (bm, bn, bk, g, nw, ns, act, swap)), decode=None))
    return out


def layout_stage(top):
    "Stage 2 (many rows per expert): the best stage-1 configs with the intermediate and/or x in expert order."
    return [{**{k: v for k, v in c.items() if k != 'down'}, **l} for c in top for l in LAYOUTS]


def down_stage(best):
    "Stage 3: launch 2's own tile (N = H, K = I: the other way round from launch 1), launch 1 at its best."
    best = {k: v for k, v in best.items() if k != 'down'}
    bm, out = best['BLOCK_M'], []
    for bn, bk, g, nw, ns in itertools.product((64, 128, 256), (32, 64, 128), (1, 8), (4, 8), (3, 4)):
        if (bm * bk + bn * bk) * 2 * ns > SMEM or bm * bn // (nw * 32) > 128:
            continue
        if nw == 8 and bm * bn < 64 * 128 or nw == 4 and bm * bn > 128 * 128:
            continue
        down = dict(BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=nw, num_stages=ns)
        if any(best[k] != v for k, v in down.items()):
            out.append({**best, 'down': down})
    return out


def decode_stage1():
    "Launch 1 (gate/up GEMV with SiLU-and-mul) sizes, launch 2 at its default."
    return [
        {**DECODE_DEFAULT, 'BN1': bn, 'BK1': bk, 'W1': w}
        for bn, bk, w in itertools.product((4, 8, 16, 32), (128, 256, 512), (2, 4, 8))
        if bn * bk // (w * 32) <= 64
    ]


def decode_stage2(best1):
    "Launch 2 (down GEMV with the weighted top-k sum) sizes, launch 1 at its best."
    return [
        {**best1, 'BN2': bn, 'BK2': bk, 'W2': w, 'SPLIT2': s}
        for bn, bk, w, s in itertools.product((4, 8, 16, 32), (128, 256), (2, 4, 8), (1, 2, 4, 8))
        if bn * bk // (w * 32) <= 64
    ]


def problem(M, E, H, I, K, copies, device=None, dtype=None):
    "x, routing and `copies` sets of expert weights (random, O(1) outputs) for M tokens."
    device, dtype = device or C.DEVICE, dtype or C.XDT
    g = torch.Generator(device='cpu').manual_seed(M)
    x = torch.randn(M, H, generator=g).to(device, dtype)
    tw, ids = fm.select_experts(torch.randn(M, E, generator=g).to(device), K, True)
    ws = [
        (
            (torch.randn(E, 2 * I, H, device=device, dtype=dtype) * H**-0.5),
            (torch.randn(E, H, I, device=device, dtype=dtype) * I**-0.5),
        )
        for _ in range(copies)
    ]
    return x, tw, ids, ws


def _compile_worker(jobs):
    "Run each (shape, M, config) once: compiles the Triton variants into the disk cache."
    bad, cache = 0, {}
    for (E, H, I, K), M, cfg in jobs:
        try:
            if M not in cache:
                cache = {M: problem(M, E, H, I, K, 1)}
            x, tw, ids, ws = cache[M]
            fm.fused_moe(x, *ws[0], tw, ids, config=cfg)
        except Exception as e:
            bad += 1
            print('compile failed', M, cfg, repr(e)[:200], flush=True)
    return bad


def _row(cfg):
    "A config as stored: grouped keys (ACT/SWAP only when on), plus `decode` where the decode path runs."
    row = {k: v for k, v in cfg.items() if k not in ('decode', 'down') and not (k in FLAGS and not v)}
    if cfg.get('down'):
        row['down'] = dict(cfg['down'])
    if cfg.get('decode'):
        row['decode'] = dict(cfg['decode'])
    return row


def main():
    out_dir = C.arg('--out', '.')
    os.makedirs(out_dir, exist_ok=True)
    E, H, I, K = shape = tuple(int(v) for v in C.arg('--shape', ','.join(map(str, SHAPE))).split(','))
    ms = [int(m) for m in C.arg('--ms', '1,16' if C.DRY else ','.join(map(str, MS))).split(',')]
    limit = int(C.arg('--limit', 2 if C.DRY else 0)) or None
    budget = float(C.arg('--budget', 300))
    t0 = time.time()
    dev_key = 'dry' if C.DRY else tuned.device_key(C.device_name())
    print(C.device_name(), torch.__version__, 'triton', triton.__version__, 'shape E,H,I,K =', shape, flush=True)
    workers = int(C.arg('--workers', min(12, (os.cpu_count() or 2) - 1)))
    plan = [(M, fm.get_config(M, E, H, I, K, C.DEVICE)) for M in ms]
    plan = [(M, cur, [c for c in candidates(M, E, K) if c != cur][:limit]) for M, cur in plan]
    if not C.DRY:
        jobs = [(shape, M, c) for M, cur, cs in plan for c in [cur] + cs]
        jobs += [
            (shape, M, {'decode': d})
            for M, _, _ in plan
            if M * K <= DECODE_MAX_ASSIGNMENTS
            for d in decode_stage1() + decode_stage2(DECODE_DEFAULT)
        ]  # launch 2 compiles on its own
        C.precompile(_compile_worker, jobs, workers, timeout=budget / 2)
    wbytes = E * 3 * H * I * torch.finfo(C.XDT).bits // 8
    rows, best_per_bucket = [], {}
    for M, cur, cs in plan:
        if time.time() - t0 > budget:
            print(f'budget spent: bucket {M} and later keep their configs')
            break
        x, tw, ids, ws = problem(M, E, H, I, K, 1 if C.DRY else C.copies_for(wbytes))
        ref = fm.fused_moe_ref(x, *ws[0], tw, ids).float()

        def timed(cfgs, kind):
            "(us, cfg) of each config that gives the reference's result."
            res = []
            for cfg in cfgs:
                if time.time() - t0 > budget * 1.2:
                    print(f'budget spent inside bucket {M}')
                    break
                try:
                    y = fm.fused_moe(x, *ws[0], tw, ids, config=cfg).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    if err > 3e-2:
                        print('wrong result', M, cfg, f'{err:.2e}')
                        continue
                    if C.DRY:
                        t = time.time()
                        fm.fused_moe(x, *ws[0], tw, ids, config=cfg)
                        us = (time.time() - t) * 1e6
                    else:
                        us = C.graph_time(lambda i: fm.fused_moe(x, *ws[i], tw, ids, config=cfg), len(ws)) * 1e6
                except Exception as e:  # out of shared memory / registers
                    print('failed', M, cfg, repr(e)[:160])
                    continue
                res.append((us, cfg))
                rows.append(
                    dict(
                        device=dev_key,
                        E=E,
                        H=H,
                        I=I,
                        K=K,
                        M=M,
                        bucket=fm.m_bucket(M),
                        kind=kind,
                        us=round(us, 2),
                        **{k: cfg.get(k) for k in KEYS},
                        down=cfg.get('down'),
                        decode=cfg.get('decode'),
                    )
                )
            return res

        t_cur = timed([cur], 'current')
        t_grp = timed(cs, 'grouped')
        if M * K / E >= LAYOUT_MIN_PER_EXPERT and t_grp + t_cur:
            top = [c for _, c in sorted(t_grp + t_cur, key=lambda t: t[0])[:LAYOUT_TOP]]
            seen = {repr(sorted(_row(c).items())) for _, c in t_grp + t_cur}
            stage2 = [c for c in layout_stage(top) if repr(sorted(_row(c).items())) not in seen][:limit]
            if not C.DRY:
                C.precompile(_compile_worker, [(shape, M, c) for c in stage2], workers)
            t_grp += timed(stage2, 'layout')
            best = {k: v for k, v in min(t_grp + t_cur, key=lambda t: t[0])[1].items() if k != 'down'}
            stage2b = [{**best, 'PERSISTENT': p, 'CTAS_PER_SM': c} for p in (1, 2) for c in (1, 2)][:limit]
            if not C.DRY:
                C.precompile(_compile_worker, [(shape, M, c) for c in stage2b], workers)
            t_grp += timed(stage2b, 'persistent')
            stage3 = down_stage(min(t_grp + t_cur, key=lambda t: t[0])[1])[:limit]
            if not C.DRY:
                C.precompile(_compile_worker, [(shape, M, c) for c in stage3], workers)
            t_grp += timed(stage3, 'down')
        t_dec = []
        if M * K <= DECODE_MAX_ASSIGNMENTS:
            s1 = timed([{'decode': d} for d in decode_stage1()[:limit]], 'decode')
            if s1:
                best1 = min(s1, key=lambda t: t[0])[1]['decode']
                t_dec = s1 + timed([{'decode': d} for d in decode_stage2(best1)[:limit]], 'decode')
        if not (t_cur or t_grp or t_dec):
            continue
        us_cur = t_cur[0][0] if t_cur else float('inf')
        us_grp, grp = min(t_grp + t_cur, key=lambda t: t[0])
        us_dec, dec = min(t_dec, key=lambda t: t[0]) if t_dec else (float('inf'), None)
        best = {**grp, 'decode': dec['decode']} if us_dec < us_grp else grp
        us_best = min(us_dec, us_grp)
        selected = ids.unique().numel()  # experts this routing reads
        gbs = selected / E * wbytes / (us_best * 1e-6) / 1e9
        print(
            f'M={M:5d}  current {us_cur:8.1f} us  grouped {us_grp:8.1f} us  decode {us_dec:8.1f} us  '
            f'({gbs:6.0f} GB/s of the {selected} selected experts)  {_row(best)}',
            flush=True,
        )
        if us_best < 0.99 * us_cur or not t_cur:
            best_per_bucket[fm.m_bucket(M)] = _row(best)
        if M >= BREAKDOWN_MIN and not C.DRY:
            breakdown(lambda: fm.fused_moe(x, *ws[0], tw, ids, config=best))
        _write(out_dir, dev_key, shape, best_per_bucket, rows)


def breakdown(fn, reps=5):
    "GPU microseconds per kernel of one call of `fn` (the mean over `reps` profiled calls), printed largest first."
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    agg = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name[:60]] = agg.get(e.name[:60], 0) + e.device_time
    print(
        '   per kernel: ' + ', '.join(f'{n} {us / reps:.1f} us' for n, us in sorted(agg.items(), key=lambda t: -t[1])),
        flush=True,
    )


def _write(out_dir, dev_key, shape, best_per_bucket, rows):
    "The timings CSV and the device's config file with the buckets tuned so far."
    with open(os.path.join(out_dir, 'tune_fused_moe.csv'), 'w', newline='') as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    tables = tuned.load_configs(KERNEL, dev_key)
    table = {
        'default': {**tables['default'], **best_per_bucket},
        'shapes': {**tables.get('shapes', {}), **{shape + (b,): c for b, c in best_per_bucket.items()}},
    }
    target = tuned.CONFIG_DIR / KERNEL if '--write' in sys.argv and not C.DRY else out_dir
    with open(os.path.join(target, f'{dev_key}.json'), 'w') as f:
        f.write(tuned.dump_configs(table))
    print('wrote', os.path.join(target, f'{dev_key}.json'), flush=True)


if __name__ == '__main__':
    main()
