"""FP8 kernels against their PyTorch references: the activation quantization (`fp8_act_quant`), the W8A8 GEMM on
FP8 tensor cores (`fp8_gemm`), the W8A16 GEMV / `tl.dot` kernels and the dispatcher `fp8_matmul` (`fp8_matmul`).

CPU: the Triton kernels under TRITON_INTERPRET=1 at small sizes (the interpreter runs `tl.dot` on float8e4nv
operands; its fp32 -> e4m3 conversion is worked around in `to_e4m3`, so quantization matches the reference
bit for bit there). CUDA (`-m cuda`): the Llama-3-8B shapes, every GEMM variant and backend, `FP8Linear` in both
scale layouts. `python -m benchmarks.kernels.tune_fp8_mm` times them.
"""

import pytest
import torch
from helpers import rel_err as _rel

from cvllm_lab.kernels.fp8_act_quant import act_quant_fp8, act_quant_fp8_ref
from cvllm_lab.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref, fp8_scaled_mm, gemm_bucket, scale_layout
from cvllm_lab.kernels.fp8_matmul import fp8_dequantize, fp8_gemv, fp8_matmul, fp8_matmul_ref, fp8_mm, gemm_config
from cvllm_lab.kernels.split_k import workspaces
from cvllm_lab.quant.fp8 import FP8Linear, quantize_fp8_block, quantize_fp8_channel


def _ws_clean():
    "Split-K kernels must leave their workspace and counters at zero."
    return all(not ws.any() and not cnt.any() for ws, cnt in workspaces())


def _fp8(N, K, seed, layout='block', device='cpu'):
    "Random weights (std 0.05) quantized to FP8: (`weight`, its scale) in the `layout`."
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[: N // 3] *= 4  # rows (and blocks) of different ranges
    w, s = quantize_fp8_block(w) if layout == 'block' else quantize_fp8_channel(w)
    return w.to(device), s.to(device)


def _e4m3_steps(a, b):
    "Distance of two e4m3 tensors in representable steps (their bytes ordered as sign-magnitude integers)."
    ia, ib = (t.view(torch.uint8).int() for t in (a, b))
    mag = lambda i: torch.where(i >= 128, -(i - 128), i)
    return (mag(ia) - mag(ib)).abs()


# ------------------------------------------------------------------------------------------- CPU (interpreter)


@pytest.mark.interp
def test_act_quant_cpu():
    g = torch.Generator().manual_seed(0)
    for M, K in ((5, 300), (3, 1024), (1, 128)):
        x = torch.randn(M, K, generator=g) * 3
        x[0] = 0  # an all-zero row: finite scale, zeros
        if K > 8:
            x[-1, :5] = torch.tensor([1e-6, -3e-5, 448.0, 0.5, 2**-8])  # subnormals, the maximum
        for group in (None, 128):
            q, s = act_quant_fp8(x, group, bk=256)
            qr, sr = act_quant_fp8_ref(x, group)
            assert q.dtype == torch.float8_e4m3fn and s.shape == sr.shape and torch.equal(s, sr), (M, K, group)
            assert torch.equal(q.float(), qr.float()), (M, K, group)  # (-0 and +0 alike)
            d = q.float() * (s[:, None] if group is None else s.repeat_interleave(128, 1)[:, :K])
            assert ((d - x).abs() <= x.abs() / 16 + 2**-9 * s.max()).all()  # within half an e4m3 step
        q, s = act_quant_fp8(x, 128, scales_t=True)
        assert s.stride(0) == 1 and torch.equal(s, act_quant_fp8_ref(x, 128)[1])
    with pytest.raises(ValueError):
        act_quant_fp8(x, 64)


CASES = [('block', 40, 300), ('block', 64, 256), ('channel', 40, 300), ('channel', 136, 384)]


@pytest.mark.interp
@pytest.mark.parametrize('layout,N,K', CASES, ids=[f'{l}-{n}x{k}' for l, n, k in CASES])
def test_fp8_gemm_cpu(layout, N, K):
    "Every variant of the W8A8 kernel against the PyTorch reference that quantizes x the same way."
    w, s = _fp8(N, K, N + K, layout)
    assert scale_layout(s, N, K) == layout
    steps = -(-K // 128)
    for M in (1, 40):  # 40: three blocks of 16 rows
        x = torch.randn(M, K)
        exact = fp8_matmul_ref(x, w, s, N, K)
        for ag in (128, None) if layout == 'channel' else (128,):
            ref = fp8_gemm_ref(x, w, s, N, K, ag)
            assert _rel(ref, exact) < 0.1  # e4m3 activations: a few % on random data
            for fused in (True, False) if ag else (False,):
                for swap in (False, True):
                    for split in sorted({1, steps}):  # split-K through the workspace
                        y = fp8_gemm(x, w, s, N, K, act_group=ag, fused=fused, swap=swap, split_k=split)
                        assert y.shape == (M, N) and _rel(y, ref) < 1e-5, (M, ag, fused, swap, split, _rel(y, ref))
    x = torch.randn(5, K)
    assert _rel(fp8_gemm(x, w, s, N, K, bn=16, bm=16), fp8_gemm_ref(x, w, s, N, K)) < 1e-5  # 16-column tiles
    if layout == 'block':
        with pytest.raises(ValueError, match='1 x 128'):
            fp8_gemm(x, w, s, N, K, act_group=None, fused=False)
        with pytest.raises(ValueError, match='divide 128'):
            fp8_gemm(x, w, s, N, K, bn=48)
    assert _ws_clean()


@pytest.mark.interp
@pytest.mark.parametrize('layout', ['block', 'channel'])
def test_fp8_matmul_dispatch_cpu(layout):
    "fp8_matmul: the GEMV at M = 1 (both layouts), the tuned backend above, the W8A16 kernel on request."
    N, K = 40, 300
    w, s = _fp8(N, K, 3, layout)
    x = torch.randn(1, K)
    assert _rel(fp8_matmul(x, w, s, N, K), fp8_matmul_ref(x, w, s, N, K)) < 1e-5
    for tpi, split in ((1, 3), (1, 1)):
        for pdl in (False, True):  # PDL: the first iteration's weights before the wait
            assert _rel(fp8_gemv(x, w, s, N, K, tpi=tpi, split_k=split, pdl=pdl), fp8_matmul_ref(x, w, s, N, K)) < 1e-5
    for shape in ((2, 7), (140,)):  # decode batch, prefill
        x = torch.randn(*shape, K)
        y = fp8_matmul(x, w, s, N, K)
        cfg = gemm_config(N, K, x.shape[:-1].numel(), layout, x.device)
        ref = fp8_gemm_ref(x.reshape(-1, K), w, s, N, K, cfg.get('act_group', 128)).reshape(*shape, N)
        assert y.shape == (*shape, N) and _rel(y, ref) < 1e-5, shape
    assert fp8_matmul(torch.randn(0, K), w, s, N, K).shape == (0, N)
    if layout == 'block':  # W8A16 batched kernel, x kept in 16/32 bits
        for M in (5, 17):
            x = torch.randn(M, K)
            assert _rel(fp8_matmul(x, w, s, N, K, backend='w8a16'), fp8_matmul_ref(x, w, s, N, K)) < 1e-5
            xh = x.half()
            assert _rel(fp8_mm(xh, w, s, N, K, split_k=3, bn=16), fp8_matmul_ref(x, w, s, N, K)) < 2e-3
    with pytest.raises(ValueError, match='scale'):
        fp8_matmul(x, w, s[:-1], N, K)
    assert _ws_clean()


@pytest.mark.interp
def test_fp8_gemm_configs():
    "Every row bucket of both layouts has a config; buckets by M."
    assert [gemm_bucket(m) for m in (2, 16, 17, 64, 65, 200, 257, 8192)] == [16, 16, 32, 64, 128, 256, 512, 512]
    for layout in ('block', 'channel'):
        for M in (2, 20, 50, 100, 200, 5000):
            assert gemm_config(4096, 4096, M, layout, torch.device('cpu'))['backend'] in (
                'triton',
                'scaled_mm',
                'w8a16',
            )


# ------------------------------------------------------------------------------------------- CUDA

SHAPES = [(4096, 14336), (28672, 4096), (6144, 4096), (576, 576)]


@pytest.mark.cuda
def test_act_quant_cuda():
    "Real sizes: scales equal the reference's, values at most one e4m3 step away (division rounding at ties), rarely."
    for M, K in ((1, 4096), (16, 14336), (64, 4096), (300, 576)):
        x = torch.randn(M, K, device='cuda', dtype=torch.bfloat16) * 3
        for group in (None, 128):
            q, s = act_quant_fp8(x, group)
            qr, sr = act_quant_fp8_ref(x, group)
            assert torch.allclose(s, sr, rtol=1e-6, atol=0), (M, K, group)
            d = _e4m3_steps(q, qr)
            assert d.max() <= 1 and (d > 0).float().mean() < 1e-3, (M, K, group, d.max().item())


@pytest.mark.cuda
@pytest.mark.parametrize('layout', ['block', 'channel'])
@pytest.mark.parametrize('N,K', SHAPES)
def test_fp8_gemm_cuda(layout, N, K):
    "The dispatcher's pick and every variant of the W8A8 kernel at real sizes, bf16 x."
    w, s = _fp8(N, K, N, layout, 'cuda')
    wd = fp8_dequantize(w, s)
    steps = -(-K // 128)
    for M in (2, 16, 33, 64, 128, 300, 1000):
        x = torch.randn(M, K, device='cuda', dtype=torch.bfloat16)
        exact = x.float() @ wd.T
        y = fp8_matmul(x, w, s, N, K)
        assert y.dtype == torch.bfloat16 and _rel(y, exact) < 8e-2, (M, _rel(y, exact))
        cfg = gemm_config(N, K, M, layout, x.device)
        ref = fp8_gemm_ref(x, w, s, N, K, cfg.get('act_group', 128))
        assert _rel(y, ref) < 1e-2, (M, cfg, _rel(y, ref))  # bf16 output, rare one-step quantization ties
        if M in (16, 64, 300):
            ref = fp8_gemm_ref(x, w, s, N, K)
            for fused, swap, bm, bn, split in (
                (True, True, 16, 64, 1),
                (True, True, 64, 128, 2),
                (False, False, 64, 128, 1),
                (False, True, 32, 64, 4),
                (False, False, 128, 128, 1),
                (True, False, 64, 256, 1),
            ):
                if steps % split or (layout == 'block' and bn > 128 and N % 256):
                    continue
                y = fp8_gemm(x, w, s, N, K, fused=fused, swap=swap, bm=bm, bn=bn, split_k=split)
                assert _rel(y, ref) < 1e-2, (M, fused, swap, bm, bn, split, _rel(y, ref))
            if layout == 'channel':  # per-token activations, K-steps of 64 and 128
                ref = fp8_gemm_ref(x, w, s, N, K, None)
                for bk in (64, 128):
                    y = fp8_gemm(x, w, s, N, K, act_group=None, fused=False, bk=bk, bm=64, bn=128)
                    assert _rel(y, ref) < 1e-2, (M, bk)
    assert _ws_clean()


@pytest.mark.cuda
@pytest.mark.parametrize('layout', ['block', 'channel'])
def test_fp8_scaled_mm_cuda(layout):
    "torch._scaled_mm: rowwise for the channel layout; the block layout where the build has 1x128 x 128x128 scaling."
    N, K = 4096, 4096
    w, s = _fp8(N, K, 1, layout, 'cuda')
    for M in (16, 64, 512):
        x = torch.randn(M, K, device='cuda', dtype=torch.bfloat16)
        try:
            y = fp8_scaled_mm(x, w, s, N, K)
        except (RuntimeError, NotImplementedError, ValueError) as e:
            if layout == 'channel':
                raise
            pytest.skip(f'no blockwise torch._scaled_mm here: {str(e)[:300]}')
        ref = fp8_gemm_ref(x, w, s, N, K, None if layout == 'channel' else 128)
        assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2, (M, _rel(y, ref))


@pytest.mark.cuda
@pytest.mark.parametrize('N,K', SHAPES)
def test_fp8_w8a16_cuda(N, K):
    "The W8A16 kernels (GEMV both layouts, batched block kernel) at real sizes."
    for layout in ('block', 'channel'):
        w, s = _fp8(N, K, N, layout, 'cuda')
        wd = fp8_dequantize(w, s)
        kb = (K + 127) // 128
        x = torch.randn(1, K, device='cuda')
        assert _rel(fp8_matmul(x, w, s, N, K), x @ wd.T) < 1e-5
        for bn, tpi, sk in ((16, 2, 1), (32, 1, 4), (8, 4, 2)):
            if kb % (sk * tpi) == 0:
                assert _rel(fp8_gemv(x, w, s, N, K, bn=bn, tpi=tpi, split_k=sk), x @ wd.T) < 1e-5, (layout, bn, tpi, sk)
        if layout == 'block':
            x = torch.randn(16, K, device='cuda', dtype=torch.bfloat16)
            for sk in (2, 4):
                if kb % sk == 0:
                    assert _rel(fp8_mm(x, w, s, N, K, split_k=sk), x.float() @ wd.T) < 1e-2, (N, K, sk)
    assert _ws_clean()


@pytest.mark.cuda
def test_fp8_linear_cuda():
    "FP8Linear in both layouts (and from a per-tensor scale) on CUDA against its CPU path, decode and prefill rows."
    from cvllm_lab.layers.basic import Linear

    lin = Linear(1024, [512, 256, 256], bias=True)
    torch.nn.init.normal_(lin.weight, std=0.02)
    torch.nn.init.normal_(lin.bias)
    x = torch.randn(300, 1024)
    for m in (
        FP8Linear.from_linear(lin),
        FP8Linear.from_linear(lin, block=False),
        FP8Linear.from_fp8(*quantize_fp8_channel(lin.weight.detach(), per_tensor=True), lin.bias),
    ):
        ref = m(x)  # CPU: dequantize + F.linear
        mc = m.cuda()
        for M in (1, 16, 300):
            y = mc(x[:M].cuda().bfloat16()).float().cpu()
            assert _rel(y, ref[:M]) < (2e-2 if M == 1 else 8e-2), (m.extra_repr(), M, _rel(y, ref[:M]))
        m.cpu()
