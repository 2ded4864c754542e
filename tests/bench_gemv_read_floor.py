"""The GEMV's read floor on a GPU: a kernel that only streams the packed W4A16 words with the GEMV's tiling (the
current `[R, N]` layout and a column-blocked one) against the GEMV, per Llama-3-8B shape. `OUT=dir python
tests/bench_gemv_read_floor.py` writes OUT/probe.json (`results/h200_gemv_read_floor.csv`: the H200 run)."""
import json, os, sys
sys.path.insert(0, 'tests')
import torch, triton, triton.language as tl
from bench_quant import time_fn
from cvllm_lab.kernels import w4a16 as KW
from cvllm_lab.quant.w4a16 import W4A16Linear

OUT = os.environ.get('OUT', '/tmp')
SHAPES = {'qkv': (6144, 4096), 'o': (4096, 4096), 'gate_up': (28672, 4096), 'down': (4096, 14336)}

@triton.jit
def _read(qw, out, N, BNL, RB, TPS, C: tl.constexpr, BN: tl.constexpr, TPI: tl.constexpr):
    pid_n = tl.program_id(0); pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN); rc = tl.arange(0, C)
    cofs = (rn // BNL) * RB + rn % BNL
    wp = qw + rc[:, None] * BNL + cofs[None, :]
    acc = tl.zeros([C, BN], tl.int32)
    for t in range(pid_k * TPS, (pid_k + 1) * TPS, TPI):
        for i in tl.static_range(TPI):
            acc += tl.load(wp + (t + i) * C * BNL, eviction_policy='evict_first')
    tl.store(out + pid_k * N + rn, tl.sum(acc, 0))

def read(q, N, R, bnl, bn, split, tpi, nw):
    out = torch.empty(split, N, dtype=torch.int32, device=q.device)
    tiles = R // 16
    _read[(N // bn, split)](q, out, N, bnl, R * bnl, tiles // split, C=16, BN=bn, TPI=tpi, num_warps=nw)
    return out

rows = []
torch.manual_seed(0)
for name, (N, K) in SHAPES.items():
    m = W4A16Linear.from_float(torch.randn(N, K, device='cuda') * 0.02, 128, 4, sym=True)
    q, s, o = m.qweight, m.scales, m.offsets
    R = q.shape[0]
    nb = q.numel() * 4
    ref = q.sum(0)
    for blocked in (False, True):
        for bn in (64, 128, 256):
            for split in (1, 2, 4, 8, 16, 32):
                if (R // 16) % split or N // bn * split > 64 * 132: continue
                for tpi in (1, 2, 4):
                    if (R // 16 // split) % tpi: continue
                    bnl = bn if blocked else N
                    qq = q.view(R, N // bn, bn).permute(1, 0, 2).contiguous() if blocked else q
                    got = read(qq, N, R, bnl, bn, split, tpi, 4).sum(0)
                    assert torch.equal(got.int(), ref.int()), (name, blocked, bn, split)
                    mk = lambda i: (qq.clone(),)
                    us = time_fn(mk, lambda a: read(a, N, R, bnl, bn, split, tpi, 4), nb)
                    rows.append(dict(shape=name, kernel='read', blocked=blocked, bn=bn, split=split, tpi=tpi, us=us, tbs=nb / us / 1e6))
        best = min((r for r in rows if r['shape'] == name and r['blocked'] == blocked), key=lambda r: r['us'])
        print(name, 'blocked' if blocked else 'current', 'best read', best, flush=True)
    nbg = nb + s.numel() * 4
    mk = lambda i: (torch.randn(1, K, device='cuda', dtype=torch.bfloat16), q.clone(), s.clone(), o.clone())
    us = time_fn(mk, lambda x, a, b, c: KW.w4a16_gemv(x, a, b, c, 4, 128, N, K), nbg)
    rows.append(dict(shape=name, kernel='gemv', us=us, tbs=nbg / us / 1e6))
    print(name, 'gemv default', us, nbg / us / 1e6, flush=True)
    big = torch.empty(int(2e9) // 4, dtype=torch.int32, device='cuda')
    us = time_fn(lambda i: (big,), lambda a: a.sum(), big.numel() * 4, reps=5) if name == 'qkv' else None
    if us: print('torch int32 sum 2 GB:', us, big.numel() * 4 / us / 1e6, 'TB/s', flush=True); rows.append(dict(shape='2GB', kernel='torch.sum', us=us, tbs=big.numel() * 4 / us / 1e6))
    del big
json.dump(rows, open(f'{OUT}/probe.json', 'w'))
