"""GGUF matmul kernels (cvllm_lab.kernels.gguf_matmul) against the dequantize + fp32 matmul reference.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small sizes, every block type.
CUDA (`-m cuda`): real sizes. `python -m benchmarks.kernels.bench_gguf` times them on a GPU.
"""

import pytest
import torch
from helpers import rel_err as _rel

from cvllm_lab.kernels.gguf_matmul import (
    KERNEL_TYPES,
    gguf_dequantize,
    gguf_gemv,
    gguf_matmul,
    gguf_matmul_ref,
    gguf_mm,
)
from cvllm_lab.kernels.gguf_layout import dequantize
from cvllm_lab.quant.gguf import GGUFLinear, quantize, random_blocks

IDS = [t.name.lower() for t in KERNEL_TYPES]


def _weights(t, N, K, seed, device='cpu'):
    "Fresh quantized weights: our quantizer on gaussian weights (odd seeds) or random block bytes (even seeds)."
    g = torch.Generator().manual_seed(seed)
    if seed % 2:
        return quantize(torch.randn(N, K, generator=g).to(device) * 0.05, t)
    return random_blocks(t, N, K, generator=g).to(device)


# ------------------------------------------------------------------------------------------- CPU (interpreter)


@pytest.mark.interp
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


@pytest.mark.interp
@pytest.mark.parametrize('t', ['q4_0', 'q8_0', 'q5_1'])
def test_legacy_odd_shapes_cpu(t):
    "Row lengths that are not a multiple of 256 (fewer 32-blocks per step), N not a multiple of the tile."
    for N, K in ((10, 96), (33, 384)):
        q = _weights(t, N, K, 3)
        assert torch.equal(gguf_dequantize(q, t, N, K, dtype=torch.float32), dequantize(q, t))
        for M in (2, 6):
            x = torch.randn(M, K)
            assert _rel(gguf_matmul(x, q, t, N, K), gguf_matmul_ref(x, q, t, N, K)) < 1e-5


@pytest.mark.interp
def test_prefill_path_and_errors_cpu():
    t, N, K = 'q4k', 16, 256
    q = _weights(t, N, K, 5)
    x = torch.randn(2, 33, K)  # M=66 > 64: dequantize kernel + matmul; leading dims kept
    y = gguf_matmul(x, q, t, N, K)
    assert y.shape == (2, 33, N) and _rel(y, gguf_matmul_ref(x, q, t, N, K)) < 1e-5
    with pytest.raises(ValueError):
        gguf_matmul(torch.randn(1, K), q[:, :-1], t, N, K)  # wrong bytes per row
    with pytest.raises(ValueError):
        gguf_matmul(torch.randn(1, K), q, 'iq2_xxs', N, K)


# ------------------------------------------------------------------------------------------- CUDA

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K)
MAIN = ('q4_0', 'q4_1', 'q8_0', 'q4k', 'q6k')


@pytest.mark.cuda
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
            ref = x.float() @ w.T
            y = gguf_matmul(x, q, t, N, K)
            assert y.dtype == torch.bfloat16 and y.shape == (M, N)
            err = _rel(y, ref)
            assert err < (8e-3 if M <= 4 else 2e-2), (t.name, N, K, M, err)
        x = torch.randn(2, K, device='cuda', dtype=torch.float16)
        assert _rel(gguf_matmul(x, q, t, N, K), x.float() @ w.T) < 8e-3


@pytest.mark.cuda
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
            assert y.dtype == torch.bfloat16 and _rel(y.float().cpu(), ref[:, : xs.shape[1]]) < 2e-2
