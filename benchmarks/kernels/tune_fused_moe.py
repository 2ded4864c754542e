"""Tune the fused MoE kernel's launch configs per token bucket on a GPU and write them as data.

    python -m benchmarks.kernels.tune_fused_moe [--ms 1,2,4,...,4096] [--shape E,H,I,K] [--budget SECONDS]
        [--limit N] [--workers N] [--out DIR] [--write] [--dry]

The shape defaults to Qwen3-30B-A3B's experts: E = 128 experts, hidden H = 2048, moe_intermediate I = 768, top-K
= 8, bf16. For every token count M of `--ms` (each stands for its bucket, `fused_moe.m_bucket`; default the twelve
buckets 1 ... 4096) the candidates are a grid over BLOCK_M x BLOCK_N x BLOCK_K x GROUP_M x num_warps x
num_stages, pruned by how many assignments an expert gets (`M * K / E`: tall tiles only where experts have rows
to fill them, GROUP_M > 1 only where there are several M-blocks per expert). Routing is random (softmax top-K of
random logits), as in a dummy-weight benchmark. Each candidate runs the whole `fused_moe` (alignment, both grouped
GEMMs, SiLU-and-mul, the per-token sum), is checked against the loop-over-experts reference (max relative error
< 3e-2), and is timed in a CUDA graph over rotating copies of the expert weights (each call reads its experts
from HBM, `common.graph_time`). Candidates are compiled first by parallel workers. `--budget` (seconds, default
600) stops the timing loop; buckets not reached keep their config.

Written to `--out` (default `.`): `tune_fused_moe.csv` (every timing) and `<device>.json` holding the `default`
table (bucket -> fastest config) and `shapes` rows `E,H,I,K,bucket` for this shape; `--write` writes it into
`kernels/configs/fused_moe/` (the file `kernels/tuned.py` loads for this GPU). Printed: per bucket, microseconds
of the current and the best config, and the expert weight bandwidth the best one reaches. `--dry`: a small
shape, buckets 1 and 16, two candidates each, on the CPU under the Triton interpreter (a check of the script, not
a measurement).
"""
from benchmarks.kernels import common as C   # first: `--dry` sets TRITON_INTERPRET before the kernels load

import csv
import itertools
import os
import sys
import time

import torch
import triton

from cvllm_lab.kernels import tuned
from cvllm_lab.kernels import fused_moe as fm

KERNEL = 'fused_moe'
SHAPE = (16, 128, 64, 4) if C.DRY else (128, 2048, 768, 8)     # E, H, I, top-K
KEYS = ('BLOCK_M', 'BLOCK_N', 'BLOCK_K', 'GROUP_M', 'num_warps', 'num_stages')


def candidates(M, E, K):
    "Configs to time for M tokens: the grid pruned by the assignments per expert."
    per_expert = M * K / E
    bms = [16] if per_expert <= 16 else [16, 32, 64] if per_expert <= 64 else [32, 64, 128]
    groups = [1] if per_expert <= 2 * max(bms) else [1, 16, 32]
    out = []
    for bm, bn, bk, g, nw, ns in itertools.product(bms, (32, 64, 128, 256), (64, 128, 256), groups, (4, 8), (2, 3, 4, 5)):
        if bm * bn >= 128 * 128 and nw == 4 or bm * bn <= 32 * 64 and nw == 8: continue
        if bk == 256 and ns > 3: continue                       # shared memory
        out.append(dict(zip(KEYS, (bm, bn, bk, g, nw, ns))))
    return out


def problem(M, E, H, I, K, copies, device=None, dtype=None):
    "x, routing and `copies` sets of expert weights (random, O(1) outputs) for M tokens."
    device, dtype = device or C.DEVICE, dtype or C.XDT
    g = torch.Generator(device='cpu').manual_seed(M)
    x = torch.randn(M, H, generator=g).to(device, dtype)
    tw, ids = fm.select_experts(torch.randn(M, E, generator=g).to(device), K, True)
    ws = [((torch.randn(E, 2 * I, H, device=device, dtype=dtype) * H ** -0.5),
           (torch.randn(E, H, I, device=device, dtype=dtype) * I ** -0.5)) for _ in range(copies)]
    return x, tw, ids, ws


def _compile_worker(jobs):
    "Run each (shape, M, config) once: compiles the Triton variants into the disk cache."
    bad, cache = 0, {}
    for (E, H, I, K), M, cfg in jobs:
        try:
            if M not in cache: cache = {M: problem(M, E, H, I, K, 1)}
            x, tw, ids, ws = cache[M]
            fm.fused_moe(x, *ws[0], tw, ids, config=cfg)
        except Exception as e:
            bad += 1
            print('compile failed', M, cfg, repr(e)[:200], flush=True)
    return bad


def main():
    out_dir = C.arg('--out', '.')
    os.makedirs(out_dir, exist_ok=True)
    E, H, I, K = shape = tuple(int(v) for v in C.arg('--shape', ','.join(map(str, SHAPE))).split(','))
    ms = [int(m) for m in C.arg('--ms', '1,16' if C.DRY else ','.join(map(str, fm.M_BUCKETS))).split(',')]
    limit = int(C.arg('--limit', 2 if C.DRY else 0)) or None
    budget = float(C.arg('--budget', 600))
    dev_key = 'dry' if C.DRY else tuned.device_key(C.device_name())
    print(C.device_name(), torch.__version__, 'triton', triton.__version__, 'shape E,H,I,K =', shape, flush=True)
    plan = [(M, fm.get_config(M, E, H, I, K, C.DEVICE)) for M in ms]
    plan = [(M, cur, [c for c in candidates(M, E, K) if c != cur][:limit]) for M, cur in plan]
    if not C.DRY:
        jobs = [(shape, M, c) for M, cur, cs in plan for c in [cur] + cs]
        C.precompile(_compile_worker, jobs, int(C.arg('--workers', min(12, (os.cpu_count() or 2) - 1))), timeout=budget)
    wbytes = E * 3 * H * I * torch.finfo(C.XDT).bits // 8
    rows, best_per_bucket, t0 = [], {}, time.time()
    for M, cur, cs in plan:
        if time.time() - t0 > budget: print(f'budget spent: bucket {M} and later keep their configs'); break
        x, tw, ids, ws = problem(M, E, H, I, K, 1 if C.DRY else C.copies_for(wbytes))
        ref = fm.fused_moe_ref(x, *ws[0], tw, ids).float()
        timed = []
        for cfg in [cur] + cs:
            try:
                y = fm.fused_moe(x, *ws[0], tw, ids, config=cfg).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                if err > 3e-2: print('wrong result', M, cfg, f'{err:.2e}'); continue
                if C.DRY:
                    t = time.time(); fm.fused_moe(x, *ws[0], tw, ids, config=cfg); us = (time.time() - t) * 1e6
                else:
                    us = C.graph_time(lambda i: fm.fused_moe(x, *ws[i], tw, ids, config=cfg), len(ws)) * 1e6
            except Exception as e:   # out of shared memory / registers
                print('failed', M, cfg, repr(e)[:160]); continue
            timed.append((us, cfg))
            rows.append(dict(device=dev_key, E=E, H=H, I=I, K=K, M=M, bucket=fm.m_bucket(M), us=round(us, 2),
                             current=cfg == cur, **cfg))
        if not timed: continue
        us_best, best = min(timed, key=lambda t: t[0])
        us_cur = next((u for u, c in timed if c == cur), float('nan'))
        used = min(E, M * K)   # experts a step reads (at most)
        gbs = used / E * wbytes / (us_best * 1e-6) / 1e9
        print(f'M={M:5d}  current {us_cur:9.1f} us  best {us_best:9.1f} us  ({gbs:7.0f} GB/s of expert weights)  {best}',
              flush=True)
        best_per_bucket[fm.m_bucket(M)] = best if us_best < 0.99 * us_cur else cur
    with open(os.path.join(out_dir, 'tune_fused_moe.csv'), 'w', newline='') as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader(); w.writerows(rows)
    tables = tuned.load_configs(KERNEL, dev_key)
    table = {'default': {**tables['default'], **best_per_bucket},
             'shapes': {**tables.get('shapes', {}), **{(E, H, I, K, b): c for b, c in best_per_bucket.items()}}}
    text = tuned.dump_configs(table)
    target = tuned.CONFIG_DIR / KERNEL if '--write' in sys.argv and not C.DRY else out_dir
    with open(os.path.join(target, f'{dev_key}.json'), 'w') as f: f.write(text)
    print('wrote', os.path.join(target, f'{dev_key}.json'))


if __name__ == '__main__':
    main()
