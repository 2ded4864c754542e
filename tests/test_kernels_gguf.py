"""GGUF matmul kernels (cvllm_lab.kernels.gguf_matmul) against the dequantize + fp32 matmul reference.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small sizes, every block type.
CUDA (`-m cuda`): real sizes. `python tests/test_kernels_gguf.py bench` times the GEMV at M=1 (and a few more) on a GPU.
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')  # must be set before triton is imported

from cvllm_lab.kernels.gguf_matmul import (KERNEL_TYPES, gguf_dequantize, gguf_gemv, gguf_matmul, gguf_matmul_ref,
                                           gguf_mm)
from cvllm_lab.kernels.gguf_layout import dequantize, parse_qtype
from cvllm_lab.quant.gguf import GGUFLinear, quantize, random_blocks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
interp = pytest.mark.skipif(os.environ.get('TRITON_INTERPRET') != '1', reason='CPU tests run the Triton interpreter')
IDS = [t.name.lower() for t in KERNEL_TYPES]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weights(t, N, K, seed, device='cpu'):
    "Fresh quantized weights: our quantizer on gaussian weights (odd seeds) or random block bytes (even seeds)."
    g = torch.Generator().manual_seed(seed)
    if seed % 2: return quantize(torch.randn(N, K, generator=g).to(device) * 0.05, t)
    return random_blocks(t, N, K, generator=g).to(device)


# ------------------------------------------------------------------------------------------- CPU (interpreter)

@interp
@pytest.mark.parametrize('t', KERNEL_TYPES, ids=IDS)
def test_kernels_cpu(t):
    N, K = 64, 512
    for seed, Ms in ((1, (1, 3, 17)), (2, (3, 17))):  # our quantizer's bytes, then random block bytes
        q = _weights(t, N, K, seed)
        # the dequantize kernel is bit-exact with the PyTorch dequantizer
        assert torch.equal(gguf_dequantize(q, t, N, K, dtype=torch.float32), dequantize(q, t))
        g = torch.Generator().manual_seed(seed)
        for M in Ms:
            x = torch.randn(M, K, generator=g)
            ref = gguf_matmul_ref(x, q, t, N, K)
            y = gguf_matmul(x, q, t, N, K)  # M<=4: GEMV, else fused tl.dot (fp32, ieee)
            assert y.shape == (M, N) and _rel(y, ref) < 1e-5, (M, _rel(y, ref))
    # split-K (fp32 atomics), the 4-row GEMV, and the tl.dot kernel on fp16 input
    x = torch.randn(4, K, generator=g)
    assert _rel(gguf_gemv(x, q, t, N, K, split_k=2), gguf_matmul_ref(x, q, t, N, K)) < 1e-5
    x = torch.randn(5, K, generator=g).half()
    assert _rel(gguf_mm(x, q, t, N, K, split_k=2), gguf_matmul_ref(x.float(), q, t, N, K)) < 2e-3


@interp
@pytest.mark.parametrize('t', ['q4_0', 'q8_0', 'q5_1'])
def test_legacy_odd_shapes_cpu(t):
    "Row lengths that are not a multiple of 256 (fewer 32-blocks per step), N not a multiple of the tile."
    for N, K in ((10, 96), (33, 384)):
        q = _weights(t, N, K, 3)
        assert torch.equal(gguf_dequantize(q, t, N, K, dtype=torch.float32), dequantize(q, t))
        for M in (2, 6):
            x = torch.randn(M, K)
            assert _rel(gguf_matmul(x, q, t, N, K), gguf_matmul_ref(x, q, t, N, K)) < 1e-5


@interp
def test_prefill_path_and_errors_cpu():
    t, N, K = 'q4k', 16, 256
    q = _weights(t, N, K, 5)
    x = torch.randn(2, 33, K)  # M=66 > 64: dequantize kernel + matmul; leading dims kept
    y = gguf_matmul(x, q, t, N, K)
    assert y.shape == (2, 33, N) and _rel(y, gguf_matmul_ref(x, q, t, N, K)) < 1e-5
    with pytest.raises(ValueError): gguf_matmul(torch.randn(1, K), q[:, :-1], t, N, K)  # wrong bytes per row
    with pytest.raises(ValueError): gguf_matmul(torch.randn(1, K), q, 'iq2_xxs', N, K)


# ------------------------------------------------------------------------------------------- CUDA

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K)
MAIN = ('q4_0', 'q4_1', 'q8_0', 'q4k', 'q6k')


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize('t', KERNEL_TYPES, ids=IDS)
def test_kernels_cuda(t):
    shapes = SHAPES if t.name.lower().replace('_k', 'k') in MAIN else SHAPES[:1]
    for i, (N, K) in enumerate(shapes):
        q = _weights(t, N, K, i + 1, device='cuda')
        # dequantize kernel (fp32 out) against the PyTorch dequantizer: equal up to FMA contraction on the GPU
        w = dequantize(q, t)
        wk = gguf_dequantize(q, t, N, K, dtype=torch.float32)
        assert torch.allclose(wk, w, rtol=1e-6, atol=1e-6 * w.abs().max().item()), (t.name, (wk - w).abs().max())
        for M in (1, 3, 16, 100):
            x = torch.randn(M, K, device='cuda', dtype=torch.bfloat16)
            ref = (x.float() @ w.T)
            y = gguf_matmul(x, q, t, N, K)
            assert y.dtype == torch.bfloat16 and y.shape == (M, N)
            err = _rel(y, ref)
            assert err < (8e-3 if M <= 4 else 2e-2), (t.name, N, K, M, err)
        x = torch.randn(2, K, device='cuda', dtype=torch.float16)
        assert _rel(gguf_matmul(x, q, t, N, K), x.float() @ w.T) < 8e-3


@pytest.mark.cuda
@cuda
def test_gguf_linear_cuda():
    import copy
    lin = torch.nn.Linear(4096, 1024, bias=True)
    for t in ('q4k', 'q6k', 'q8_0'):
        m = GGUFLinear.from_float(lin.weight, t, bias=lin.bias)
        x = torch.randn(3, 7, 4096)
        ref = m(x)  # CPU path
        mc = copy.deepcopy(m).cuda()
        for xs in (x[:, :1], x):  # decode (M=3, GEMV) and a small batch (M=21, tl.dot)
            y = mc(xs.cuda().bfloat16())
            assert y.dtype == torch.bfloat16 and _rel(y.float().cpu(), ref[:, :xs.shape[1]]) < 2e-2

# ------------------------------------------------------------------------------------------- GPU benchmark

def _graph_time(fn, n_inner=16, reps=10):
    "Median time per call (s) of `fn(i)` for i in range(n_inner), captured in a CUDA graph (no launch overhead)."
    for i in range(n_inner): fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(n_inner): fn(i)  # warm the stream
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for i in range(n_inner): fn(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / n_inner)
    return sorted(times)[len(times) // 2]


def bench(types=None, sweep=('q4k', 'q6k', 'q4_0', 'q8_0'), peak=4.2e12):
    "GEMV at M=1 for 4096x14336 / 14336x4096 weights per type: time and GB/s of quantized bytes read."
    types = [parse_qtype(t) for t in (types or KERNEL_TYPES)]
    sweep = {parse_qtype(t) for t in sweep}
    dev = 'cuda'
    print(f"device: {torch.cuda.get_device_name()}, peak read bandwidth assumed {peak / 1e12:.1f} TB/s")
    print(f"{'type':6} {'N x K':>12} {'MB':>7} {'us':>8} {'GB/s':>7} {'%peak':>6}  config")
    copies = 8  # rotate over 8 weight copies (> L2) so every call reads from HBM
    for (N, K) in ((4096, 14336), (14336, 4096)):
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        wd = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(4)]
        tt = _graph_time(lambda i: x @ wd[i % 4].T)
        print(f"{'bf16':6} {f'{N}x{K}':>12} {N * K * 2 / 1e6:7.1f} {tt * 1e6:8.1f} {N * K * 2 / tt / 1e9:7.0f} "
              f"{N * K * 2 / tt / peak * 100:5.0f}%  torch x @ W.T (cuBLAS)")
        del wd
        for t in types:
            q0 = random_blocks(t, N, K, generator=torch.Generator().manual_seed(0)).to(dev)
            qs = [q0] + [q0.roll(i, 0).contiguous() for i in range(1, copies)]
            nbytes = q0.numel()
            ref = gguf_matmul_ref(x, q0, t, N, K).float()
            cfgs = [dict()]
            if t in sweep:
                cfgs += [dict(bn=bn, num_warps=nw) for bn, nw in ((8, 4), (16, 8), (32, 4), (32, 8))] + [dict(split_k=1)]
            best = None
            for cfg in cfgs:
                try:
                    err = _rel(gguf_gemv(x, q0, t, N, K, **cfg), ref)
                    assert err < 1e-2, err
                    tt = _graph_time(lambda i: gguf_gemv(x, qs[i % copies], t, N, K, **cfg))
                except Exception as e:  # report and go on: one call has to cover everything
                    print(f"{t.name:6} {f'{N}x{K}':>12} FAILED {cfg}: {str(e)[:300]}")
                    continue
                line = (f"{t.name:6} {f'{N}x{K}':>12} {nbytes / 1e6:7.1f} {tt * 1e6:8.1f} {nbytes / tt / 1e9:7.0f} "
                        f"{nbytes / tt / peak * 100:5.0f}%  {cfg or 'default'}")
                print(line, flush=True)
                best = min(best or (tt, cfg), (tt, cfg), key=lambda v: v[0])
            if len(cfgs) > 1 and best: print(f"{'':6} best: {best[1] or 'default'}")
            del qs
    # batched paths, one type each
    for t, M in (('q4k', 16), ('q6k', 16), ('q4k', 64), ('q4k', 512)):
        t = parse_qtype(t)
        N, K = 14336, 4096
        q = random_blocks(t, N, K, generator=torch.Generator().manual_seed(1)).to(dev)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        wd = dequantize(q, t, dtype=torch.bfloat16)
        try:
            assert _rel(gguf_matmul(x, q, t, N, K), x.float() @ wd.float().T) < 2e-2
            tt = _graph_time(lambda i: gguf_matmul(x, q, t, N, K), n_inner=8)
            td = _graph_time(lambda i: x @ wd.T, n_inner=8)
            print(f"{t.name:6} M={M:<4} {N}x{K}: gguf_matmul {tt * 1e6:8.1f} us, bf16 cuBLAS {td * 1e6:8.1f} us")
        except Exception as e:
            print(f"{t.name} M={M} FAILED: {str(e)[:300]}")


if __name__ == '__main__' and sys.argv[1:2] == ['bench']:
    bench()
