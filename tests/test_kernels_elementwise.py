"""RMSNorm, rotary embedding and SiLU-and-mul kernels (cvllm_lab.kernels.{norm,rotary,activation}).

Each Triton kernel against its PyTorch reference, and each reference against an independent formulation
(torch's rms_norm, HF's rotate_half, complex multiplication, F.silu). CPU runs the kernels under
TRITON_INTERPRET=1 at small sizes (it rounds fp32 -> bf16 toward zero, so bf16 outputs may differ by one ulp);
`-m cuda` runs Llama-8B sizes.
"""

import pytest
import torch

from cvllm_lab.kernels import activation, norm, rotary

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
# one or two ulps of the output dtype (the interpreter truncates to bf16, and the fused norm rounds twice)
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2**-10, atol=1e-3),
    torch.bfloat16: dict(rtol=2**-6, atol=1e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


# ------------------------------------------------------------------------------------------------ RMSNorm


def test_rms_norm_ref_matches_torch():
    torch.manual_seed(0)
    x, w = torch.randn(5, 48), torch.randn(48)
    torch.testing.assert_close(norm.rms_norm_ref(x, w, 1e-5), torch.nn.functional.rms_norm(x, (48,), w, 1e-5))


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize(
    'shape', [(7, 96), (2, 3, 64), (1, 4096), (37, 128), (3, 5, 2, 64)]
)  # short rows: several per program
def test_rms_norm(dtype, shape):
    torch.manual_seed(1)
    x = (torch.randn(shape, device=DEV) * 3).to(dtype)
    w = torch.randn(shape[-1], device=DEV).to(dtype)
    out = norm.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    close(out, norm.rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('inplace', [False, True])
def test_fused_add_rms_norm(dtype, inplace):
    torch.manual_seed(2)
    x, res = (torch.randn(2, 9, 80, device=DEV) * 2).to(dtype)
    w = torch.randn(80, device=DEV).to(dtype)
    normed_ref, res_ref = norm.fused_add_rms_norm_ref(x, res, w, 1e-5)
    close(res_ref, x.float() + res.float(), dtype)  # the reference's residual is the plain sum
    xc, rc = x.clone(), res.clone()
    normed, new_res = norm.fused_add_rms_norm(xc, rc, w, 1e-5, inplace=inplace)
    close(new_res, res_ref, dtype)
    close(normed, normed_ref, dtype)
    if inplace:
        assert normed.data_ptr() == xc.data_ptr() and new_res.data_ptr() == rc.data_ptr()
    else:
        assert torch.equal(xc, x) and torch.equal(rc, res)


def test_rms_norm_strided_rows():
    "Rows of a wider buffer (row stride != hidden size) and an explicit out buffer."
    torch.manual_seed(3)
    buf = torch.randn(6, 100, device=DEV)
    w = torch.randn(64, device=DEV)
    out = torch.empty(6, 64, device=DEV)
    norm.rms_norm(buf[:, 10:74], w, 1e-6, out=out)
    close(out, norm.rms_norm_ref(buf[:, 10:74], w, 1e-6), torch.float32)


@pytest.mark.parametrize('T', [1, 9])
def test_rms_norm_heads_of_fused_qkv(T):
    "QK-norm: `[T, heads, head_dim]` heads sliced out of a fused qkv row (token stride != heads * head_dim), read in place."
    torch.manual_seed(4)
    qkv = torch.randn(T, 12 * 32, device=DEV)
    q = qkv[:, : 8 * 32].view(T, 8, 32)
    assert T == 1 or q.stride(0) != 8 * 32  # (a size-1 dim's stride is normalized)
    w = torch.randn(32, device=DEV)
    close(norm.rms_norm(q, w, 1e-6), norm.rms_norm_ref(q, w, 1e-6), torch.float32)


# ------------------------------------------------------------------------------------------------ rotary


def cos_sin_cache(max_pos, rot_dim, base=10000.0, device=DEV):
    "Plain RoPE cache `[max_pos, rot_dim]`: cos then sin of pos * base^(-2i/rot_dim)."
    inv_freq = base ** -(torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None]
    return torch.cat([f.cos(), f.sin()], -1).float().to(device)


def rope_independent(x, positions, cache, head_dim, is_neox):
    "Rotate `[T, H, D]` in fp64: HF `rotate_half` for neox, complex multiplication of (2i, 2i+1) for GPT-J."
    rot = cache.shape[-1]
    cs = cache[positions].double()
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2 :]
    x = x.double()
    xr, xp = x[..., :rot], x[..., rot:]
    if is_neox:
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        half = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
        y = xr * c + half * s
    else:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], rot // 2, 2).contiguous())
        y = torch.view_as_real(z * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))).flatten(-2)
    return torch.cat([y, xp], -1)


@pytest.mark.parametrize('is_neox', [True, False])
@pytest.mark.parametrize('rot_dim', [32, 16, 20])
def test_rotary_ref_matches_independent(is_neox, rot_dim):
    torch.manual_seed(4)
    T, H, D = 5, 3, 32
    q, k = torch.randn(T, H * D), torch.randn(T, 1, D)
    pos = torch.randint(0, 100, (T,))
    cache = cos_sin_cache(100, rot_dim, device='cpu')
    qr, kr = rotary.apply_rotary_ref(q, k, pos, cache, D, is_neox)
    torch.testing.assert_close(qr.double(), rope_independent(q.view(T, H, D), pos, cache, D, is_neox).view(T, -1))
    torch.testing.assert_close(kr.double(), rope_independent(k, pos, cache, D, is_neox))


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('is_neox', [True, False])
@pytest.mark.parametrize('rot_dim', [64, 32, 40])  # full, partial (half), partial non power of 2
def test_rotary(dtype, is_neox, rot_dim):
    torch.manual_seed(5)
    T, H, Hkv, D = 6, 4, 2, 64
    q = torch.randn(T, H * D, device=DEV).to(dtype)
    k = torch.randn(T, Hkv, D, device=DEV).to(dtype)  # 3-D works too
    pos = torch.randint(0, 500, (T,), device=DEV)
    cache = cos_sin_cache(512, rot_dim)
    qr, kr = rotary.apply_rotary_ref(q, k, pos, cache, D, is_neox)
    qo, ko = rotary.apply_rotary(q, k, pos, cache, D, is_neox)
    assert qo.data_ptr() == q.data_ptr() and qo.shape == (T, H * D) and ko.shape == (T, Hkv, D)
    close(qo, qr, dtype)
    close(ko, kr, dtype)


def test_rotary_views_of_fused_qkv():
    "q and k as column slices of one qkv projection output: rotated in place inside it, v untouched."
    torch.manual_seed(6)
    T, H, Hkv, D = 5, 4, 1, 32
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=DEV)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    v_before = v.clone()
    pos = torch.arange(T, device=DEV) * 7
    cache = cos_sin_cache(64, D)
    qr, kr = rotary.apply_rotary_ref(q, k, pos, cache, D)
    rotary.apply_rotary(q, k, pos, cache, D)
    close(qkv[:, : H * D], qr, torch.float32)
    close(qkv[:, H * D : (H + Hkv) * D], kr, torch.float32)
    assert torch.equal(v, v_before)
    q2 = torch.randn(T, H * D, device=DEV)  # k may be None
    q2r, _ = rotary.apply_rotary_ref(q2, None, pos, cache, D)
    close(rotary.apply_rotary(q2, None, pos, cache, D)[0], q2r, torch.float32)


# ------------------------------------------------------------------------------------------------ silu_and_mul


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', [(5, 2 * 200), (2, 3, 2 * 64), (3, 2 * 1500)])
def test_silu_and_mul(dtype, shape):
    torch.manual_seed(7)
    x = (torch.randn(shape, device=DEV) * 3).to(dtype)
    ref = activation.silu_and_mul_ref(x)
    n = shape[-1] // 2
    torch.testing.assert_close(
        ref.float(), (torch.nn.functional.silu(x[..., :n].float()) * x[..., n:].float()).to(dtype).float()
    )
    out = activation.silu_and_mul(x)
    assert out.shape == (*shape[:-1], n)
    close(out, ref, dtype)
    xi = torch.stack([x[..., :n], x[..., n:]], -1).flatten(-2)  # gate_i, up_i at 2i, 2i + 1
    torch.testing.assert_close(activation.silu_and_mul_ref(xi, interleaved=True), ref)
    close(activation.silu_and_mul(xi, interleaved=True), ref, dtype)


# ------------------------------------------------------------------------------------------------ CUDA, real sizes


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_cuda_real_sizes(dtype):
    "Llama-3-8B shapes: hidden 4096, 32/8 heads of 128, intermediate 14336, 2048 tokens."
    torch.manual_seed(8)
    T, hidden, H, Hkv, D, inter = 2048, 4096, 32, 8, 128, 14336
    x, res = torch.randn(2, T, hidden, device=DEV).to(dtype)
    w = torch.randn(hidden, device=DEV).to(dtype)
    close(norm.rms_norm(x, w, 1e-5), norm.rms_norm_ref(x, w, 1e-5), dtype)
    got, ref = norm.fused_add_rms_norm(x, res, w, 1e-5), norm.fused_add_rms_norm_ref(x, res, w, 1e-5)
    close(got[0], ref[0], dtype)
    close(got[1], ref[1], dtype)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=DEV).to(dtype)
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    cache = cos_sin_cache(8192, D, base=500000.0)
    qr, kr = rotary.apply_rotary_ref(q, k, pos, cache, D)
    rotary.apply_rotary(q, k, pos, cache, D)
    close(q, qr, dtype)
    close(k, kr, dtype)
    g = torch.randn(T, 2 * inter, device=DEV).to(dtype)
    close(activation.silu_and_mul(g), activation.silu_and_mul_ref(g), dtype)
