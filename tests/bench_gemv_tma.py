"""The TMA-pipelined GEMV prototype (`gemv_tma_proto.py`) against the default GEMV on a GPU: correctness, then a sweep
(block N x column tiles x stages x split-K). `OUT=dir python tests/bench_gemv_tma.py`; `results/h200_gemv_tma_sweep.csv`
holds the H200 run (slower on every shape: not used by the library)."""
import itertools, json, os, sys, time
sys.path.insert(0, 'tests')
import torch
from bench_quant import L3_8B as SHAPES, gemv_case, time_fn
from cvllm_lab.kernels import w4a16 as KW
from cvllm_lab.quant.w4a16 import W4A16Linear
from gemv_tma_proto import gemv_tma
OUT = os.environ.get('OUT', '/tmp')
def cfgs(N, K):
    out = []
    for bn, nh, ns, nw in itertools.product((64, 128, 256), (1, 2), (2, 3, 4), (4,)):
        if bn // nh < 32: continue
        for tg in (2, 4, 8):
            sk = KW._pick_split(K // 128, -(-int(tg * 132) // (N // bn)), 1)
            c = dict(bn=bn, nh=nh, ns=ns, nw=nw, sk=sk)
            if c not in out: out.append(c)
    return out

def warm(jobs):
    for name, c in jobs:
        N, K = SHAPES[name]
        m = W4A16Linear.from_float(torch.randn(N, K, device='cuda') * 0.02, 128, 4, sym=True)
        x = torch.randn(1, K, device='cuda', dtype=torch.bfloat16)
        try: gemv_tma(x, m.qweight, m.scales, m.offsets, N, K, bn=c['bn'], nh=c['nh'], split_k=c['sk'], ns=c['ns'], num_warps=c['nw'], act='silu_and_mul' if name == 'gate_up' else None)
        except Exception as e: print('warm fail', name, c, repr(e)[:300], flush=True)
    torch.cuda.synchronize()

def main():
    import multiprocessing as mp
    jobs = [(n, c) for n in SHAPES for c in cfgs(*SHAPES[n])]
    t0 = time.time()
    with mp.get_context('spawn').Pool(14) as pool: pool.map(warm, [jobs[i::14] for i in range(14)])
    print(f'precompiled {len(jobs)} in {time.time() - t0:.0f}s', flush=True)
    torch.manual_seed(0)
    rows, tot = [], {'default': 0, 'tma_best': 0}
    for name, (N, K) in SHAPES.items():
        p, x, r, nb, args, act = gemv_case(name, N, K)
        base = time_fn(args, lambda x, q, s, o: KW.w4a16_gemv(x, q, s, o, 4, 128, N, K, act=act, ), nb)
        best = (base, 'default')
        tiles = K // 128
        sms = 132
        for c in cfgs(N, K):
                bn, nh, ns, nw, sk = c['bn'], c['nh'], c['ns'], c['nw'], c['sk']
                try:
                    y = gemv_tma(x, *p, N, K, bn=bn, nh=nh, split_k=sk, ns=ns, num_warps=nw)
                except Exception as e:
                    print('fail', name, bn, nh, ns, nw, sk, repr(e)[:200], flush=True); continue
                err = ((y.float() - r).norm() / r.norm()).item()
                if err > 5e-3: print('WRONG', name, bn, nh, ns, nw, sk, err, flush=True); continue
                us = time_fn(args, lambda x, q, s, o: gemv_tma(x, q, s, o, N, K, bn=bn, nh=nh, split_k=sk, ns=ns, num_warps=nw, act=act), nb)
                rows.append(dict(shape=name, us=us, **c))
                if us < best[0]: best = (us, c)
        tot['default'] += base; tot['tma_best'] += best[0]
        print(f'{name:8s} default {base:6.2f}  tma best {best[0]:6.2f} {best[1]}', flush=True)
    print('layer', tot)
    json.dump(rows, open(f'{OUT}/tma_sweep.json', 'w'))

if __name__ == '__main__':
    main()
