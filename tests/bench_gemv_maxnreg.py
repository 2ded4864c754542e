"""Register caps (`maxnreg`) for the M = 1 GEMV on a GPU, W4A16 g128 and g32, Llama-3-8B shapes: correctness, then
times per cap. `OUT=dir python tests/bench_gemv_maxnreg.py` writes OUT/reg_sweep2.json (`results/h200_gemv_maxnreg_sweep.csv`
holds the H200 runs behind the `maxnreg` entries of `GEMV_CONFIGS`)."""
import json, os, sys, runpy, subprocess
sys.path.insert(0, 'tests')
import torch
from bench_quant import L3_8B as SHAPES, gemv_case, time_fn
from cvllm_lab.kernels import w4a16 as KW
REGS = {'qkv': (None, 144, 152, 160, 176, 192), 'o': (None, 56, 60, 64, 68, 72, 80), 'gate_up': (None, 80, 88, 96, 104, 112),
        'down': (None, 80, 88, 96, 104, 112)}
OUT = os.environ.get('OUT', '/tmp')
torch.manual_seed(0)
rows, best = [], {}
for g, sym in ((128, True), (32, False)):
    for name, (N, K) in SHAPES.items():
        p, x, r, nb, args, act = gemv_case(name, N, K, g, sym)
        for reg in REGS[name] + ((48, 56, 64, 72, 96, 128) if g == 32 else ()):
            y = KW.w4a16_gemv(x, *p, 4, g, N, K, maxnreg=reg, out_dtype=torch.float32)
            assert ((y - r).norm() / r.norm()).item() < 1e-5, (name, reg)
            us = time_fn(args, lambda x, q, s, o: KW.w4a16_gemv(x, q, s, o, 4, g, N, K, act=act, maxnreg=reg), nb)
            rows.append(dict(group=g, shape=name, maxnreg=reg, us=us))
            if (g, name) not in best or us < best[(g, name)][0] - 0.05: best[(g, name)] = (us, reg)
        print(g, name, [(r_['maxnreg'], round(r_['us'], 2)) for r_ in rows if r_['group'] == g and r_['shape'] == name], flush=True)
json.dump(rows, open(f'{OUT}/reg_sweep2.json', 'w'))
print('best', best, flush=True)
for g in (128, 32):
    print(g, 'layer default %.2f best %.2f' % (sum(r_['us'] for r_ in rows if r_['group'] == g and r_['maxnreg'] is None),
                                              sum(best[(g, n)][0] for n in SHAPES)), flush=True)
