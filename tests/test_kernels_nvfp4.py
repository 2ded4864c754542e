"""The NVFP4 weight-only matmul (`kernels/nvfp4.py`) against its plain-PyTorch reference.

Interpreter (CPU, `interp`): small odd shapes (N not a multiple of the tile, K not a multiple of BLOCK_K), the row
kernel (up to `MM_MIN_ROWS` rows) and the tile kernel (more rows; its bf16 dots run in fp32 there), fp32 and bf16 inputs, per-row global scales, and every finite e4m3 scale byte decoded in the kernel as torch decodes it; the
quantizer's rounding (nearest FP4 value, ties to the even code) on the midpoints. CUDA (`-m cuda`): Llama-3-8B-sized
projections at decode and small-batch rows.
"""

import pytest
import torch
from helpers import rel_err

from cvllm_lab.kernels.mxfp4 import FP4_VALUES
from cvllm_lab.kernels.nvfp4 import (
    dequantize_nvfp4_ref,
    fake_quantize_nvfp4_act_ref,
    fused_moe_nvfp4,
    fused_moe_nvfp4_ref,
    nvfp4_matmul,
    nvfp4_matmul_ref,
    quantize_nvfp4_ref,
)


def _layer(N, K, seed=0, device='cpu'):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.02
    q, s, gs = quantize_nvfp4_ref(w)
    rs = gs.expand(N).clone()
    rs[: N // 3] *= 2.5  # another shard's global scale on the first rows
    return w, q.to(device), s.to(device), rs.to(device)


@pytest.mark.interp
@pytest.mark.parametrize(
    'M,N,K', [(1, 40, 48), (3, 72, 160), (5, 16, 16), (9, 40, 48), (20, 72, 160)]
)  # > 8 rows: tiles
def test_nvfp4_matmul_interp(M, N, K):
    _, q, s, rs = _layer(N, K)
    x = torch.randn(M, K)
    ref = nvfp4_matmul_ref(x, q, s, rs)
    assert rel_err(nvfp4_matmul(x, q, s, rs, block_n=16, block_k=32), ref) < 1e-5
    assert rel_err(nvfp4_matmul(x, q, s, rs), ref) < 1e-5
    xb = x.bfloat16()
    yb = nvfp4_matmul(xb[None], q, s, rs)  # leading dims kept, bf16 out
    assert yb.shape == (1, M, N) and yb.dtype == torch.bfloat16
    assert rel_err(yb[0].float(), nvfp4_matmul_ref(xb, q, s, rs).float()) < 1e-2
    assert nvfp4_matmul(x[:0], q, s, rs).shape == (0, N)


@pytest.mark.interp
def test_e4m3_scales_every_byte():
    "Every finite e4m3 byte as a group scale: the kernel's arithmetic decode equals torch's float8 conversion."
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # not NaN
    N = codes.numel()
    s = codes.view(torch.float8_e4m3fn).reshape(N, 1)
    q = torch.full((N, 8), 0x22, dtype=torch.uint8)  # every value 1.0 (code 2)
    x = torch.ones(1, 16)
    y = nvfp4_matmul(x, q, s, torch.ones(N))
    assert torch.equal(y[0], 16 * s.float()[:, 0])


def test_quantizer_rounding_and_packing():
    "ModelOpt's rounding: midpoints go to the even code; the low nibble holds the even column; values exact."
    mags = torch.tensor(FP4_VALUES[:8])
    mids = (mags[:-1] + mags[1:]) / 2  # 0.25 .. 5
    six = torch.tensor([6.0])
    w = torch.cat([mags, -mags, mids, six, -mids, -six]).reshape(1, 32)  # each group's largest |w| is 6
    gs = torch.tensor(2.0**-8)  # so each group's scale is 256 (exact): FP4 steps of 1
    q, s, _ = quantize_nvfp4_ref(w, gs)
    d = dequantize_nvfp4_ref(q, s, gs)
    assert torch.equal(s.float(), torch.full((1, 2), 256.0))
    assert (d[0, :16] == torch.cat([mags, -mags])).all()  # FP4 values are exact (-0 stored as +0)
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # ties to the even code: 0, 1, 1, 2, 2, 4, 4
    assert torch.equal(d[0, 16:23], want) and torch.equal(d[0, 24:31], -want)
    assert (q[0, 0] & 15).item() == 0 and (q[0, 0] >> 4).item() == 1  # columns 0 (0.0) and 1 (0.5)


def test_fake_quantized_activations():
    "W4A4's activation rounding with a static input scale: FP4's error, and a no-op on FP4-representable inputs."
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g)
    isc = x.abs().max() / (6 * 448)
    xq = fake_quantize_nvfp4_act_ref(x, isc)
    assert 0.03 < rel_err(xq, x) < 0.15
    assert torch.equal(fake_quantize_nvfp4_act_ref(xq, isc), xq)  # idempotent


def _experts(E, N, K, device='cpu', seed=0):
    "E experts `[N, K]` in NVFP4, each its own global scale: (codes, scales, per-row global scales)."
    g = torch.Generator().manual_seed(seed)
    qs = [quantize_nvfp4_ref(torch.randn(N, K, generator=g) * 0.05 * (1 + e)) for e in range(E)]
    q, s = torch.stack([a for a, _, _ in qs]), torch.stack([b for _, b, _ in qs])
    rs = torch.stack([c.expand(N) for _, _, c in qs])
    return q.to(device), s.to(device), rs.to(device)


def _moe_case(E, H, I, T, k, device='cpu'):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).to(device)
    tw = torch.rand(T, k, generator=g).to(device)
    ti = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
    return x, _experts(E, 2 * I, H, device), _experts(E, H, I, device, 1), tw, ti


@pytest.mark.interp
def test_fused_moe_nvfp4_interp():
    x, w13, w2, tw, ti = _moe_case(E=6, H=48, I=32, T=5, k=2)
    ref = fused_moe_nvfp4_ref(x, *w13, *w2, tw, ti)
    assert rel_err(fused_moe_nvfp4(x, *w13, *w2, tw, ti), ref) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('T', [1, 16])
def test_fused_moe_nvfp4_cuda(T):
    x, w13, w2, tw, ti = _moe_case(E=32, H=2048, I=768, T=T, k=4, device='cuda')
    xb = x.bfloat16()
    ref = fused_moe_nvfp4_ref(xb, *w13, *w2, tw, ti)
    assert rel_err(fused_moe_nvfp4(xb, *w13, *w2, tw, ti).float(), ref.float()) < 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('N,K', [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_nvfp4_matmul_cuda(N, K):
    _, q, s, rs = _layer(N, K, device='cuda')
    for M in (1, 16):
        x = torch.randn(M, K, device='cuda', dtype=torch.bfloat16)
        y = nvfp4_matmul(x, q, s, rs)
        assert rel_err(y.float(), nvfp4_matmul_ref(x, q, s, rs).float()) < 1e-2
