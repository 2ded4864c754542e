"""The four W4A16 matmuls of a Llama-3-8B layer at one row, as the fp32 residual stream runs them, against the
way they ran before it; `--tune` asks whether the stream would want launch configs of its own.

    python -m benchmarks.kernels.bench_w4a16_stream [--out DIR] [--tune]

| matmul | before (`w4a16_mma` writes its output) | the stream (`acc`: the programs add into fp32 sums) |
|---|---|---|
| qkv | split-K, the last program writes bf16 | added into the QKV sums |
| o | added into the residual | the same, and its programs zero the QKV and gate/up sums |
| gate_up | split-K, the last program writes `silu(gate) * up` | raw sums added into the gate/up sums |
| down | bf16 x, added into the residual | x activated from the gate/up sums as it is loaded (`x_act`) |

Each matmul alone and the four in a row, timed over rotating weight copies in a CUDA graph (`common.time_fn`), after
a check of the stream's two new paths against the fp32 reference. Rows go to DIR/w4a16_stream.csv.

`--tune`: every matmul as the stream launches it, over warps x word tensors per thread x split-K (the stream has no
split-K read-back, so its best split could differ from that of `configs/w4a16_mma/`'s `shapes` table, which the
stream launches with), then the four in a row with the best configs against the committed ones.
"""

from benchmarks.kernels import common as C  # first: `--dry` sets TRITON_INTERPRET before the kernels load

import csv
import os
import sys

import torch

from cvllm_lab.kernels import w4a16_mma as KM
from cvllm_lab.kernels.activation import silu_and_mul_ref
from cvllm_lab.kernels.w4a16_layout import dequantize_packed_ref

SHAPES = {**C.L3_8B, 'gate_up': (2 * C.L3_8B['down'][1], C.L3_8B['gate_up'][1])}  # (the dry run's shapes differ)
NQ, NI = SHAPES['qkv'][0], SHAPES['gate_up'][0]
SPLITS = range(1, 65)  # split-K candidates: those that divide the K-tiles


def make_layer(i):
    "Weight copies of one layer (qkv, o, gate_up with its rows interleaved, down) and fresh inputs."
    return ({name: C.packed_w4a16(N, K)[:3] for name, (N, K) in SHAPES.items()},)


def before(L, x, xd, res):
    "The matmuls as they ran before the stream: qkv and gate_up write their outputs, o and down add."
    mm = lambda name, xx, **kw: KM.w4a16_mma(xx, *L[name], 4, 128, *SHAPES[name], sym=True, **kw)
    mm('qkv', x)
    mm('o', x, acc=res)
    mm('gate_up', x, act='silu_and_mul')
    mm('down', xd, acc=res)


def stream(L, x, sums, res, cfgs=None):
    """The stream: every matmul adds into fp32 sums; o zeroes `sums`, down activates the gate/up part on load.
    `cfgs`: launch configs by matmul name (`num_warps`, `nh`, `split_k`), else the tuned ones."""
    cfgs = cfgs or {}
    mm = lambda name, xx, **kw: KM.w4a16_mma(xx, *L[name], 4, 128, *SHAPES[name], sym=True, **kw, **cfgs.get(name, {}))
    qkv, gu = sums.split([NQ, NI], -1)
    mm('qkv', x, acc=qkv)
    mm('o', x, acc=res, zero=sums)
    mm('gate_up', x, acc=gu)
    mm('down', gu, acc=res, x_act='silu_and_mul', dtype=torch.bfloat16)


def check():
    "The stream's new paths at real size: the gate/up sums activated on load, and the zeroing."
    N, K = SHAPES['down']
    p = C.packed_w4a16(N, K)[:3]
    w = dequantize_packed_ref(*p, 4, 128, N, K)
    gu, z, acc = (
        torch.randn(1, 2 * K, device=C.DEVICE),
        torch.randn(NQ + NI, device=C.DEVICE),
        torch.randn(1, N, device=C.DEVICE),
    )
    want = acc + silu_and_mul_ref(gu, interleaved=True).bfloat16().float() @ w.T
    tol = 1e-2 if C.DRY else 2e-4  # the interpreter rounds x to bf16 toward zero
    KM.w4a16_mma(gu, *p, 4, 128, N, K, sym=True, acc=acc, x_act='silu_and_mul', dtype=torch.bfloat16, zero=z)
    err = C.rel_err(acc, want)
    assert err < tol and z.abs().max() == 0, err
    print(f'correct: down with x_act rel err {err:.2e}, zeroed', flush=True)


def stream_call(name, p, x, acc, sums, **cfg):
    "One matmul as the stream launches it (`stream`), alone."
    N, K = SHAPES[name]
    kw = dict(x_act='silu_and_mul', dtype=torch.bfloat16) if name == 'down' else dict(zero=sums) if name == 'o' else {}
    return KM.w4a16_mma(x, *p, 4, 128, N, K, sym=True, acc=acc, **kw, **cfg)


def configs(name):
    "Launch configs to time for one matmul: warps x word tensors per thread x the splits that divide its K-tiles."
    N, K = SHAPES[name]
    tiles = K // 128
    if C.DRY:
        return [dict(num_warps=1, nh=1, split_k=s) for s in (1, 2)]
    return [
        dict(num_warps=nw, nh=nh, split_k=sk)
        for nw in (4, 8)
        for nh in (1, 2)
        for sk in SPLITS
        if tiles % sk == 0 and C.num_sms() <= -(-N // (nh * nw * 32)) * sk <= 16 * C.num_sms()
    ]


def tune(rows, x, sums):
    "Every config of `configs` per matmul, as the stream launches it; returns the best per matmul name."
    best = {}
    for name, (N, K) in SHAPES.items():
        nb = sum(t.numel() * t.element_size() for t in C.packed_w4a16(N, K)[:3])
        args = lambda i, N=N, K=K: (C.packed_w4a16(N, K)[:3],)
        xin = torch.randn(1, 2 * K, device=C.DEVICE) if name == 'down' else x
        acc = torch.zeros(1, N, device=C.DEVICE)
        for cfg in configs(name):
            try:
                us = C.time_fn(args, lambda p: stream_call(name, p, xin, acc, sums, **cfg), nb)
            except Exception as e:
                print('failed', name, cfg, repr(e)[:200], flush=True)
                continue
            rows.append(
                dict(
                    what=name,
                    config=f'nw={cfg["num_warps"]} nh={cfg["nh"]} split={cfg["split_k"]}',
                    path='stream',
                    us=us,
                )
            )
            if name not in best or us < best[name][0]:
                best[name] = (us, cfg)
        print(f'  {name:8s} best {best[name][0]:6.2f} us {best[name][1]}', flush=True)
    return {name: cfg for name, (us, cfg) in best.items()}


def main():
    out = C.arg('--out', 'results')
    check()
    nb = sum(t.numel() * t.element_size() for t in C.packed_w4a16(*SHAPES['down'])[:3])
    rows = []
    x = torch.randn(1, SHAPES['o'][1], device=C.DEVICE, dtype=torch.bfloat16)
    xd = torch.randn(1, SHAPES['down'][1], device=C.DEVICE, dtype=torch.bfloat16)
    res = torch.zeros(1, SHAPES['o'][0], device=C.DEVICE)
    sums = torch.zeros(1, NQ + NI, device=C.DEVICE)
    t_b = C.time_fn(make_layer, lambda L: before(L, x, xd, res), 4 * nb)
    t_s = C.time_fn(make_layer, lambda L: stream(L, x, sums, res), 4 * nb)
    rows += [
        dict(what='layer', config='tuned', path='before', us=t_b),
        dict(what='layer', config='tuned', path='stream', us=t_s),
    ]
    print(f'four matmuls: before {t_b:.2f} us, stream {t_s:.2f} us ({t_b / t_s:.3f}x)', flush=True)
    for name, (N, K) in SHAPES.items():
        args = lambda i, N=N, K=K: (C.packed_w4a16(N, K)[:3],)
        mm = lambda p, xx, N=N, K=K, **kw: KM.w4a16_mma(xx, *p, 4, 128, N, K, sym=True, **kw)
        xin = torch.randn(1, 2 * K, device=C.DEVICE) if name == 'down' else x
        acc = torch.zeros(1, N, device=C.DEVICE)
        t0 = C.time_fn(
            args,
            lambda p: mm(p, xd if name == 'down' else x, **({'act': 'silu_and_mul'} if name == 'gate_up' else {})),
            nb,
        )
        t1 = C.time_fn(args, lambda p: stream_call(name, p, xin, acc, sums), nb)
        rows += [
            dict(what=name, config='tuned', path='out', us=t0),
            dict(what=name, config='tuned', path='stream', us=t1),
        ]
        print(f'  {name:8s} writes its output {t0:6.2f} us, stream {t1:6.2f} us', flush=True)
    if '--tune' in sys.argv:
        best = tune(rows, x, sums)
        t_t = C.time_fn(make_layer, lambda L: stream(L, x, sums, res, best), 4 * nb)
        t_s = C.time_fn(make_layer, lambda L: stream(L, x, sums, res), 4 * nb)
        rows += [
            dict(what='layer', config='stream tuned', path='stream', us=t_t),
            dict(what='layer', config='tuned', path='stream', us=t_s),
        ]
        print(
            f'four matmuls on the stream: committed configs {t_s:.2f} us, stream-tuned {t_t:.2f} us ({t_s / t_t:.3f}x)',
            flush=True,
        )
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, 'w4a16_stream.csv'), 'w', newline='') as f:
        w = csv.DictWriter(f, ['device', 'what', 'config', 'path', 'us'])
        w.writeheader()
        for r in rows:
            w.writerow(dict(device=C.device_name(), **r))


if __name__ == '__main__':
    main()
