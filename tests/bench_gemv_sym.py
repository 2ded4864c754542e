"""Re-tune of the M = 1 GEMV's configs for symmetric 4-bit layers (`sym=True`, which read no offsets and need fewer
registers), W4A16 g128, Llama-3-8B shapes: the current config without and with `sym`, then `sym` variants of row
halves (`rs`), words per iteration (`tpi`), register cap (`maxnreg`) and split-K. Correctness first (bf16 x, fp32
out, against the fp32 reference), then microseconds over rotating weight copies in a CUDA graph.
`OUT=dir [OLD=path] python tests/bench_gemv_sym.py` writes OUT/gemv_sym.csv and prints the best variant per shape
(OLD: a copy of `kernels/w4a16.py` to time first, `before`, at its own config with `sym`);
`results/h200_gemv_sym_sweep.csv` holds the H200 run."""
import os, sys
sys.path.insert(0, 'tests')
import pandas as pd
import torch
from bench_quant import L3_8B as SHAPES, gemv_case, kernel_copy, time_fn
from cvllm_lab.kernels import w4a16 as KW

# per shape: (rs, tpi, maxnreg, split) overrides of the current config
VARIANTS = {'qkv': [(False, 2, 128, 8), (True, 1, 80, 8), (True, 1, 80, 4), (False, 2, 168, 4)],
            'o': [(True, 1, 80, 32), (False, 1, 72, 32), (True, 1, 80, 16), (False, 1, 64, 16)],
            'gate_up': [(True, 1, 80, 4), (True, 1, 88, 4), (True, 1, 80, 8), (True, 1, 80, 2)],
            'down': [(True, 1, 80, 28), (True, 1, 96, 28), (True, 1, 80, 14), (True, 1, 96, 14)]}
OUT = os.environ.get('OUT', '/tmp')
OLD = kernel_copy(os.environ['OLD']) if os.environ.get('OLD') else None
torch.manual_seed(0)
rows = []
for name, (N, K) in SHAPES.items():
    p, x, r, nb, args, act = gemv_case(name, N, K)
    cfg = KW.GEMV_CONFIGS[(N, K, 4)]
    cur = dict(rs=cfg.get('rs', True) if cfg['tpi'] == 1 else False, tpi=cfg['tpi'], maxnreg=cfg.get('maxnreg'),
               split=cfg['split'])
    runs = [('before', OLD, True, cur)] * bool(OLD) + [('current', KW, False, cur), ('current', KW, True, cur)] + [
        ('variant', KW, True, dict(rs=rs, tpi=tpi, maxnreg=reg, split=split)) for rs, tpi, reg, split in VARIANTS[name]]
    for kernel, mod, sym, v in runs:
        kw = dict(rs=v['rs'], tpi=v['tpi'], bn=128, nh=2, split_k=v['split'], prefetch=cfg['pf'], maxnreg=v['maxnreg'],
                  sym=sym)
        y = mod.w4a16_gemv(x, *p, 4, 128, N, K, out_dtype=torch.float32, **kw)
        err = ((y - r).norm() / r.norm()).item()
        assert err < 5e-5, (name, kernel, kw, err)
        us = time_fn(args, lambda x, q, s, o: mod.w4a16_gemv(x, q, s, o, 4, 128, N, K, act=act, **kw), nb)
        rows.append(dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get('CVLLM_LAB_COMMIT', ''), shape=name,
                         N=N, K=K, kernel=kernel, sym=sym, **v, us=round(us, 2), rel_err=err))
        print(rows[-1], flush=True)
df = pd.DataFrame(rows)
df.to_csv(f'{OUT}/gemv_sym.csv', index=False)
best = df[df.sym & (df.kernel != 'before')].loc[lambda d: d.groupby('shape').us.idxmin()]
print(best[['shape', 'kernel', 'rs', 'tpi', 'maxnreg', 'split', 'us']].to_string())
cur = df[(df.kernel == 'current')]
print('layer: before (sym) %.2f us, current %.2f us, current sym %.2f us, best sym %.2f us' % (
    df[df.kernel == 'before'].us.sum(), cur[~cur.sym].us.sum(), cur[cur.sym].us.sum(), best.us.sum()))
