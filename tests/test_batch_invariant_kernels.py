"""Batch-invariant mode's GPU kernels (`EngineConfig.batch_invariant`): each row of a call's output is the same
whatever else is in the call. Under the Triton interpreter at small sizes (`interp`), and on a GPU (`cuda`) at a
model's shapes, where cuBLAS's rows do depend on M (asserted, so the test shows what the mode fixes)."""

import pytest
import torch

from cvllm_lab.kernels import split_k
from cvllm_lab.kernels.batch_invariant import linear
from cvllm_lab.kernels.matmul_invariant import matmul_invariant, matmul_invariant_ref


@pytest.fixture
def invariant():
    split_k.set_batch_invariant(True)
    yield
    split_k.set_batch_invariant(False)


def _rows_same_at_every_m(f, x, ms):
    full = f(x)
    for m in ms:
        assert torch.equal(f(x[:m]), full[:m]), m
        assert torch.equal(f(x[m - 1 : m + 2]), full[m - 1 : m + 2]), m  # rows at another offset in the tile
    return full


@pytest.mark.interp
@pytest.mark.parametrize('dtype,tol', [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_matmul_invariant_interp(dtype, tol):
    g = torch.Generator().manual_seed(3)
    M, N, K = 70, 80, 96  # a partial row block, column block and K step
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    y = _rows_same_at_every_m(lambda t: matmul_invariant(t, w, b), x, (1, 5, 17, 64, 65))
    ref = matmul_invariant_ref(x, w, b)
    assert (y.float() - ref.float()).abs().max().item() < tol * ref.float().abs().max().item()
    assert matmul_invariant(x[:0], w).shape == (0, N)
    assert matmul_invariant(x.reshape(2, 35, K), w, b).shape == (2, 35, N)


@pytest.mark.interp
def test_linear_dispatch_cpu(invariant):
    "Off CUDA, `linear` is `F.linear` even in batch-invariant mode (the CPU fast path has its own invariant kernels)."
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_matmul_invariant_gpu(invariant):
    g = torch.Generator(device='cuda').manual_seed(0)
    x = torch.randn(300, 4096, device='cuda', dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16, generator=g) / 64
    y = _rows_same_at_every_m(lambda t: linear(t, w), x, (1, 2, 7, 33, 129))
    ref = matmul_invariant_ref(x, w)
    assert (y.float() - ref.float()).abs().max().item() < 0.02 * ref.float().abs().max().item()


@pytest.mark.interp
@pytest.mark.parametrize('act', [None, 'silu_and_mul'])
def test_w4a16_matmul_invariant_interp(invariant, act):
    "W4A16 in batch-invariant mode: the `tl.dot` kernel at every M (no GEMV / MMA at one row), its rows the same."
    from cvllm_lab.kernels.w4a16 import w4a16_matmul, w4a16_matmul_ref
    from cvllm_lab.quant.w4a16 import W4A16Linear

    N, K = 64, 256
    g = torch.Generator().manual_seed(5)
    m = W4A16Linear.from_float(torch.randn(N, K, generator=g) * 0.05, 128, 4, False)
    args = (m.qweight, m.scales, m.offsets, 4, m.group, N, K)
    x = torch.randn(20, K, generator=g).half()
    y = _rows_same_at_every_m(lambda t: w4a16_matmul(t, *args, act=act), x, (1, 2, 9, 17))
    if act is None:
        ref = w4a16_matmul_ref(x, *args)
        assert (y.float() - ref.float()).abs().max().item() < 1e-2 * ref.float().abs().max().item()


@pytest.mark.interp
@pytest.mark.parametrize('layout', ['block', 'channel'])
def test_fp8_matmul_invariant_interp(invariant, layout):
    "FP8 in batch-invariant mode: `fp8_mm` (block scales) or the dequantized weight in `matmul_invariant` (channel)."
    from cvllm_lab.quant.fp8 import quantize_fp8_block, quantize_fp8_channel
    from cvllm_lab.kernels.fp8_matmul import fp8_matmul, fp8_matmul_ref

    N, K = 128, 256
    g = torch.Generator().manual_seed(6)
    w = torch.randn(N, K, generator=g) * 0.05
    w, s = quantize_fp8_block(w) if layout == 'block' else quantize_fp8_channel(w)
    x = torch.randn(20, K, generator=g).half()
    y = _rows_same_at_every_m(lambda t: fp8_matmul(t, w, s, N, K), x, (1, 2, 9, 17))
    ref = fp8_matmul_ref(x, w, s, N, K)
    assert (y.float() - ref.float()).abs().max().item() < 1e-2 * ref.float().abs().max().item()
