"""The M = 1 GEMV with fields taken where they lie (`_field_slot`, 4-bit groups >= 64) against the kernel before it
(a copy of `kernels/w4a16.py` at 19b5906 passed as `OLD=path`), W4A16 g128, Llama-3-8B shapes, with and without
row halves (`rs`), per `maxnreg` cap:
correctness (bf16 x, fp32 out, against the fp32 reference), then microseconds over rotating weight copies in a CUDA
graph. `OUT=dir OLD=path python tests/bench_gemv_slot.py` writes OUT/gemv_slot.csv and prints the best cap per
shape; `results/h200_gemv_slot_sweep.csv` holds the H200 run."""
import os, sys
sys.path.insert(0, 'tests')
import pandas as pd
import torch
from bench_quant import L3_8B as SHAPES, gemv_case, kernel_copy, time_fn
from cvllm_lab.kernels import w4a16 as KW

# (rs, tpi, maxnreg) per shape; rs: row halves (`_gemv_tile_rs`, tpi 1 only)
VARIANTS = {'qkv': [(False, 2, None), (False, 2, 168), (True, 1, 72), (True, 1, 80), (True, 1, 96)],
            'o': [(False, 1, 64), (True, 1, 64), (True, 1, 72), (True, 1, 80)],
            'gate_up': [(False, 1, 96), (True, 1, 72), (True, 1, 80), (True, 1, 88), (True, 1, 96)],
            'down': [(False, 1, 96), (True, 1, 72), (True, 1, 80), (True, 1, 88), (True, 1, 96)]}
OUT = os.environ.get('OUT', '/tmp')
OLD = kernel_copy(os.environ['OLD'])
torch.manual_seed(0)
rows = []
for name, (N, K) in SHAPES.items():
    p, x, r, nb, args, act = gemv_case(name, N, K)
    cfg = OLD.GEMV_CONFIGS[(N, K, 4)]
    runs = [('before', OLD, dict(maxnreg=cfg.get('maxnreg')))] + [
        ('slot', KW, dict(rs=rs, tpi=tpi, bn=128, nh=2, split_k=cfg['split'], prefetch=cfg['pf'], maxnreg=reg))
        for rs, tpi, reg in VARIANTS[name]]
    for kernel, mod, kw in runs:
        y = mod.w4a16_gemv(x, *p, 4, 128, N, K, out_dtype=torch.float32, **kw)
        err = ((y - r).norm() / r.norm()).item()
        assert err < 5e-5, (name, kernel, kw, err)
        us = time_fn(args, lambda x, q, s, o: mod.w4a16_gemv(x, q, s, o, 4, 128, N, K, act=act, **kw), nb)
        rows.append(dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get('CVLLM_LAB_COMMIT', ''),
                         shape=name, N=N, K=K, kernel=kernel, rs=kw.get('rs'), tpi=kw.get('tpi', cfg['tpi']),
                         maxnreg=kw['maxnreg'], us=round(us, 2), rel_err=err))
        print(rows[-1], flush=True)
df = pd.DataFrame(rows)
df.to_csv(f'{OUT}/gemv_slot.csv', index=False)
best = df[df.kernel == 'slot'].loc[lambda d: d.groupby('shape').us.idxmin()]
print(best[['shape', 'rs', 'tpi', 'maxnreg', 'us']].to_string())
print('layer before %.2f us, slot (best caps) %.2f us' % (df[df.kernel == 'before'].us.sum(), best.us.sum()))
